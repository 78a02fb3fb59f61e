"""Issue 37 probe: `dsv41::sparse_fp4_attention` at the h200 decode shape (64 heads, D 512, ring 128 + the step's
row, 512 selected bank rows of 4,096, bf16 q), timed as bench/kernels.py times family ops (back-to-back calls in
one CUDA graph over 40 input copies, PDL on):

- window as one tensor, concatenated by `torch.cat` first (what the graph launched before: two cat launches, then
  the op);
- the same window read in two parts in place (`new_codes` / `new_scales`, no cat);
- an SWA layer's window-only call (no bank rows): the op with an empty bank.

    python3 bench/probes/window_parts_probe.py OUT.json
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
from dsv41.kernels import set_pdl  # noqa: E402
from dsv41.kernels import sparse_attention as sa  # noqa: E402
from dsv41.model.formats import quantize_fp4_e4m3_1x16, quantize_fp8_1x32  # noqa: E402

set_pdl(True)
H, D, W, N, K, R = 64, 512, 128, 4096, 512, 64
copies, reps = 40, 200.0
dev = "cuda"
gen = torch.Generator().manual_seed(0)
sets = []
for _ in range(copies):
    q = torch.randn(1, 1, H, D, generator=gen).to(torch.bfloat16)
    rc, rs = quantize_fp8_1x32(torch.randn(1, W, D, generator=gen))
    nc, ns = quantize_fp8_1x32(torch.randn(1, 1, D, generator=gen))
    ok = torch.ones(1, 1, W + 1, dtype=torch.bool)
    bc, bs = quantize_fp4_e4m3_1x16(torch.randn(1, N, D, generator=gen))
    idx = torch.randint(0, N, (1, 1, K), generator=gen)
    sink = torch.randn(H, generator=gen)
    ang = torch.rand(1, 1, R // 2, generator=gen) * 6.3
    t = [q, rc, rs, nc, ns, ok, bc, bs, idx, sink, ang.cos(), ang.sin()]
    sets.append([x.to(dev) for x in t])


def one_part(a):
    """The window concatenated by torch.cat, then the op (the graph before the change)."""
    q, rc, rs, nc, ns, ok, bc, bs, idx, sink, cos, sin = a
    wc, ws = torch.cat((rc, nc), 1), torch.cat((rs, ns), 1)
    return sa.triton_sparse_fp4_attention(q, wc, ws, ok, bc, bs, idx, sink, cos, sin, D ** -0.5)


def two_parts(a):
    """The op reading the ring and the step's row in place."""
    q, rc, rs, nc, ns, ok, bc, bs, idx, sink, cos, sin = a
    return sa.triton_sparse_fp4_attention(q, rc, rs, ok, bc, bs, idx, sink, cos, sin, D ** -0.5, new_codes=nc,
                                          new_scales=ns)


def window_only(a):
    """An SWA layer's call: the two window parts, an empty bank."""
    q, rc, rs, nc, ns, ok, bc, bs, idx, sink, cos, sin = a
    return sa.triton_sparse_fp4_attention(q, rc, rs, ok, bc[:, :0], bs[:, :0], idx[:, :, :0], sink, cos, sin,
                                          D ** -0.5, new_codes=nc, new_scales=ns)


bw = kb.copy_bandwidth(reps)
rows = []
ref = one_part(sets[0])
for name, f in (("cat + op (window in one part)", one_part), ("op, window in two parts", two_parts),
                ("op, window only (SWA)", window_only)):
    got = f(sets[0])
    same = bool(torch.equal(got, ref)) if f is two_parts else None
    t = kb._bench_graph([lambda a=a: f(a) for a in sets], reps)
    rows.append(dict(kernel=name, time_us=t * 1e6, bits_equal_one_part=same))
    print(f"{name:32s} {t * 1e6:7.2f} us  bits equal to one part: {same}", flush=True)
json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, shape=dict(H=H, D=D, W=W, N=N, K=K, R=R), copy_bw_TBps=bw / 1e12,
               rows=rows), open(sys.argv[1], "w"), indent=1)
