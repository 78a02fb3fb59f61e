"""Helper (not a test module): a FusionReport built by hand from records, as the compiler would build one, with
every section the page and the summaries show: fusing families with sites in several layers, the `normalize`
rewrites, a near-miss, a finding, profiled kernel counts and static launches per layer.
"""

from __future__ import annotations

from dsv41.compiler.kernel_counts import LayerKernelCounts
from dsv41.compiler.report import FusionReport, GraphReport, KernelCount
from dsv41.passes.records import Finding, MatchRecord, NearMiss, PassRecord, SourceLocation


def _loc(file, line, fn, code, caller=None):
    stack = ((caller,) if caller else ()) + (f"{file}:{line} ({fn})",)
    return SourceLocation(file, line, fn, code, stack)


def hand_built_report(layers: int = 4, schedule: dict | None = None) -> FusionReport:
    """`layers` layers of dispatch and mhc matches, a rope_fp4 match and near-miss, 40 normalize rewrites, a
    finding, kernels per step 900 -> 120 (profiled) and static launches per layer."""
    lin = _loc("/m/linear.py", 96, "forward", "return F.linear(x, w)", "/m/attention.py:118 (forward)")
    mhc = _loc("/m/mhc.py", 40, "pre", "h = (x * w).sum(-2)")
    rope = _loc("/m/rope.py", 51, "apply_rope", "return torch.cat((nope, rot), -1)")
    matches = []
    for i in range(layers):
        matches.append(MatchRecord("dispatch", "linear_fp8_block(act_quant=True)", "dsv41::linear_fp8_block", lin,
                                   (f"mul{i}", f"mm{i}"), ("aten.mul.Tensor", "aten.mm.default"),
                                   "1000000*B*L + 5000000", "1000*B*L + 1300000", (("B", 1), ("L", 1)),
                                   (("layer", i),)))
    mh = [MatchRecord("mhc", "mhc_pre", "dsv41::mhc_pre", mhc, (f"a{i}", f"b{i}", f"c{i}"),
                      ("aten.mul.Tensor", "aten.sum.dim_IntList", "aten.div.Tensor"), "40000*B*L", "8000*B*L",
                      (("B", 1), ("L", 1)), (("layer", i),)) for i in range(layers)]
    norm = [MatchRecord("normalize", "bmm_to_mm", "aten.mm", rope, (f"n{i}",), ("aten.bmm.default",), "0", "0",
                        (("B", 1), ("L", 1))) for i in range(40)]
    r1 = MatchRecord("rope_fp4", "rope_fp4_quant(e4m3_1x16)", "dsv41::rope_fp4_quant", rope, ("a", "b", "c"),
                     ("aten.cat.default",) * 3, "512*B*L + 64", "256*B*L + 64", (("B", 1), ("L", 1)))
    miss = NearMiss("rope_fp4", "rope -> quantise", "fp4_quantiser", "scale is not a power of two", rope)
    find = Finding("dispatch", "materialised_dequant", "weight 'w' is dequantised to fp32 every step", lin)
    lk = LayerKernelCounts(total=25 * layers + 20, by_layer=tuple((i, 25) for i in range(layers)), other=20,
                           by_kind=(("cpp", 60), ("extern", 60)), method="static launches")
    rep = FusionReport()
    rep.add_graph(GraphReport(0, "0/0", (
        PassRecord("normalize", True, tuple(norm)), PassRecord("rope_fp4", True, (r1,), (miss,)),
        PassRecord("mhc", True, tuple(mh)), PassRecord("dispatch", True, tuple(matches), (), (find,))),
        KernelCount("cpu", 900, 120, "counted by hand"), layer_kernels=lk, schedule=schedule))
    return rep
