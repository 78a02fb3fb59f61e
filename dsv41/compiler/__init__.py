"""dsv41 compiler: the `dsv41` torch.compile backend, its options, pipeline and FusionReport.

Public API: `dsv41_backend` (registered as backend "dsv41"), `parse_options` / `Options`,
`FusionReport` / `GraphReport` / `KernelCount`, `last_report()`.
"""

from .backend import dsv41_backend
from .options import OPTION_KEYS, Options, parse_options
from .report import FusionReport, GraphReport, KernelCount, last_report

__all__ = ["dsv41_backend", "parse_options", "Options", "OPTION_KEYS", "FusionReport", "GraphReport",
           "KernelCount", "last_report"]
