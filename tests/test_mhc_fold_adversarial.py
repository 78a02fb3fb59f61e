"""Adversarial tests of the `mhc_fold` family and its op `dsv41::mhc_expand_mixes` (an mHC expand and the next
coefficient site of its result in one op / one Triton launch).

Three groups:

* graph: small hyper-connection ladders written here (own spelling of the mHC equations, not dsv41's functions)
  compiled with `backend="dsv41"` on CPU, in odd shapes and orders; every compiled output is compared with the
  same module run eagerly in float64 (and the op counts say what was folded);
* kernel: `triton_mhc_expand_mixes` under TRITON_INTERPRET=1 (in a child process, `interp_harness`) on odd hidden
  sizes, strided / broadcast / permuted inputs, NaN / inf, iters = 1, zero rows and many rows, against a numpy
  float64 reference written here from MODEL.md §2.3;
* errors: bad arguments must raise TypeError / ValueError naming the argument.

"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs
from test_pass_mhc_fold import sinkhorn_columns_last

from dsv41.kernels import mhc_fold as fold_kernels
from dsv41.passes.testing import capture_graphs, ops_after

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()

NORM_EPS, HC_EPS, ROUNDS = 1e-20, 1e-6, 20
FUSED, MIXES, EXPAND = "dsv41.mhc_expand_mixes", "dsv41.mhc_mixes", "dsv41.mhc_expand"


# =========================================================================================== graph-level models
# Sinkhorn of [..., 4, 4] logits ending on the column (source-axis) normalisation, as the other mhc_fold test spells it.
stochastic = sinkhorn_columns_last


class Coefficients(nn.Module):
    """One coefficient site: (pre, post, comb) of a four-stream residual H [B, T, 4, d].

    rms_weight: the "normalise, then project" spelling `F.linear(F.rms_norm(flatten(H), (4d,), w), proj)`;
    rounds / hc_eps: this site's Sinkhorn round count and eps (sites differ, so a fused op that took another
    site's constants would show)."""

    def __init__(self, d, g, rms_weight=False, rounds=ROUNDS, hc_eps=HC_EPS):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(24, 4 * d, generator=g) * 0.05)
        self.bias = nn.Parameter(torch.randn(24, generator=g) * 0.1)
        self.gain = nn.Parameter(torch.tensor([0.8, 1.2, 2.5]))
        self.w = nn.Parameter(1 + 0.2 * torch.randn(4 * d, generator=g)) if rms_weight else None
        self.rounds, self.hc_eps = rounds, hc_eps

    def forward(self, H, proj=None):
        proj = self.proj if proj is None else proj
        flat = H.flatten(start_dim=2).to(proj.dtype)
        if self.w is None:
            logits = F.linear(flat, proj) * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + NORM_EPS)
        else:
            logits = F.linear(F.rms_norm(flat, (flat.shape[-1],), self.w, NORM_EPS), proj)
        pre = torch.sigmoid(logits[..., 0:4] * self.gain[0] + self.bias[0:4]) + self.hc_eps
        post = 2.0 * torch.sigmoid(logits[..., 4:8] * self.gain[1] + self.bias[4:8])
        mix = (logits[..., 8:24] * self.gain[2] + self.bias[8:24]).unflatten(-1, (4, 4))
        return pre, post, stochastic(mix, self.rounds, self.hc_eps)


def read_out(H, pre):
    """Collapse: sum_i pre_i H_i (in pre's precision), back in H's dtype."""
    return (pre.unsqueeze(-1) * H.to(pre.dtype)).sum(dim=2).to(H.dtype)


def write_back(y, H, post, comb):
    """Expand: H'_j = post_j y + sum_i comb[i, j] H_i, back in H's dtype."""
    mixed = torch.einsum("btij,btid->btjd", comb, H.to(comb.dtype))
    return (post.unsqueeze(-1) * y.to(comb.dtype).unsqueeze(2) + mixed).to(H.dtype)


