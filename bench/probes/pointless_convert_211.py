"""Run a probe on this CPU machine's torch (2.13) with the graphs the GPU machines' torch 2.11 hands dsv41.

Torch 2.11's Inductor joint-graph pattern `pointless_convert` removes every float round trip
`convert(convert(x, dtype1), dtype2)`, also through a narrower dtype1 (f32 -> bf16 -> f32 becomes f32): a bf16
rounding the program asked for is gone before dsv41's passes see the graph. Torch 2.13 keeps a narrower
intermediate. This wrapper swaps 2.11's rule into 2.13's pattern table, then runs the given script, so a
GPU-only miss caused by that rewrite (session 34: the indexer's score chain, 6 FP32 cuBLAS GEMMs per `small`
step) reproduces here.

    python3 bench/probes/pointless_convert_211.py SCRIPT.py [ARGS ...]
"""
import runpy
import sys

import torch
import torch._inductor.fx_passes.joint_graph as jg
from torch._inductor.pattern_matcher import Match


def pointless_convert_211(match: Match, arg, dtype1, dtype2):
    """Torch 2.11's rule: any chain of two float casts becomes one cast to the last dtype."""
    graph = match.graph
    node = match.output_node()
    allowed = torch.float16, torch.bfloat16, torch.float32, torch.float64
    arg_val = arg.meta.get("val", None)
    if not isinstance(arg_val, torch.Tensor):
        return
    if arg_val.dtype in allowed and dtype1 in allowed and dtype2 in allowed:
        repl = graph.call_function(torch.ops.prims.convert_element_type.default, (arg, dtype2))
        repl.meta.update(node.meta)
        node.replace_all_uses_with(repl)
        match.erase_nodes()


n = 0
for key, entries in jg.patterns.patterns.items():
    for e in entries:
        if getattr(e, "handler", None) is not None and e.handler.__name__ == "pointless_convert":
            e.handler = pointless_convert_211
            n += 1
if n != 1:
    sys.exit(f"pointless_convert_211: expected one pointless_convert entry in Inductor's joint-graph patterns, found {n}")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
