"""dsv41 Triton kernels as `torch.library` custom ops (ARCHITECTURE.md "Kernels").

Importing this package registers every op under the `dsv41::` namespace:

- `dsv41::linear_fp8_block`, `dsv41::linear_fp4` (quant_gemv.py): quantised-weight GEMV, the dispatch target.
- `dsv41::rope_fp4_quant`, `dsv41::rope_fp4_fake_quant`, `dsv41::rope_fp4_quant_store` (rope_fp4.py).

Each op has a CPU reference (the model's own math), a CUDA implementation launching Triton, and a fake.
`set_pdl(True)` turns on Programmatic Dependent Launch for the CUDA launches.
"""

from . import quant_gemv, rope_fp4
from ._common import pdl_enabled, set_pdl

__all__ = ["quant_gemv", "rope_fp4", "set_pdl", "pdl_enabled"]