class Ladder(nn.Module):
    """`sites` coefficient sites in the paper's order: coefficients(H) -> collapse -> sublayer -> expand -> the next
    site's coefficients of the expand's result ... -> final expand. `sites - 1` expand -> coefficients pairs.

    extra: after the first expand, one more coefficient site reads H2 (its results are returned).
    keep_h2: H2 (the first expand's result) is also returned and reused by an elementwise op.
    """

    def __init__(self, d=32, sites=2, rms_weight=False, extra=False, keep_h2=False, constants=None):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        constants = constants or [{}] * sites
        self.coef = nn.ModuleList([Coefficients(d, g, rms_weight, **constants[i]) for i in range(sites)])
        self.sub = nn.ModuleList([nn.Linear(d, d) for _ in range(sites)])
        for lin in self.sub:
            nn.init.normal_(lin.weight, std=d ** -0.5, generator=g)
        self.extra, self.keep_h2 = extra, keep_h2
        if extra:
            self.side = Coefficients(d, g)

    def sublayer(self, i, x):
        lin = self.sub[i]
        return torch.tanh(lin(x.to(lin.weight.dtype))).to(x.dtype)

    def forward(self, H):
        extras = []
        pre, post, comb = self.coef[0](H)
        for i in range(1, len(self.coef) + 1):
            y = self.sublayer(i - 1, read_out(H, pre))
            H = write_back(y, H, post, comb)
            if i == len(self.coef):
                break
            if i == 1 and self.extra:
                extras += list(self.side(H))
            if i == 1 and self.keep_h2:
                extras += [H, H * 0.5 + 1.0]
            pre, post, comb = self.coef[i](H)
        return (H, *extras)


def compile_run(model, *inputs, dynamic=None, **options):
    """Compile `model` with the dsv41 backend (strict: a family that raises fails the test) and run it on each
    input; (outputs per input, dsv41 op counts of every graph compiled, the captured graphs)."""
    torch._dynamo.reset()
    options.setdefault("strict", True)
    with capture_graphs() as graphs, torch.no_grad():
        compiled = torch.compile(model, backend="dsv41", dynamic=dynamic, options=options)
        outs = [compiled(x) for x in inputs]
    return outs, ops_after(graphs, namespace="dsv41"), graphs


def float64_reference(model, x):
    with torch.no_grad():
        out = copy.deepcopy(model).double()(x.double())
    return out if isinstance(out, tuple) else (out,)


def assert_close_to(got, want, rel):
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (k, g.shape, w.shape)
        err = (g.double() - w).abs().max().item()
        assert err <= rel * (1.0 + w.abs().max().item()), f"output {k}: max error {err:.3g}"


