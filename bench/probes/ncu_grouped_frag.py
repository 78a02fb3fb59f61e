"""ncu driver (issue #3, session 22): plain launches (no graph, PDL off) of the grouped FP4 expert GEMV at the h200
decode shapes, 6 of 96 experts, bf16 x: w1 frag (default), w2 frag (frag=True), w2 word-decode act_quant=False."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # dsv41 from this checkout
import torch
from dsv41.kernels import grouped_gemv as gg
gen = torch.Generator(device="cuda").manual_seed(0)
for name, n, k, shared, aq, cfg in [("w1", 2304, 5120, True, True, {}), ("w2", 5120, 2304, False, True, dict(frag=True)),
                                     ("w2_noaq", 5120, 2304, False, False, {})]:
    w = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    x = torch.randn(*((1, k) if shared else (1, 6, k)), device="cuda", dtype=torch.bfloat16, generator=gen)
    for i in range(6):
        idx = torch.randperm(96, device="cuda", generator=gen)[:6][None]
        gg.triton_grouped_linear_fp4(x, w, s, idx, aq, **cfg)
    torch.cuda.synchronize()
    print(name, "done", flush=True)
