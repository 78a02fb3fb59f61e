"""`passes.engine.eliminate_dead_code`: torch's dead-code rule, asking about side effects only of nodes without users."""

import copy

import torch
import torch.fx as fx

from dsv41.passes.engine import eliminate_dead_code

torch.library.define("dcetest::bump", "(Tensor(a!) x) -> ()")


@torch.library.impl("dcetest::bump", "CompositeExplicitAutograd")
def _bump(x):
    x.add_(1)


def _graph() -> fx.GraphModule:
    g = fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    a = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    g.call_function(torch.ops.aten.add.Tensor, (a, 1))  # dead and pure
    g.call_function(torch.ops.aten.sin.default, (x,))  # dead and pure
    g.call_function(torch.ops.dcetest.bump.default, (buf,))  # no users, mutates its input: kept
    g.call_function(torch.ops.aten.rand.default, ([2],), {"device": torch.device("cpu")})  # random: torch keeps it
    g.call_function(torch.ops.aten.copy_.default, (buf, a))  # in-place: kept
    live = g.call_function(torch.ops.aten.cos.default, (a,))
    g.output(live)
    return fx.GraphModule(torch.nn.Module(), g)


def _ops(gm):
    return [str(n.target) for n in gm.graph.nodes]


def test_erases_what_torchs_own_dce_erases(monkeypatch):
    ours, theirs = _graph(), copy.deepcopy(_graph())
    asked = []
    orig = fx.Node.is_impure

    def counting(self, *a, **k):
        asked.append(self.name)
        return orig(self, *a, **k)

    theirs.graph.eliminate_dead_code()
    monkeypatch.setattr(fx.Node, "is_impure", counting)
    assert eliminate_dead_code(ours.graph)
    assert _ops(ours) == _ops(theirs)
    kept = _ops(ours)
    assert "aten.add.Tensor" not in kept and "aten.sin.default" not in kept
    assert {"dcetest.bump.default", "aten.rand.default", "aten.copy_.default", "aten.cos.default"} <= set(kept)
    # only the nodes without users were asked (placeholders used by others, mul, cos were not)
    assert "mul" not in asked and "cos" not in asked and "x" not in asked
    assert not eliminate_dead_code(ours.graph)
    x, buf = torch.randn(3), torch.zeros(3)
    torch.testing.assert_close(ours(x, buf), torch.cos(x * 2))
    torch.testing.assert_close(buf, x * 2)  # copy_ ran after bump: buf holds a
