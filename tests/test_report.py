"""FusionReport: aggregation per torch.compile call with per-graph entries, kernels, bytes, JSON, text, options.

The shared model has a graph break and is called with a prefill-like shape [1, 3, K] and a decode-like shape
[1, 1, K] (`dynamic=False`), so one compile call produces four graphs: (before break, after break) x (prefill,
decode). Each graph holds exactly one quantised Linear.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import sympy
import torch
from torch import nn

pytest.importorskip("dsv41.kernels", reason="dsv41.kernels (the fused ops) is not importable")
import dsv41  # noqa: E402
import dsv41.kernels  # noqa: E402,F401
from dsv41.model.linear import Linear  # noqa: E402
from dsv41.passes import FAMILY_ORDER  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

if not (hasattr(torch.ops.dsv41, "linear_fp8_block") and hasattr(torch.ops.dsv41, "linear_fp4")):
    pytest.skip("dsv41::linear_fp8_block / linear_fp4 are not registered", allow_module_level=True)


class TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = Linear(64, 64, "fp8_block", torch.float32)
        self.a.init_random(gen)
        self.b = Linear(64, 32, "fp4", torch.float32)
        self.b.init_random(gen)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.relu(h))


class OneLinear(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.a = Linear(64, 32, "fp8_block", torch.float32)
        self.a.init_random(torch.Generator().manual_seed(seed))

    def forward(self, x):
        return self.a(x)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(model, outputs [prefill, decode], eager outputs, report, JSON path) of one compile call, 4 graphs."""
    path = tmp_path_factory.mktemp("report") / "fusion.json"
    model = TwoGraphs().eval()
    xs = [torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1)),
          torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(2))]
    torch._dynamo.reset()
    fn = torch.compile(model, backend="dsv41", dynamic=False, options={"count_kernels": True, "report": str(path)})
    with torch.no_grad():
        outs = [fn(x) for x in xs]
        eager = [model(x) for x in xs]
    return model, outs, eager, dsv41.last_report(), path


def test_report_aggregates_every_graph_of_one_compile_call(compiled):
    _, outs, eager, report, _ = compiled
    for o, e in zip(outs, eager):
        assert torch.allclose(o, e, rtol=1e-5, atol=1e-5)
    assert len(report.graphs) == 4
    assert len({g.compile_id for g in report.graphs}) == 4
    d = report.to_dict()
    assert d["families"]["dispatch"]["matches"] == 4
    assert [g.record("dispatch").match_count for g in report.graphs] == [1, 1, 1, 1]
    assert [[r["family"] for r in g["records"]] for g in d["graphs"]] == [list(FAMILY_ORDER)] * 4  # one per family
    assert sorted(s["graph"] for s in d["families"]["dispatch"]["sites"]) == [0, 1, 2, 3]


def test_last_report_follows_the_most_recent_compile_call(compiled):
    _, _, _, report, _ = compiled
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(OneLinear(), backend="dsv41")(torch.randn(2, 64))
    newer = dsv41.last_report()
    assert newer is not report
    assert len(newer.graphs) == 1 and len(report.graphs) == 4


def test_kernels_per_step_are_counted_before_and_after(compiled):
    _, _, _, report, _ = compiled
    k = report.to_dict()["kernels"]
    assert "views and allocations excluded" in k["method"]
    per = [g.kernels for g in report.graphs]
    for kc in per:
        assert kc.device == "cpu" and kc.note == ""
        # eager: the fake-quant and dequantise chains are ~20 ops each; compiled: the fused op plus a few kernels
        assert kc.before >= 20 and 1 <= kc.after <= 5 and kc.after < kc.before
    assert k["before"] == sum(kc.before for kc in per) and k["after"] == sum(kc.after for kc in per)


def test_bytes_are_sympy_in_batch_and_length_evaluated_for_each_graph(compiled):
    _, _, _, report, _ = compiled
    fam = report.to_dict()["families"]["dispatch"]
    B, L = sympy.symbols("B L", positive=True, integer=True)
    lengths = sorted(s["symbols"]["L"] for s in fam["sites"])
    assert lengths == [1, 1, 3, 3]
    total_before = 0
    for s in fam["sites"]:
        expr = sympy.sympify(s["bytes_before"], locals={"B": B, "L": L})
        assert expr.free_symbols == {B, L}
        assert int(expr.subs({B: s["symbols"]["B"], L: s["symbols"]["L"]})) == s["bytes_before_value"]
        total_before += s["bytes_before_value"]
    assert fam["bytes_before_value"] == total_before > fam["bytes_after_value"]
    summed = sympy.sympify(fam["bytes_before"], locals={"B": B, "L": L})
    assert summed == sum(sympy.sympify(s["bytes_before"], locals={"B": B, "L": L}) for s in fam["sites"])


def test_report_option_writes_json_that_round_trips(compiled, tmp_path):
    _, _, _, report, path = compiled
    on_disk = json.loads(path.read_text())
    assert on_disk["families"]["dispatch"]["matches"] == 4
    assert on_disk["options"]["count_kernels"] is True
    report.to_json(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(json.dumps(report.to_dict(), default=str))


def test_text_report_lists_families_sites_and_kernels(compiled):
    _, _, _, report, _ = compiled
    text = str(report)
    for word in ("normalize", "rope_fp4", "dispatch", "linear_fp8_block(act_quant=True)",
                 "linear_fp4(act_quant=True)", "kernels per step"):
        assert word in text
    assert re.search(r"linear\.py:\d+ \(forward\) <- test_report\.py:\d+", text)
    import io
    buf = io.StringIO()
    report.print(file=buf)
    assert "dsv41 fusion report: 4 graph(s)" in buf.getvalue()


def test_switched_off_family_shows_off_and_its_chain_stays():
    torch._dynamo.reset()
    m = OneLinear()
    x = torch.randn(2, 64)
    with torch.no_grad(), capture_graphs() as graphs:
        y = torch.compile(m, backend="dsv41", options={"disable": ["dispatch"], "debug": True})(x)
        assert torch.allclose(y, m(x), rtol=1e-5, atol=1e-5)
    report = dsv41.last_report()
    d = report.to_dict()["families"]
    assert d["dispatch"]["enabled"] is False and d["dispatch"]["matches"] == 0
    assert "disabled by options" in d["dispatch"]["note"]
    assert d["rope_fp4"]["enabled"] is True and d["normalize"]["enabled"] is True
    assert re.search(r"dispatch\s+.\s+OFF", str(report))
    after = ops_after(graphs)
    assert after["aten.mm.default"] > 0 and ops_after(graphs, namespace="dsv41") == {}


def test_records_are_immutable():
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(OneLinear(), backend="dsv41")(torch.randn(2, 64))
    rec = dsv41.last_report().graphs[0].record("dispatch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.enabled = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.matches[0].op = "x"
    assert isinstance(rec.matches, tuple) and isinstance(rec.matches[0].nodes_replaced, tuple)


def test_recompiling_from_inductors_cache_keeps_the_records():
    from torch._inductor import config

    reports = []
    for _ in range(3):
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(OneLinear(seed=3), backend="dsv41")(torch.randn(2, 64))
        reports.append(dsv41.last_report())
    sites = [[(s["pattern"], s["location"]["where"], s["nodes_replaced"])
              for s in r.to_dict()["families"]["dispatch"]["sites"]] for r in reports]
    assert sites[0] == sites[1] == sites[2] and len(sites[0]) == 1
    if config.fx_graph_cache:
        # the first compile filled Inductor's caches: the passes did not run again, their records came back
        assert reports[1].graphs[0].from_cache and reports[2].graphs[0].from_cache
