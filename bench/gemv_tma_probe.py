"""Probe for issue #3 (GEMV at 80 % of copy bandwidth): what a pure read reaches at the GEMV shapes, and a GEMV
whose weight tiles arrive by TMA (Hopper bulk tensor copies) in a software-pipelined K loop.

    python3 bench/gemv_tma_probe.py [--json PATH] [--reps-ms 100]

Rows (CUDA-graph replay back to back over weight copies beyond L2, as bench/kernels.py times; fraction of the
1 GiB device-to-device copy bandwidth measured in the same run):
- `copy` : torch's copy of a buffer of the weight's size (bytes read + written);
- `read tile` : the default GEMV grid and tile (`gemv_plan`) reading and summing the bytes, no arithmetic;
- `read tma S` : the same bytes through a TMA pipeline of S stages;
- `gemv default` : the shipped tile-at-once GEMV (`triton_linear_fp8_block` / `triton_linear_fp4`);
- `gemv tma BN S` : the TMA GEMV of this file, BLOCK_N rows and S stages;
and the grouped FP4 expert GEMV (6 of 96 experts) default vs TMA. Correctness of the TMA GEMV against the shipped
op's reference is checked per shape before it is timed (max abs error / max |y|).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41.kernels._common import E2M1_HALF_SCALE, e4m3_round, exp2_int, ue8m0_exponent  # noqa: E402


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


@triton.jit
def _fq8(x):
    amax = tl.maximum(tl.max(tl.abs(x), axis=1, keep_dims=True), 1e-4)
    e = ue8m0_exponent(tl.math.div_rn(amax, 448.0))
    q = tl.minimum(tl.maximum(x * exp2_int(254 - e), -448.0), 448.0)
    qr = e4m3_round(tl.abs(q))
    return tl.where(q < 0, -qr, qr) * exp2_int(e)


@triton.jit
def _tma_gemv_kernel(x_ptr, w_desc, s_ptr, idx_ptr, y_ptr, part_ptr, cnt_ptr, N_OUT, K, stride_sn, stride_se,
                     X_ROW_DIV, stride_xr, FP4: tl.constexpr, GROUPED: tl.constexpr, SPLIT_K: tl.constexpr,
                     SPLIT_POW2: tl.constexpr, K_ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    # Program (n-tile, k-split, pair) of y[pair, n-tile]; the weight rows of the pair start at e * N_OUT in the
    # descriptor's 2-D view (e = idx[pair] when GROUPED, else 0). x is fake-quantised per 32-block in the loop.
    NKB: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if GROUPED:
        e = tl.load(idx_ptr + pair).to(tl.int32)
    else:
        e = pair * 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    kb = tl.arange(0, NKB)
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xr
    row0 = e * N_OUT + pid_n * BLOCK_N
    s_rows = offs_n if FP4 else offs_n // 32
    s_base = s_ptr + e.to(tl.int64) * stride_se + s_rows[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, NKB], dtype=tl.float32)
    for it in tl.range(0, K_ITERS, num_stages=STAGES):
        k0 = (pid_k * K_ITERS + it) * BLOCK_K
        s_raw = tl.load(s_base + (k0 // 32 + kb)[None, :], mask=n_ok[:, None], other=0)
        sw = exp2_int(s_raw.to(tl.int32))
        if FP4:
            j16 = tl.arange(0, 16)
            w = w_desc.load([row0, k0 // 2])
            c = tl.reshape(w, [BLOCK_N, NKB, 16]).to(tl.int32)
            if x_ptr.dtype.element_ty == tl.bfloat16:
                # One 4-byte load per (even, odd) pair of bf16 values: even = low half, odd = high half.
                xw = tl.load(x_row.to(tl.pointer_type(tl.int32)) + k0 // 2 + kb[:, None] * 16 + j16[None, :])
                xe = (xw << 16).to(tl.float32, bitcast=True)
                xo = (xw & -65536).to(tl.float32, bitcast=True)
            else:
                xe = tl.load(x_row + k0 + kb[:, None] * 32 + 2 * j16[None, :]).to(tl.float32)
                xo = tl.load(x_row + k0 + kb[:, None] * 32 + 2 * j16[None, :] + 1).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xe), axis=1, keep_dims=True), tl.max(tl.abs(xo), axis=1, keep_dims=True))
            amax = tl.maximum(amax, 1e-4)
            ex = ue8m0_exponent(tl.math.div_rn(amax, 448.0))
            qe = tl.minimum(tl.maximum(xe * exp2_int(254 - ex), -448.0), 448.0)
            qo = tl.minimum(tl.maximum(xo * exp2_int(254 - ex), -448.0), 448.0)
            xe = tl.where(qe < 0, -e4m3_round(tl.abs(qe)), e4m3_round(tl.abs(qe))) * exp2_int(ex)
            xo = tl.where(qo < 0, -e4m3_round(tl.abs(qo)), e4m3_round(tl.abs(qo))) * exp2_int(ex)
            lo = c & 15
            hi = c >> 4
            vlo = (((lo & 7) << 9) | ((lo & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            vhi = (((hi & 7) << 9) | ((hi & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            part = tl.sum(vlo * xe[None, :, :] + vhi * xo[None, :, :], axis=2)
            acc += part * (sw * E2M1_HALF_SCALE)
        else:
            j32 = tl.arange(0, 32)
            w = w_desc.load([row0, k0])
            w3 = tl.reshape(w, [BLOCK_N, NKB, 32]).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            xv = tl.load(x_row + k0 + kb[:, None] * 32 + j32[None, :]).to(tl.float32)
            xq = _fq8(xv)
            acc += tl.sum(w3 * xq[None, :, :], axis=2) * sw
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc1 = tl.sum(acc, axis=1)
    y_ptrs = y_ptr + pair.to(tl.int64) * N_OUT + offs_n
    if SPLIT_K == 1:
        total = acc1
        ok = n_ok
    else:
        p_ptrs = part_ptr + pair.to(tl.int64) * N_OUT + offs_n
        tl.store(p_ptrs + pid_k.to(tl.int64) * tl.num_programs(2) * N_OUT, acc1, mask=n_ok)
        tl.debug_barrier()
        tile = pair * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        if arrived == SPLIT_K - 1:
            sp = tl.arange(0, SPLIT_POW2)
            parts = tl.load(p_ptrs[None, :] + sp[:, None].to(tl.int64) * tl.num_programs(2) * N_OUT,
                            mask=(sp < SPLIT_K)[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            tl.atomic_xchg(cnt_ptr + tile, 0)
        ok = n_ok & ((offs_n * 0 + arrived) == SPLIT_K - 1)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        b = total.to(tl.uint32, bitcast=True)
        total = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=ok)


def tma_plan(n_out: int, k: int, pairs: int, block_n: int, stages: int, block_k: int = 128, sms: int = 132,
             per_sm: int = 3) -> dict:
    """Grid (n tiles, K splits, pairs) with about sms * per_sm programs, each streaming its K range."""
    n_tiles = -(-n_out // block_n)
    k_tiles = -(-k // block_k)
    split = max(1, min(k_tiles, (sms * per_sm) // max(1, n_tiles * pairs)))
    k_iters = -(-k_tiles // split)
    split = -(-k_tiles // k_iters)
    return dict(grid=(n_tiles, split, pairs), K_ITERS=k_iters, SPLIT_K=split,
                SPLIT_POW2=triton.next_power_of_2(split), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages)


def tma_gemv(x, w, s, fp4: bool, block_n: int, stages: int, idx=None, per_sm: int = 3, pdl: bool = False,
             desc=None, shared_x: bool = True):
    """y [pairs, N_OUT] (plain: pairs = M = 1) of the TMA GEMV; w [N, K or K/2] or [E, out, K/2] (grouped);
    grouped x [1, K] shared by the pairs (shared_x) or [pairs, K]."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    from dsv41.kernels._common import split_k_counters
    grouped = idx is not None
    k = x.shape[-1]
    if grouped:
        e_count, n_out, kb = w.shape
        w2 = w.view(e_count * n_out, kb)
        pairs = idx.numel()
        x_row_div = idx.shape[1] if shared_x else 1
    else:
        n_out, kb = w.shape
        w2 = w
        pairs = 1
        x_row_div = 1
    plan = tma_plan(n_out, k, pairs, block_n, stages, per_sm=per_sm)
    bkb = plan["BLOCK_K"] // 2 if fp4 else plan["BLOCK_K"]
    if desc is None:
        desc = TensorDescriptor.from_tensor(w2, [block_n, bkb])
    y = torch.empty(pairs, n_out, dtype=x.dtype, device=x.device)
    part = torch.empty(plan["SPLIT_K"], pairs, n_out, dtype=torch.float32, device=x.device)
    cnt = split_k_counters(x.device, plan["grid"][0] * pairs)
    extra = {"launch_pdl": True} if pdl else {}
    _tma_gemv_kernel[plan["grid"]](
        x, desc, s, idx if grouped else s, y, part, cnt, n_out, k, s.stride(-2), s.stride(0) if grouped else 0,
        x_row_div, x.stride(-2) if x.dim() >= 2 else 0, FP4=fp4, GROUPED=grouped, SPLIT_K=plan["SPLIT_K"],
        SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"], BLOCK_N=block_n, BLOCK_K=plan["BLOCK_K"],
        STAGES=stages, USE_PDL=pdl, num_warps=4, **extra)
    return y


