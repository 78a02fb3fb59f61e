"""`moe` family: the MoE router and the MoE tail become dsv41::moe_router / dsv41::moe_combine.

A hand-written zoo (not dsv41/model/moe.py: [B, T, d] activations never flattened, softplus as log1p(exp), sqrt as
`** 0.5`, the temperature as a multiplication, `torch.gather`, experts gathered as a [B, T, k, f, d] stack and
run through einsums, a SiLU-GLU shared expert through `F.linear`) holds every case, compiled once per activation
dtype (module-scoped fixture, debug mode):

    router_a   x W^T * 0.5 -> log1p(exp) ** 0.5 -> topk(s + b) -> gather -> / (sum + 1e-20) * 2.5
                                                            -> moe_router(gate_temp=2, route_scale=2.5)
    tail_a     einsum("btk,btkd->btd", w, y) + shared    (weights applied after w2)
                                                            -> moe_combine(weights=w)
    router_b   F.linear on the flattened x, F.softplus, sqrt, eps 1e-6, no route scale
                                                            -> moe_router(route_scale=1, eps=1e-6)
    tail_b     (y.sum(-2) + shared).to(x.dtype)           (weights applied before w2, the V4.1 order)
                                                            -> moe_combine(weights=None)
    biased     weights gathered from the BIASED scores    -> near-miss router_weights_biased
    softmax    softmax scores instead of sqrt(softplus)   -> near-miss router_scoring
    nonorm     weights not divided by their sum           -> near-miss router_normalisation
    mean       experts averaged instead of summed         -> near-miss moe_combine_mean

References are written here in float64 (plain per-token Python for the router, float64 tensor math for the experts).
The fused ops run their CPU references under the compiled graph; the compiled outputs must equal the references to
FP32 rounding (bf16: a few roundings of the expert GEMMs).

Tensor parallelism: a one-block zoo whose MoE output goes through `_functional_collectives.all_reduce` is compiled in
this process with torch.distributed's single-process "fake" backend (world size 2, the collective returns its input),
which is enough to check that the tail is matched through the collective and that the all-reduce is recorded and
kept right after the op. A real 2-rank gloo run of the sharded model is NOT done here (see tests/test_tp.py for the
spawn machinery; it costs minutes per world size).

The `tiny` model test reads the session's fresh-interpreter dsv41 run of `tiny` (fixture `tiny_dsv41`, every
family on) and checks one router and one tail per MoE layer (8 + 8), that the chains' ops are gone from the
post-pass graph, and that the logits and tokens match eager.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("dsv41.kernels.moe", reason="dsv41.kernels.moe (the fused ops) is not importable")
import dsv41.kernels.moe  # noqa: E402,F401
from zoo_sites import site_markers, site_of  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after, ops_between  # noqa: E402

_OPS = ("moe_router", "moe_combine")
if not all(hasattr(torch.ops.dsv41, op) for op in _OPS):
    pytest.skip(f"dsv41 ops {_OPS} are not all registered", allow_module_level=True)

SITES = site_markers(__file__)

D, F_INTER, E, K = 32, 16, 8, 3


# ------------------------------------------------------------------------------------------- float64 references
def ref_router(x, W, bias, k, temp, scale, eps, scoring="sqrtsoftplus"):
    """(weights [.., k] float64, ids [.., k] int64) per token in plain Python (MODEL.md §2.9 steps 1-4)."""
    lead = x.shape[:-1]
    xs = x.double().reshape(-1, x.shape[-1]).tolist()
    w_rows = W.double().tolist()
    b = bias.double().tolist()
    ws, ids = [], []
    for row in xs:
        logits = [sum(a * c for a, c in zip(row, wr)) / temp for wr in w_rows]
        s = [math.sqrt(math.log1p(math.exp(v))) for v in logits]
        order = sorted(range(len(s)), key=lambda e: (-(s[e] + b[e]), e))[:k]
        tot = sum(s[e] for e in order)
        ws.append([s[e] / (tot + eps) * scale for e in order])
        ids.append(order)
    return (torch.tensor(ws, dtype=torch.float64).reshape(*lead, k),
            torch.tensor(ids, dtype=torch.int64).reshape(*lead, k))


def ref_experts(x, ids, w, W1, W3, W2, weight_before_w2):
    """y [.., k, d] float64 of the gathered experts; h weighted before w2 when `weight_before_w2`."""
    xd = x.double()
    a = torch.einsum("btd,btkfd->btkf", xd, W1.double()[ids])
    b = torch.einsum("btd,btkfd->btkf", xd, W3.double()[ids])
    h = F.silu(a) * b
    if weight_before_w2:
        h = h * w.double()[..., None]
    return torch.einsum("btkf,btkdf->btkd", h, W2.double()[ids])


def ref_shared(x, S1, S3, S2):
    xd = x.double()
    return (F.silu(xd @ S1.double().t()) * (xd @ S3.double().t())) @ S2.double().t()


# ------------------------------------------------------------------------------------------- zoo
def sqrt_softplus_router(x, W, bias, k):
    """router_a's spelling: 3-D x, temperature as * 0.5, log1p(exp), ** 0.5, torch.gather, route scale 2.5."""
    logits = torch.matmul(x.float(), W.float().transpose(0, 1)) * 0.5
    s = torch.log1p(torch.exp(logits)) ** 0.5
    _, idx = torch.topk(s + bias, k, dim=-1)
    g = torch.gather(s, -1, idx)
    return g / (g.sum(-1, keepdim=True) + 1e-20) * 2.5, idx