def residual(b, t, d=32, dtype=torch.float32, seed=0):
    return torch.randn(b, t, 4, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fused_nodes(graphs):
    return [n for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("dsv41.mhc_expand_mixes")]


# =========================================================================================== graph-level tests
def test_graph_three_sites_fold_twice_with_per_site_constants():
    # Sites with different Sinkhorn round counts and eps: each fused op must carry its own site's constants.
    constants = [dict(rounds=20), dict(rounds=5, hc_eps=1e-3), dict(rounds=9)]
    model = Ladder(sites=3, constants=constants)
    H = residual(2, 3)
    (out,), ops, graphs = compile_run(model, H)
    assert ops[FUSED] == 2 and ops[MIXES] == 1 and ops[EXPAND] == 1, dict(ops)
    got = sorted(tuple(n.args[7:10]) for n in fused_nodes(graphs))
    assert got == sorted([(NORM_EPS, 1e-3, 5), (NORM_EPS, HC_EPS, 9)]), got
    assert_close_to(out, float64_reference(model, H), 1e-4)


def test_graph_expand_result_read_by_two_coefficient_sites():
    # H2 feeds two mixes: one folds, the other keeps reading H2 (now the fused op's first result).
    model = Ladder(sites=2, extra=True)
    H = residual(2, 3, seed=1)
    (out,), ops, _ = compile_run(model, H)
    assert ops[FUSED] == 1 and ops[MIXES] == 2, dict(ops)
    assert_close_to(out, float64_reference(model, H), 1e-4)


class TwoReaders(nn.Module):
    """One expand, then two coefficient sites of its result, both returned. The first (in source and graph order)
    reads a projection computed after the expand (`proj + delta`: cannot fold); the second reads parameters."""

    def __init__(self, d=32):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a, self.late, self.ok = Coefficients(d, g), Coefficients(d, g), Coefficients(d, g)
        self.delta = nn.Parameter(0.01 * torch.randn(24, 4 * d, generator=g))
        self.lin = nn.Linear(d, d)

    def forward(self, H):
        pre, post, comb = self.a(H)
        y = torch.tanh(self.lin(read_out(H, pre).to(self.lin.weight.dtype))).to(H.dtype)
        H2 = write_back(y, H, post, comb)
        first = self.late(H2, self.late.proj + self.delta)
        second = self.ok(H2)
        return (H2, *first, *second)


@pytest.fixture(scope="module")
def late_first_site():
    model = TwoReaders()
    H = residual(2, 3, seed=2)
    (out,), ops, graphs = compile_run(model, H)
    return model, H, out, ops, graphs


def test_graph_late_first_reader_still_equals_eager(late_first_site):
    model, H, out, ops, graphs = late_first_site
    assert ops[MIXES] + ops[FUSED] == 3, dict(ops)
    assert_close_to(out, float64_reference(model, H), 1e-4)
    # The precondition of the test below: the late reader is the earlier mixes node of the graph.
    readers = [n for n in graphs[0].graph.nodes if str(n.target) == "dsv41.mhc_mixes.default"
               and n.args[0].op == "call_function"]
    if ops[FUSED] == 0:
        assert len(readers) == 2 and readers[0].args[1].op == "call_function"  # fn = proj + delta


def test_graph_foldable_second_reader_folds_when_first_reader_is_late(late_first_site):
    # The earlier mixes of H2 reads a projection computed after the expand (a near-miss); the later one folds.
    ops = late_first_site[3]
    assert ops[FUSED] == 1 and ops[MIXES] == 2, dict(ops)


def test_graph_expand_result_also_returned_and_reused():
    model = Ladder(sites=3, keep_h2=True)
    H = residual(3, 2, seed=3)
    (out,), ops, _ = compile_run(model, H)
    assert ops[FUSED] == 2, dict(ops)
    want = float64_reference(model, H)
    assert_close_to(out, want, 1e-4)
    # H2 as returned is the expand's value (FP32 rounding of the float64 one), not something else of that shape.
    h2 = out[1]
    assert h2.dtype == torch.float32 and h2.shape == H.shape
    assert torch.allclose(h2.double(), want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], h2 * 0.5 + 1.0)


class ReadsAltered(nn.Module):
    """Expand, then the next site's coefficients of a transformed H2 (`how`)."""

    def __init__(self, how, d=32):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.a, self.b = Coefficients(d, g), Coefficients(d, g)
        self.lin = nn.Linear(d, d)
        self.how = how

    def forward(self, H):
        pre, post, comb = self.a(H)
        y = torch.tanh(self.lin(read_out(H, pre).to(self.lin.weight.dtype))).to(H.dtype)
        H2 = write_back(y, H, post, comb)
        if self.how == "transpose":        # B == T: same shape, other values
            Hm = H2.transpose(0, 1)
        elif self.how == "streams_swapped":
            Hm = H2[:, :, [1, 0, 3, 2]]
        elif self.how == "channels_shuffled":  # a view chain that permutes channels within each stream
            Hm = H2.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        elif self.how == "clone":          # same values: folding is allowed
            Hm = H2.clone()
        return (H2, *self.b(Hm))


@pytest.mark.parametrize("how, folds", [("transpose", 0), ("streams_swapped", 0), ("channels_shuffled", 0),
                                        ("clone", None)])
def test_graph_coefficients_of_an_altered_copy_of_h2(how, folds):
    model = ReadsAltered(how)
    H = residual(3, 3, seed=4)
    (out,), ops, _ = compile_run(model, H)
    if folds is not None:
        assert ops[FUSED] == folds, dict(ops)
    assert_close_to(out, float64_reference(model, H), 1e-4)


