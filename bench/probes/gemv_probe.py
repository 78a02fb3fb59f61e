"""Compile report and single launches of the GEMV kernels at h200 shapes, for `ncu` or a quick look on the H200.

    python3 bench/probes/gemv_probe.py [--runs N]      # registers, spills, shared memory, async copies per plan

Prints, per (shape, plan), the compiled kernel's registers, spills, shared memory and the number of asynchronous
global->shared copies in its TTGIR (the software pipeliner's; 0 means the K loop is not pipelined), then launches it
`--runs` times (for `ncu --kernel-name regex:gemv`). Not a timing tool: bench/kernels.py times.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

SHAPES = [("wq_b", False, 32768, 1280), ("wo_b", False, 5120, 8192), ("expert_w1", True, 2304, 5120)]
#: The tile-at-once kernel, the best pipelined FMA and the best tensor-core plan of the 2026-11-30 sweep, and the TMA
#: kernel (`gemv_tma`, block FP8 only; the default from 16 MiB of weight, 2026-12-01).
PLANS = [dict(tma=False), dict(stages=3, block_n=128), dict(mma=True, block_n=128), dict(tma=True)]


def main() -> int:
    from dsv41.kernels import grouped_gemv as gg
    from dsv41.kernels import quant_gemv as qg
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    from dsv41.kernels import gemv_tma as gt
    for name, fp4, n, k in SHAPES:
        w = torch.randint(0, 256, (n, k // 2 if fp4 else k), dtype=torch.uint8, device="cuda", generator=gen)
        srows = n if fp4 else -(-n // 32)
        s = torch.randint(120, 124, (srows, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
        for over in PLANS:
            if fp4 and over.get("tma"):
                continue
            for _ in range(args.runs):
                fn(x, w, s, True, **over)
            torch.cuda.synchronize()
            sms = qg.device_sm_count(x.device)
            if over.get("tma"):
                plan, kernel = gt.tma_gemv_plan(1, n, k, sm_count=sms), gt._tma_gemv_kernel
            else:
                plan = qg.gemv_plan(1, n, k, fp4, sm_count=sms, **{key: v for key, v in over.items() if key != "tma"})
                kernel = qg._quant_gemv_kernel
            _report(f"{name} {over} grid={plan['grid']} K_ITERS={plan['K_ITERS']}", kernel)
    ws = torch.randint(0, 256, (16, 2304, 2560), dtype=torch.uint8, device="cuda", generator=gen)
    ss = torch.randint(120, 124, (16, 2304, 160), dtype=torch.uint8, device="cuda", generator=gen)
    idx = torch.arange(6, device="cuda")[None]
    x = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16, generator=gen)
    for over in (dict(), *PLANS[1:3]):  # the grouped FP4 kernel: its default and the tile-loop plans
        for _ in range(args.runs):
            gg.triton_grouped_linear_fp4(x, ws, ss, idx, True, **over)
        torch.cuda.synchronize()
        plan = gg.grouped_gemv_plan(6, 2304, 5120, sm_count=qg.device_sm_count(x.device), **over)
        _report(f"grouped_w1w3 {over or 'default'} grid={plan['grid']} K_ITERS={plan['K_ITERS']}",
                gg._grouped_gemv_kernel)
    return 0


def _report(label: str, kernel) -> None:
    """Print the resources of the most recently compiled specialisation of `kernel` (Triton's per-device cache)."""
    caches = getattr(kernel, "device_caches", None) or {}
    compiled = None
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if cache:
            compiled = list(cache.values())[-1]
    if compiled is None:
        print(label, "(no compiled kernel found)")
        return
    ttgir = compiled.asm.get("ttgir", "")
    print(f"{label}: regs={getattr(compiled, 'n_regs', '?')} spills={getattr(compiled, 'n_spills', '?')} "
          f"shared={compiled.metadata.shared} async_copies={ttgir.count('async_copy_global_to_local')}")


if __name__ == "__main__":
    raise SystemExit(main())
