"""Run grouped FP4 GEMV variants once each at the h200 w1 shape (tile kernel; word-decode kernel at two plans), for
Nsight Compute (issue #3 probe; bench/results/2026-12-01_h200_s19/ncu.txt):

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis \
      -k regex:"grouped_(words|gemv)_kernel" python3 bench/probes/ncu_grouped_words.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # dsv41 from this checkout
import torch
from dsv41.kernels import grouped_gemv as gg
gen = torch.Generator(device="cuda").manual_seed(0)
E, n, k, topk = 96, 2304, 5120, 6
w = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
s = torch.randint(117, 124, (E, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
idx = torch.randperm(E, device="cuda", generator=gen)[:topk][None]
for cfg in (dict(words=False), dict(words=True, block_n=32, block_k=256, num_warps=1, x_perm=False),
            dict(words=True, block_n=32, block_k=256, num_warps=1, x_perm=True),
            dict(words=True, block_n=128, block_k=256, num_warps=4, x_perm=True)):
    gg.triton_grouped_linear_fp4(x, w, s, idx, True, **cfg)
torch.cuda.synchronize()
