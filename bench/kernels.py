"""Microbenchmark of the dsv41 Triton kernels against their byte floor (GPU only).

For every kernel and shape: median time (triton.testing.do_bench, L2 flushed before each rep, >= 20 reps)
against the byte floor = bytes the kernel must move / device-to-device copy bandwidth measured in the same
run (copy bandwidth counts bytes read + written, ARCHITECTURE.md "Kernels"). Kernel times come from CUDA
graphs of back-to-back calls over rotating weight copies (> L2), as in a captured decode step; an eager
row adds the Python + launch overhead. The GEMV rows also time the fallback the dispatch pass replaces
(dequantise + F.linear through cuBLAS) and a bf16 cuBLAS GEMV on an already-dequantised weight.

Usage:
    python bench/kernels.py [--json PATH] [--reps-ms MS] [--sweep] [--only NAME ...] [--pdl]
    python bench/kernels.py --families [--m M ...] [--contexts C,C,...] [--tiny] [--device cpu] [--only NAME ...]
`--sweep` also times a small grid of GEMV launch configurations per shape (to tune `gemv_plan`), the grouped FP4
expert GEMV's too (`GROUPED_SHAPES`, `--only grouped_w1w3 grouped_w2`).
Shapes are the h200 preset's decode shapes (MODEL.md §4.3): wq_b 32768x1280, wo_b 5120x8192, wq_a 1280x5120,
shared w1 2304x5120, w2 5120x2304, FP4 expert 2304x5120 / 5120x2304, head-like 129280x5120 (fp8).
`--families` times the fusion-family ops instead (Engram lookup / gate, MoE router / tail, grouped FP4 experts,
C2 bank writes; byte formulas in the comment above `_FAMILY_MAX_COPIES`) at h200 shapes; with `--tiny` at tiny
shapes with one timed call per variant, also on `--device cpu` under TRITON_INTERPRET=1 (an end-to-end check).
It also times the sparse FP4 attention and the indexer ops (scores, top-k, candidate pool, Reindex pool) for one
decode query at each of `--contexts` (default 4096,32768,131072 tokens, with --tiny 4096 only; M = 1 whatever
`--m` says), e.g.
    python bench/kernels.py --families --only sparse_fp4_attention indexer_scores indexer_topk indexer_candidates
Exits with status 2 and a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (name, weight format, N, K) of the GEMVs of one h200 decode step.
GEMV_SHAPES = [
    ("wq_b", "fp8", 32768, 1280),
    ("wo_b", "fp8", 5120, 8192),
    ("wq_a", "fp8", 1280, 5120),
    ("shared_w1", "fp8", 2304, 5120),
    ("shared_w2", "fp8", 5120, 2304),
    ("expert_w1", "fp4", 2304, 5120),
    ("expert_w2", "fp4", 5120, 2304),
    ("head", "fp8", 129280, 5120),
    ("fp4_large", "fp4", 16384, 16384),  # not in the model: the FP4 kernel's bandwidth away from latency limits
]
#: (name, leading shape of x, D, R/2 rope pairs, scale_block, e4m3_scale, op)
ROPE_SHAPES = [
    ("bank_store", (1, 1), 512, 32, 16, True, "store"),
    ("index_key_store", (1, 1), 128, 32, 32, False, "store"),
    ("index_q_fake", (1, 1, 32), 128, 32, 32, False, "fake"),
    ("bank_quant_prefill", (1, 256), 512, 32, 16, True, "quant"),
]
#: (name, N, K) of the grouped FP4 expert GEMVs of one h200 decode step (k = 6 of 96 experts per token; w1 and w3
#: have the same shape). Timed by the GEMV section (heuristic plan) and, with --sweep, over `GROUPED_SWEEP`.
GROUPED_SHAPES = [("grouped_w1w3", 2304, 5120), ("grouped_w2", 5120, 2304)]
#: Launch configurations tried by --sweep on every GEMV shape at M = 1 and on the grouped GEMV (bf16 x).
#: A tuple is a tile-loop plan: (BLOCK_N, BLOCK_K, num_warps, STAGES, programs per SM, MMA[, maxnreg]); MMA False:
#: CUDA-core FMA tiles, STAGES 1 the tile-at-once layout with its own K_ITERS rule (a quarter to a half of copy
#: bandwidth, 2026-11-30), maxnreg a register cap (ncu: 120 registers (FP8) / 168 (FP4) hold it at 4 / 3 programs
#: per SM). The pipelined and tensor-core tile loops were slower at every shape (bench/results/2026-11-30_h200_s7_gemv/)
#: and are left out, as are the row-streaming plans (`dsv41/kernels/gemv_rows.py`, slower at every shape:
#: bench/results/2026-11-30_h200_s11; a dict with `kc_bytes` still selects one). A dict with `tma` is a TMA GEMV plan
#: (`dsv41/kernels/gemv_tma.py`, block FP8 only: block_n, stages, programs_per_sm).
SWEEP = [(128, 128, 4, 1, 4, False),
         dict(tma=True, block_n=64, stages=3, programs_per_sm=4, scale_words=True),
         dict(tma=True, block_n=64, stages=4, programs_per_sm=3),
         dict(tma=True, block_n=64, stages=3, programs_per_sm=5),
         dict(tma=True, block_n=128, stages=3, programs_per_sm=2),
         dict(tma=True, block_n=128, stages=3, programs_per_sm=2, scale_words=True),
         dict(tma=True, block_n=128, stages=4, programs_per_sm=2),
         dict(tma=True, block_n=32, stages=4, programs_per_sm=6)]
#: The grouped GEMV also tries the word-decode tensor-core kernel (`dsv41/kernels/grouped_mma.py`, a dict with
#: `mma_words`: block_n, block_k, stages, programs_per_sm, num_warps); every one of these plans was slower than the
#: CUDA-core default at both h200 shapes (50-72 vs 37 us, bench/results/2026-12-01_h200_s18).
GROUPED_SWEEP = [c for c in SWEEP if not isinstance(c, dict)] + [  # the TMA GEMV takes block FP8 only
    dict(mma_words=True, block_n=64, block_k=256, stages=3, programs_per_sm=4),
    dict(mma_words=True, block_n=64, block_k=256, stages=4, programs_per_sm=3),
    dict(mma_words=True, block_n=64, block_k=256, stages=3, programs_per_sm=6),
    dict(mma_words=True, block_n=128, block_k=256, stages=3, programs_per_sm=2, num_warps=8),
    dict(mma_words=True, block_n=64, block_k=512, stages=2, programs_per_sm=3),
    dict(mma_words=True, block_n=128, block_k=512, stages=2, programs_per_sm=1, num_warps=8),
    # The CUDA-core word-decode kernel (dsv41/kernels/grouped_words.py, the default for bf16 / fp32 x).
    dict(words=True, block_n=16, block_k=256, num_warps=1),
    dict(words=True, block_n=32, block_k=256, num_warps=1, k_iters=2),
    dict(words=True, block_n=64, block_k=256, num_warps=1),
    dict(words=True, block_n=64, block_k=128, num_warps=4, k_iters=4, x_perm=True),
    dict(words=True, block_n=128, block_k=256, num_warps=4, x_perm=True)]


def _sweep_overrides(bn, bk, nw, st, density, mma, maxnreg=None):
    """gemv_plan overrides and a row label for one tile-loop SWEEP entry (an optional 7th field caps registers)."""
    over = dict(block_n=bn, block_k=bk, num_warps=nw, stages=st, mma=mma)
    if st > 1:
        over["sm_count"] = max(1, int(132 * density / 4))
    label = f"sweep {'mma' if mma else 'fma'} bn={bn} bk={bk} w={nw} st={st}" + (f" {density}/SM" if st > 1 else "")
    if maxnreg is not None:
        over["maxnreg"] = maxnreg
        label += f" maxnreg={maxnreg}"
    return over, label


def sweep_overrides(cfg, fp4: bool):
    """(overrides for triton_linear_* / triton_grouped_linear_fp4, row label) of one SWEEP entry, or None for a
    row-streaming entry the format cannot take (block FP8 with block_r > 32)."""
    if not isinstance(cfg, dict):
        return _sweep_overrides(*cfg)
    cfg = dict(cfg)
    if cfg.get("mma_words"):
        return cfg, "sweep mma_words" + "".join(f" {k}={v}" for k, v in cfg.items() if k != "mma_words")
    if cfg.get("words"):
        return cfg, "sweep words" + "".join(f" {k}={v}" for k, v in cfg.items() if k != "words")
    if cfg.get("tma"):
        if fp4:
            return None
        return cfg, "sweep tma" + "".join(f" {k}={v}" for k, v in cfg.items() if k != "tma")
    kcb = cfg.pop("kc_bytes")
    if not fp4 and cfg.get("block_r", 32) > 32:
        return None
    over = dict(rows=True, kc=kcb * (2 if fp4 else 1), **cfg)
    from dsv41.kernels import gemv_rows
    label = f"sweep rows B={kcb} rb={cfg.get('block_r', gemv_rows._RB[fp4])}" + "".join(
        f" {k}={v}" for k, v in cfg.items() if k != "block_r")
    return over, label


def _bench(fn, reps_ms: float) -> float:
    """Median seconds of `fn` (do_bench: L2 flushed before each rep, CUDA events around each)."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    rep = max(reps_ms, 25 * start.elapsed_time(end))  # do_bench runs rep / estimate reps: keep >= 20
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e-3