@pytest.mark.parametrize("dtype, rel", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_graph_half_precision_residual(dtype, rel):
    model = Ladder(sites=3)
    H = residual(2, 4, dtype=dtype, seed=5)
    (out,), ops, _ = compile_run(model, H)
    assert ops[FUSED] == 2, dict(ops)
    assert out[0].dtype == dtype
    assert_close_to(out, float64_reference(model, H), rel)
    with torch.no_grad():  # and next to the eager module in the same dtype (the same rounding points)
        (same,) = model(H)
    assert (out[0].float() - same.float()).abs().max().item() <= rel * (1 + same.float().abs().max().item())


def test_graph_normalise_then_project_spelling_gives_eleven_args(tmp_path):
    model = Ladder(sites=2, rms_weight=True)
    H = residual(2, 5, seed=6)
    report = tmp_path / "report.json"
    (out,), ops, graphs = compile_run(model, H, report=str(report))
    assert ops[FUSED] == 1 and ops[MIXES] == 1, dict(ops)
    (node,) = fused_nodes(graphs)
    assert len(node.args) == 11 and not node.kwargs
    w = node.args[10].meta["val"]
    assert tuple(w.shape) == (4 * 32,) and w.dtype == torch.float32
    assert_close_to(out, float64_reference(model, H), 1e-4)
    fam = json.loads(report.read_text())["families"]["mhc_fold"]
    (site,) = fam["sites"]
    assert site["pattern"] == "mhc_expand_mixes(norm_weight)"
    assert site["bytes_after_value"] < site["bytes_before_value"]


def test_graph_dynamic_shapes_never_break():
    # (`mhc` leaves symbolic-size graphs unfused (its near-miss static_shapes), so nothing reaches mhc_fold here;
    # what is checked is that the whole pipeline, mhc_fold included, neither raises nor changes the values.)
    model = Ladder(sites=2)
    shapes = [(2, 3), (3, 5), (2, 6)]
    inputs = [residual(b, t, seed=10 + b + t) for b, t in shapes]
    outs, _, graphs = compile_run(model, *inputs, dynamic=True)
    assert len(graphs) == 1
    for x, (out,) in zip(inputs, outs):
        assert_close_to(out, float64_reference(model, x), 1e-4)


def test_graph_automatic_dynamic_recompile_after_a_folded_static_graph():
    # First call static (folds), then new sizes: Dynamo recompiles with symbolic B / T.
    model = Ladder(sites=2)
    inputs = [residual(2, 3, seed=20), residual(2, 6, seed=21)]
    outs, _, graphs = compile_run(model, *inputs)
    assert ops_after(graphs[0], namespace="dsv41")[FUSED] == 1
    for x, (out,) in zip(inputs, outs):
        assert_close_to(out, float64_reference(model, x), 1e-4)


class Shifted(nn.Module):
    """DeepSeek-V4.1's order: the second site's coefficients are first used after the second sublayer's matmul."""

    def __init__(self, d=32):
        super().__init__()
        g = torch.Generator().manual_seed(9)
        self.a, self.b = Coefficients(d, g), Coefficients(d, g)
        self.f1, self.f2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, H):
        pre, post, comb = self.a(H)
        H2 = write_back(torch.tanh(self.f1(read_out(H, pre))), H, post, comb)
        pre2, post2, comb2 = self.b(H2)
        y2 = torch.tanh(self.f2(read_out(H2, pre)))  # the earlier site's pre: the matmul does not need pre2
        return write_back(y2, H2, post2, comb2), pre2


@pytest.fixture(scope="module")
def shifted_with_streams(tmp_path_factory):
    report = tmp_path_factory.mktemp("shifted") / "report.json"
    model = Shifted()
    H = residual(2, 3, seed=8)
    (out,), ops, _ = compile_run(model, H, streams=True, report=str(report))
    return model, H, out, ops, json.loads(report.read_text())["families"]["mhc_fold"]


def test_graph_stream_schedule_leaves_an_overlappable_mixes_apart(shifted_with_streams):
    model, H, out, ops, fam = shifted_with_streams
    assert ops[FUSED] == 0 and ops[MIXES] == 2, dict(ops)
    assert [m["check"] for m in fam["near_misses"]] == ["overlappable"]
    assert_close_to(out, float64_reference(model, H), 1e-4)


