"""Issue 37 probe, two latency-bound decode ops at the h200 shapes (one token, bf16), timed as bench/kernels.py
times family ops: back-to-back calls in one CUDA graph over 40 input copies (> L2), PDL as the backend launches
them.

- `dsv41::mhc_expand_mixes` (one launch) against `mhc_expand` then `mhc_mixes` (two launches), d = 5120;
- `dsv41::moe_router` (E = 384, d = 5120, bf16 W) with its first weight block read before the PDL wait
  (`prefetch=True`, the default) and after it (the kernel before issue 37).

    python3 bench/probes/latency_ops_probe.py OUT.json
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
from dsv41.kernels import mhc as mk, mhc_fold as fk, moe as rk, set_pdl  # noqa: E402

set_pdl(True)  # as the backend launches them inside its CUDA graphs

d, copies, reps = int(os.environ.get("MHC_D", 5120)), 40, 200.0
gen = torch.Generator(device="cuda").manual_seed(0)
args = []
for _ in range(copies):
    y = torch.randn(1, 1, d, device="cuda", generator=gen).to(torch.bfloat16)
    H = torch.randn(1, 1, 4, d, device="cuda", generator=gen).to(torch.bfloat16)
    post = 2 * torch.rand(1, 1, 4, device="cuda", generator=gen)
    comb = torch.rand(1, 1, 4, 4, device="cuda", generator=gen)
    fn = torch.randn(24, 4 * d, device="cuda", generator=gen) * (4 * d) ** -0.5
    base = torch.randn(24, device="cuda", generator=gen)
    scale = 0.5 + torch.rand(3, device="cuda", generator=gen)
    args.append((y, H, post, comb, fn, base, scale))
E = (1e-20, 1e-6, 20)


def separate(a):
    out = mk.triton_mhc_expand(*a[:4])
    return (out, *mk.triton_mhc_mixes(out, *a[4:], *E))


def fused(a):
    return fk.triton_mhc_expand_mixes(*a, *E)


bw = kb.copy_bandwidth(reps)
ref = separate(args[0])
rows = []
for name, f in (("expand+mixes (2 launches)", separate), ("expand_mixes (1 launch)", fused),
                ("expand alone", lambda a: mk.triton_mhc_expand(*a[:4]))):
    got = f(args[0])
    err = max(float((g.float() - r.float()).abs().max()) for g, r in zip(got if isinstance(got, tuple) else (got,),
                                                                      ref))
    t = kb._bench_graph([lambda a=a: f(a) for a in args], reps)
    rows.append(dict(kernel=name, time_us=t * 1e6, max_abs_err_vs_separate=err))
    print(f"{name:28s} {t * 1e6:7.2f} us  err {err:.2e}", flush=True)
E_, K_ = 384, 6
routers = []
for _ in range(copies):
    x = torch.randn(1, d, device="cuda", generator=gen).to(torch.bfloat16)
    W = (torch.randn(E_, d, device="cuda", generator=gen) * d ** -0.5).to(torch.bfloat16)
    routers.append((x, W, torch.randn(E_, device="cuda", generator=gen) * 0.1))
want = rk.reference_moe_router(*routers[0], K_, 1.0, 1.5, 1e-20)
for prefetch in (False, True):
    got = rk.triton_moe_router(*routers[0], K_, 1.0, 1.5, 1e-20, prefetch=prefetch)
    same = bool(torch.equal(got[1].cpu(), want[1].cpu()))
    t = kb._bench_graph([lambda a=a, p=prefetch: rk.triton_moe_router(*a, K_, 1.0, 1.5, 1e-20, prefetch=p)
                         for a in routers], reps)
    rows.append(dict(kernel="moe_router", prefetch=prefetch, time_us=t * 1e6, ids_equal_reference=same))
    print(f"moe_router prefetch={prefetch!s:5s} {t * 1e6:7.2f} us  ids equal reference: {same}", flush=True)
json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, d=d, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
