"""Issue 37 probe: where do the `dsv41::moe_router`'s 12.4 us at the h200 decode shape go (E = 384, d = 5120, k = 6,
bf16 W, one token; H100 session 31: a 3.9 MB read, ~1.3 us at copy bandwidth)?

Times, as bench/kernels.py times family ops (back-to-back calls in one CUDA graph over 40 weight copies, PDL):
- the default plan, and the expert split forced to 24 / 48 / 192 / 384 programs (fewer or more experts each);
- 2 and 8 warps per program;
- k = 1 against k = 6 (the selection loop's rounds) and the same with 8 experts (a near-empty selection), which
  bound the cost of the top-k in the last program;
- the GEMV alone: a `dsv41::linear_fp8_block`-free stand-in, `torch.mv` of the same bytes in the same graph.

    python3 bench/probes/router_sweep_probe.py OUT.json
"""
import json
import os
import sys
import time

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
import kernels as kb  # noqa: E402  (bench/kernels.py)
from dsv41.kernels import moe as rk, set_pdl  # noqa: E402

set_pdl(True)
E, D, K, copies, reps = 384, 5120, 6, 40, 200.0
gen = torch.Generator(device="cuda").manual_seed(0)
sets = []
for _ in range(copies):
    x = torch.randn(1, D, device="cuda", generator=gen).to(torch.bfloat16)
    W = (torch.randn(E, D, device="cuda", generator=gen) * D ** -0.5).to(torch.bfloat16)
    sets.append((x, W, torch.randn(E, device="cuda", generator=gen) * 0.1))
rows = []


def timed(name, fn, **info):
    t = kb._bench_graph([lambda a=a: fn(a) for a in sets], reps)
    rows.append(dict(variant=name, time_us=t * 1e6, **info))
    print(f"{name:34s} {t * 1e6:7.2f} us", flush=True)


want = rk.reference_moe_router(*sets[0], K, 1.0, 1.5, 1e-20)[1].cpu()
timed("default", lambda a: rk.triton_moe_router(*a, K, 1.0, 1.5, 1e-20), plan=rk.router_plan(1, E, D))
for split in (24, 48, 192, 384):
    got = rk.triton_moe_router(*sets[0], K, 1.0, 1.5, 1e-20, split=split)[1].cpu()
    timed(f"split {split}", lambda a, s=split: rk.triton_moe_router(*a, K, 1.0, 1.5, 1e-20, split=s),
          plan=rk.router_plan(1, E, D, split=split), ids_equal=bool(torch.equal(got, want)))
for nw in (2, 8):
    timed(f"num_warps {nw}", lambda a, n=nw: rk.triton_moe_router(*a, K, 1.0, 1.5, 1e-20, num_warps=n))
timed("k = 1", lambda a: rk.triton_moe_router(*a, 1, 1.0, 1.5, 1e-20))
small = [(x, W[:8].contiguous(), b[:8].contiguous()) for x, W, b in sets]
t = kb._bench_graph([lambda a=a: rk.triton_moe_router(*a, K, 1.0, 1.5, 1e-20) for a in small], reps)
rows.append(dict(variant="8 experts (k = 6)", time_us=t * 1e6))
print(f"{'8 experts (k = 6)':34s} {t * 1e6:7.2f} us", flush=True)
timed("torch.mv of the same W (bf16)", lambda a: torch.mv(a[1], a[0][0]))
bw = kb.copy_bandwidth(reps)
json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, E=E, d=D, k=K, copy_bw_TBps=bw / 1e12,
               floor_us=E * D * 2 / bw * 1e6, rows=rows), open(sys.argv[1], "w"), indent=1)
