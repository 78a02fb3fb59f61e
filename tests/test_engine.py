"""The chain engine (`dsv41/passes/engine/`) on small hand-traced graphs: region growth and cut search, literal
discovery, probe evaluation and the default byte rule. Fast: `make_fx` graphs, no compile."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41.passes.engine import (ByteTally, RegionEvaluator, backward_distances, closed_region, cut_search,
                                 eps_candidates, float_literals, int_literals, is_step, per_token_closure, probe_runs,
                                 ranked, shape_of, walk_inputs)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _graph(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    end = next(n for n in reversed(nodes) if n.op == "call_function")
    return gm, placeholders, end


def test_closed_region_needs_every_cut_node_and_nothing_else():
    gm, (x, w), end = _graph(_rms, torch.randn(2, 8), torch.randn(8))
    region = closed_region(end, (x, w), 50, is_step)
    assert region is not None and x not in region and w not in region and end in region
    assert closed_region(end, (x,), 50, is_step) is None  # reads w, which is not in the cut
    assert closed_region(end, (x, w, end.args[0]), 50, is_step) is None  # a cut node the walk never reaches
    assert closed_region(end, (x, w), 2, is_step) is None  # larger than the limit


def test_cut_search_yields_the_nearest_closed_cut_first():
    gm, (x, w), end = _graph(_rms, torch.randn(2, 8), torch.randn(8))
    dist = backward_distances(end, 50, is_step)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    cands = {"x": ranked([n for n in dist if shape_of(n) == (2, 8) and n is not end], dist, pos, 6),
             "w": ranked([n for n in dist if shape_of(n) == (8,)], dist, pos, 6)}
    cut, region = next(cut_search(cands, dist, lambda c: closed_region(end, c, 50, is_step)))
    assert cut["w"] is w and cut["x"] is not end
    assert next(cut_search({"x": [], "w": [w]}, dist, lambda c: []), None) is None  # a role without candidates


def test_walk_inputs_stops_at_the_limit_or_when_the_step_gives_up():
    gm, (x, w), end = _graph(_rms, torch.randn(2, 8), torch.randn(8))
    seen = walk_inputs(end, None, lambda n, s: n.all_input_nodes)
    assert x in seen and w in seen
    assert walk_inputs(end, 2, lambda n, s: n.all_input_nodes) is None
    assert walk_inputs(end, None, lambda n, s: None if n is x else n.all_input_nodes) is None


def test_literals_are_distinct_in_order_and_eps_candidates_end_with_zero():
    gm, _, end = _graph(lambda x: (x * 0.5 + 1e-6) * 0.5 + 3, torch.randn(4))
    nodes = list(gm.graph.nodes)
    assert float_literals(nodes) == [0.5, 1e-6]
    assert eps_candidates(nodes) == [1e-6, 0.0]
    assert int_literals(nodes) == [3]


def test_probe_runs_evaluates_the_region_on_real_tensors():
    gm, (x, w), end = _graph(_rms, torch.randn(2, 8), torch.randn(8))
    xs, ws = torch.randn(2, 8), torch.rand(8) + 0.5
    runs = probe_runs(RegionEvaluator(gm), end, [{x: xs, w: ws}])
    torch.testing.assert_close(runs[0], _rms(xs, ws))
    assert probe_runs(RegionEvaluator(gm), end, [{x: xs}]) is None  # w has no probe value: not closed


def test_byte_tally_counts_activations_per_token_and_parameters_per_step():
    gm, (x, w), end = _graph(_rms, torch.randn(3, 8), torch.randn(8))
    region = [n for n in gm.graph.nodes if n.op == "call_function"]
    inputs_of = {n: list(n.all_input_nodes) for n in region}
    per_token = per_token_closure((x,), region, inputs_of)
    assert end in per_token and w not in per_token
    tally = ByteTally((3,), per_token.__contains__)
    tally.add("after", x)
    tally.add("after", w)
    tally.add("after", end)
    before, after, subs = tally.result()
    assert after == "64*B + 32" and subs == {"B": 3}
