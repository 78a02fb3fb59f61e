"""Probe for issue #3 (GEMV at 80 % of copy bandwidth): what a pure read of the weight bytes reaches at the GEMV
shapes, beside the GEMVs, so a GEMV's fraction of copy bandwidth can be read against the ceiling of one launch.

    python3 bench/probes/gemv_tma_probe.py [--json PATH] [--reps-ms 100] [--pdl]

Rows (CUDA-graph replay back to back over weight copies beyond L2, as bench/kernels.py times; fraction of the
1 GiB device-to-device copy bandwidth measured in the same run):
- `copy` : torch's copy of a buffer of the weight's size (bytes read + written);
- `read tile` : the tile kernel's grid and tile (`gemv_plan`) reading and summing the bytes through registers;
- `read tma bnB sS pP` : the same bytes through a TMA pipeline of S stages, B-row bands, P programs per SM;
- `gemv default` : the op as shipped (`triton_linear_fp8_block` / `triton_linear_fp4`);
- `gemv tile` / `gemv tma bnB sS pP` : the tile kernel (tma=False) and the TMA GEMV (`dsv41/kernels/gemv_tma.py`)
  with that plan, block FP8 only.
The results of 2026-12-01 (bench/results/2026-12-01_h200_s16/tma_probe*.json) were made with the first version of
this file (commit 8f17ab3), whose `gemv tma` rows ran a prototype of the TMA GEMV defined in the file itself and
also tried it on the FP4 experts (slower than the tile kernel there); the shipped kernel measured within 4 % of it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root


@triton.jit
def _read_tile_kernel(w_ptr, out_ptr, N, KB, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      K_ITERS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32)
    for it in range(K_ITERS):
        k = (pid_k * K_ITERS + it) * BLOCK_K + offs_k
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=(offs_n < N)[:, None] & (k < KB)[None, :], other=0)
        acc += w.to(tl.int32)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _read_tma_kernel(w_desc, out_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
                     STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32)
    for it in tl.range(0, K_ITERS, num_stages=STAGES):
        w = w_desc.load([pid_n * BLOCK_N, (pid_k * K_ITERS + it) * BLOCK_K])
        acc += w.to(tl.int32)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.sum(tl.sum(acc, axis=1), axis=0))


def _frac_row(rows, name, variant, nbytes, t, bw, **extra):
    """Append one result row (time, fraction of copy bandwidth) and print it."""
    rows.append(dict(shape=name, variant=variant, bytes=nbytes, time_us=t * 1e6, frac_of_copy=nbytes / t / bw,
                     **extra))
    print(f"{name:14s} {variant:28s} {t * 1e6:9.2f} us  {nbytes / t / bw:6.1%}", flush=True)


def main() -> int:
    from bench import kernels as bk
    import dsv41.kernels as kernels
    from dsv41.kernels import quant_gemv as qg
    from dsv41.kernels.gemv_tma import tma_gemv_plan
    from triton.tools.tensor_descriptor import TensorDescriptor
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps-ms", type=float, default=100.0)
    ap.add_argument("--pdl", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/probes/gemv_tma_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    reps = args.reps_ms
    kernels.set_pdl(args.pdl)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = bk.copy_bandwidth(reps)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    shapes = [("wq_b", False, 32768, 1280), ("wo_b", False, 5120, 8192), ("shared_w1", False, 2304, 5120),
              ("expert_w1", True, 2304, 5120), ("head", False, 129280, 5120)]
    for name, fp4, n, k in shapes:
        make = bk._random_fp4_weight if fp4 else bk._random_fp8_weight
        w0, s0 = make(n, k, gen)
        nb = w0.numel() + s0.numel()
        ws = [(w0, s0)] + [make(n, k, gen) for _ in range(bk._copies_for(nb) - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        moved = nb + 2 * k + 2 * n
        # copy of the same bytes
        srcs = [w for w, _ in ws]
        dsts = [torch.empty_like(w) for w in srcs]
        t = bk._bench_graph([lambda a=a, b=b: b.copy_(a) for a, b in zip(srcs, dsts)], reps)
        _frac_row(rows, name, "copy (read+write)", 2 * w0.numel(), t, bw)
        del dsts
        # pure reads, default grid
        plan = qg.gemv_plan(1, n, k, fp4, sm_count=qg.device_sm_count(x.device))
        kbytes = w0.shape[1]
        bkb = plan["BLOCK_K"] // 2 if fp4 else plan["BLOCK_K"]
        grid = (-(-n // plan["BLOCK_N"]), -(-kbytes // (bkb * plan["K_ITERS"])))
        out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device="cuda")
        t = bk._bench_graph([lambda w=w: _read_tile_kernel[grid](w, out, n, kbytes, w.stride(0), BLOCK_N=plan[
            "BLOCK_N"], BLOCK_K=bkb, K_ITERS=plan["K_ITERS"]) for w, _ in ws], reps)
        _frac_row(rows, name, "read tile (default grid)", w0.numel(), t, bw)
        for bn, st, per_sm in ((64, 4, 3), (128, 3, 2), (128, 4, 2)):
            tp = tma_gemv_plan(1, n, k, block_n=bn, stages=st, programs_per_sm=per_sm)
            tb = tp["BLOCK_K"] // 2 if fp4 else tp["BLOCK_K"]
            descs = [TensorDescriptor.from_tensor(w, [bn, tb]) for w, _ in ws]
            g2 = tp["grid"][:2]
            out2 = torch.empty(g2[0] * g2[1], dtype=torch.int32, device="cuda")
            try:
                t = bk._bench_graph([lambda d=d: _read_tma_kernel[g2](d, out2, BLOCK_N=bn, BLOCK_K=tb, K_ITERS=tp[
                    "K_ITERS"], STAGES=st) for d in descs], reps)
                _frac_row(rows, name, f"read tma bn{bn} s{st} p{per_sm}", w0.numel(), t, bw)
            except Exception as exc:  # noqa: BLE001
                print(name, "read tma", bn, st, type(exc).__name__, str(exc)[:300], flush=True)
        # GEMVs
        tri = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
        t = bk._bench_graph([lambda w=w, s=s: tri(x, w, s, True) for w, s in ws], reps)
        _frac_row(rows, name, "gemv default", moved, t, bw)
        if not fp4:
            t = bk._bench_graph([lambda w=w, s=s: tri(x, w, s, True, tma=False) for w, s in ws], reps)
            _frac_row(rows, name, "gemv tile", moved, t, bw)
        for bn, st, per_sm in () if fp4 else ((64, 3, 4), (64, 4, 3), (128, 3, 2)):
            over = dict(tma=True, block_n=bn, stages=st, programs_per_sm=per_sm)
            t = bk._bench_graph([lambda w=w, s=s: tri(x, w, s, True, **over) for w, s in ws], reps)
            _frac_row(rows, name, f"gemv tma bn{bn} s{st} p{per_sm}", moved, t, bw)
        del ws, srcs
        torch.cuda.empty_cache()
    if args.json:
        import triton as _t
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=_t.__version__,
                    copy_bandwidth_tb_s=bw / 1e12, pdl=args.pdl)
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
