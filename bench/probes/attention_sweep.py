"""Launch-plan sweep of `sparse_fp4_attention` at the h200 decode shape: time per call for each (split, BLOCK_N),
and how that time divides between the attention kernel and the split combine.

    python3 bench/probes/attention_sweep.py [--preset h200] [--ctx 131072] [--splits 0,1,2,4,8,16,32] [--block-n 16,32]
                                     [--pv default,ieee,tf32x3] [--warps 0,4,8] [--json F]

`split` 0 is `attention_plan`'s own choice, `--warps` 0 its num_warps; `--pv` the `tl.dot` precision of the
weighted sums (`triton_sparse_fp4_attention(pv_precision=)`; "default": the op's choice for bf16 q).
A plan whose output differs from the reference by more than one bf16 rounding of the largest |o| is marked BAD
(and the script exits 1). Each plan is checked against `reference_sparse_fp4_attention` on
one input (max |diff| printed), then timed as `bench/kernels.py` times the family rows: calls on distinct
inputs back to back in one CUDA graph, bank rows rotated over 4 GiB so gathered rows come from HBM (PDL on
where the device supports it, as in a compiled model). The per-kernel split comes from one profiled replay
(torch.profiler's CUDA kernel durations, summed per kernel name, divided by the calls); it excludes the gaps
between kernels, so the two parts need not add up to the time per call.
Written for the 2026-11-30 question why the h200 call takes ~40 µs for 350 KB (LATENCY_ANALYSIS.md estimated
~10 µs per program and a few µs for the combine).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)  # dsv41 from this checkout, from any working directory


def _kernels_module():
    """bench/kernels.py as a module (bench/ is not a package)."""
    path = os.path.join(_ROOT, "bench", "kernels.py")
    spec = importlib.util.spec_from_file_location("dsv41_bench_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _kernel_split(graph_replay, calls: int) -> dict[str, float]:
    """µs per call of each CUDA kernel name in one profiled replay."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    graph_replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph_replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith("_"):
            out[ev.name] = out.get(ev.name, 0.0) + ev.device_time / calls
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="h200", help="model preset whose attention shape is swept (heads, head dim, "
                    "window, top-k)")
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--splits", type=_ints, default=[0, 1, 2, 4, 8, 16, 32])
    ap.add_argument("--block-n", type=_ints, default=[16, 32])
    ap.add_argument("--pv", default="default", help="comma-separated pv_precision values ('default': the op's)")
    ap.add_argument("--warps", type=_ints, default=[0])
    ap.add_argument("--copies", type=int, default=256, help="calls per CUDA graph")
    ap.add_argument("--reps-ms", type=float, default=200.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from dsv41.kernels import sparse_attention as sa
    from dsv41.model import ModelConfig

    if not torch.cuda.is_available():
        print("attention_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    km = _kernels_module()
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    cfg = ModelConfig.preset(a.preset)
    case = km._case_sparse_attention(a.ctx, cfg, 1, dev, torch.bfloat16, gen, {})
    args = [case["make"]() for _ in range(a.copies)]
    want = sa.reference_sparse_fp4_attention(*args[0])
    bound = float(want.float().abs().max()) * 2.0 ** -8  # one bf16 rounding of the largest output
    rows, bad = [], 0
    combos = [(bn, sp, pv, nw) for pv in a.pv.split(",") for nw in a.warps for bn in a.block_n for sp in a.splits]
    for bn, sp, pv, nw in combos:
        pv = sa.pv_precision_for(torch.bfloat16) if pv == "default" else pv
        try:
            plan = sa.attention_plan(1, cfg.num_attention_heads, min(cfg.sliding_window, a.ctx), cfg.index_topk,
                                     cfg.head_dim, split=sp or None, block_n=bn)
        except ValueError as exc:
            print(f"BLOCK_N {bn} split {sp}: FAILED {exc}", flush=True)
            continue
        tag = (f"BLOCK_N {bn:3d} split {sp:3d} -> SPLIT {plan['SPLIT']:3d} ({plan['tiles_per_split']} tiles each, "
               f"{plan['HB'] * plan['SPLIT']} programs) pv {pv:6s} warps {nw or plan['num_warps']}")
        call = functools.partial(sa.triton_sparse_fp4_attention, split=sp or None, block_n=bn, pv_precision=pv,
                                 num_warps=nw or None)
        try:
            got = call(*args[0])
            diff = float((got.float() - want.float()).abs().max())
            calls = [functools.partial(call, *x) for x in args]
            t = km._bench_graph(calls, a.reps_ms) * 1e6
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for c in calls:
                    c()
            parts = _kernel_split(graph.replay, len(calls))
            del graph
        except Exception as exc:  # one plan failing (compile, launch) must not hide the others
            torch.cuda.synchronize()
            print(f"{tag}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        ok = diff <= bound
        bad += not ok
        row = dict(ctx=a.ctx, block_n=bn, split_asked=sp, SPLIT=plan["SPLIT"], tiles=plan["n_tiles"],
                   tiles_per_split=plan["tiles_per_split"], programs=plan["HB"] * plan["SPLIT"], pv_precision=pv,
                   num_warps=nw or plan["num_warps"], time_us=t, kernels_us=parts, max_abs_diff=diff,
                   diff_bound=bound, within_bound=ok)
        rows.append(row)
        part_txt = ", ".join(f"{k.strip('_')[:28]} {v:.1f}" for k, v in sorted(parts.items()))
        print(f"{tag}: {t:7.2f} us/call  [{part_txt}]  max|diff| {diff:.3g} {'ok' if ok else 'BAD'}", flush=True)
    if not rows:
        return 1
    if a.json:
        meta = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), preset=a.preset, ctx=a.ctx,
                    copies=a.copies)
        import triton
        meta["triton"] = triton.__version__
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    best = min(rows, key=lambda r: r["time_us"])
    print(f"best: BLOCK_N {best['block_n']} SPLIT {best['SPLIT']} pv {best['pv_precision']} warps "
          f"{best['num_warps']}: {best['time_us']:.2f} us/call")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
