"""dsv41 Triton kernels as `torch.library` custom ops (ARCHITECTURE.md "Kernels").

Importing this package registers every op under the `dsv41::` namespace: it imports each module of the package
that defines one (`@torch.library.custom_op("dsv41::...")` in its source; `op_modules()`), found by walking the
package, so a new kernel module needs no line here. The modules stay importable by name (`dsv41.kernels.mhc`, or
`from dsv41.kernels import mhc`). Which op each pass family emits: `dsv41 report --patterns`; what each op computes,
with shapes, dtypes and errors: its module's docstring. The shared GEMV variants (`gemv_tma`, `gemv_rows`,
`gemv_frag`, `grouped_*`) define no op and are imported by their op modules when a launch needs them.

Each op has a CPU reference (its arguments checked, then `dsv41.ref`'s math), a CUDA implementation launching
Triton, and a fake.
The CUDA implementations register through `_common.register_cuda`, so `census.py` can count the kernels one
call launches (shapes only, on meta tensors) for the compiler's static launch count.
`set_pdl(True)` turns on Programmatic Dependent Launch for the CUDA launches.
"""

import importlib
import os
import pkgutil
import re

from ._common import pdl_enabled, prepare_device, set_pdl

#: How a module defines a dsv41 op (read from its source, so modules that define none are not imported here).
_DEFINES_OP = re.compile(r"""custom_op\(\s*["']dsv41::""")


def op_modules() -> list[str]:
    """Names of this package's public modules that define a `dsv41::` op (`@torch.library.custom_op("dsv41::...")`
    in their source), sorted. Reads the sources only; imports nothing."""
    out = []
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg or info.name.startswith("_"):
            continue
        with open(os.path.join(__path__[0], info.name + ".py"), encoding="utf-8") as f:
            if _DEFINES_OP.search(f.read()):
                out.append(info.name)
    return sorted(out)


# Import every op module: this is what registers the ops (and binds each module as an attribute of the package).
_OPS = op_modules()
for _name in _OPS:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = [*_OPS, "op_modules", "set_pdl", "pdl_enabled", "prepare_device"]