def flat_router(x, W, bias, k, variant=""):
    """router_b's spelling: flattened tokens, F.linear, F.softplus, sqrt, eps 1e-6, no route scale; look-alikes."""
    b, t, d = x.shape
    logits = F.linear(x.reshape(b * t, d).float(), W.float())
    s = torch.softmax(logits, -1) if variant == "softmax" else torch.sqrt(F.softplus(logits))
    sel = s + bias
    idx = sel.topk(k, dim=-1).indices
    g = (sel if variant == "biased" else s).gather(1, idx)
    if variant == "nonorm":
        return (g * 1.5).view(b, t, k), idx.view(b, t, k)
    return (g / (g.sum(-1, keepdim=True) + 1e-6)).view(b, t, k), idx.view(b, t, k)


def experts(x, idx, w, W1, W3, W2, weight_before_w2):
    """Gathered-stack experts (SiLU-GLU, no clamps) computed in FP32; y [B, T, k, d] in FP32."""
    xf = x.float()
    a = torch.einsum("btd,btkfd->btkf", xf, W1[idx].float())
    g = torch.einsum("btd,btkfd->btkf", xf, W3[idx].float())
    h = F.silu(a) * g
    if weight_before_w2:
        h = h * w.unsqueeze(-1)
    return torch.einsum("btkf,btkdf->btkd", h, W2[idx].float())


def shared_expert(x, S1, S3, S2):
    xf = x.float()
    return F.linear(F.silu(F.linear(xf, S1.float())) * F.linear(xf, S3.float()), S2.float())


