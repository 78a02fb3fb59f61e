"""Probe (issue #3, session 23): dsv41::linear_fp8_block_multi (one launch for GEMVs of one x) against the separate
single ops at the h200 sibling shapes, and the pair op's w1 + w3 in one fragment launch against two; CUDA-graph
replay, PDL, one bf16 x row, weights beyond L2. Writes JSON (argv[1])."""
import os, json, sys, time
import torch, triton
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import _bench_graph, _copies_for, copy_bandwidth, _random_fp8_weight
from dsv41.kernels import grouped_gemv as gg, set_pdl


def main():
    set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    multi, single = torch.ops.dsv41.linear_fp8_block_multi, torch.ops.dsv41.linear_fp8_block
    for name, widths, k in [("shared w1 + w3", (2304, 2304), 5120), ("wq_a + wkv", (1280, 512), 5120)]:
        nbytes = sum(n * k + (n // 32) * (k // 32) for n in widths)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        sets = [[_random_fp8_weight(n, k, gen) for n in widths] for _ in range(_copies_for(nbytes))]
        ys = multi(x, [w for w, _ in sets[0]], [s for _, s in sets[0]], True)
        same = all(torch.equal(y, single(x, w, s, True)) for y, (w, s) in zip(ys, sets[0]))
        for label, calls in [("separate", [lambda ws=ws: [single(x, w, s, True) for w, s in ws] for ws in sets]),
                             ("multi op", [lambda ws=ws: multi(x, [w for w, _ in ws], [s for _, s in ws], True)
                                           for ws in sets])]:
            t = _bench_graph(calls, 60)
            rows.append(dict(case=name, variant=label, us=t * 1e6, frac=nbytes / t / bw, equal=same))
            print(f"{name:20s} {label:30s} {t*1e6:8.2f} us ({100*nbytes/t/bw:.1f} %) equal={same}", flush=True)
        del sets
    n, k = 2304, 5120
    w1 = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s1 = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    w3 = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s3 = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    per = 2 * 6 * n * (k // 2 + k // 32)
    idxs = [torch.randperm(96, device="cuda", generator=gen)[:6][None] for _ in range(_copies_for(per))]
    for one in (True, False):
        gg.PAIR_ONE_LAUNCH = one
        a, b = gg.triton_grouped_linear_fp4_pair(x, w1, s1, w3, s3, idxs[0], True)
        same = torch.equal(a, gg.triton_grouped_linear_fp4(x, w1, s1, idxs[0], True)) and torch.equal(
            b, gg.triton_grouped_linear_fp4(x, w3, s3, idxs[0], True))
        t = _bench_graph([lambda i=i: gg.triton_grouped_linear_fp4_pair(x, w1, s1, w3, s3, i, True) for i in idxs], 60)
        label = "pair op, one launch" if one else "pair op, two launches"
        rows.append(dict(case="routed w1 + w3", variant=label, us=t * 1e6, frac=per / t / bw, equal=same))
        print(f"{'routed w1 + w3':20s} {label:30s} {t*1e6:8.2f} us ({100*per/t/bw:.1f} %) equal={same}", flush=True)
    gg.PAIR_ONE_LAUNCH = True
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
