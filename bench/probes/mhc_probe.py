"""Session 25 probe: `dsv41::mhc_mixes` at the h200 decode shape (d = 5120, one token, bf16 H), the s24 kernel
(the kernel section of dsv41/kernels/mhc.py at a829329, everything above its op registrations) against this tree's,
each with 20 Sinkhorn rounds and with 1 (what the rounds cost), timed as bench/kernels.py times family ops:
back-to-back calls in one CUDA graph over 40 fn copies (80 MB > L2), PDL as the backend launches them. Also the
collapse + RMSNorm op. Results: bench/results/2026-12-03_h200_s25/README.md (`mhc_probe.json`).

    python3 bench/probes/mhc_probe.py OUT.json [S24_MHC.py]

The s24 kernel is read with `git show a829329:dsv41/kernels/mhc.py` (this checkout's history), or from S24_MHC.py
where the machine has no git history (a copy of that file, e.g. made with the same `git show`)."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
import kernels as kb  # noqa: E402  (bench/kernels.py)
from dsv41.kernels import mhc as new  # noqa: E402

S24_COMMIT = "a829329"


def _s24_kernels(path: str | None):
    """dsv41/kernels/mhc.py at S24_COMMIT (or `path`) cut at its `# --- ops` line (the op registrations would
    register the dsv41:: ops a second time), loaded as `dsv41.kernels.mhc_s24` so its relative imports resolve.
    Written to a file first: Triton reads a kernel's source from its file."""
    if path:
        with open(path) as f:
            text = f.read()
    else:
        text = subprocess.run(["git", "-C", ROOT, "show", f"{S24_COMMIT}:dsv41/kernels/mhc.py"], check=True,
                              capture_output=True, text=True).stdout
    cut = re.search(r"^# -+ ops$", text, flags=re.M)
    if cut is not None:
        text = text[:cut.start()]
    fd, fn = tempfile.mkstemp(prefix="mhc_s24_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("dsv41.kernels.mhc_s24", fn)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


old = _s24_kernels(sys.argv[2] if len(sys.argv) > 2 else None)

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
