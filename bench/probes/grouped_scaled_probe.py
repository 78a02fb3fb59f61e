"""Probe (issue #3): the grouped FP4 expert GEMV through tl.dot_scaled (e2m1 weights upcast in the wgmma register
layout), a register-prefetch tile loop (`_kpf`, --mode pf) and tile-plan overrides (--mode plan) against the default
launch, at the h200 decode shapes. Prints a table and writes JSON. Results: bench/results/2026-12-01_h200_s19/README.md
(all slower than the tile kernel's 37 us; the default is now the word-decode kernel of grouped_words.py)."""
import os, argparse, json, sys, time
import torch, triton, triton.language as tl
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import _bench_graph, _copies_for, copy_bandwidth
from dsv41.kernels import grouped_gemv as gg
from dsv41.kernels.gemv_tiles import fp8_1x32_parts
from dsv41.kernels._common import exp2_int, split_k_workspace
from dsv41.kernels.gemv_tiles import load_weight_tile, tile_products
from dsv41.kernels.gemv_tiles import pair_expert, grouped_store


@triton.jit
def _kpf(x_ptr, w_ptr, s_ptr, idx_ptr, y_ptr, part_ptr, cnt_ptr, P, N_OUT, K, E, X_ROW_DIV, stride_xr, stride_we,
         stride_wn, stride_se, stride_sn, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr, K_ITERS: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, DEPTH: tl.constexpr):
    # CUDA-core tiles with the next tile's codes loaded into registers before this tile is multiplied.
    NKB: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.arange(0, NKB)
    j32 = tl.arange(0, 32)
    e_ok, e_safe, n_ok = pair_expert(idx_ptr, pair, E, offs_n, N_OUT, USE_PDL)
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xr
    w_exp = w_ptr + e_safe * stride_we
    s_exp = s_ptr + e_safe * stride_se
    zero = pair * 0
    offs_m = tl.arange(0, 1)
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    kbeg = pid_k * K_ITERS * BLOCK_K
    kend = tl.minimum(kbeg + K_ITERS * BLOCK_K, K)
    w0, s0, ok0 = load_weight_tile(w_exp, s_exp, offs_n, n_ok, kb, kbeg, kend, stride_wn, stride_sn, True, False)
    if DEPTH == 2:
        w1, s1, ok1 = load_weight_tile(w_exp, s_exp, offs_n, n_ok, kb, kbeg + BLOCK_K, kend, stride_wn, stride_sn,
                                        True, False)
    for it in tl.range(0, K_ITERS, num_stages=1):
        k0 = kbeg + it * BLOCK_K
        wn, sn, okn = load_weight_tile(w_exp, s_exp, offs_n, n_ok, kb, k0 + DEPTH * BLOCK_K, kend, stride_wn,
                                        stride_sn, True, False)
        acc = tile_products(x_row, w0, s0, ok0, acc, offs_m, kb, j32, k0, zero, 1, 0, True, True, False, 1,
                             BLOCK_N, NKB)
        if DEPTH == 2:
            w0, s0, ok0 = w1, s1, ok1
            w1, s1, ok1 = wn, sn, okn
        else:
            w0, s0, ok0 = wn, sn, okn
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    grouped_store(tl.sum(acc, axis=0), e_ok, offs_n, pair, pid_n, pid_k, y_ptr, part_ptr, cnt_ptr, P, N_OUT,
                   SPLIT_K, SPLIT_POW2)