# (Was a defect while writing this file: the SPEC declared only operand_order / tuple_use; fixed in the tree.)
def test_graph_every_reported_near_miss_is_a_declared_check(shifted_with_streams):
    from dsv41.passes.mhc_fold import SPEC

    declared = {c for chain in SPEC.chains for c in chain.checks}
    *_, fam = shifted_with_streams
    reported = {m["check"] for m in fam["near_misses"]}
    assert reported and reported <= declared, (reported, declared)


class ThreeSitesMixedOrder(nn.Module):
    """Site b's coefficients are first used after the f2 matmul (V4.1's shifted order: overlappable), site c's at
    once by the next collapse (paper order); the second sublayer's output y2 is bf16 while the residual is FP32."""

    def __init__(self, d=32):
        super().__init__()
        g = torch.Generator().manual_seed(10)
        self.a, self.b, self.c = Coefficients(d, g), Coefficients(d, g), Coefficients(d, g)
        self.f1, self.f2, self.f3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, H):
        pre, post, comb = self.a(H)
        H2 = write_back(torch.tanh(self.f1(read_out(H, pre))), H, post, comb)
        pre2, post2, comb2 = self.b(H2)
        y2 = torch.tanh(self.f2(read_out(H2, pre).to(self.f2.weight.dtype))).bfloat16()
        H3 = write_back(y2, H2, post2, comb2)
        pre3, post3, comb3 = self.c(H3)
        return write_back(torch.tanh(self.f3(read_out(H3, pre3))), H3, post3, comb3), pre2


def test_graph_stream_schedule_decides_per_pair(tmp_path):
    report = tmp_path / "report.json"
    model = ThreeSitesMixedOrder()
    H = residual(2, 3, seed=13)
    (out,), ops, _ = compile_run(model, H, streams=True, count_kernels=True, report=str(report))
    assert ops[FUSED] == 1 and ops[MIXES] == 2 and ops[EXPAND] == 2, dict(ops)
    fam = json.loads(report.read_text())["families"]["mhc_fold"]
    assert [m["check"] for m in fam["near_misses"]] == ["overlappable"]
    assert_close_to(out, float64_reference(model, H), 1e-4)


# =========================================================================================== kernel level
def np_reference(y, H, post, comb, fn, base, scale, w=None, iters=ROUNDS, norm_eps=NORM_EPS, hc_eps=HC_EPS):
    """float64 numpy: (H' before rounding, and a function giving (pre, post, comb) of a stored H')."""
    y, H, post, comb = (np.asarray(t.detach().double()) for t in (y, H, post, comb))
    expanded = post[..., :, None] * y[..., None, :] + np.einsum("btij,btid->btjd", comb, H)
    fn, base, scale = (np.asarray(t.double()) for t in (fn, base, scale))
    wv = None if w is None else np.asarray(w.double())

    def coefficients(stored):
        z = np.asarray(stored.double()).reshape(*stored.shape[:2], -1)
        with np.errstate(all="ignore"):
            r = 1.0 / np.sqrt(np.mean(z * z, axis=-1, keepdims=True) + norm_eps)
            m = ((z if wv is None else z * wv) @ fn.T) * r
            sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
            pre = sig(m[..., :4] * scale[0] + base[:4]) + hc_eps
            post2 = 2.0 * sig(m[..., 4:8] * scale[1] + base[4:8])
            lg = (m[..., 8:] * scale[2] + base[8:]).reshape(*m.shape[:-1], 4, 4)
            c = np.exp(lg - lg.max(axis=-1, keepdims=True))
            c = c / c.sum(axis=-1, keepdims=True) + hc_eps
            c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
            for _ in range(iters - 1):
                c = c / (c.sum(axis=-1, keepdims=True) + hc_eps)
                c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
        return pre, post2, c

    return expanded, coefficients


