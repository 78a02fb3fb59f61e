"""dsv41 Triton kernels as `torch.library` custom ops (ARCHITECTURE.md "Kernels").

Importing this package registers every op under the `dsv41::` namespace:

- `dsv41::linear_fp8_block`, `dsv41::linear_fp4` (quant_gemv.py): quantised-weight GEMV, the dispatch target.
- `dsv41::rope_fp4_quant`, `dsv41::rope_fp4_fake_quant`, `dsv41::rope_fp4_quant_store` (rope_fp4.py).
- `dsv41::mhc_mixes`, `dsv41::mhc_collapse_rmsnorm`, `dsv41::mhc_expand` (mhc.py): mHC coefficients, pre-mix + RMSNorm, post-mix.

Each op has a CPU reference (the model's own math), a CUDA implementation launching Triton, and a fake.
`set_pdl(True)` turns on Programmatic Dependent Launch for the CUDA launches.
"""

from . import mhc, quant_gemv, rope_fp4
from ._common import pdl_enabled, prepare_device, set_pdl

__all__ = ["mhc", "quant_gemv", "rope_fp4", "set_pdl", "pdl_enabled", "prepare_device"]
