"""Probe (issue #3, session 24): the block-FP8 fragment GEMV (dsv41/kernels/gemv_frag.py) against the default
kernels at the h200 dense decode shapes; CUDA-graph replay, PDL, one bf16 x row, weights beyond L2 (as
bench/kernels.py). Every plan's result is checked against the float64-free reference op first. Writes JSON (argv[1])."""
import os, json, sys, time
import torch, triton
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import GEMV_SHAPES, _bench_graph, _copies_for, copy_bandwidth, _random_fp8_weight
from dsv41.kernels import quant_gemv as qg, set_pdl
from dsv41.kernels.gemv_frag import frag_gemv_plan

PLANS = {
    "wq_b": [dict(split_k=1), dict(split_k=1, num_warps=2), dict(split_k=1, num_warps=8), dict(split_k=1, num_warps=1),
             dict(split_k=1, maxnreg=80), dict(split_k=1, early_launch=True), dict(split_k=1, num_warps=8, early_launch=True),
             dict(split_k=5, early_launch=True)],
    "wo_b": [dict(num_warps=1), dict(num_warps=1, split_k=4), dict(num_warps=1, split_k=16), dict(num_warps=2, split_k=4),
             dict(num_warps=2, split_k=16), dict(num_warps=1, early_launch=True), dict(num_warps=2, early_launch=True),
             dict(num_warps=4, early_launch=True), dict(num_warps=1, prefetch=False, split_k=16)],
    "wq_a": [dict(num_warps=2), dict(num_warps=2, early_launch=True), dict(num_warps=1, split_k=5),
             dict(num_warps=1, split_k=10), dict(num_warps=1, split_k=10, early_launch=True)],
    "shared_w1": [dict(num_warps=2), dict(num_warps=2, early_launch=True), dict(num_warps=1, split_k=5),
                  dict(num_warps=1, split_k=10, early_launch=True)],
    "shared_w2": [dict(num_warps=2), dict(num_warps=2, early_launch=True), dict(num_warps=1, split_k=3),
                  dict(num_warps=1, split_k=3, early_launch=True)],
    "head": [dict(num_warps=8), dict(num_warps=8, early_launch=True), dict(num_warps=8, maxnreg=80),
             dict(num_warps=8, prefetch=False), dict(num_warps=4, early_launch=True)],
}


def main():
    set_pdl(True)
    reps = float(sys.argv[2]) if len(sys.argv) > 2 else 40
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    for name, fmt, n, k in GEMV_SHAPES:
        if fmt != "fp8":
            continue
        w0, s0 = _random_fp8_weight(n, k, gen)
        nbytes = w0.numel() + s0.numel() + k * 2 + n * 2
        ws = [(w0, s0)] + [_random_fp8_weight(n, k, gen) for _ in range(_copies_for(nbytes) - 1)]
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = qg.reference_linear_fp8_block(x.float(), w0, s0, True).double()
        scale_ref = ref.abs().max().item()
        variants = [("default", {}), ("tile (tma=False)", {"tma": False})]
        variants += [("frag " + " ".join(f"{a}={b}" for a, b in p.items()), dict(frag=True, **p))
                     for p in [{}] + PLANS.get(name, [])]
        for label, over in variants:
            try:
                y = qg.triton_linear_fp8_block(x, w0, s0, True, **over)
                err = ((y.double() - ref).abs().max().item()) / scale_ref
                t = _bench_graph([lambda w=w, s=s: qg.triton_linear_fp8_block(x, w, s, True, **over) for w, s in ws],
                                 reps)
            except Exception as exc:
                print(f"{name:10s} {label:34s} {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            plan = frag_gemv_plan(n, k, **{a: b for a, b in over.items() if a != "frag"}) if over.get("frag") else None
            rows.append(dict(shape=name, N=n, K=k, variant=label, us=t * 1e6, frac=nbytes / t / bw, err=err,
                             grid=list(plan["grid"]) if plan else None))
            print(f"{name:10s} {label:34s} {t*1e6:8.2f} us ({100*nbytes/t/bw:5.1f} %) err/max {err:.2e}"
                  + (f" grid {plan['grid']}" if plan else ""), flush=True)
        del ws
        torch.cuda.empty_cache()
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