def make_args(b, t, d, dtype=torch.float32, seed=0, weighted=False, y_dtype=None):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(b, t, d, generator=g).to(y_dtype or dtype)
    H = torch.randn(b, t, 4, d, generator=g).to(dtype)
    post = 2 * torch.rand(b, t, 4, generator=g)
    comb = torch.rand(b, t, 4, 4, generator=g) + 0.05
    comb = comb / comb.sum(dim=-2, keepdim=True)
    fn = torch.randn(24, 4 * d, generator=g) * (4 * d) ** -0.5
    base = 0.5 * torch.randn(24, generator=g)
    scale = torch.tensor([0.6, 1.3, 2.7])
    w = (0.5 + torch.rand(4 * d, generator=g)) if weighted else None
    return y, H, post, comb, fn, base, scale, w


def expect_matches(got, args, iters=ROUNDS, allow_nan=False):
    y, H, post, comb, fn, base, scale, w = args
    out, pre, post2, comb2 = got
    assert out.dtype == H.dtype and tuple(out.shape) == tuple(H.shape) and out.is_contiguous()
    for c, shape in ((pre, H.shape[:3]), (post2, H.shape[:3]), (comb2, (*H.shape[:3], 4))):
        assert c.dtype == torch.float32 and tuple(c.shape) == tuple(shape) and c.is_contiguous()
    expanded, coefficients = np_reference(y, H, post, comb, fn, base, scale, w, iters)
    ulp = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[H.dtype]
    pairs = [("H'", out, expanded, 1e-5, ulp + 2e-6)]
    pairs += [(n, g, r, 2e-5, 1e-4) for n, g, r in zip(("pre", "post", "comb"), (pre, post2, comb2),
                                                         coefficients(out))]
    for name, g, r, atol, rtol in pairs:
        g = np.asarray(g.double())
        if allow_nan:
            if name == "H'":  # overflow happens when the value is stored in H's dtype
                r = np.asarray(torch.from_numpy(r).to(H.dtype).double())
            assert np.array_equal(np.isnan(g), np.isnan(r)), f"{name}: NaN where the reference has none, or not"
            assert np.array_equal(np.isposinf(g), np.isposinf(r)) and np.array_equal(np.isneginf(g), np.isneginf(r))
            keep = np.isfinite(r)
            g, r = g[keep], r[keep]
        else:
            assert np.isfinite(g).all(), f"{name}: non-finite value (an element left unwritten?)"
        err = np.abs(g - r)
        assert (err <= atol + rtol * np.abs(r)).all(), f"{name}: worst error {err.max():.3g}"


@pytest.fixture
def poisoned(monkeypatch):
    poison_outputs(monkeypatch, fold_kernels)


@interpreted
@pytest.mark.parametrize("b, t, d, dtype, weighted, split", [
    (1, 1, 1, torch.float32, False, None),
    (2, 1, 7, torch.bfloat16, True, None),
    (1, 2, 65, torch.float32, True, None),
    (1, 1, 65, torch.float16, False, 2),
    (1, 3, 130, torch.bfloat16, False, 3),
    (2, 1, 130, torch.float32, True, 1),
], ids=lambda v: str(v).replace("torch.", ""))
def test_kernel_hidden_sizes_off_the_block(b, t, d, dtype, weighted, split, poisoned):
    args = make_args(b, t, d, dtype, seed=d, weighted=weighted)
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS, args[7], split=split)
    expect_matches(got, args)


@interpreted
def test_kernel_strided_broadcast_and_permuted_inputs(poisoned):
    b, t, d = 2, 3, 48
    g = torch.Generator().manual_seed(3)
    y = torch.randn(b, t, 2 * d, generator=g)[..., ::2]                           # last-dim stride 2
    H = torch.randn(d, 4, t, b, generator=g).to(torch.bfloat16).permute(3, 2, 1, 0)  # stride(-1) != 1
    post = torch.rand(4, t, b, generator=g).permute(2, 1, 0) * 2                  # [B, T, 4], stream-major layout
    raw = torch.rand(b, t, 4, 4, generator=g) + 0.05
    comb = (raw / raw.sum(dim=-2, keepdim=True)).transpose(-1, -2).contiguous().transpose(-1, -2)
    fn = (torch.randn(4 * d, 24, generator=g) * 0.1).t()                          # stride(-1) == 24
    base = torch.randn(48, generator=g)[::2]
    scale = torch.tensor([0.6, 0.0, 1.3, 0.0, 2.7, 0.0])[::2]
    w = (0.5 + torch.rand(8 * d, generator=g))[::2]
    args = (y, H, post, comb, fn, base, scale, w)
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS, w, split=2)
    expect_matches(got, args)


