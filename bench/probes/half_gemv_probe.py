"""Probe (issue [generic], session 28): the half-precision GEMV ops (dsv41/kernels/half_gemv.py) against cuBLAS at the
Llama-3.2-1B and -8B decode shapes, M = 1, bf16, PDL on, each timed in one CUDA graph of back-to-back launches over
weight copies beyond L2 (bench/kernels.py `_bench_graph`). Rows: cuBLAS (`F.linear`, one call per weight, plus the
eager SwiGLU / residual ops where the fused op has them), the default plan, and a few plan overrides (BLOCK_N,
BLOCK_K, K_ITERS, warps). Fractions are of the copy bandwidth measured in the same run. Writes JSON (argv[1])."""
import json
import os
import sys

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]
from kernels import _bench_graph, _copies_for, copy_bandwidth  # noqa: E402
from dsv41.kernels import half_gemv as hg, set_pdl, prepare_device  # noqa: E402

# (name, op, [N_i], K): op "multi" (siblings), "swiglu" (gate, up), "residual" (one weight + r), "single".
SHAPES = [("1b qkv", "multi", [2048, 512, 512], 2048), ("1b o+res", "residual", [2048], 2048),
          ("1b gate/up", "swiglu", [8192, 8192], 2048), ("1b down+res", "residual", [2048], 8192),
          ("1b head", "single", [128256], 2048), ("8b qkv", "multi", [4096, 1024, 1024], 4096),
          ("8b gate/up", "swiglu", [14336, 14336], 4096), ("8b down+res", "residual", [4096], 14336)]
PLANS = [{}, {"block_n": 64}, {"block_n": 32}, {"block_n": 64, "block_k": 128}, {"k_iters": 1},
         {"k_iters": 4}, {"num_warps": 8}, {"block_n": 16, "block_k": 256}]


def _calls(op, x, sets, r, over):
    if op == "multi":
        return [lambda ws=ws: hg.triton_linear_half_multi(x, ws, **over) for ws in sets]
    if op == "swiglu":
        return [lambda ws=ws: hg.triton_linear_half_silu_mul(x, ws[0], ws[1], **over) for ws in sets]
    if op == "residual":
        return [lambda ws=ws: hg.triton_linear_half(x, ws[0], r, **over) for ws in sets]
    return [lambda ws=ws: hg.triton_linear_half(x, ws[0], None, **over) for ws in sets]


def _cublas(op, x, sets, r):
    if op == "swiglu":
        return [lambda ws=ws: F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1]) for ws in sets]
    if op == "residual":
        return [lambda ws=ws: r + F.linear(x, ws[0]) for ws in sets]
    return [lambda ws=ws: [F.linear(x, w) for w in ws] for ws in sets]


def main():
    set_pdl(True)
    prepare_device(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name, op, widths, k in SHAPES:
        nbytes = sum(n * k * 2 for n in widths)
        copies = _copies_for(nbytes)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        r = torch.randn(1, widths[0], device="cuda", generator=gen).bfloat16()
        sets = [[(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16() for n in widths]
                for _ in range(copies)]
        variants = [("cublas", _cublas(op, x, sets, r))] + [
            ("dsv41 " + (",".join(f"{a}={b}" for a, b in p.items()) or "default"), _calls(op, x, sets, r, p))
            for p in PLANS]
        for label, calls in variants:
            try:
                t = _bench_graph(calls, 60)
            except Exception as exc:  # a plan the shape cannot take
                print(f"{name:14s} {label:34s} {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            rows.append(dict(shape=name, op=op, variant=label, us=t * 1e6, frac=nbytes / t / bw, bytes=nbytes))
            print(f"{name:14s} {label:34s} {t * 1e6:9.2f} us {100 * nbytes / t / bw:6.1f} %", flush=True)
        del sets
        torch.cuda.empty_cache()
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=bw / 1e12, rows=rows)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