def _frac_row(rows, name, variant, nbytes, t, bw, **extra):
    rows.append(dict(shape=name, variant=variant, bytes=nbytes, time_us=t * 1e6, frac_of_copy=nbytes / t / bw,
                     **extra))
    print(f"{name:14s} {variant:28s} {t * 1e6:9.2f} us  {nbytes / t / bw:6.1%}", flush=True)


def main() -> int:
    from bench import kernels as bk
    from dsv41.kernels import grouped_gemv as gg
    from dsv41.kernels import quant_gemv as qg
    from triton.tools.tensor_descriptor import TensorDescriptor
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps-ms", type=float, default=100.0)
    ap.add_argument("--pdl", action="store_true")
    args = ap.parse_args()
    reps = args.reps_ms
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
            tp = tma_plan(n, k, 1, bn, st, per_sm=per_sm)
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
        ref = qg.reference_linear_fp4 if fp4 else qg.reference_linear_fp8_block
        t = bk._bench_graph([lambda w=w, s=s: tri(x, w, s, True) for w, s in ws], reps)
        _frac_row(rows, name, "gemv default", moved, t, bw)
        want = ref(x.float(), w0, s0, True).double()
        for bn, st, per_sm in ((64, 4, 3), (64, 3, 4), (128, 3, 2), (128, 4, 2), (32, 4, 6)):
            try:
                got = tma_gemv(x, w0, s0, fp4, bn, st, per_sm=per_sm, pdl=args.pdl).double()
                err = float((got - want).abs().max() / want.abs().max())
                descs = [TensorDescriptor.from_tensor(w, [bn, 64 if fp4 else 128]) for w, _ in ws]
                t = bk._bench_graph([lambda w=w, s=s, d=d: tma_gemv(x, w, s, fp4, bn, st, per_sm=per_sm,
                                                                      pdl=args.pdl, desc=d)
                                     for (w, s), d in zip(ws, descs)], reps)
                _frac_row(rows, name, f"gemv tma bn{bn} s{st} p{per_sm}", moved, t, bw, rel_err=err)
            except Exception as exc:  # noqa: BLE001
                print(name, "gemv tma", bn, st, type(exc).__name__, str(exc)[:300], flush=True)
        del ws, srcs
        torch.cuda.empty_cache()
    # grouped w1/w3 and w2 (6 of 96 experts)
    for name, n_out, k in (("grouped_w1w3", 2304, 5120), ("grouped_w2", 5120, 2304)):
        w = torch.randint(0, 256, (96, n_out, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = torch.randint(117, 124, (96, n_out, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        shared = name == "grouped_w1w3"
        x = torch.randn(*((1, k) if shared else (1, 6, k)), device="cuda", dtype=torch.bfloat16, generator=gen)
        per_call = 6 * n_out * (k // 2 + k // 32)
        idxs = [torch.randperm(96, device="cuda", generator=gen)[:6][None] for _ in range(bk._copies_for(per_call))]
        moved = per_call + x.numel() * 2 + 6 * n_out * 2
        t = bk._bench_graph([lambda i=i: gg.triton_grouped_linear_fp4(x, w, s, i, True) for i in idxs], reps)
        _frac_row(rows, name, "gemv default", moved, t, bw)
        want = gg.reference_grouped_linear_fp4(x.float(), w, s, idxs[0], True).double().reshape(6, n_out)
        xk = x if shared else x.reshape(6, k)
        for bn, st, per_sm in ((64, 4, 3), (64, 3, 4), (128, 3, 2), (32, 4, 6)):
            try:
                got = tma_gemv(xk, w, s, True, bn, st, idx=idxs[0], per_sm=per_sm, pdl=args.pdl,
                               shared_x=shared).double()
                err = float((got - want).abs().max() / want.abs().max())
                d = TensorDescriptor.from_tensor(w.view(96 * n_out, k // 2), [bn, 64])
                t = bk._bench_graph([lambda i=i: tma_gemv(xk, w, s, True, bn, st, idx=i, per_sm=per_sm,
                                                          pdl=args.pdl, desc=d, shared_x=shared)
                                     for i in idxs], reps)
                _frac_row(rows, name, f"gemv tma bn{bn} s{st} p{per_sm}", moved, t, bw, rel_err=err)
            except Exception as exc:  # noqa: BLE001
                print(name, "gemv tma", bn, st, type(exc).__name__, str(exc)[:300], flush=True)
        del w, s
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
