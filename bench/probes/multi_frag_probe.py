"""Probe (issue #3, session 24, call 4): dsv41::linear_fp8_block_multi on the fragment GEMV (one activation launch +
one GEMV launch for every weight) against its tile launch and against the separate single ops, at the h200 sibling
shapes; CUDA-graph replay, PDL, one bf16 x row, weights beyond L2. Writes JSON (argv[1])."""
import os, json, sys, time
import torch, triton
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import _bench_graph, _copies_for, copy_bandwidth, _random_fp8_weight
from dsv41.kernels import gemv_multi as gm, quant_gemv as qg, set_pdl


def main():
    set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    multi, single = torch.ops.dsv41.linear_fp8_block_multi, torch.ops.dsv41.linear_fp8_block
    frag_min = gm.FRAG_MULTI_MIN_WEIGHT_BYTES
    for name, widths, k in [("wq_a + wkv", (1280, 512), 5120), ("shared w1 + w3", (2304, 2304), 5120),
                            ("wq_b + indexer wq_b", (32768, 4096), 1280)]:
        nbytes = sum(n * k + (n // 32) * (k // 32) for n in widths)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        sets = [[_random_fp8_weight(n, k, gen) for n in widths] for _ in range(_copies_for(nbytes))]
        refs = [qg.reference_linear_fp8_block(x.float(), w, s, True).double() for w, s in sets[0]]
        for label, fmin, calls in [
                ("separate ops", frag_min, [lambda ws=ws: [single(x, w, s, True) for w, s in ws] for ws in sets]),
                ("multi op, fragment kernel", frag_min,
                 [lambda ws=ws: multi(x, [w for w, _ in ws], [s for _, s in ws], True) for ws in sets]),
                ("multi op, no fragment kernel", 1 << 62,
                 [lambda ws=ws: multi(x, [w for w, _ in ws], [s for _, s in ws], True) for ws in sets])]:
            gm.FRAG_MULTI_MIN_WEIGHT_BYTES = fmin
            ys = calls[0]()
            err = max(((y.double() - r).abs().max() / r.abs().max()).item() for y, r in zip(ys, refs))
            t = _bench_graph(calls, 60)
            rows.append(dict(case=name, variant=label, us=t * 1e6, frac=nbytes / t / bw, err=err))
            print(f"{name:22s} {label:30s} {t*1e6:8.2f} us ({100*nbytes/t/bw:5.1f} %) err/max {err:.2e}", flush=True)
        gm.FRAG_MULTI_MIN_WEIGHT_BYTES = frag_min
        del sets
        torch.cuda.empty_cache()
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