def _bench_graph(calls, reps_ms: float) -> float:
    """Median seconds per call of `calls` (a list of callables) captured back to back in one CUDA graph.

    This is how a decode step runs (ARCHITECTURE.md "CUDA graphs"): it removes the Python/launch overhead
    that dominates eager timing of microsecond kernels. Callers rotate over enough weight copies that the
    graph's data exceeds L2, so each call reads its weights from HBM.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:  # compile and allocate outside the capture
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    t = _bench(graph.replay, reps_ms)
    del graph
    return t / len(calls)


def _copies_for(nbytes: int) -> int:
    """Weight copies so that one graph replay touches >= 3x the H200's 60 MB L2 (at most 32)."""
    return max(1, min(32, -(-(180 << 20) // max(nbytes, 1))))


def copy_bandwidth(reps_ms: float) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written) of a 1 GiB buffer."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _bench(lambda: dst.copy_(src), reps_ms)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / t


def _random_fp8_weight(n: int, k: int, gen: torch.Generator):
    """Random E4M3 bytes (NaN codes 0x7F / 0xFF replaced) and UE8M0 scales near 2^-8."""
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    w[(w & 0x7F) == 0x7F] = 0x38
    s = torch.randint(116, 122, (-(-n // 32), k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    return w, s


def _random_fp4_weight(n: int, k: int, gen: torch.Generator):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s = torch.randint(116, 122, (n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    return w, s


def bench_gemv(name, fmt, n, k, m, bw, reps_ms, sweep, gen):
    """Rows for one GEMV shape: Triton (graph and eager), the dequant+cuBLAS fallback, a bf16 cuBLAS GEMV."""
    from dsv41.kernels import quant_gemv as qg
    from dsv41.model.formats import dequantize_fp4_1x32, dequantize_fp8_block
    fp4 = fmt == "fp4"
    make = _random_fp4_weight if fp4 else _random_fp8_weight
    w0, s0 = make(n, k, gen)
    copies = _copies_for(w0.numel() + s0.numel())
    ws = [(w0, s0)] + [make(n, k, gen) for _ in range(copies - 1)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    tri = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    ref = qg.reference_linear_fp4 if fp4 else qg.reference_linear_fp8_block
    moved = w0.numel() + s0.numel() + x.numel() * 2 + m * n * 2
    base = dict(kernel=f"linear_{fmt}", shape=name, M=m, N=n, K=k)

    def row(variant, t, nbytes=moved, **extra):
        return dict(base, variant=variant, bytes=nbytes, time_us=t * 1e6, floor_us=nbytes / bw * 1e6,
                    eff_bw_TBps=nbytes / t / 1e12, frac_of_copy=nbytes / t / bw, **extra)

    plan = _default_plan(m, n, k, fp4, w0)
    plan_j = {kk: (list(v) if kk == "grid" else v) for kk, v in plan.items()}
    rows = [row("triton (graph)", _bench_graph([lambda w=w, s=s: tri(x, w, s, True) for w, s in ws], reps_ms),
                plan=plan_j),
            row("triton (eager, incl. launch)", _bench(lambda: tri(x, w0, s0, True), reps_ms))]
    if not fp4:  # the default is the TMA kernel where the GPU has TMA: the tile kernel beside it
        rows.append(row("triton tile kernel, tma=False (graph)",
                        _bench_graph([lambda w=w, s=s: tri(x, w, s, True, tma=False) for w, s in ws], reps_ms),
                        plan=_plan_grid({"tma": False}, m, n, k, fp4)))
    rows.append(row("fallback dequant+cuBLAS (graph)",
                    _bench_graph([lambda w=w, s=s: ref(x, w, s, True) for w, s in ws[:4]], reps_ms)))
    wd = (dequantize_fp4_1x32(w0, s0, torch.bfloat16) if fp4 else dequantize_fp8_block(w0, s0, torch.bfloat16))
    wds = [wd] + [wd.clone() for _ in range(_copies_for(wd.numel() * 2) - 1)]
    bf16_bytes = wd.numel() * 2 + x.numel() * 2 + m * n * 2
    rows.append(row("bf16 cuBLAS, 2 B/weight (graph)",
                    _bench_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in wds], reps_ms), bf16_bytes))
    del wd, wds
    if sweep and m == 1:
        for cfg in SWEEP:
            picked = sweep_overrides(cfg, fp4)
            if picked is None:
                continue
            over, label = picked
            try:
                t = _bench_graph([lambda w=w, s=s: tri(x, w, s, True, **over) for w, s in ws], reps_ms / 4)
            except Exception as exc:  # a config that does not compile (registers, shared memory)
                print(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append(row(label, t, plan=_plan_grid(over, m, n, k, fp4)))
    return rows


def _default_plan(m: int, n: int, k: int, fp4: bool, weight: torch.Tensor) -> dict:
    """The plan (with "kernel": "tma" or "tile") a launch without options runs on this GPU for `weight`."""
    from dsv41.kernels import gemv_tma, quant_gemv as qg
    dev = torch.device("cuda")
    sms = qg.device_sm_count(dev)
    if qg.split_tma_overrides({}, fp4, dev, m, weight) is not None:
        return dict(gemv_tma.tma_gemv_plan(m, n, k, sm_count=sms), kernel="tma")
    return dict(qg.gemv_plan(m, n, k, fp4, sm_count=sms), kernel="tile")


def _plan_grid(over: dict, m: int, n: int, k: int, fp4: bool, pairs: int = 0) -> list:
    """The launch grid an override set gives (TMA, row-streaming or tile-loop plan), for the JSON rows."""
    from dsv41.kernels import gemv_rows, quant_gemv as qg
    over = dict(over)
    if torch.cuda.is_available():  # as the launchers do: the plan is sized to this GPU's SMs
        over.setdefault("sm_count", qg.device_sm_count(torch.device("cuda")))
    if over.pop("words", None):
        from dsv41.kernels.grouped_words import grouped_words_plan
        return list(grouped_words_plan(max(pairs, 1), n, k, **over)["grid"])
    if over.pop("mma_words", None):
        from dsv41.kernels.grouped_mma import grouped_mma_plan
        return list(grouped_mma_plan(max(pairs, 1), n, k, **over)["grid"])
    if over.pop("tma", None):
        from dsv41.kernels.gemv_tma import tma_gemv_plan
        return list(tma_gemv_plan(m, n, k, **over)["grid"])
    rows = qg.split_rows_overrides(over, m, fp4)
    if rows is not None:
        return list(gemv_rows.rows_plan(n, k, fp4, pairs=max(pairs, 1), **rows)["grid"])
    if pairs:
        from dsv41.kernels import grouped_gemv as gg
        return list(gg.grouped_gemv_plan(pairs, n, k, **over)["grid"])
    return list(qg.gemv_plan(m, n, k, fp4, **over)["grid"])


def bench_grouped(name, n, k, bw, reps_ms, sweep, gen, experts=96, topk=6):
    """Rows for one grouped FP4 expert GEMV shape at one token: the heuristic plan (graph and eager) and, with
    `sweep`, every `GROUPED_SWEEP` configuration. Each call of a graph picks its own `topk` distinct experts of an
    [experts, n, k/2] stack (566 MB for w1 at h200, beyond L2), so the weights come from HBM; bytes are the picked
    experts' codes + scales, x and y (`--families`' grouped_fp4 rule)."""
    from dsv41.kernels import grouped_gemv as gg
    w = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s = torch.randint(117, 124, (experts, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    shared = name == "grouped_w1w3"  # w1 / w3 read one x row per token, w2 one per (token, expert)
    x = torch.randn(*((1, k) if shared else (1, topk, k)), device="cuda", dtype=torch.bfloat16, generator=gen)
    per_call = topk * n * (k // 2 + k // 32)
    copies = _copies_for(per_call)
    idxs = [torch.randperm(experts, device="cuda", generator=gen)[:topk][None] for _ in range(copies)]
    moved = per_call + x.numel() * 2 + topk * n * 2
    base = dict(kernel="grouped_linear_fp4", shape=name, M=1, N=n, K=k)

    def row(variant, t, **extra):
        return dict(base, variant=variant, bytes=moved, time_us=t * 1e6, floor_us=moved / bw * 1e6,
                    eff_bw_TBps=moved / t / 1e12, frac_of_copy=moved / t / bw, **extra)

    from dsv41.kernels import grouped_frag, grouped_words
    frag = gg.takes_frag_by_default(x, w, True, topk)
    words = gg.takes_words_by_default(x, w, True, topk)
    plan = (grouped_frag.grouped_frag_plan(topk, n, k) if frag else grouped_words.grouped_words_plan(topk, n, k)
            if words else gg.grouped_gemv_plan(topk, n, k))
    tile = gg.grouped_gemv_plan(topk, n, k)
    rows = [row("triton (graph)", _bench_graph([lambda i=i: gg.triton_grouped_linear_fp4(x, w, s, i, True)
                                                for i in idxs], reps_ms),
                kernel_used="grouped_frag" if frag else "grouped_words" if words else "grouped_gemv",
                plan={kk: (list(v) if kk == "grid" else v) for kk, v in plan.items()}),
            row("triton (eager, incl. launch)", _bench(lambda: gg.triton_grouped_linear_fp4(x, w, s, idxs[0], True),
                                                       reps_ms))]
    if words or frag:  # the tile kernel they replaced, same plan heuristic as before
        rows.append(row("tile kernel, words=False (graph)", _bench_graph(
            [lambda i=i: gg.triton_grouped_linear_fp4(x, w, s, i, True, words=False) for i in idxs], reps_ms),
            plan={kk: (list(v) if kk == "grid" else v) for kk, v in tile.items()}))
    if sweep:
        for cfg in GROUPED_SWEEP:
            over, label = sweep_overrides(cfg, True)
            try:
                t = _bench_graph([lambda i=i: gg.triton_grouped_linear_fp4(x, w, s, i, True, **over) for i in idxs],
                                 reps_ms / 4)
            except Exception as exc:  # a config that does not compile (registers, shared memory)
                print(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append(row(label, t, plan=_plan_grid(over, 1, n, k, True, pairs=topk)))
    del w, s
    return rows


#: The FP8 projections of one h200 decode layer, in model order (attention q/o paths and the shared expert).
CHAIN = ("wq_a", "wq_b", "wo_b", "shared_w1", "shared_w2")


def bench_gemv_chain(bw, reps_ms, gen):
    """Two rows (the default kernel and the tile kernel, tma=False): the FP8 GEMVs of one decode layer (`CHAIN`)
    back to back in one CUDA graph, as a decode step runs
    them (PDL overlaps each kernel's weight loads with the previous one's tail), over enough layer copies that
    the weights exceed L2. Bytes = all weights + scales + activations read and outputs written."""
    from dsv41.kernels import quant_gemv as qg
    shapes = [(n, k) for name, fmt, n, k in GEMV_SHAPES if name in CHAIN]
    layer_bytes = sum(n * k + (-(-n // 32)) * (k // 32) for n, k in shapes)
    layers = [[_random_fp8_weight(n, k, gen) for n, k in shapes] for _ in range(_copies_for(layer_bytes))]
    xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen) for n, k in shapes]
    moved = layer_bytes + sum(2 * k + 2 * n for n, k in shapes)
    out = []
    for variant, over in (("triton (graph), one layer", {}), ("triton tile kernel, tma=False (graph), one layer",
                                                             {"tma": False})):
        calls = [lambda x=x, w=w, s=s: qg.triton_linear_fp8_block(x, w, s, True, **over)
                 for layer in layers for x, (w, s) in zip(xs, layer)]
        t = _bench_graph(calls, reps_ms) * len(shapes)  # seconds per layer
        out.append(dict(kernel="linear_fp8_block chain", shape="+".join(CHAIN), M=1, N=sum(n for n, _ in shapes),
                        K=0, variant=variant, bytes=moved, time_us=t * 1e6, floor_us=moved / bw * 1e6,
                        eff_bw_TBps=moved / t / 1e12, frac_of_copy=moved / t / bw))
    return out


def bench_rope(name, lead, d, r_half, block, e4m3, op, bw, reps_ms, gen):
    """Rows for one RoPE+FP4 case: Triton and the eager reference, 16 calls per graph, plus eager Triton."""
    from dsv41.kernels import rope_fp4 as rp
    x = torch.randn(*lead, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    ang = torch.rand(*lead[:2], r_half, device="cuda", generator=gen) * 100
    extra = (1,) * (len(lead) - 2)
    cos = ang.cos().reshape(*lead[:2], *extra, r_half)
    sin = ang.sin().reshape(*lead[:2], *extra, r_half)
    nvec = x.numel() // d
    in_bytes = x.numel() * 2 + 2 * cos.numel() * 4
    if op == "store":
        b, t_ = lead
        cc = torch.zeros(b, 4096, d // 2, dtype=torch.uint8, device="cuda")
        sc = torch.zeros(b, 4096, d // block, dtype=torch.uint8, device="cuda")
        rows = torch.randint(0, 4096, (b, t_), device="cuda", generator=gen)
        fn = lambda: rp.triton_rope_fp4_quant_store(x, cos, sin, block, e4m3, cc, sc, rows)  # noqa: E731
        ref = lambda: rp.reference_rope_fp4_quant_store(x, cos, sin, block, e4m3, cc, sc, rows)  # noqa: E731
        moved = in_bytes + rows.numel() * 8 + nvec * (d // 2 + d // block)
    elif op == "fake":
        fn = lambda: rp.triton_rope_fp4_fake_quant(x, cos, sin, block, e4m3)  # noqa: E731
        ref = lambda: rp.reference_rope_fp4_fake_quant(x, cos, sin, block, e4m3)  # noqa: E731
        moved = in_bytes + x.numel() * 2
    else:
        fn = lambda: rp.triton_rope_fp4_quant(x, cos, sin, block, e4m3)  # noqa: E731
        ref = lambda: rp.reference_rope_fp4_quant(x, cos, sin, block, e4m3)  # noqa: E731
        moved = in_bytes + nvec * (d // 2 + d // block)
    out = []
    base = dict(kernel=f"rope_fp4_{op}", shape=name, M=nvec, N=d, K=r_half * 2, bytes=moved,
                floor_us=moved / bw * 1e6)
    graphable = op != "store"  # the eager reference of the store uses boolean indexing (host sync)
    variants = [("triton (graph)", lambda: _bench_graph([fn] * 16, reps_ms)),
                ("triton (eager, incl. launch)", lambda: _bench(fn, reps_ms))]
    variants.append(("reference (graph)", lambda: _bench_graph([ref] * 16, reps_ms)) if graphable
                    else ("reference (eager)", lambda: _bench(ref, reps_ms)))
    for variant, timer in variants:
        t = timer()
        out.append(dict(base, variant=variant, time_us=t * 1e6, eff_bw_TBps=moved / t / 1e12,
                        frac_of_copy=moved / t / bw))
    return out


# ------------------------------------------------------------------------------------------- fusion families
# `--families`: the ops of the fusion families (dsv41/kernels/{engram,moe,grouped_gemv,c2_compressor,mhc}.py) at the
# decode shapes of a preset (h200; tiny with --tiny), every size from dsv41.model.ModelConfig, activations bf16.
# Rows follow the GEMV/RoPE schema; M = token rows of the decode step (--m), N and K as listed per op below.
#
# Byte floor of each op = what it must read + write at minimum (elt(t) = bytes per element of t; not counted:
# split-K partials and arrival counters, the router's logit workspace, re-reads that hit L2):
#   engram_lookup  tokens * (M_ng * 8                      u, the look-back ids (int64)
#                            + R * (C + C/32)              the R gathered table rows: E4M3 bytes + UE8M0 scales
#                            + R * C * elt(x))             the dequantised wkv input written
#                  + (M_ng + 2 R) * 8                      multipliers, primes, offsets
#                  M_ng = engram_max_ngram, R = (M_ng - 1) * engram_n_heads, C = engram_row_dim; N = R*C, K = C
#   engram_gate    tokens * (4d [H] + 4d [keys] + d [value] + 4d [H' written]) * elt + 2 * 4d * elt [q/k weights]
#                  d = hidden_size; N = 4d, K = d
#   moe_router     tokens * d * elt(x) + E * d * elt(W) + E * 4 [bias fp32] + tokens * k * (4 + 8) [weights, ids]
#                  E = n_routed_experts, k = num_experts_per_tok; N = E, K = d
#   moe_combine    tokens * (k * d * elt(y) + d * elt(shared) + d * elt(out))    (V4.1's tail: weights = None)
#                  N = d, K = k
#   upcast_head    tokens * d * 4 [x fp32] + V * d * 2 [bf16 head weight, read once] + tokens * V * 4 [logits]
#                  V = vocab_size; N = V, K = d
#   fp32_dense     tokens * K * 4 [x] + head_dim * K * 4 [FP32 compressor weight] + tokens * head_dim * 4 [y]
#   grouped_fp4    U * out * (K/2 + K/32)                  codes + scales of the U distinct experts the ids name
#                  + x bytes (tokens x K for w1/w3, tokens x k x K for w2) + tokens * k * 8 [ids]
#                  + tokens * k * out * elt(y); shapes w1w3: out = moe_intermediate_size, K = d; w2: the reverse
#   c2_pool_store  tokens * (4 D * 4 [k, g, prev_k, prev_g fp32] + 2 * R/2 * 4 [cos, sin] + 8 [row]
#                            + D * elt(latent) + D/2 + D/16 [latent, FP4 codes, E4M3 scales written]) + D * elt(w)
#                  D = head_dim, R = qk_rope_head_dim (bank rows: E2M1 + E4M3 scale per 16); N = D, K = R
#   c2_norm_store  as c2_pool_store with tokens * D * elt(x) read instead of the four fp32 projections
#   mhc_mixes      tokens * 4d * elt(H) + 24 * 4d * 4 [fn fp32] + (24 + 3) * 4 [base, scale]
#                  + tokens * 24 * 4 [pre, post, comb written]; N = 24, K = 4d
#   mhc_collapse_rmsnorm  tokens * (4d * elt(H) + 4 * 4 [pre] + d * elt(x) [written]) + d * elt(w); N = d, K = 4d
#   mhc_expand     tokens * (d * elt(y) + 2 * 4d * elt(H) [read, written] + (4 + 16) * 4 [post, comb]); N = 4d,
#                  K = 4 (the streams mixed)
#
# Attention and indexer rows (`CONTEXT_CASES`): one decode query (batch 1, M = 1) of a sequence `ctx` tokens long,
# once per `--contexts` entry (shape label <preset>_ctx<ctx>[_r<ratio> | _pool]). A ratio-r layer sees
# n_r = floor(ctx / r) bank / key rows (dsv41/model/csa.py `visible_rows` at position ctx - 1); k = index_topk.
#   sparse_fp4_attention  2 * H * D * elt(q)          q read, o written
#                         + S * (D + D/32 + 1)        window rows (E4M3 bytes, UE8M0 scales, window_ok byte),
#                                                     S = min(sliding_window, ctx), all visible
#                         + kv * (D/2 + D/16)         the kv = min(k, n_2) selected bank rows (E2M1 + E4M3 per
#                                                     16), NOT the whole ceil(ctx / 2)-row bank: the kernel
#                                                     gathers only those; -1 slots read nothing
#                         + k * 8 + H * 4 + 2 * R/2 * 4   indices (int64), sink, cos / sin
#                         N = S + k (rows attended), K = D
#   indexer_scores _r{r}  n_r * (Di/2 + Di/32)        every visible index-key row (E2M1 + UE8M0 per 32)
#                         + Hi * Di * elt(q) + Hi * 4 + 8 + n_r * 4    q, head weights (fp32), n_visible,
#                                                     scores written (fp32); N = n_r, K = Di
#   indexer_scores _pool  as _r1 over the rows of the W = min(n_blocks, ceil(n_1 / block)) pool blocks only,
#                         + W * 8 (block ids) and W * block * 4 compact scores written (the Reindex layers)
#   indexer_topk _r{r}    n_r * 4 + k * 8             scores read, indices written (int64); N = n_r, K = k
#   indexer_topk _pool    W * block * 4 + min(k, W) * 8 + k * 8   compact scores, the block ids the selected
#                                                     slots map through, indices written
#   indexer_candidates    n_1 * 4 + 8 + W * 8         scores, n_visible, block ids written (the candidate source
#                                                     is a ratio-1 layer); not counted: the block-max workspace
#
# Timing (CUDA, default): a CUDA graph of back-to-back calls over input copies (rotated so one replay touches
# >= 3x the 60 MB L2 where <= _FAMILY_MAX_COPIES copies suffice; `copies` and `graph_data_MB` in each row say
# how much), triton.testing.do_bench median with L2 flushed per replay, divided by the calls per graph. The big
# shared tables (Engram rows, expert stacks) are not copied: each call gathers other rows / experts. References
# are graph-captured too, except the bank writes, whose reference scatters through boolean indexing (a host
# sync): "reference (eager)". The grouped GEMV's reference is the model's gather -> dequantise -> einsum
# without `reference_grouped_linear_fp4`'s host-side index range check (a sync a graph cannot capture).
# `--tiny` (and `--device cpu`, where the kernels run in the Triton interpreter under TRITON_INTERPRET=1): one
# timed call after one warm-up call, no graphs; that checks the code end to end, the times mean little.
# Every row also carries `check`: the Triton output against the reference on the first input copy.

#: Most input copies one timing graph rotates over.
_FAMILY_MAX_COPIES = 1024
#: Most copies a reference graph replays (the references launch ~10 kernels per call).
_FAMILY_MAX_REF_COPIES = 256
#: The H200's L2 (bytes): one replay should touch 3x this.
_L2_BYTES = 60 << 20
#: Bank rows of the compressor caches the c2 rows write into.
_C2_CACHE_ROWS = 4096
#: Default `--contexts`: sequence lengths (tokens) of the attention / indexer rows.
DEFAULT_CONTEXTS = (4096, 32768, 131072)
#: Compress ratio of the bank the attention rows read (the encoder's ratio-2 kv sources).
_ATTN_BANK_RATIO = 2
#: `offset` of the top-k rows: dsv41/model keeps window and bank rows apart, so the compiled graph passes 0.
_TOPK_OFFSET = 0
#: Bytes of distinct bank / key caches the copies of a case that gathers only part of its cache rotate over.
_GATHER_SOURCE_BUDGET = 4 << 30


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _family_copies(nbytes: int) -> int:
    """Input copies so that one graph replay touches >= 3x the L2 (at most `_FAMILY_MAX_COPIES`)."""
    return max(1, min(_FAMILY_MAX_COPIES, -(-3 * _L2_BYTES // max(nbytes, 1))))


def _randn(shape, gen, dev, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)


def _grouped_reference_graphable(x, weight, scale, indices, act_quant):
    """`grouped_gemv.reference_grouped_linear_fp4` minus its host-side index range check: the model's
    gather -> dequantise -> einsum (dsv41/model/moe.py `RoutedExperts.forward_gather`). Shapes as the op."""
    from dsv41.model.formats import dequantize_fp4_1x32, fake_quant_fp8_1x32
    w = dequantize_fp4_1x32(weight[indices], scale[indices], x.dtype)
    xq = fake_quant_fp8_1x32(x) if act_quant else x
    return torch.einsum("nd,nkfd->nkf" if x.dim() == 2 else "nkd,nkfd->nkf", xq, w)


def _case_engram_lookup(cfg, n, dev, dt, gen, state):
    from dsv41.kernels import engram as ek
    from dsv41.model.engram import EngramHash
    layer = cfg.engram_layer_ids[0]
    if "engram" not in state:  # the layer's table: ~3.1M rows x (256 + 8) B at h200, shared by every copy
        h = EngramHash(cfg)
        consts = tuple(torch.tensor(v, dtype=torch.int64, device=dev)
                       for v in (h.multipliers(layer), h.primes(layer), h.offsets(layer)))
        c = cfg.engram_row_dim
        w = torch.randint(0, 256, (h.num_rows(layer), c), dtype=torch.uint8, device=dev, generator=gen)
        w[(w & 0x7F) == 0x7F] = 0x38  # no NaN codes, so that `check` compares finite values
        s = torch.randint(110, 140, (h.num_rows(layer), c // 32), dtype=torch.uint8, device=dev, generator=gen)
        state["engram"] = (consts, w, s)
    consts, w, s = state["engram"]
    m_ng, r, c = cfg.engram_max_ngram, consts[1].numel(), w.shape[1]

    def make():
        u = torch.randint(0, cfg.engram_compressed_vocab_size, (n, 1, m_ng), device=dev, generator=gen)
        return (u, *consts, w, s, dt)

    def nbytes(a):
        return _nbytes(a[0]) + n * r * (c + c // 32) + n * r * c * _elt(dt) + (m_ng + 2 * r) * 8

    return dict(shape=f"R{r}xC{c}", N=r * c, K=c, make=make, nbytes=nbytes, tri=ek.triton_engram_lookup,
                ref=ek.reference_engram_lookup, ref_graph=True)


def _case_engram_gate(cfg, n, dev, dt, gen, state):
    from dsv41.kernels import engram as ek
    d, hc = cfg.hidden_size, cfg.hc_mult

    def make():
        H = _randn((n, 1, hc, d), gen, dev, 2.0, dt)
        kv = _randn((n, 1, (hc + 1) * d), gen, dev, 1.0, dt)  # the wkv output; keys / value are views of it
        qw = (1 + _randn((hc, d), gen, dev, 0.1)).to(dt)
        kw = (1 + _randn((hc, d), gen, dev, 0.1)).to(dt)
        return (H, kv[..., :hc * d].unflatten(-1, (hc, d)), kv[..., hc * d:], qw, kw, cfg.rms_norm_eps)

    def nbytes(a):
        H, keys, value, qw, kw, _ = a
        return 2 * _nbytes(H) + _nbytes(keys) + _nbytes(value) + _nbytes(qw) + _nbytes(kw)

    return dict(shape=f"{hc}x{d}", N=hc * d, K=d, make=make, nbytes=nbytes, tri=ek.triton_engram_gate,
                ref=ek.reference_engram_gate, ref_graph=True)


def _case_moe_router(cfg, n, dev, dt, gen, state):
    from dsv41.kernels import moe as mk
    e, d, k = cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok

    def make():
        x = _randn((n, d), gen, dev, 1.0, dt)
        W = _randn((e, d), gen, dev, d ** -0.5, dt)  # dsv41.model.moe.Gate.init_random's scale
        bias = _randn((e,), gen, dev, 0.01)
        return (x, W, bias, k, cfg.gate_temp, cfg.routed_scaling_factor, 1e-20)

    def nbytes(a):
        return _nbytes(a[0]) + _nbytes(a[1]) + _nbytes(a[2]) + n * k * (4 + 8)

    return dict(shape=f"E{e}_k{k}", N=e, K=d, make=make, nbytes=nbytes, tri=mk.triton_moe_router,
                ref=mk.reference_moe_router, ref_graph=True)


def _case_upcast_head(cfg, n, dev, dt, gen, state):
    from dsv41.kernels import upcast_gemv as ug
    v, d = cfg.vocab_size, cfg.hidden_size

    def make():
        # The LM head as the model spells it: F.linear(h.float(), W.float()) with W in the model dtype.
        return (_randn((n, d), gen, dev, 1.0), _randn((v, d), gen, dev, d ** -0.5, torch.bfloat16))

    def nbytes(a):
        return _nbytes(a[0]) + _nbytes(a[1]) + n * v * 4

    return dict(shape=f"{v}x{d}", N=v, K=d, make=make, nbytes=nbytes, tri=ug.triton_linear_upcast,
                ref=ug.reference_linear_upcast, ref_graph=True)


def _case_moe_combine(cfg, n, dev, dt, gen, state):
    from dsv41.kernels import moe as mk
    d, k = cfg.hidden_size, cfg.num_experts_per_tok

    def make():
        return (_randn((n, k, d), gen, dev, 1.0, dt), _randn((n, d), gen, dev, 1.0, dt), None, dt)

    def nbytes(a):
        return _nbytes(a[0]) + _nbytes(a[1]) + n * d * _elt(dt)

    return dict(shape=f"k{k}x{d}", N=d, K=k, make=make, nbytes=nbytes, tri=mk.triton_moe_combine,
                ref=mk.reference_moe_combine, ref_graph=True)


def _case_grouped(which, cfg, n, dev, dt, gen, state):
    from dsv41.kernels import grouped_gemv as gg
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    out, kin = ((cfg.moe_intermediate_size, cfg.hidden_size) if which == "w1w3"
                else (cfg.hidden_size, cfg.moe_intermediate_size))
    if which not in state:  # the stacked FP4 experts (~600 MB each at h200), shared by every copy
        w = torch.randint(0, 256, (e, out, kin // 2), dtype=torch.uint8, device=dev, generator=gen)
        s = torch.randint(117, 124, (e, out, kin // 32), dtype=torch.uint8, device=dev, generator=gen)
        state[which] = (w, s)
    w, s = state[which]

    def make():
        # Each token picks k distinct experts (the router's top-k); copies pick other experts.
        idx = torch.stack([torch.randperm(e, generator=gen, device=dev)[:k] for _ in range(n)])
        x = _randn((n, kin) if which == "w1w3" else (n, k, kin), gen, dev, 1.0, dt)
        return (x, w, s, idx, True)

    def nbytes(a):
        x, _, _, idx, _ = a
        distinct = int(torch.unique(idx).numel())
        return distinct * out * (kin // 2 + kin // 32) + _nbytes(x) + _nbytes(idx) + n * k * out * _elt(dt)

    return dict(shape=which, N=out, K=kin, make=make, nbytes=nbytes, tri=gg.triton_grouped_linear_fp4,
                ref=_grouped_reference_graphable, ref_graph=True, ref_copies=4)


def _case_c2(pool, cfg, n, dev, dt, gen, state):
    from dsv41.kernels import c2_compressor as c2
    from dsv41.kernels.rope_fp4 import FP4_MODES
    d, r_half = cfg.head_dim, cfg.qk_rope_head_dim // 2
    block, e4m3 = FP4_MODES[0]  # bank rows: E2M1 codes, one E4M3 scale per 16 channels
    key = ("c2_caches", n)
    if key not in state:  # written in place by every call (one row each), shared by the copies
        state[key] = (torch.zeros(n, _C2_CACHE_ROWS + 1, d // 2, dtype=torch.uint8, device=dev),
                      torch.zeros(n, _C2_CACHE_ROWS + 1, d // block, dtype=torch.uint8, device=dev))
    cc, sc = state[key]
    eps = float(cfg.rms_norm_eps)

    def make():
        w = (0.5 + torch.rand(d, generator=gen, device=dev)).to(dt)
        ang = torch.rand(n, 1, r_half, generator=gen, device=dev) * 6
        rows = torch.randint(0, _C2_CACHE_ROWS, (n, 1), device=dev, generator=gen)
        tail = (ang.cos(), ang.sin(), block, e4m3, cc, sc, rows)
        if pool:
            k, g, pk, pg = (_randn((n, 1, d), gen, dev, 2.0) for _ in range(4))
            return (k, g, pk, pg, w, eps, dt, *tail)
        return (_randn((n, 1, d), gen, dev, 3.0, dt), w, eps, *tail)

    def nbytes(a):
        cos, sin, rows = a[-7], a[-6], a[-1]
        inputs = sum(_nbytes(t) for t in a[:4]) if pool else _nbytes(a[0])
        w = a[4] if pool else a[1]
        return (inputs + _nbytes(w) + _nbytes(cos) + _nbytes(sin) + _nbytes(rows)
                + n * (d * _elt(dt) + d // 2 + d // block))

    tri = c2.triton_c2_pool_norm_rope_fp4_store if pool else c2.triton_c2_norm_rope_fp4_store
    ref = c2.reference_c2_pool_norm_rope_fp4_store if pool else c2.reference_c2_norm_rope_fp4_store
    return dict(shape=f"bank{d}", N=d, K=2 * r_half, make=make, nbytes=nbytes, tri=tri, ref=ref, ref_graph=False)


# ------------------------------------------------------------------------------------ attention / indexer cases
# Builders of `CONTEXT_CASES`: (context, cfg, tokens, device, dtype, generator, state) -> case dict, as the
# `_case_*` above plus the sequence length `context` (tokens) first. They build one decode query (batch 1); byte
# floors in the comment above `_FAMILY_MAX_COPIES`.


def _decode_only(n: int) -> None:
    if n != 1:
        raise ValueError(f"the attention / indexer cases are decode rows (M = 1), got M = {n}")


def _random_e4m3(shape, gen, dev) -> torch.Tensor:
    """uint8 `shape` of random FP8 E4M3 bytes, every code but the NaNs 0x7F / 0xFF (replaced by 0x38 = 1.0), so
    the Triton output and its reference stay finite and comparable."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x38
    return b


def _random_index_keys(rows: int, di: int, gen, dev):
    """One FP4 index-key cache of `rows` rows: (codes uint8 [1, rows, di/2] (any byte is two valid E2M1 codes),
    UE8M0 scales uint8 [1, rows, di/32] in 120..130, i.e. 2^-7 .. 2^3)."""
    codes = torch.randint(0, 256, (1, rows, di // 2), dtype=torch.uint8, device=dev, generator=gen)
    scales = torch.randint(120, 131, (1, rows, di // 32), dtype=torch.uint8, device=dev, generator=gen)
    return codes, scales


def _index_query(cfg, dev, dt, gen):
    """(q [1, 1, Hi, Di] in `dt`, head weights fp32 [1, 1, Hi]) scaled as `Indexer.scores` scales them
    (w = weights_proj(x) * Di^-0.5 * Hi^-0.5, weights_proj(x) ~ N(0, 1))."""
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    return (_randn((1, 1, hi, di), gen, dev, 1.0, dt), _randn((1, 1, hi), gen, dev, (hi * di) ** -0.5))


def _rotation(build, nbytes: int):
    """A callable returning `build()` results round-robin over at most `_GATHER_SOURCE_BUDGET // nbytes` distinct
    ones (`nbytes` = bytes of one), built on first use.

    For caches a call reads only a few rows of (the attention bank, the pool's key rows): giving every timing
    copy its own would take copies x the cache (GBs at 128K), sharing one lets later copies hit rows an earlier
    copy left in L2. Rotating over up to 4 GiB keeps the chance that a gathered row is still in L2 small.
    """
    pool, calls = [], [0]
    limit = max(1, min(_FAMILY_MAX_COPIES, _GATHER_SOURCE_BUDGET // max(nbytes, 1)))

    def nxt():
        j = calls[0] % limit
        calls[0] += 1
        if j == len(pool):
            pool.append(build())
        return pool[j]

    return nxt


def _pool_blocks(n_rows: int, block: int, width: int, gen, dev) -> torch.Tensor:
    """int64 [1, 1, width]: a candidate pool as `indexer_candidates` returns it for a ratio-1 layer that sees
    `n_rows` rows (1 <= width <= ceil(n_rows / block)): ascending block ids, the newest block (holding row
    n_rows - 1, which the op forces in) always present, the others drawn at random. No -1 slot: every visible
    block has a finite score, and the op keeps min(n_blocks, blocks) finite ones."""
    nb = -(-n_rows // block)
    others = torch.randperm(nb - 1, generator=gen, device=dev)[:width - 1]
    newest = torch.full((1,), nb - 1, dtype=torch.int64, device=dev)
    return torch.cat((others, newest)).sort().values.view(1, 1, width)


def _case_sparse_attention(ctx, cfg, n, dev, dt, gen, state):
    """`sparse_fp4_attention` for the decode query at position ctx - 1 of a ratio-2 layer.

    Inputs (batch 1, T = 1): q [1, 1, H, D] in `dt`; S = min(sliding_window, ctx) window rows, all visible (E4M3
    bytes without NaN codes, UE8M0 scales 120..123, i.e. values |v| <= 448 * 2^-4); a bank of ceil(ctx / 2) rows
    (random E2M1 bytes, E4M3 scales 0x28..0x40 = 0.25 .. 2.0), shared round-robin by the copies (`_rotation`);
    indices int64 [1, 1, k]: min(k, floor(ctx / 2)) distinct visible rows ascending, then -1 (`select_topk`'s
    layout); sink fp32 [H] ~ N(0, 1); cos / sin fp32 [1, 1, R/2] of random angles; softmax scale D^-0.5.
    Bytes: selected bank rows only (module comment above `_FAMILY_MAX_COPIES`).
    """
    from dsv41.kernels import sparse_attention as sa
    _decode_only(n)
    h, d, r_half, k = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim // 2, cfg.index_topk
    s = min(cfg.sliding_window, ctx)
    n_bank, n_vis = -(-ctx // _ATTN_BANK_RATIO), ctx // _ATTN_BANK_RATIO
    bank_row = d // 2 + d // 16
    u8 = dict(dtype=torch.uint8, device=dev, generator=gen)
    bank = _rotation(lambda: (torch.randint(0, 256, (1, n_bank, d // 2), **u8),
                              torch.randint(0x28, 0x41, (1, n_bank, d // 16), **u8)), n_bank * bank_row)

    def make():
        bc, bs = bank()
        kv = min(k, n_vis)
        sel = torch.randperm(n_vis, generator=gen, device=dev)[:kv].sort().values
        idx = torch.cat((sel, torch.full((k - kv,), -1, dtype=torch.int64, device=dev))).view(1, 1, k)
        ang = torch.rand(1, 1, r_half, generator=gen, device=dev) * 6.2832
        return (_randn((1, 1, h, d), gen, dev, 1.0, dt), _random_e4m3((1, s, d), gen, dev),
                torch.randint(120, 124, (1, s, d // 32), **u8), torch.ones(1, 1, s, dtype=torch.bool, device=dev),
                bc, bs, idx, _randn((h,), gen, dev), ang.cos(), ang.sin(), d ** -0.5)

    def nbytes(a):
        q, wc, ws, ok, _, _, idx, sink, cos, sin, _ = a
        kv = int((idx >= 0).sum())
        return (2 * _nbytes(q) + _nbytes(wc) + _nbytes(ws) + _nbytes(ok) + kv * bank_row + _nbytes(idx)
                + _nbytes(sink) + _nbytes(cos) + _nbytes(sin))

    return dict(shape=f"ctx{ctx}", N=s + k, K=d, make=make, nbytes=nbytes, tri=sa.triton_sparse_fp4_attention,
                ref=sa.reference_sparse_fp4_attention, ref_graph=True)


def _case_index_scores(ratio, ctx, cfg, n, dev, dt, gen, state):
    """`indexer_scores` of a ratio-`ratio` index source over all of its floor(ctx / ratio) visible key rows (the
    key cache sized to exactly those, n_visible int64 [1, 1] = that count, no `blocks`): scores fp32
    [1, 1, floor(ctx / ratio)]. Every copy has its own key cache (the op reads all of it)."""
    from dsv41.kernels import indexer as ik
    _decode_only(n)
    nk, di = ctx // ratio, cfg.index_head_dim

    def make():
        q, w = _index_query(cfg, dev, dt, gen)
        codes, scales = _random_index_keys(nk, di, gen, dev)
        return (q, w, codes, scales, torch.full((1, 1), nk, dtype=torch.int64, device=dev), None, 1)

    def nbytes(a):
        return sum(_nbytes(t) for t in a[:5]) + nk * 4

    return dict(shape=f"ctx{ctx}_r{ratio}", N=nk, K=di, make=make, nbytes=nbytes, tri=ik.triton_indexer_scores,
                ref=ik.reference_indexer_scores, ref_graph=True)


def _pool_geometry(ctx, cfg):
    """(visible rows n, block size, pool width W) of the candidate pool a Reindex layer reads at `ctx` tokens:
    the candidate source's ratio (1 in every preset, `ModelConfig.validate`), W = `candidate_width`."""
    from dsv41.kernels.indexer import candidate_width
    nk = ctx // cfg.compress_ratios[cfg.candidate_source_layer_id]
    block = cfg.candidate_block_size
    return nk, block, int(candidate_width(nk, block, cfg.candidate_topk_blocks))


def _case_index_pool_scores(ctx, cfg, n, dev, dt, gen, state):
    """`indexer_scores` with `blocks` (a Reindex layer): compact scores fp32 [1, 1, W * block] over the rows of a
    random W-block pool (`_pool_blocks`) of a key cache of all n visible rows, shared round-robin by the copies
    (`_rotation`: the op reads only the pool's rows)."""
    from dsv41.kernels import indexer as ik
    _decode_only(n)
    nk, block, width = _pool_geometry(ctx, cfg)
    di = cfg.index_head_dim
    keys = _rotation(lambda: _random_index_keys(nk, di, gen, dev), nk * (di // 2 + di // 32))

    def make():
        q, w = _index_query(cfg, dev, dt, gen)
        codes, scales = keys()
        blocks = _pool_blocks(nk, block, width, gen, dev)
        return (q, w, codes, scales, torch.full((1, 1), nk, dtype=torch.int64, device=dev), blocks, block)

    def nbytes(a):
        q, w, _, _, nv, blocks, _ = a
        rows = int((nk - blocks * block).clamp(0, block).sum())  # the newest block may be partly past row n - 1
        return (_nbytes(q) + _nbytes(w) + _nbytes(nv) + _nbytes(blocks) + rows * (di // 2 + di // 32)
                + width * block * 4)

    return dict(shape=f"ctx{ctx}_pool", N=width * block, K=di, make=make, nbytes=nbytes,
                tri=ik.triton_indexer_scores, ref=ik.reference_indexer_scores, ref_graph=True)


def _case_index_topk(ratio, ctx, cfg, n, dev, dt, gen, state):
    """`indexer_topk` of a ratio-`ratio` layer's score row: scores fp32 [1, 1, floor(ctx / ratio)] uniform in
    [0, 1) (every row visible, so finite; distinct values, as real index scores mostly are), k = index_topk,
    no blocks, offset `_TOPK_OFFSET` -> int64 [1, 1, k] (-1 padded when fewer rows than k)."""
    from dsv41.kernels import indexer as ik
    _decode_only(n)
    nk, k = ctx // ratio, cfg.index_topk

    def make():
        return (torch.rand(1, 1, nk, generator=gen, device=dev), k, None, 1, _TOPK_OFFSET)

    def nbytes(a):
        return _nbytes(a[0]) + k * 8

    return dict(shape=f"ctx{ctx}_r{ratio}", N=nk, K=k, make=make, nbytes=nbytes, tri=ik.triton_indexer_topk,
                ref=ik.reference_indexer_topk, ref_graph=True)


def _case_index_pool_topk(ctx, cfg, n, dev, dt, gen, state):
    """`indexer_topk` of a Reindex layer's compact scores: fp32 [1, 1, W * block] uniform in [0, 1), -inf at the
    slots past row n - 1, with the pool's blocks int64 [1, 1, W] (`_pool_blocks`) mapping slots back to rows,
    k = index_topk, offset `_TOPK_OFFSET`."""
    from dsv41.kernels import indexer as ik
    _decode_only(n)
    nk, block, width = _pool_geometry(ctx, cfg)
    k = cfg.index_topk

    def make():
        blocks = _pool_blocks(nk, block, width, gen, dev)
        rows = (blocks[..., None] * block + torch.arange(block, device=dev)).flatten(-2)
        s = torch.rand(1, 1, width * block, generator=gen, device=dev)
        return (torch.where(rows < nk, s, torch.full_like(s, float("-inf"))), k, blocks, block, _TOPK_OFFSET)

    def nbytes(a):
        return _nbytes(a[0]) + min(k, width) * 8 + k * 8

    return dict(shape=f"ctx{ctx}_pool", N=width * block, K=k, make=make, nbytes=nbytes, tri=ik.triton_indexer_topk,
                ref=ik.reference_indexer_topk, ref_graph=True)


def _case_index_candidates(ctx, cfg, n, dev, dt, gen, state):
    """`indexer_candidates` of the candidate-source layer: scores fp32 [1, 1, n] uniform in [0, 1) over its n
    visible rows, n_visible int64 [1, 1] = n, block / n_blocks from the config -> block ids int64 [1, 1, W]."""
    from dsv41.kernels import indexer as ik
    _decode_only(n)
    nk, block, width = _pool_geometry(ctx, cfg)

    def make():
        return (torch.rand(1, 1, nk, generator=gen, device=dev), torch.full((1, 1), nk, dtype=torch.int64,
                                                                            device=dev),
                block, cfg.candidate_topk_blocks)

    def nbytes(a):
        return _nbytes(a[0]) + _nbytes(a[1]) + width * 8

    return dict(shape=f"ctx{ctx}_r1", N=nk, K=width, make=make, nbytes=nbytes, tri=ik.triton_indexer_candidates,
                ref=ik.reference_indexer_candidates, ref_graph=True)


def _case_fp32_dense(k_in, cfg, n, dev, dt, gen, state):
    """The ratio-2 compressor's wkv (or wgate): an FP32 [head_dim, k_in] weight times FP32 x, `F.linear` (cuBLAS)
    against the GEMV the `upcast_linear` family puts there. k_in: the hidden size (5120 at h200, 1024 at small)."""
    from dsv41.kernels import upcast_gemv as ug
    hd = cfg.head_dim

    def make():
        return (_randn((n, k_in), gen, dev, 1.0), _randn((hd, k_in), gen, dev, k_in ** -0.5))

    def nbytes(a):
        return _nbytes(a[0]) + _nbytes(a[1]) + n * hd * 4

    return dict(shape=f"{hd}x{k_in}_fp32", N=hd, K=k_in, make=make, nbytes=nbytes, tri=ug.triton_linear_upcast,
                ref=ug.reference_linear_upcast, ref_graph=True)


def _mhc_h(cfg, n, dev, dt, gen):
    return _randn((n, 1, cfg.hc_mult, cfg.hidden_size), gen, dev, 1.0, dt)


def _case_mhc_mixes(cfg, n, dev, dt, gen, state):
    """One sublayer's mHC coefficients (pre, post, Sinkhorn comb) from the residual, as `Block.mixes` computes them
    (fn, base, scale drawn as `DeepseekV41Flash.init_random` draws them)."""
    from dsv41.kernels import mhc
    hc, d = cfg.hc_mult, cfg.hidden_size
    m = (2 + hc) * hc

    def make():
        fn = _randn((m, hc * d), gen, dev, (hc * d) ** -0.5)
        base = _randn((m,), gen, dev)
        scale = 0.5 + torch.rand(3, generator=gen, device=dev)
        return (_mhc_h(cfg, n, dev, dt, gen), fn, base, scale, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def nbytes(a):
        return _nbytes(a[0]) + _nbytes(a[1]) + _nbytes(a[2]) + _nbytes(a[3]) + n * m * 4

    return dict(shape=f"{hc}x{d}_it{cfg.hc_sinkhorn_iters}", N=m, K=hc * d, make=make, nbytes=nbytes,
                tri=mhc.triton_mhc_mixes, ref=mhc.reference_mhc_mixes, ref_graph=True)


def _case_mhc_collapse(cfg, n, dev, dt, gen, state):
    """Pre-mix collapse of the four streams fused with the sublayer's RMSNorm."""
    from dsv41.kernels import mhc
    hc, d = cfg.hc_mult, cfg.hidden_size

    def make():
        pre = torch.rand((n, 1, hc), generator=gen, device=dev)
        w = (1 + _randn((d,), gen, dev, 0.1)).to(dt)
        return (_mhc_h(cfg, n, dev, dt, gen), pre, w, cfg.rms_norm_eps)

    def nbytes(a):
        return _nbytes(a[0]) + _nbytes(a[1]) + _nbytes(a[2]) + n * d * _elt(dt)

    return dict(shape=f"{hc}x{d}", N=d, K=hc * d, make=make, nbytes=nbytes, tri=mhc.triton_mhc_collapse_rmsnorm,
                ref=mhc.reference_mhc_collapse_rmsnorm, ref_graph=True)


def _case_mhc_expand(cfg, n, dev, dt, gen, state):
    """Post-mix expand of the sublayer output into the four streams with the residual update."""
    from dsv41.kernels import mhc
    hc, d = cfg.hc_mult, cfg.hidden_size

    def make():
        y = _randn((n, 1, d), gen, dev, 1.0, dt)
        post = 2 * torch.rand((n, 1, hc), generator=gen, device=dev)
        comb = torch.rand((n, 1, hc, hc), generator=gen, device=dev) / hc
        return (y, _mhc_h(cfg, n, dev, dt, gen), post, comb)

    def nbytes(a):
        return _nbytes(a[0]) + 2 * _nbytes(a[1]) + _nbytes(a[2]) + _nbytes(a[3])

    return dict(shape=f"{hc}x{d}", N=hc * d, K=hc, make=make, nbytes=nbytes, tri=mhc.triton_mhc_expand,
                ref=mhc.reference_mhc_expand, ref_graph=True)


#: (row kernel name, dsv41 op, case builder(cfg, tokens, device, dtype, generator, shared state) -> case dict).
FAMILY_CASES = [
    ("engram_lookup", "dsv41::engram_lookup", _case_engram_lookup),
    ("engram_gate", "dsv41::engram_gate", _case_engram_gate),
    ("moe_router", "dsv41::moe_router", _case_moe_router),
    ("moe_combine", "dsv41::moe_combine", _case_moe_combine),
    ("upcast_head", "dsv41::linear_upcast", _case_upcast_head),
    ("fp32_dense", "dsv41::linear_upcast", functools.partial(_case_fp32_dense, 5120)),
    ("fp32_dense", "dsv41::linear_upcast", functools.partial(_case_fp32_dense, 1024)),
    ("grouped_fp4", "dsv41::grouped_linear_fp4", functools.partial(_case_grouped, "w1w3")),
    ("grouped_fp4", "dsv41::grouped_linear_fp4", functools.partial(_case_grouped, "w2")),
    ("c2_pool_store", "dsv41::c2_pool_norm_rope_fp4_store", functools.partial(_case_c2, True)),
    ("c2_norm_store", "dsv41::c2_norm_rope_fp4_store", functools.partial(_case_c2, False)),
    ("mhc_mixes", "dsv41::mhc_mixes", _case_mhc_mixes),
    ("mhc_collapse_rmsnorm", "dsv41::mhc_collapse_rmsnorm", _case_mhc_collapse),
    ("mhc_expand", "dsv41::mhc_expand", _case_mhc_expand),
]

#: (row kernel name, dsv41 op, case builder(context, cfg, tokens, device, dtype, generator, state) -> case dict):
#: decode rows (M = 1) timed once per `--contexts` entry, after FAMILY_CASES; `--only` matches as there.
CONTEXT_CASES = [
    ("sparse_fp4_attention", "dsv41::sparse_fp4_attention", _case_sparse_attention),
    ("indexer_scores", "dsv41::indexer_scores", functools.partial(_case_index_scores, 2)),
    ("indexer_scores", "dsv41::indexer_scores", functools.partial(_case_index_scores, 1)),
    ("indexer_scores", "dsv41::indexer_scores", _case_index_pool_scores),
    ("indexer_topk", "dsv41::indexer_topk", functools.partial(_case_index_topk, 2)),
    ("indexer_topk", "dsv41::indexer_topk", functools.partial(_case_index_topk, 1)),
    ("indexer_topk", "dsv41::indexer_topk", _case_index_pool_topk),
    ("indexer_candidates", "dsv41::indexer_candidates", _case_index_candidates),
]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_once(fn, dev: torch.device) -> float:
    """Seconds of one call of `fn` after one warm-up call (compiles on CUDA), host clock around a device sync."""
    fn()
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def _compare(got, want) -> dict:
    """How far `got` is from `want` (tensors or tuples of them): max |difference| of float outputs (NaN-aware),
    the largest |reference| value, and counts of differing integer elements / NaN positions."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    out = dict(max_abs_diff=0.0, max_abs_ref=0.0, unequal_ints=0, nan_mismatch=0)
    for g, w in zip(got, want):
        g, w = g.detach().cpu(), w.detach().cpu()
        if g.dtype.is_floating_point:
            g64, w64 = g.double(), w.double()
            out["nan_mismatch"] += int((torch.isnan(g64) != torch.isnan(w64)).sum())
            d = (g64 - w64).abs()
            d = d[~torch.isnan(d)]
            if d.numel():
                out["max_abs_diff"] = max(out["max_abs_diff"], float(d.max()))
            finite = w64[torch.isfinite(w64)]
            if finite.numel():
                out["max_abs_ref"] = max(out["max_abs_ref"], float(finite.abs().max()))
        else:
            out["unequal_ints"] += int((g != w).sum())
    return out


def bench_family_case(kernel, op, builder, cfg, n, dev, dt, bw, reps_ms, graphs, gen, state, errors):
    """Rows for one family op at `n` token rows: Triton and its reference (graph or single-call timing, see the
    comment above `_FAMILY_MAX_COPIES`), plus eager Triton in graph mode. Failures are appended to `errors`
    (the other rows still run)."""
    case = builder(cfg, n, dev, dt, gen, state)
    a0 = case["make"]()
    nbytes = case["nbytes"](a0)
    copies = _family_copies(nbytes) if graphs else 1
    args = [a0] + [case["make"]() for _ in range(copies - 1)]
    tri, ref = case["tri"], case["ref"]
    shape = f"{cfg.name}_{case['shape']}"
    tag = f"{kernel} {shape} M={n}"
    try:
        check = _compare(tri(*a0), ref(*a0))
    except Exception as exc:  # the kernel or its reference does not run: report and go on
        errors.append(f"{tag} check: {type(exc).__name__}: {str(exc)[:500]}")
        print(f"  {errors[-1]}", file=sys.stderr)
        return []
    base = dict(kernel=kernel, op=op, shape=shape, M=n, N=case["N"], K=case["K"], bytes=nbytes,
                floor_us=nbytes / bw * 1e6, check=check)

    def graph_of(fn, cps):
        return lambda: _bench_graph([functools.partial(fn, *a) for a in cps], reps_ms)

    if graphs:
        ref_cps = args[:min(copies, case.get("ref_copies", _FAMILY_MAX_REF_COPIES))]
        variants = [("triton (graph)", len(args), graph_of(tri, args)),
                    ("triton (eager, incl. launch)", 1, lambda: _bench(lambda: tri(*a0), reps_ms))]
        if case["ref_graph"]:
            variants.append(("reference (graph)", len(ref_cps), graph_of(ref, ref_cps)))
        else:
            variants.append(("reference (eager)", 1, lambda: _bench(lambda: ref(*a0), reps_ms)))
    else:
        variants = [("triton (single call)", 1, lambda: _time_once(lambda: tri(*a0), dev)),
                    ("reference (single call)", 1, lambda: _time_once(lambda: ref(*a0), dev))]
    rows = []
    for variant, cps, timer in variants:
        try:
            t = timer()
        except Exception as exc:
            _sync(dev)
            msg = f"{tag} {variant}: {type(exc).__name__}: {str(exc)[:500]}"
            print(f"  {msg}", file=sys.stderr)
            if variant != "reference (graph)":
                errors.append(msg)
                continue
            try:  # a reference that cannot be captured is still timed, eagerly
                variant, cps, t = "reference (eager)", 1, _bench(lambda: ref(*a0), reps_ms)
            except Exception as exc2:
                errors.append(f"{msg}; eager: {type(exc2).__name__}: {str(exc2)[:500]}")
                continue
        rows.append(dict(base, variant=variant, copies=cps, graph_data_MB=cps * nbytes / 2 ** 20,
                         time_us=t * 1e6, eff_bw_TBps=nbytes / t / 1e12, frac_of_copy=nbytes / t / bw))
    return rows


def _cpu_copy_bandwidth() -> float:
    """Host memory copy bandwidth in bytes/s (read + written) of a 64 MiB buffer, best of 5."""
    src = torch.ones(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def main_families(args) -> int:
    """`--families`: time the fusion-family ops (FAMILY_CASES) and print / write their rows (exit 1 if any failed).

    Exits with status 2 and a message when the device cannot run the kernels (no CUDA; CPU without
    TRITON_INTERPRET=1 set before Triton was imported).
    """
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench/kernels.py --families --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import triton
    import dsv41.kernels as kernels
    from dsv41.model import ModelConfig
    kernels.set_pdl(args.pdl)
    cfg = ModelConfig.preset("tiny" if args.tiny else "h200")
    graphs = dev.type == "cuda" and not args.tiny
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    if dev.type == "cuda":
        kernels.prepare_device(dev)
        bw = copy_bandwidth(args.reps_ms)
    else:
        bw = _cpu_copy_bandwidth()
    rows, errors, state = [], [], {}
    for kernel, op, builder in FAMILY_CASES:
        if args.only and kernel not in args.only and op not in args.only:
            continue
        for m in args.m:
            rows += bench_family_case(kernel, op, builder, cfg, m, dev, torch.bfloat16, bw, args.reps_ms, graphs,
                                      gen, state, errors)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    # The defaults are h200 contexts: a preset only gets those it supports (tiny: max_position_embeddings 4096,
    # which also keeps an interpreted --tiny run short); contexts given explicitly are used as given.
    contexts = (list(args.contexts) if args.contexts is not None
                else [c for c in DEFAULT_CONTEXTS if c <= cfg.max_position_embeddings])
    for kernel, op, builder in CONTEXT_CASES:
        if args.only and kernel not in args.only and op not in args.only:
            continue
        for ctx in contexts:
            # A fresh state per row: the caches of a 128K context (GBs with the copies) go when the row is done.
            new = bench_family_case(kernel, op, functools.partial(builder, ctx), cfg, 1, dev, torch.bfloat16, bw,
                                    args.reps_ms, graphs, gen, {}, errors)
            rows += [dict(r, context=ctx) for r in new]
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    import datetime
    timing = ("CUDA graph of back-to-back calls over input copies; triton.testing.do_bench median, L2 flushed per "
              "replay" if graphs else "one call after one warm-up call, host clock"
              + (" (Triton interpreter)" if dev.type == "cpu" else ""))
    meta = dict(date=datetime.date.today().isoformat(),
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})",
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                copy_bw_TBps=bw / 1e12, pdl=args.pdl, preset=cfg.name, section="families", dtype="bfloat16",
                contexts=contexts, timing=timing, errors=errors)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  copy bandwidth "
          f"{bw / 1e12:.4f} TB/s (read+write)  pdl={args.pdl}  preset={cfg.name}  timing: {timing}")
    # `int!=`: differing elements of integer outputs (the top-k / candidate ids), where max|d| says nothing.
    hdr = (f"{'kernel':<21}{'shape':<20}{'M':>3}{'N':>7}{'K':>6}  {'variant':<30}{'copies':>7}{'us':>12}"
           f"{'floor us':>10}{'TB/s':>7}{'of copy':>9}{'max|d|':>10}{'int!=':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['kernel']:<21}{r['shape']:<20}{r['M']:>3}{r['N']:>7}{r['K']:>6}  {r['variant']:<30}"
              f"{r['copies']:>7}{r['time_us']:>12.2f}{r['floor_us']:>10.3f}{r['eff_bw_TBps']:>7.2f}"
              f"{r['frac_of_copy']:>8.0%}{r['check']['max_abs_diff']:>10.2e}{r['check']['unequal_ints']:>6}")
    for e in errors:
        print(f"ERROR {e}")
    return 1 if errors else 0


def _contexts_arg(text: str) -> list:
    """argparse type of `--contexts`: "4096,32768" -> [4096, 32768] (tokens; each >= 2, so that a ratio-2 layer
    sees at least one bank row)."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--contexts takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 2:
        raise argparse.ArgumentTypeError(f"--contexts needs at least one context, each >= 2 tokens, got {text!r}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--reps-ms", type=float, default=200.0, help="do_bench time budget per measurement (ms)")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of GEMV launch configs")
    ap.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    ap.add_argument("--m", type=int, nargs="*", default=[1], help="GEMV batch rows M to time (default: 1)")
    ap.add_argument("--pdl", action="store_true", help="launch with PDL (dsv41.kernels.set_pdl(True))")
    ap.add_argument("--families", action="store_true",
                    help="time the fusion-family ops (Engram, MoE router / tail, grouped FP4 experts, C2 bank "
                         "write) instead of the GEMV / RoPE rows; --only then takes kernel or op names")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="--families only: device (cpu runs the Triton interpreter: set TRITON_INTERPRET=1)")
    ap.add_argument("--tiny", action="store_true",
                    help="--families only: tiny preset shapes, one timed call per variant instead of CUDA graphs")
    ap.add_argument("--contexts", type=_contexts_arg, default=None,
                    help="--families only: comma-separated sequence lengths (tokens, >= 2) of the attention and "
                         "indexer decode rows (default: " + ",".join(map(str, DEFAULT_CONTEXTS)) + ", those up to "
                         "the preset's max_position_embeddings: 4096 only with --tiny)")
    args = ap.parse_args(argv)
    if args.families:
        return main_families(args)
    if args.device != "cuda" or args.tiny or args.contexts is not None:
        print("--device, --tiny and --contexts apply to --families only", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    import dsv41.kernels as kernels
    kernels.set_pdl(args.pdl)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    bw = copy_bandwidth(args.reps_ms)
    rows = []
    for name, fmt, n, k in GEMV_SHAPES:
        if args.only and name not in args.only:
            continue
        for m in args.m:
            rows += bench_gemv(name, fmt, n, k, m, bw, args.reps_ms, args.sweep, gen)
            torch.cuda.empty_cache()
    for name, n, k in GROUPED_SHAPES:
        if args.only and name not in args.only:
            continue
        rows += bench_grouped(name, n, k, bw, args.reps_ms, args.sweep, gen)
        torch.cuda.empty_cache()
    if not args.only or "chain" in args.only:
        rows += bench_gemv_chain(bw, args.reps_ms, gen)
        torch.cuda.empty_cache()
    for spec in ROPE_SHAPES:
        if args.only and spec[0] not in args.only:
            continue
        rows += bench_rope(*spec, bw, args.reps_ms, gen)
    import datetime
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__,
                python=platform.python_version(), copy_bw_TBps=bw / 1e12, pdl=args.pdl,
                timing="triton.testing.do_bench median, L2 flushed per rep")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  copy bandwidth "
          f"{bw / 1e12:.3f} TB/s (read+write)  pdl={args.pdl}")
    hdr = f"{'kernel':<20}{'shape':<20}{'M':>4}{'N':>8}{'K':>6}  {'variant':<34}{'us':>9}{'floor us':>10}" \
          f"{'TB/s':>7}{'of copy':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['kernel']:<20}{r['shape']:<20}{r['M']:>4}{r['N']:>8}{r['K']:>6}  {r['variant']:<34}"
              f"{r['time_us']:>9.2f}{r['floor_us']:>10.2f}{r['eff_bw_TBps']:>7.2f}{r['frac_of_copy']:>8.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
