"""Run a probe on this CPU machine's torch (2.13) with the graphs the GPU machines' torch 2.11 hands dsv41.

Torch 2.11's Inductor joint-graph pattern `pointless_convert` removes every float round trip
`convert(convert(x, dtype1), dtype2)`, also through a narrower dtype1 (f32 -> bf16 -> f32 becomes f32): a bf16
rounding the program asked for is gone before dsv41's passes see the graph. Torch 2.13 keeps a narrower
intermediate. This wrapper swaps 2.11's rule into 2.13's pattern table, then runs the given script, so a
GPU-only miss caused by that rewrite (session 34: the indexer's score chain, 6 FP32 cuBLAS GEMMs per `small`
step) reproduces here.

    python3 bench/probes/pointless_convert_211.py SCRIPT.py [ARGS ...]
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from dsv41.passes.testing import torch211_casts  # noqa: E402

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    with torch211_casts():
        runpy.run_path(sys.argv[0], run_name="__main__")