@interpreted
def test_kernel_broadcast_and_row_strided_inputs(poisoned):
    b, t, d = 2, 2, 40
    g = torch.Generator().manual_seed(4)
    y = torch.randn(1, 1, d, generator=g).to(torch.float16).expand(b, t, d)      # strides (0, 0, 1)
    H = torch.randn(b, t, 6, d, generator=g)[:, :, 1:5]                          # streams of a wider buffer
    post = torch.rand(1, t, 4, generator=g).expand(b, t, 4)
    comb = torch.full((b, t, 4, 4), 0.25)
    fn = (torch.randn(24, 8 * d, generator=g) * 0.1)[:, :4 * d]                  # row stride 8d
    base, scale = torch.zeros(24), torch.ones(3)
    args = (y, H, post, comb, fn, base, scale, None)
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS)
    expect_matches(got, args)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_nan_and_inf_propagate_per_row(dtype):
    # Row 0: a NaN in y; row 1: +inf in H; row 2: finite. Splits over channels must not leak one row into another.
    args = make_args(1, 3, 130, dtype, seed=11, weighted=True)
    y, H = args[0], args[1]
    y[0, 0, 5] = float("nan")
    H[0, 1, 2, 129] = float("inf")
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS, args[7], split=3)
    expect_matches(got, args, allow_nan=True)
    assert torch.isfinite(got[1][0, 2]).all() and torch.isfinite(got[3][0, 2]).all()
    assert torch.isnan(got[1][0, 0]).all() and torch.isnan(got[1][0, 1]).all()


@interpreted
def test_kernel_fp16_overflow_to_inf_like_the_reference():
    args = make_args(1, 2, 64, torch.float16, seed=12)
    args[0][0, 1] = 60000.0  # post up to 2: H' overflows fp16 in row 1 only
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS)
    want = fold_kernels.reference_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS)
    assert torch.isinf(got[0][0, 1]).any()
    assert torch.equal(torch.isinf(got[0]), torch.isinf(want[0]))
    for g, r in zip(got[1:], want[1:]):
        assert torch.equal(torch.isnan(g), torch.isnan(r))
    expect_matches(got, args, allow_nan=True)


@interpreted
@pytest.mark.parametrize("iters", [1, 2])
def test_kernel_few_sinkhorn_rounds(iters, poisoned):
    args = make_args(2, 2, 96, torch.float32, seed=13)
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, iters)
    expect_matches(got, args, iters=iters)


@interpreted
@pytest.mark.parametrize("b, t", [(0, 3), (2, 0)])
def test_kernel_zero_rows(b, t):
    args = make_args(b, t, 65, torch.bfloat16, seed=1, weighted=True)
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS, args[7])
    want = fold_kernels.reference_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS, args[7])
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype and g.numel() == 0


@interpreted
def test_kernel_many_rows_one_split_each(poisoned):
    assert fold_kernels.expand_mixes_plan(40, 64)["SPLIT"] == 1
    args = make_args(1, 40, 64, torch.bfloat16, seed=14, y_dtype=torch.float32)
    got = fold_kernels.triton_mhc_expand_mixes(*args[:7], NORM_EPS, HC_EPS, ROUNDS)
    expect_matches(got, args)


# =========================================================================================== errors
def _good(d=16):
    y, H, post, comb, fn, base, scale, w = make_args(1, 2, d, seed=2, weighted=True)
    return dict(y=y, H=H, post=post, comb=comb, fn=fn, base=base, scale=scale, norm_eps=NORM_EPS, hc_eps=HC_EPS,
                iters=ROUNDS, norm_weight=w)


