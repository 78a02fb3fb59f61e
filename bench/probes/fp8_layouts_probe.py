"""GPU probe: `dsv41::linear_fp8_scaled` (dsv41/kernels/gemv_scaled.py) at DeepSeek-V3 decode shapes, one GPU.

    python3 bench/probes/fp8_layouts_probe.py --out X.json [--reps-ms MS] [--budget-s S] [--all-layouts]

For each GEMV: microseconds per call from CUDA-graph replay of back-to-back calls over enough weight copies that one
replay reads more than the L2 (bench/kernels.py `_bench_graph`, `_copies_for`: >= 180 MB, above the H100's 50 MB and
the H200's 60 MB L2), with and without PDL (`dsv41.kernels.set_pdl`); the bytes one call must read and write (codes +
scales + x + y); and that traffic per second as a fraction of the device-to-device copy bandwidth measured in the same
run (a 1 GiB `copy_`, bytes read + written / time, `bench/kernels.py copy_bandwidth`).

Rows: the DeepSeek-V3 checkpoint layout (float8_e4m3fn codes, float32 `weight_scale_inv` per 128x128 block, the
weight rounded to bf16 as `(w.float() * s).to(bf16)` does, bf16 x) at N x K = 7168 x 2048, 2048 x 7168,
24576 x 7168 and 7168 x 18432, M = 1 and 4, PDL off and on; at M = 1 without PDL also the path the fusion replaces
(dequantise to bf16, then F.linear through cuBLAS; its bytes count what eager moves: codes + scales read, the bf16
weight written and read back, x, y). Other layouts (1x128 float32 scales with an FP32 weight, UE8M0 128x128, 32x32
float32 scales) at 7168 x 2048, M = 1 with PDL; `--all-layouts` times them at every shape and M.
Each distinct launch configuration compiles once (about a second), so the default set is sized for about 40 s on an
H100; rows past `--budget-s` (default 55) are skipped and listed under "skipped". Correctness is the GPU test's
(tests/test_kernels_gpu_fp8_scaled.py); this probe checks only that each result is finite.
Exits with status 2 and a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

#: (name, N, K) of DeepSeek-V3 decode GEMVs.
SHAPES = [("o_proj_like", 7168, 2048), ("q_a_like", 2048, 7168), ("q_b_like", 24576, 7168),
          ("ffn_down_like", 7168, 18432)]
#: layout name -> (block_n, block_k, UE8M0 scales, x dtype, weight_dtype, scale_cast).
LAYOUTS = {
    "fp32_128x128": (128, 128, False, torch.bfloat16, torch.bfloat16, torch.float32),
    "fp32_1x128": (1, 128, False, torch.float32, torch.float32, torch.float32),
    "ue8m0_128x128": (128, 128, True, torch.bfloat16, torch.bfloat16, torch.float32),
    "fp32_32x32": (32, 32, False, torch.bfloat16, torch.bfloat16, torch.float32),
}
MAIN = "fp32_128x128"


def _load_bench():
    """bench/kernels.py (not a package), for its CUDA-graph timing and copy-bandwidth helpers."""
    spec = importlib.util.spec_from_file_location("_dsv41_bench_kernels", os.path.join(_ROOT, "bench", "kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _weights(n, k, layout, copies, gen):
    """`copies` (codes uint8 [n, k], scale) pairs: random E4M3 bytes without NaN codes, scales near 2^-8."""
    bn, bk, ue8m0 = LAYOUTS[layout][:3]
    grid = (-(-n // bn), -(-k // bk))
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0x38
        if ue8m0:
            scale = torch.randint(116, 122, grid, dtype=torch.uint8, device="cuda", generator=gen)
        else:
            scale = torch.rand(grid, device="cuda", generator=gen) * 2.0 ** -7 + 2.0 ** -9
        out.append((codes, scale))
    return out


def _bytes(n, k, m, layout, scale):
    x_dtype = LAYOUTS[layout][3]
    esize = torch.empty(0, dtype=x_dtype).element_size()
    return n * k + scale.numel() * scale.element_size() + m * k * esize + m * n * esize


def main(argv=None) -> int:
    """Run the probe; returns the exit status (2 without CUDA)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="write the results here as JSON")
    ap.add_argument("--reps-ms", type=float, default=25.0, help="do_bench time budget per measurement (ms)")
    ap.add_argument("--budget-s", type=float, default=55.0, help="skip rows that would start after this many seconds")
    ap.add_argument("--all-layouts", action="store_true", help="time every layout at every shape and M")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_layouts_probe: no CUDA device", file=sys.stderr)
        return 2
    start = time.time()
    import triton

    import dsv41.kernels as kernels
    from dsv41.kernels import gemv_scaled as gs
    from dsv41.model.formats import dequantize_fp8_scaled
    bench = _load_bench()
    dev = torch.device("cuda")
    kernels.prepare_device(dev)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = bench.copy_bandwidth(args.reps_ms)
    plan_jobs = []  # (layout, shape, M, pdl, variant)
    for name, n, k in SHAPES:
        for m in (1, 4):
            for pdl in (False, True):
                plan_jobs.append((MAIN, name, n, k, m, pdl, "triton (graph)"))
            if m == 1:
                plan_jobs.append((MAIN, name, n, k, m, False, "dequantise + cuBLAS (graph)"))
    for layout in LAYOUTS:
        if layout == MAIN:
            continue
        for name, n, k in SHAPES if args.all_layouts else SHAPES[:1]:
            for m in (1, 4) if args.all_layouts else (1,):
                for pdl in (False, True) if args.all_layouts else (True,):
                    plan_jobs.append((layout, name, n, k, m, pdl, "triton (graph)"))
    rows, skipped, cache = [], [], {}
    for layout, name, n, k, m, pdl, variant in plan_jobs:
        label = f"{layout} {name} {n}x{k} M={m} pdl={pdl} {variant}"
        if time.time() - start > args.budget_s:
            skipped.append(label)
            continue
        bn, bk, _, x_dtype, weight_dtype, scale_cast = LAYOUTS[layout]
        key = (layout, n, k)
        if key not in cache:
            cache.clear()  # one shape's copies at a time: the 7168 x 18432 copies alone take ~260 MB
            torch.cuda.empty_cache()
            cache[key] = _weights(n, k, layout, bench._copies_for(n * k), gen)
        ws = cache[key]
        x = torch.randn(m, k, device="cuda", generator=gen).to(x_dtype)
        kernels.set_pdl(pdl)
        if variant.startswith("triton"):
            calls = [lambda c=c, s=s: gs.triton_linear_fp8_scaled(x, c, s, bn, bk, weight_dtype, scale_cast)
                     for c, s in ws]
            nbytes = _bytes(n, k, m, layout, ws[0][1])
            plan = gs.scaled_plan(m, n, k, bk, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
            extra = dict(plan={kk: (list(v) if kk == "grid" else v) for kk, v in plan.items()})
        else:
            def calls_ref(c, s):
                w = dequantize_fp8_scaled(c, s, bn, bk, weight_dtype, scale_cast)
                return torch.nn.functional.linear(x, w)
            calls = [lambda c=c, s=s: calls_ref(c, s) for c, s in ws[:4]]
            esize = x.element_size()
            nbytes = _bytes(n, k, m, layout, ws[0][1]) + 2 * n * k * esize
            extra = {}
        try:
            y = calls[0]()
            finite = bool(torch.isfinite(y).all())
            t = bench._bench_graph(calls, args.reps_ms)
        except Exception as exc:  # a configuration that does not compile or launch: recorded, not fatal
            rows.append(dict(layout=layout, shape=name, N=n, K=k, M=m, pdl=pdl, variant=variant,
                             error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        finally:
            kernels.set_pdl(False)
        row = dict(layout=layout, shape=name, N=n, K=k, M=m, pdl=pdl, variant=variant, time_us=t * 1e6,
                   bytes=nbytes, eff_TBps=nbytes / t / 1e12, frac_of_copy=nbytes / t / bw, finite=finite,
                   copies=len(calls), **extra)
        rows.append(row)
        print(f"{label}: {t * 1e6:8.2f} us  {nbytes / 1e6:8.2f} MB  {row['frac_of_copy'] * 100:5.1f} % of copy bw")
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), copy_bw_TBps=bw / 1e12, reps_ms=args.reps_ms,
                elapsed_s=time.time() - start, skipped=skipped)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write); {len(rows)} rows, {len(skipped)} skipped, "
          f"{meta['elapsed_s']:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