def launch_pf(x2, w, s, idx, y, xdiv, bn, bk, kiters, nw, pdl, depth=1, maxnreg=None):
    pairs = idx.numel()
    out, kk = w.shape[1], x2.shape[1]
    split = -(-kk // (bk * kiters))
    part, cnt = split_k_workspace(gg._empty, x2.device, split, (pairs, out), -(-out // bn) * pairs)
    extra = {"launch_pdl": True} if pdl else {}
    if maxnreg:
        extra["maxnreg"] = maxnreg
    _kpf[(-(-out // bn), split, pairs)](x2, w, s, idx, y, part, cnt, pairs, out, kk, w.shape[0], xdiv, x2.stride(0),
                                         w.stride(0), w.stride(1), s.stride(0), s.stride(1), SPLIT_K=split,
                                         SPLIT_POW2=triton.next_power_of_2(split), K_ITERS=kiters, BLOCK_N=bn,
                                         BLOCK_K=bk, USE_PDL=pdl, DEPTH=depth, num_warps=nw, **extra)


@triton.jit
def _k(x_ptr, w_ptr, s_ptr, idx_ptr, part_ptr, P, N_OUT, K, X_ROW_DIV, stride_xr, stride_we, stride_wn,
       stride_se, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
       STAGES: tl.constexpr, USE_PDL: tl.constexpr, XCOLS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    e = tl.load(idx_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ob = tl.arange(0, BLOCK_K // 2)
    osb = tl.arange(0, BLOCK_K // 32)
    ok = tl.arange(0, BLOCK_K)
    col = tl.arange(0, XCOLS)
    w_base = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    s_base = s_ptr + e * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xr
    acc = tl.zeros([BLOCK_N, XCOLS], dtype=tl.float32)
    for it in tl.range(0, K_ITERS, num_stages=STAGES):
        k0 = (pid_k * K_ITERS + it) * BLOCK_K
        w = tl.load(w_base + (k0 // 2 + ob)[None, :])
        s = tl.load(s_base + (k0 // 32 + osb)[None, :])
        x = tl.load(x_row + k0 + ok).to(tl.float32)
        q, ex = fp8_1x32_parts(tl.reshape(x, [BLOCK_K // 32, 32]))
        xq = tl.reshape(q * exp2_int(ex), [BLOCK_K])
        xm = tl.where(col[None, :] == 0, xq[:, None], 0.0).to(tl.bfloat16)
        acc = tl.dot_scaled(w, s, "e2m1", xm, None, "bf16", acc)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1)
    tl.store(part_ptr + (pid_k.to(tl.int64) * P + pair) * N_OUT + offs_n, y)


def launch(x2, w, s, idx, part, xdiv, bn, bk, split, stages, nw, pdl, xcols=16):
    pairs = idx.numel()
    out, kk = w.shape[1], x2.shape[1]
    kiters = kk // bk // split
    assert kiters * bk * split == kk and out % bn == 0
    _k[(out // bn, split, pairs)](x2, w, s, idx, part, pairs, out, kk, xdiv, x2.stride(0), w.stride(0), w.stride(1),
                                  s.stride(0), s.stride(1), BLOCK_N=bn, BLOCK_K=bk, K_ITERS=kiters, STAGES=stages,
                                  USE_PDL=pdl, XCOLS=xcols, num_warps=nw, **({"launch_pdl": True} if pdl else {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps-ms", type=float, default=200)
    ap.add_argument("--mode", default="all")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(a.reps_ms)
    rows = []
    experts, topk = 96, 6
    for name, n, k in [("grouped_w1w3", 2304, 5120), ("grouped_w2", 5120, 2304)]:
        w = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = torch.randint(117, 124, (experts, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        shared = name == "grouped_w1w3"
        x = torch.randn(*((1, k) if shared else (1, topk, k)), device="cuda", dtype=torch.bfloat16, generator=gen)
        x2 = x.reshape(-1, k)
        per_call = topk * n * (k // 2 + k // 32)
        copies = _copies_for(per_call)
        idxs = [torch.randperm(experts, device="cuda", generator=gen)[:topk][None] for _ in range(copies)]
        ref = gg.reference_grouped_linear_fp4(x.float(), w, s, idxs[0], True).reshape(topk, n)
        t = _bench_graph([lambda i=i: gg.triton_grouped_linear_fp4(x, w, s, i, True) for i in idxs], a.reps_ms)
        rows.append(dict(shape=name, variant="default", time_us=t * 1e6, frac=per_call / t / bw))
        print(f"{name} default {t*1e6:.1f} us {per_call/t/bw:.3f}", flush=True)
        xdiv = topk if shared else 1
        y = torch.empty(topk, n, dtype=torch.bfloat16, device="cuda")
        refb = ref.to(torch.bfloat16).float()
        cfgs = []
        if a.mode in ("pf", "all"):
            for bn, bk, kiters, depth, nw, mr in [
                    (128, 128, 2, 1, 4, None), (128, 128, 4, 1, 4, None), (128, 128, 6, 1, 4, None),
                    (128, 128, 10, 1, 4, None), (128, 128, 3, 2, 4, None), (128, 128, 6, 2, 4, None),
                    (128, 128, 9, 2, 4, None), (64, 128, 4, 1, 4, None), (64, 128, 9, 1, 4, None),
                    (64, 128, 10, 1, 4, None), (64, 128, 6, 2, 4, None), (64, 256, 2, 1, 4, None),
                    (64, 256, 5, 1, 4, None), (64, 256, 3, 1, 4, None), (128, 128, 4, 1, 4, 128),
                    (128, 128, 6, 1, 8, None), (128, 256, 3, 1, 8, None), (32, 256, 3, 1, 4, None),
                    (32, 256, 5, 1, 4, None), (64, 128, 18, 1, 4, None), (128, 128, 20, 1, 4, None)]:
                if (k // bk) % kiters and kiters > 2 and (k // bk) // kiters < 2:
                    continue
                cfgs.append(("pf", dict(bn=bn, bk=bk, kiters=kiters, depth=depth, nw=nw, maxnreg=mr)))
        if a.mode in ("plan", "all"):
            for bn, bk, kiters, nw in [(128, 128, 1, 4), (128, 256, 1, 4), (64, 256, 1, 4), (64, 256, 2, 4),
                                       (128, 128, 4, 4), (64, 512, 1, 4), (128, 256, 1, 8), (256, 128, 1, 8)]:
                cfgs.append(("plan", dict(block_n=bn, block_k=bk, k_iters=kiters, num_warps=nw, stages=1)))
        for kind, cfg in cfgs:
            if kind == "pf":
                fn = lambda i, cfg=cfg: launch_pf(x2, w, s, i.reshape(-1), y, xdiv, cfg["bn"], cfg["bk"],
                                                  cfg["kiters"], cfg["nw"], True, cfg["depth"], cfg["maxnreg"])
            else:
                fn = lambda i, cfg=cfg: gg.triton_grouped_linear_fp4(x, w, s, i, True, **cfg).reshape(topk, n)
            try:
                y.fill_(float("nan"))
                got = fn(idxs[0])
                got = (y if got is None else got).float()
                torch.cuda.synchronize()
                err = ((got - refb).abs().max() / ref.abs().max()).item()
                t = _bench_graph([lambda i=i: fn(i) for i in idxs], a.reps_ms / 4)
            except Exception as exc:
                print(f"  {name} {kind} {cfg}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            r = dict(shape=name, variant=kind, **cfg, time_us=t * 1e6, frac=per_call / t / bw, max_rel_err=err)
            rows.append(r)
            print(f"{name} {kind} {cfg}: {t*1e6:.1f} us {per_call/t/bw:.3f} err={err:.2e}", flush=True)
        del w, s
    out = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    for name in ("grouped_w1w3", "grouped_w2"):
        rs = sorted([r for r in rows if r["shape"] == name], key=lambda r: r["time_us"])[:6]
        for r in rs:
            print(name, r)


if __name__ == "__main__":
    main()