_BAD = {  # case: (changes to the good arguments, exception, words the message must contain)
    "H_3d": (lambda a: dict(H=a["H"][:, :, 0]), ValueError, "H must"),
    "H_3_streams": (lambda a: dict(H=a["H"][:, :, :3]), ValueError, "H must"),
    "H_float64": (lambda a: dict(H=a["H"].double()), TypeError, "H has dtype"),
    "y_wrong_d": (lambda a: dict(y=a["y"][..., :8]), ValueError, "y must"),
    "y_int": (lambda a: dict(y=a["y"].long()), TypeError, "y has dtype"),
    "post_3": (lambda a: dict(post=a["post"][..., :3]), ValueError, "post must"),
    "comb_4x3": (lambda a: dict(comb=a["comb"][..., :3]), ValueError, "comb must"),
    "fn_short": (lambda a: dict(fn=a["fn"][:, :-1]), ValueError, "fn must"),
    "fn_23_rows": (lambda a: dict(fn=a["fn"][:23]), ValueError, "fn must"),
    "fn_bf16": (lambda a: dict(fn=a["fn"].bfloat16()), TypeError, "fn has dtype"),
    "base_23": (lambda a: dict(base=a["base"][:23]), ValueError, "base must"),
    "scale_2": (lambda a: dict(scale=a["scale"][:2]), ValueError, "scale must"),
    "weight_short": (lambda a: dict(norm_weight=a["norm_weight"][:-1]), ValueError, "norm_weight must"),
    "weight_2d": (lambda a: dict(norm_weight=a["norm_weight"].view(4, -1)), ValueError, "norm_weight must"),
    "weight_int": (lambda a: dict(norm_weight=a["norm_weight"].int()), TypeError, "norm_weight has dtype"),
    "iters_0": (lambda a: dict(iters=0), ValueError, "iters"),
    "iters_too_many": (lambda a: dict(iters=5000), ValueError, "iters"),
    "norm_eps_negative": (lambda a: dict(norm_eps=-1e-6), ValueError, "norm_eps"),
    "hc_eps_nan": (lambda a: dict(hc_eps=float("nan")), ValueError, "hc_eps"),
    "fn_on_meta": (lambda a: dict(fn=a["fn"].to("meta")), ValueError, "fn on meta"),
}


# (Not through torch.ops for fn_on_meta: the dispatcher sends a call with a meta tensor to the fake, which does not
# check devices; that is the dispatcher's rule for every custom op.)
@pytest.mark.parametrize("case, entry", [(c, e) for c in _BAD for e in ("op", "reference", "triton")
                                         if (c, e) != ("fn_on_meta", "op")])
def test_errors_name_the_bad_argument(case, entry):
    a = _good()
    change, exc, words = _BAD[case]
    a.update(change(a))
    fn = {"op": torch.ops.dsv41.mhc_expand_mixes, "reference": fold_kernels.reference_mhc_expand_mixes,
          "triton": fold_kernels.triton_mhc_expand_mixes}[entry]
    with pytest.raises(exc, match=words):
        fn(*a.values())


def test_errors_cpu_launch_without_the_interpreter_is_a_runtime_error():
    if IN_INTERPRETER:
        pytest.skip("the interpreter can launch on CPU")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fold_kernels.triton_mhc_expand_mixes(*_good().values())


@pytest.mark.parametrize("split", [0, -3])
def test_errors_plan_rejects_a_split_below_one(split):
    with pytest.raises(ValueError, match="split"):
        fold_kernels.expand_mixes_plan(1, 64, split)


def test_errors_op_registration_passes_opcheck():
    # Schema, fake (incl. non-contiguous H and a bf16 weight), autograd registration and AOT dispatch.
    y, H, post, comb, fn, base, scale, w = make_args(2, 3, 16, torch.bfloat16, seed=3, weighted=True)
    H = H.transpose(0, 1).contiguous().transpose(0, 1)
    for weight in (None, w.bfloat16()):
        result = torch.library.opcheck(torch.ops.dsv41.mhc_expand_mixes.default,
                                       (y, H, post, comb, fn, base, scale, NORM_EPS, HC_EPS, ROUNDS, weight))
        assert set(result.values()) == {"SUCCESS"}, result
