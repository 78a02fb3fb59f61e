"""Probe (issue #3, session 23): what one launch for two GEMVs of the same x would save at the h200 decode shapes.
Each row times, in one CUDA graph with PDL (back-to-back launches over weight copies beyond L2, M = 1, bf16 x,
act_quant), the separate launches against one launch over the weights concatenated along N (the upper bound of a
kernel that reads both weights in one grid): the shared expert's w1 + w3, the attention's wq_a + wkv, wq_b + the
indexer's wq_b, and the routed experts' w1 + w3 (grouped FP4, 6 of 96, one expert stack of 2 x 2304 rows).
Writes JSON (argv[1])."""
import os, json, sys, time
import torch, triton
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import _bench_graph, _copies_for, copy_bandwidth, _random_fp8_weight
from dsv41.kernels import quant_gemv as qg, grouped_gemv as gg, set_pdl

DENSE = [("shared w1 + w3", [(2304, 5120), (2304, 5120)]), ("wq_a + wkv", [(1280, 5120), (512, 5120)]),
         ("wq_b + indexer wq_b", [(32768, 1280), (4096, 1280)]),
         ("wq_a + wkv + shared w1 + w3 (one x?)", [(1280, 5120), (512, 5120), (2304, 5120), (2304, 5120)])]


def main():
    set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    for name, shapes in DENSE:
        k = shapes[0][1]
        nbytes = sum(n * k + (n // 32) * (k // 32) for n, _ in shapes)
        copies = _copies_for(nbytes)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        sets = [[_random_fp8_weight(n, k, gen) for n, _ in shapes] for _ in range(copies)]
        cats = [(torch.cat([w for w, _ in ws]), torch.cat([s for _, s in ws])) for ws in sets]
        sep = [lambda ws=ws: [qg.triton_linear_fp8_block(x, w, s, True) for w, s in ws] for ws in sets]
        one = [lambda c=c: qg.triton_linear_fp8_block(x, c[0], c[1], True) for c in cats]
        y_sep = torch.cat([t for t in sep[0]()], dim=-1)
        y_one = one[0]()
        same = torch.equal(y_sep, y_one)
        for label, calls, extra in [("separate", sep, {}), ("one launch", one, {}),
                                    ("one launch, tile kernel", [lambda c=c: qg.triton_linear_fp8_block(
                                        x, c[0], c[1], True, tma=False) for c in cats], {}),
                                    ("one launch, TMA kernel", [lambda c=c: qg.triton_linear_fp8_block(
                                        x, c[0], c[1], True, tma=True) for c in cats], {})]:
            try:
                t = _bench_graph(calls, 60)
            except Exception as exc:
                print(f"{name} {label}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                continue
            rows.append(dict(pair=name, variant=label, us=t * 1e6, frac=nbytes / t / bw, bytes=nbytes, equal=same))
            print(f"{name:40s} {label:26s} {t*1e6:8.2f} us ({100*nbytes/t/bw:.1f} %) equal={same}", flush=True)
        del sets, cats
        torch.cuda.empty_cache()
    # Grouped: w1 and w3 stacked per expert [E, 2N, K/2] against the pair op's two launches.
    n, k = 2304, 5120
    w1 = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s1 = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    w3 = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s3 = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    w13, s13 = torch.cat([w1, w3], 1), torch.cat([s1, s3], 1)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    per = 2 * 6 * n * (k // 2 + k // 32)
    idxs = [torch.randperm(96, device="cuda", generator=gen)[:6][None] for _ in range(_copies_for(per))]
    a, b = gg.triton_grouped_linear_fp4_pair(x, w1, s1, w3, s3, idxs[0], True)
    c = gg.triton_grouped_linear_fp4(x, w13, s13, idxs[0], True)
    same = torch.equal(torch.cat([a, b], -1), c)
    for label, calls in [("pair op (two launches)", [lambda i=i: gg.triton_grouped_linear_fp4_pair(
            x, w1, s1, w3, s3, i, True) for i in idxs]),
                         ("one launch [E, 2N]", [lambda i=i: gg.triton_grouped_linear_fp4(x, w13, s13, i, True)
                                                 for i in idxs])]:
        t = _bench_graph(calls, 60)
        rows.append(dict(pair="routed w1 + w3", variant=label, us=t * 1e6, frac=per / t / bw, bytes=per, equal=same))
        print(f"{'routed w1 + w3':40s} {label:26s} {t*1e6:8.2f} us ({100*per/t/bw:.1f} %) equal={same}", flush=True)
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
