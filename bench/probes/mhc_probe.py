"""Session 25 probe: `dsv41::mhc_mixes` at the h200 decode shape (d = 5120, one token, bf16 H), the s24 kernel
(`mhc_s24.py`, the kernel section of dsv41/kernels/mhc.py at a829329) against this tree's, each with 20 Sinkhorn
rounds and with 1 (what the rounds cost), timed as bench/kernels.py times family ops: back-to-back calls in one
CUDA graph over 40 fn copies (80 MB > L2), PDL as the backend launches them. Also the collapse + RMSNorm op.
Usage: python3 mhc_probe.py OUT.json"""
import importlib.util
import json
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
import kernels as kb  # noqa: E402  (bench/kernels.py)
from dsv41.kernels import mhc as new  # noqa: E402

spec = importlib.util.spec_from_file_location("dsv41.kernels.mhc_s24", os.path.join(HERE, "mhc_s24.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

d, copies, reps = 5120, 40, 200.0
gen = torch.Generator(device="cuda").manual_seed(0)
args = []
for _ in range(copies):
    H = torch.randn(1, 1, 4, d, device="cuda", generator=gen).to(torch.bfloat16)
    fn = torch.randn(24, 4 * d, device="cuda", generator=gen) * (4 * d) ** -0.5
    base = torch.randn(24, device="cuda", generator=gen)
    scale = 0.5 + torch.rand(3, device="cuda", generator=gen)
    args.append((H, fn, base, scale))
bw = kb.copy_bandwidth(reps)
rows = []
for it in (20, 1):
    ref = new.reference_mhc_mixes(*args[0], 1e-20, 1e-6, it)
    for name, mod in (("s24", old), ("s25", new)):
        got = mod.triton_mhc_mixes(*args[0], 1e-20, 1e-6, it)
        err = max(float((g - r).abs().max()) for g, r in zip(got, ref))
        calls = [lambda a=a, m=mod: m.triton_mhc_mixes(*a, 1e-20, 1e-6, it) for a in args]
        t = kb._bench_graph(calls, reps)
        rows.append(dict(kernel="mhc_mixes", version=name, iters=it, time_us=t * 1e6, max_abs_err=err))
        print(f"mixes {name} iters={it:2d}: {t * 1e6:7.2f} us  err {err:.2e}", flush=True)
pre = new.triton_mhc_mixes(*args[0], 1e-20, 1e-6, 20)[0]
w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
t = kb._bench_graph([lambda a=a: new.triton_mhc_collapse_rmsnorm(a[0], pre, w, 1e-20) for a in args], reps)
rows.append(dict(kernel="mhc_collapse_rmsnorm", version="s25", iters=None, time_us=t * 1e6))
print(f"collapse_rmsnorm: {t * 1e6:7.2f} us", flush=True)
json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
