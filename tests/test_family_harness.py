"""dsv41.passes.testing: the harness family tests use (`run_family`, `ops_after`, `ops_between`, `capture_graphs`).

The modules here are written for this file: the mHC collapse + RMSNorm spelled with `vector_norm` (no mean of
squares anywhere), and a mean-centred look-alike. The query tests build their FX graphs by hand, so they know
every node the queries should see.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.fx as fx

from dsv41.passes import FAMILY_ORDER
from dsv41.passes.testing import PREREQUISITES, OpCounts, capture_graphs, ops_after, ops_between, run_family

mhc_ops = pytest.importorskip("dsv41.kernels.mhc", reason="the mhc fused ops are not importable")

D = 16


class NormByVectorNorm(torch.nn.Module):
    """Collapse the 4 streams with `pre`, then RMSNorm through the 2-norm: ||x|| / sqrt(d) is the RMS."""

    def __init__(self, centred: bool = False):
        super().__init__()
        self.centred = centred

    def forward(self, H, pre, w):
        x = (pre.unsqueeze(-1) * H).sum(2)
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True) / math.sqrt(D)
        return w * x / torch.sqrt(rms * rms + 1e-6)


def _inputs():
    """(H, pre, w): the weight is an argument, so the graph's placeholders are exactly these three."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, 2, 4, D, generator=g), torch.rand(1, 2, 4, generator=g), 0.5 + torch.rand(D, generator=g)


@pytest.fixture(scope="module")
def vector_norm_run():
    return run_family("mhc", NormByVectorNorm(), _inputs())


def test_a_vector_norm_rmsnorm_becomes_one_collapse_op(vector_norm_run):
    gm, rec = vector_norm_run
    assert isinstance(gm, fx.GraphModule)
    assert ops_after(gm, namespace="dsv41") == {"dsv41.mhc_collapse_rmsnorm.default": 1}
    # Nothing of the eager norm is left beside the op: no reduction, no root.
    left = ops_after(gm, namespace="aten")
    assert left["aten.sum"] == left["aten.sqrt"] == left["aten.linalg_vector_norm"] == 0, left
    (match,) = rec.matches
    assert rec.family == "mhc" and dict(match.detail)["eps"] == pytest.approx(1e-6)


def test_the_graph_after_computes_what_eager_computes(vector_norm_run):
    gm, _ = vector_norm_run
    # Dynamo orders the placeholders by first use, not by the signature; the three inputs differ in shape.
    by_shape = {tuple(t.shape): t for t in _inputs()}
    (got,) = gm(*(by_shape[tuple(p.meta["val"].shape)] for p in gm.graph.find_nodes(op="placeholder")))
    with torch.no_grad():
        want = NormByVectorNorm()(*_inputs())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_mean_centred_look_alike_stays_unfused_and_says_why():
    gm, rec = run_family("mhc", NormByVectorNorm(centred=True), _inputs())
    assert ops_after(gm)["dsv41.mhc_collapse_rmsnorm"] == 0
    assert ops_after(gm)[torch.ops.aten.mean] >= 1
    assert [m.check for m in rec.near_misses] == ["collapse_rmsnorm_values"]
    assert rec.matches == ()


def test_other_families_stay_off():
    # normalize has nothing to fuse: the collapse chain must survive it as eager ops.
    gm, rec = run_family("normalize", NormByVectorNorm(), _inputs())
    assert ops_after(gm, namespace="dsv41") == {}
    assert rec.family == "normalize"


@pytest.mark.parametrize("bad, also", [("mhcc", ()), ("mhc", ("dispatch", "rms_norm"))])
def test_unknown_family_names_are_refused_before_compiling(bad, also):
    with pytest.raises(ValueError) as err:
        run_family(bad, NormByVectorNorm(), _inputs(), also=also)
    msg = str(err.value)
    assert ("'mhcc'" in msg) if bad == "mhcc" else ("'rms_norm'" in msg and "'dispatch'" not in msg.split(";")[0])
    assert all(name in msg for name in FAMILY_ORDER)


def test_every_family_has_prerequisites_that_run_before_it():
    assert set(PREREQUISITES) == set(FAMILY_ORDER)
    for name, before in PREREQUISITES.items():
        assert all(FAMILY_ORDER.index(b) < FAMILY_ORDER.index(name) for b in before), name
    assert all(set(PREREQUISITES[f]) >= {"normalize", "dispatch"} for f in ("grouped_pair", "sibling_gemv"))


# ------------------------------------------------------------------------------------------- queries on hand-made graphs
def _hand_graph() -> fx.GraphModule:
    """x -> mm -> relu -> mhc_expand-like op (a dsv41 op) -> add; a functionalised store beside it."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    r = g.call_function(torch.ops.aten.relu.default, (mm,))
    s = g.call_function(torch.ops.aten.sum.dim_IntList, (r, [0]))
    t = g.call_function(torch.ops.aten.add.Tensor, (s, 1))
    side = g.call_function(torch.ops.aten.exp.default, (x,))
    mm2 = g.call_function(torch.ops.aten.mm.default, (t, side))
    store = g.call_function(torch.ops.higher_order.auto_functionalized,
                            (torch.ops.aten.add_.Tensor,), {"self": mm2, "other": x})
    first = g.call_function(operator.getitem, (store, 1))
    g.output((first,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_counts_index_by_overload_packet_and_name():
    c = ops_after(_hand_graph())
    assert c["aten.mm.default"] == c["aten.mm"] == c[torch.ops.aten.mm] == c[torch.ops.aten.mm.default] == 2
    assert c["aten.sum.dim_IntList"] == c["aten.sum"] == 1
    assert c["aten.add"] == 1 and c["aten.add_"] == 1  # add.Tensor, and add_ through auto_functionalized
    assert c[torch.ops.higher_order.auto_functionalized] == 1
    assert c["_operator.getitem"] == 1
    assert c["aten.topk"] == 0 and c["aten"] == 0  # a namespace is not an op


def test_printed_code_gives_the_same_torch_ops_as_the_graph():
    gm = _hand_graph()
    from_graph = {k: v for k, v in ops_after(gm).items() if not k.startswith("_operator.")}
    assert ops_after(gm.code) == from_graph
    assert ops_after({"graph_after": gm.code}) == from_graph
    with pytest.raises(ValueError, match="debug"):
        ops_after({"graph_after": None})
    with pytest.raises(TypeError):
        ops_after(42)


def test_ops_between_lists_only_the_path_from_one_op_to_the_next():
    gm = _hand_graph()
    between = ops_between(gm, torch.ops.aten.relu, "aten.mm")
    assert between == {"aten.sum.dim_IntList": 1, "aten.add.Tensor": 1}  # not exp: it is off the path
    assert ops_between(gm, "aten.add_", "aten.relu") == OpCounts()
    with pytest.raises(TypeError):
        ops_between(gm.code, "aten.relu", "aten.mm")


def test_capture_sees_the_graph_the_debug_report_prints():
    import dsv41

    torch._dynamo.reset()
    with capture_graphs() as graphs, torch.no_grad():
        torch.compile(NormByVectorNorm(), backend="dsv41", options={"debug": True})(*_inputs())
    (gm,) = graphs
    (printed,) = dsv41.last_report().graphs
    assert ops_after(printed) == {k: v for k, v in ops_after(gm).items() if not k.startswith("_operator.")}
    assert ops_after(gm)["dsv41.mhc_collapse_rmsnorm"] == 1
