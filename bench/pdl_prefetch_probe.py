"""H200 probe: block-FP8 GEMVs with an L2 prefetch of their weights before the PDL wait and an early launch of the
next kernel (`gemv_tma` l2_prefetch / early_launch, `quant_gemv` early_launch), against the defaults.

Each row: CUDA-graph replay of back-to-back PDL launches over weight copies beyond L2 (`bench/kernels.py`'s
`_bench_graph`), M = 1, bf16 x, act_quant; fraction of the copy bandwidth measured in the same run. Every variant's
output is checked bit-identical to its kernel without the options (same arithmetic). The chain rows run one decode
layer's five FP8 GEMVs (`kernels.CHAIN`) back to back with per-shape options.

Usage: python bench/pdl_prefetch_probe.py [--json PATH] [--reps-ms MS]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import kernels as kb  # noqa: E402

SHAPES = [s for s in kb.GEMV_SHAPES if s[1] == "fp8"]
VARIANTS = [
    ("default", {}),
    ("tma", dict(tma=True)),
    ("tma early", dict(tma=True, early_launch=True)),
    ("tma pf1", dict(tma=True, l2_prefetch=1)),
    ("tma pf2", dict(tma=True, l2_prefetch=2)),
    ("tma pf4", dict(tma=True, l2_prefetch=4)),
    ("tma pf all", dict(tma=True, l2_prefetch=1 << 10)),
    ("tma pf all, late launch", dict(tma=True, l2_prefetch=1 << 10, early_launch=False)),
    ("tile", dict(tma=False)),
    ("tile early", dict(tma=False, early_launch=True)),
]
#: Chain rows: (label, options for shapes under 16 MiB, options for larger ones).
CHAIN_VARIANTS = [
    ("default", {}, {}),
    ("tile early + tma", dict(tma=False, early_launch=True), dict(tma=True)),
    ("tile early + tma pf2", dict(tma=False, early_launch=True), dict(tma=True, l2_prefetch=2)),
    ("tile early + tma pf all", dict(tma=False, early_launch=True), dict(tma=True, l2_prefetch=1 << 10)),
    ("tma pf2 everywhere", dict(tma=True, l2_prefetch=2), dict(tma=True, l2_prefetch=2)),
    ("tma pf all everywhere", dict(tma=True, l2_prefetch=1 << 10), dict(tma=True, l2_prefetch=1 << 10)),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--reps-ms", type=float, default=150.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from dsv41 import kernels
    from dsv41.kernels import quant_gemv as qg
    kernels.set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = kb.copy_bandwidth(args.reps_ms)
    rows = []
    for name, _, n, k in SHAPES:
        w0, s0 = kb._random_fp8_weight(n, k, gen)
        ws = [(w0, s0)] + [kb._random_fp8_weight(n, k, gen) for _ in range(kb._copies_for(w0.numel()) - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        moved = w0.numel() + s0.numel() + 2 * k + 2 * n
        plain = {key: qg.triton_linear_fp8_block(x, w0, s0, True, tma=key) for key in (True, False)}
        for label, over in VARIANTS:
            y = qg.triton_linear_fp8_block(x, w0, s0, True, **over)
            same = torch.equal(y, plain[over.get("tma", n * k >= qg.TMA_MIN_WEIGHT_BYTES_M1) is not False])
            t = kb._bench_graph([lambda w=w, s=s: qg.triton_linear_fp8_block(x, w, s, True, **over) for w, s in ws],
                                args.reps_ms)
            rows.append(dict(shape=name, N=n, K=k, variant=label, options=over, time_us=t * 1e6, bytes=moved,
                             frac_of_copy=moved / t / bw, bit_identical=same))
            print(f"{name:10s} {label:26s} {t * 1e6:8.2f} us  {moved / t / bw:6.1%}  same={same}", flush=True)
        del ws, w0, s0
    shapes = [(n, k) for name, _, n, k in kb.GEMV_SHAPES if name in kb.CHAIN]
    layer_bytes = sum(n * k + (-(-n // 32)) * (k // 32) for n, k in shapes)
    layers = [[kb._random_fp8_weight(n, k, gen) for n, k in shapes] for _ in range(kb._copies_for(layer_bytes))]
    xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen) for n, k in shapes]
    moved = layer_bytes + sum(2 * k + 2 * n for n, k in shapes)
    for label, small, large in CHAIN_VARIANTS:
        opts = [large if n * k >= qg.TMA_MIN_WEIGHT_BYTES_M1 else small for n, k in shapes]
        calls = [lambda x=x, w=w, s=s, o=o: qg.triton_linear_fp8_block(x, w, s, True, **o)
                 for layer in layers for x, (w, s), o in zip(xs, layer, opts)]
        t = kb._bench_graph(calls, args.reps_ms) * len(shapes)
        rows.append(dict(shape="chain " + "+".join(kb.CHAIN), variant=label, options=[small, large],
                         time_us=t * 1e6, bytes=moved, frac_of_copy=moved / t / bw))
        print(f"chain      {label:26s} {t * 1e6:8.2f} us  {moved / t / bw:6.1%}", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_bw_TBps=bw / 1e12, pdl=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