class MoeZoo(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for blk in ("a", "b"):
            self.register_buffer(f"gate_{blk}", (torch.randn(E, D, generator=g) / math.sqrt(D)).to(dtype))
            self.register_buffer(f"bias_{blk}", torch.randn(E, generator=g) * 0.05)
            self.register_buffer(f"w1_{blk}", (torch.randn(E, F_INTER, D, generator=g) / math.sqrt(D)).to(dtype))
            self.register_buffer(f"w3_{blk}", (torch.randn(E, F_INTER, D, generator=g) / math.sqrt(D)).to(dtype))
            self.register_buffer(f"w2_{blk}", (torch.randn(E, D, F_INTER, generator=g) / math.sqrt(F_INTER)).to(dtype))
            self.register_buffer(f"s1_{blk}", (torch.randn(F_INTER, D, generator=g) / math.sqrt(D)).to(dtype))
            self.register_buffer(f"s3_{blk}", (torch.randn(F_INTER, D, generator=g) / math.sqrt(D)).to(dtype))
            self.register_buffer(f"s2_{blk}", (torch.randn(D, F_INTER, generator=g) / math.sqrt(F_INTER)).to(dtype))

    def forward(self, x, x2):
        wa, ia = sqrt_softplus_router(x, self.gate_a, self.bias_a, K)  # site:router_a
        ya = experts(x, ia, wa, self.w1_a, self.w3_a, self.w2_a, False)
        out_a = torch.einsum("btk,btkd->btd", wa, ya) + shared_expert(x, self.s1_a, self.s3_a, self.s2_a)  # site:tail_a
        wb, ib = flat_router(x2, self.gate_b, self.bias_b, K)  # site:router_b
        yb = experts(x2, ib, wb, self.w1_b, self.w3_b, self.w2_b, True)
        sb = shared_expert(x2, self.s1_b, self.s3_b, self.s2_b)
        out_b = (yb.sum(-2) + sb).to(x.dtype)  # site:tail_b
        mean = yb.mean(-2) + sb  # site:mean
        biased = flat_router(x2, self.gate_b, self.bias_b, K, "biased")  # site:biased
        soft = flat_router(x2, self.gate_b, self.bias_b, K, "softmax")  # site:softmax
        nonorm = flat_router(x2, self.gate_b, self.bias_b, K, "nonorm")  # site:nonorm
        return wa, ia, out_a, wb, ib, out_b, mean, biased, soft, nonorm


DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module", params=DTYPES)
def compiled_zoo(request):
    """((dtype, inputs (x, x2), module, compiled outputs, report).

    The second block reads its own input x2: Inductor does not emulate a bf16 rounding between two fused kernels
    (`emulate_precision_casts` is off), so a block fed with `out_a.to(bf16)` would see unrounded values and could
    not be compared with a reference computed from the rounded output, post-pass GraphModules)."""
    import dsv41

    dtype = getattr(torch, request.param)
    gen = torch.Generator().manual_seed(1)
    xs = (torch.randn(2, 3, D, generator=gen).to(dtype), torch.randn(2, 3, D, generator=gen).to(dtype))
    model = MoeZoo(dtype)
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(*xs)
    return (request.param, xs, model, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(dtype, inputs (x, x2), module, compiled outputs, report).

    The second block reads its own input x2: Inductor does not emulate a bf16 rounding between two fused kernels
    (`emulate_precision_casts` is off), so a block fed with `out_a.to(bf16)` would see unrounded values and could
    not be compared with a reference computed from the rounded output."""
    return compiled_zoo[0]



def _fam(report):
    return report.to_dict()["families"]["moe"]


def _site_of(s, fn="forward"):
    return site_of(s, __file__, SITES, fn)


# ------------------------------------------------------------------------------------------- zoo tests
def test_each_moe_chain_is_fused_once_with_its_constants(zoo):
    *_, report = zoo
    fam = _fam(report)
    got = sorted((_site_of(s), s["pattern"]) for s in fam["sites"])
    assert got == sorted([("router_a", "moe_router"), ("tail_a", "moe_combine"), ("router_b", "moe_router"),
                          ("tail_b", "moe_combine")])
    det = {_site_of(s): s["detail"] for s in fam["sites"]}
    assert det["router_a"]["gate_temp"] == 2.0 and det["router_a"]["route_scale"] == 2.5
    assert det["router_a"]["norm_eps"] == 1e-20 and det["router_a"]["k"] == K and det["router_a"]["bias"] is True
    assert det["router_b"]["gate_temp"] == 1.0 and det["router_b"]["route_scale"] == 1.0
    assert det["router_b"]["norm_eps"] == 1e-6
    assert det["tail_a"]["weights"] == "in the tail" and det["tail_a"]["reduction"] == "bmm"
    assert det["tail_b"]["weights"] == "before w2 (in h)" and det["tail_b"]["reduction"] == "sum"
    assert det["tail_b"]["out_dtype"] == zoo[0]


def test_look_alikes_are_near_misses_naming_the_failed_check(zoo):
    *_, report = zoo
    misses = {_site_of(m): m for m in _fam(report)["near_misses"]}
    assert set(misses) == {"biased", "softmax", "nonorm", "mean"}
    assert misses["biased"]["check"] == "router_weights_biased" and "BIASED" in misses["biased"]["reason"]
    assert misses["softmax"]["check"] == "router_scoring" and "softmax" in misses["softmax"]["reason"]
    assert misses["nonorm"]["check"] == "router_normalisation"
    assert misses["mean"]["check"] == "moe_combine_mean" and "AVERAGED" in misses["mean"]["reason"]


def test_compiled_zoo_equals_float64_references(zoo):
    name, (x, x2), m, out, _ = zoo
    wa, ia, out_a, wb, ib, out_b, mean, biased, soft, nonorm = out
    rwa, ria = ref_router(x, m.gate_a, m.bias_a, K, 2.0, 2.5, 1e-20)
    assert torch.equal(ia, ria) and wa.dtype == torch.float32
    assert torch.allclose(wa.double(), rwa, rtol=1e-5, atol=1e-6)
    ya = ref_experts(x, ia, wa, m.w1_a, m.w3_a, m.w2_a, False)
    want_a = torch.einsum("btk,btkd->btd", wa.double(), ya) + ref_shared(x, m.s1_a, m.s3_a, m.s2_a)
    assert torch.allclose(out_a.double(), want_a, rtol=1e-4, atol=1e-5)
    rwb, rib = ref_router(x2, m.gate_b, m.bias_b, K, 1.0, 1.0, 1e-6)
    assert torch.equal(ib, rib) and torch.allclose(wb.double(), rwb, rtol=1e-5, atol=1e-6)
    yb = ref_experts(x2, ib, wb, m.w1_b, m.w3_b, m.w2_b, True)
    sb = ref_shared(x2, m.s1_b, m.s3_b, m.s2_b)
    tol = dict(rtol=1e-4, atol=1e-5) if name == "float32" else dict(rtol=2 ** -7, atol=2e-3)
    assert out_b.dtype == x.dtype and torch.allclose(out_b.double(), yb.sum(-2) + sb, **tol)
    # The look-alikes kept their own meaning (left unfused).
    assert torch.allclose(mean.double(), yb.mean(-2) + sb, rtol=1e-4, atol=1e-5)
    s_b = torch.sqrt(F.softplus(x2.double().reshape(-1, D) @ m.gate_b.double().t())).reshape(2, 3, E)
    assert torch.allclose(nonorm[0].double(), 1.5 * s_b.gather(-1, nonorm[1]), rtol=1e-5, atol=1e-6)
    assert float((biased[0].sum(-1) - 1).abs().max()) < 1e-5


def test_fused_chains_are_gone_from_post_pass_graph(zoo, zoo_after):
    *_, report = zoo
    (graph,) = report.graphs
    ops = ops_after(zoo_after)
    assert ops["dsv41.moe_router.default"] == 2
    assert ops["dsv41.moe_combine.default"] == 2
    assert ops["aten.topk.default"] == 3  # the three look-alike routers
    defined = {n.name for n in zoo_after.graph.nodes}
    for rec in graph.records:
        if rec.family == "moe":
            for mt in rec.matches:
                assert mt.nodes_replaced and not defined & set(mt.nodes_replaced), mt.pattern
                if mt.pattern == "moe_router":
                    assert {"aten.topk.default", "aten.gather.default", "aten.mm.default"} <= set(mt.ops_replaced)


def test_moe_bytes_are_symbolic_and_shrink(zoo):
    import sympy

    *_, report = zoo
    B, L = sympy.symbols("B L", positive=True, integer=True)
    for s in _fam(report)["sites"]:
        before = sympy.sympify(s["bytes_before"], locals={"B": B, "L": L})
        assert B in before.free_symbols
        assert s["bytes_before_value"] > s["bytes_after_value"] > 0


def test_family_switched_off_shows_off_and_leaves_the_chains():
    import dsv41

    m = MoeZoo(torch.float32)
    x = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        torch.compile(lambda x: sqrt_softplus_router(x, m.gate_a, m.bias_a, K), backend="dsv41",
                      options={"disable": ["moe"], "debug": True})(x)
    rep = dsv41.last_report()
    fam = _fam(rep)
    assert fam["enabled"] is False and fam["matches"] == 0
    ops = ops_after(graphs)
    assert [op for op in ops if op.startswith("dsv41.moe")] == [] and ops["aten.topk"] > 0


# ------------------------------------------------------------------------------------------- tensor parallelism
def tp_block(x, m, group):
    """One MoE block whose output is all-reduced over `group` (the hook of dsv41/model/tp.py, written inline)."""
    import torch.distributed._functional_collectives as funcol

    w, idx = flat_router(x, m.gate_b, m.bias_b, K)
    y = experts(x, idx, w, m.w1_b, m.w3_b, m.w2_b, True)
    out = (y.sum(-2) + shared_expert(x, m.s1_b, m.s3_b, m.s2_b)).to(x.dtype)  # site:tp_tail
    return funcol.all_reduce(out, "sum", group)


def test_tail_is_matched_through_the_all_reduce_of_tensor_parallelism():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dsv41

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        m = MoeZoo(torch.float32)
        x = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(3))
        group = dist.group.WORLD
        torch._dynamo.reset()
        with torch.no_grad(), capture_graphs() as graphs:
            eager = tp_block(x, m, group)
            got = torch.compile(lambda x: tp_block(x, m, group), backend="dsv41", options={"debug": True},
                                fullgraph=True)(x)
        rep = dsv41.last_report()
    finally:
        dist.destroy_process_group()
    fam = _fam(rep)
    tails = [s for s in fam["sites"] if s["op"] == "dsv41::moe_combine"]
    assert len(tails) == 1 and tails[0]["pattern"] == "moe_combine -> all_reduce"
    assert "kept right after the op" in tails[0]["detail"]["all_reduce"]
    assert sum(s["op"] == "dsv41::moe_router" for s in fam["sites"]) == 1
    (gm,) = graphs
    # The collective reads the fused tail, and only views stand between them.
    (reduce,) = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default)
    between = ops_between(gm, "dsv41.moe_combine", "_c10d_functional.all_reduce")
    assert all(op.split(".")[1] in ("view", "reshape", "_unsafe_view") for op in between), between
    arg = reduce.args[0]
    while arg.target is not torch.ops.dsv41.moe_combine.default:
        assert arg.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default), gm.code
        arg = arg.args[0]
    assert torch.allclose(got, eager, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- tiny model
def test_tiny_decode_fuses_one_router_and_one_tail_per_moe_layer(tiny_dsv41, tiny_model):
    # Session fixture: the fresh-interpreter dsv41 run of `tiny` (tests/fresh_tiny_dsv41.py, 32 decode steps).
    report = tiny_dsv41["report"]
    layers = tiny_model.config.num_hidden_layers
    fam = report["families"]["moe"]
    counts = {}
    for s in fam["sites"]:
        counts[s["pattern"]] = counts.get(s["pattern"], 0) + 1
    assert counts == {"moe_router": layers, "moe_combine": layers}
    assert fam["near_misses"] == []
    cfg = tiny_model.config
    for s in fam["sites"]:
        if s["pattern"] == "moe_router":
            d = s["detail"]
            assert (d["k"], d["experts"], d["route_scale"], d["gate_temp"]) == (
                cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.routed_scaling_factor, cfg.gate_temp)
        else:
            assert s["detail"]["weights"] == "before w2 (in h)"
    (graph,) = report["graphs"]
    after = graph["graph_after"]
    ops_before, ops = ops_after(graph["graph_before"]), ops_after(after)  # the JSON report keeps printed code only
    # One top-k and one gather of the scores per MoE layer are gone (the indexer keeps its own selection ops).
    for op in ("aten.topk.default", "aten.gather.default"):
        assert ops_before[op] - ops[op] == layers, op
    assert ops["dsv41.moe_router.default"] == layers
    assert ops["dsv41.moe_combine.default"] == layers
    defined = set(re.findall(r"^\s+(\w+) = ", after, flags=re.M))
    for rec in graph["records"]:
        if rec["family"] == "moe":
            for mt in rec["matches"]:
                assert not defined & set(mt["nodes_replaced"]), mt["pattern"]
    # Logits: the fused ops run the model's own math on CPU (the tail adds in the eager order, Inductor's addmm
    # folding undone); FP32 activations agree to FP32 rounding through 8 layers (bound 1e-4 of the largest logit).
    assert tiny_dsv41["max_rel_logit_error"] < 1e-4
    assert tiny_dsv41["compiled_tokens"] == tiny_dsv41["eager_tokens"]
