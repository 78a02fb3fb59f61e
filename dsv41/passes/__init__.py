"""dsv41 fusion passes: one family per module, run in a fixed order by `PassManager` (manager.py).

Families, in `FAMILY_ORDER`: `normalize` (normalize.py), `c2_compressor` (c2_compressor.py), `rope_fp4`
(rope_fp4.py), `mhc` (mhc.py), `engram` (engram.py), `moe` (moe.py), `sparse_attention` (sparse_attention.py),
`indexer` (indexer.py), `small_ops` (small_ops.py), `upcast_linear` (upcast_linear.py: FP32 matmul by an upcast
half-precision weight), `dispatch` (dispatch.py: plain and gathered-expert GEMVs), `grouped_pair` (grouped_pair.py:
two gathered-expert GEMVs of one activation and one expert selection share its FP8 quantisation), `sibling_gemv`
(sibling_gemv.py: block-FP8 GEMVs of one activation in one launch).
After them the side-stream scheduler (dsv41/compiler/streams.py) places dsv41 ops off the critical path. Each returns an
immutable `PassRecord` (records.py) with its matches, near-misses and findings. The matching engine the families share
(region growth, cut search, probe evaluation, literal discovery, the chain loop) is the package `engine/`; each family
declares itself and its chains as data (`SPEC`, engine/chain.py), which `dsv41 report --patterns` prints.
"""

from .records import Finding, MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import FusionFamily
from .manager import FAMILIES, FAMILY_ORDER, GraphPassResult, PassManager

__all__ = ["FAMILIES", "FAMILY_ORDER", "PassManager", "GraphPassResult", "PassRecord", "MatchRecord", "NearMiss",
           "Finding", "SourceLocation", "FusionFamily"]
