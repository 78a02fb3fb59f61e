"""dsv41 fusion passes: one family per module, run in order by `PassManager` (manager.py).

The families are not listed here: the registry (registry.py) finds every module of this package that declares
one (`SPEC = register_family(...)` and a `FusionFamily` subclass with `spec = SPEC`) and orders them by the
`after` / `before` of their declarations (`FAMILY_ORDER`). `dsv41 report --patterns` prints each family in that
order with the chains it looks for and the ops they become. After them the side-stream scheduler
(dsv41/compiler/streams.py) places dsv41 ops off the critical path. Each family returns an immutable `PassRecord`
(records.py) with its matches, near-misses and findings. The matching engine the families share (region growth,
cut search, probe evaluation, literal discovery, the chain loop) is the package `engine/`.
"""

from .records import Finding, MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import FusionFamily
from .manager import FAMILIES, FAMILY_ORDER, GraphPassResult, PassManager

__all__ = ["FAMILIES", "FAMILY_ORDER", "PassManager", "GraphPassResult", "PassRecord", "MatchRecord", "NearMiss",
           "Finding", "SourceLocation", "FusionFamily"]
