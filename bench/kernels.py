"""Microbenchmark of the dsv41 Triton kernels against their byte floor (GPU only).

For every kernel and shape: median time (triton.testing.do_bench, L2 flushed before each rep, >= 20 reps)
against the byte floor = bytes the kernel must move / device-to-device copy bandwidth measured in the same
run (copy bandwidth counts bytes read + written, ARCHITECTURE.md "Kernels"). Kernel times come from CUDA
graphs of back-to-back calls over rotating weight copies (> L2), as in a captured decode step; an eager
row adds the Python + launch overhead. The GEMV rows also time the fallback the dispatch pass replaces
(dequantise + F.linear through cuBLAS) and a bf16 cuBLAS GEMV on an already-dequantised weight.

Usage:
    python bench/kernels.py [--json PATH] [--reps-ms MS] [--sweep] [--only NAME ...] [--pdl]
`--sweep` also times a small grid of GEMV launch configurations per shape (to tune `gemv_plan`).
Shapes are the h200 preset's decode shapes (MODEL.md §4.3): wq_b 32768x1280, wo_b 5120x8192, wq_a 1280x5120,
shared w1 2304x5120, w2 5120x2304, FP4 expert 2304x5120 / 5120x2304, head-like 129280x5120 (fp8).
Exits with status 2 and a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

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
#: (BLOCK_N, BLOCK_K, num_warps, K_ITERS) tried by --sweep at M = 1.
SWEEP = [(128, 128, 4, 1), (128, 128, 4, 2), (128, 128, 4, 4), (128, 128, 8, 2), (64, 128, 4, 1), (64, 128, 4, 4),
         (128, 256, 4, 1), (128, 256, 8, 1), (64, 256, 4, 2), (256, 128, 8, 1), (32, 512, 4, 1), (64, 64, 2, 4)]


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

    plan = qg.gemv_plan(m, n, k, fp4)
    plan_j = {kk: (list(v) if kk == "grid" else v) for kk, v in plan.items()}
    rows = [row("triton (graph)", _bench_graph([lambda w=w, s=s: tri(x, w, s, True) for w, s in ws], reps_ms),
                plan=plan_j),
            row("triton (eager, incl. launch)", _bench(lambda: tri(x, w0, s0, True), reps_ms))]
    rows.append(row("fallback dequant+cuBLAS (graph)",
                    _bench_graph([lambda w=w, s=s: ref(x, w, s, True) for w, s in ws[:4]], reps_ms)))
    wd = (dequantize_fp4_1x32(w0, s0, torch.bfloat16) if fp4 else dequantize_fp8_block(w0, s0, torch.bfloat16))
    wds = [wd] + [wd.clone() for _ in range(_copies_for(wd.numel() * 2) - 1)]
    bf16_bytes = wd.numel() * 2 + x.numel() * 2 + m * n * 2
    rows.append(row("bf16 cuBLAS, 2 B/weight (graph)",
                    _bench_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in wds], reps_ms), bf16_bytes))
    del wd, wds
    if sweep and m == 1:
        for bn, bk, nw, ki in SWEEP:
            try:
                t = _bench_graph([lambda w=w, s=s: tri(x, w, s, True, block_n=bn, block_k=bk, num_warps=nw,
                                                       k_iters=ki) for w, s in ws], reps_ms / 4)
            except Exception as exc:  # a config that does not compile (registers, shared memory)
                print(f"  sweep {name} bn={bn} bk={bk} w={nw} it={ki}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append(row(f"sweep bn={bn} bk={bk} w={nw} it={ki}", t))
    return rows


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--reps-ms", type=float, default=200.0, help="do_bench time budget per measurement (ms)")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of GEMV launch configs")
    ap.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    ap.add_argument("--m", type=int, nargs="*", default=[1], help="GEMV batch rows M to time (default: 1)")
    ap.add_argument("--pdl", action="store_true", help="launch with PDL (dsv41.kernels.set_pdl(True))")
    args = ap.parse_args(argv)
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
