"""dsv41 compiler: the `dsv41` torch.compile backend, its options, pipeline and FusionReport.

Public API: `dsv41_backend` (registered as backend "dsv41"), `Backend` (the backend as an object keeping its
report), `parse_options` / `Options`,
`FusionReport` / `GraphReport` / `KernelCount`, `last_report()`.
"""

from .._package import repair as _repair

_repair()  # `dsv41` imported as a namespace package (a script beside the clone): run its __init__ now

from .backend import Backend, dsv41_backend  # noqa: E402
from .options import OPTION_KEYS, Options, parse_options  # noqa: E402
from .report import FusionReport, GraphReport, KernelCount, last_report  # noqa: E402

__all__ = ["dsv41_backend", "Backend", "parse_options", "Options", "OPTION_KEYS", "FusionReport", "GraphReport",
           "KernelCount", "last_report"]
