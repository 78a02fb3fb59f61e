"""`sparse_attention` family: attention over [FP8 window ; gathered FP4 bank rows] with sink -> one dsv41 op.

A hand-written zoo (not dsv41/model/attention.py: the window codes are concatenated BEFORE dequantisation, UE8M0
scales through `exp2`, the bank gathered at `where(idx < 0, 0, idx)` and decoded with arithmetic E2M1 instead of
bit tricks, `torch.matmul` products instead of einsum, `masked_fill(~ok)`, an explicit max / exp / sum softmax with
the sink in the denominator, a strided-slice inverse RoPE, 3 heads) holds every case, compiled once per activation
dtype (module-scoped fixture, debug mode):

    sparse      the V4.1 chain                                        -> sparse_fp4_attention (sink)
    plain       the same without a sink (plain softmax)               -> sparse_fp4_attention with sink = -inf
    sinkbias    the sink added to every score (softmax ignores it)    -> near-miss attention_sink
    ue8m0       bank rows with UE8M0 scales per 32 (index-key format) -> near-miss bank_format
    fwdrope     output rotated by +angle                              -> near-miss inverse_rope
    nopevalues  values = keys with the RoPE channels zeroed (MLA-like) -> near-miss attention_values

References are written here in float64. The fused op runs its CPU reference under the compiled graph, so compiled
outputs equal the float64 references to FP32 rounding (bf16: one rounding of the output).

The `tiny` test reads the session's fresh-interpreter dsv41 run (fixture `tiny_dsv41`): the family fuses one site
per attention layer (roles full / reindex / reuse with their bank; the SWA-only layers over the window alone),
reported per role through each match's module path, and the compiled model equals eager for the 40-token prompt and for a
5-token prompt (below the window 16 and top-k 8, crossing both) decoded by the same compiled graph, without a
recompile.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

pytest.importorskip("dsv41.kernels.sparse_attention", reason="dsv41.kernels.sparse_attention is not importable")
import dsv41.kernels.sparse_attention  # noqa: E402,F401
from dsv41.model.formats import quantize_fp4_e4m3_1x16, quantize_fp4_ue8m0_1x32, quantize_fp8_1x32  # noqa: E402
from zoo_sites import site_markers, site_of  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

SITES = site_markers(__file__)
B, T, H, D, R, W, N, K = 2, 1, 3, 64, 16, 8, 24, 6


# ------------------------------------------------------------------------------------------- zoo
def window_keys(codes, scales):
    """FP8 E4M3 x 2^(e - 127) per 32 channels, spelled with exp2 and repeat_interleave."""
    return codes.view(torch.float8_e4m3fn).float() * torch.exp2(scales.float() - 127.0).repeat_interleave(32, -1)


def e2m1(nib):
    mag, neg = nib & 7, (nib & 8) != 0
    e, m = (mag >> 1).float(), (mag & 1).float()
    val = torch.where(e == 0, m * 0.5, (2.0 + m) * torch.pow(2.0, e - 2.0))
    return torch.where(neg, -val, val)


def bank_rows(codes, scales, idx, ue8m0=False):
    b = idx.shape[0]
    bidx = torch.arange(b, device=idx.device).view(b, 1, 1)
    safe = torch.where(idx < 0, torch.zeros_like(idx), idx)
    packed, sc = codes[bidx, safe], scales[bidx, safe]
    vals = e2m1(torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).to(torch.int32))
    mult = torch.exp2(sc.float() - 127.0) if ue8m0 else sc.view(torch.float8_e4m3fn).float()
    return vals * mult.repeat_interleave(vals.shape[-1] // mult.shape[-1], -1)


def derotate(o, cos, sin, forward=False):
    r = 2 * cos.shape[-1]
    head, tail = o[..., :-r], o[..., -r:].float()
    re_, im = tail[..., 0::2], tail[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if forward:  # the look-alike: rotation by +angle
        out = torch.stack((re_ * c - im * s, im * c + re_ * s), -1).flatten(-2)
    else:
        out = torch.stack((re_ * c + im * s, im * c - re_ * s), -1).flatten(-2)
    return torch.cat((head, out.to(o.dtype)), -1)


def attend(q, ring_codes, ring_scales, new_codes, new_scales, ok, bank_codes, bank_scales, idx, sink, cos, sin,
           mode="sink", ue8m0=False):
    dh = q.shape[-1]
    keys = window_keys(torch.cat([ring_codes, new_codes], 1), torch.cat([ring_scales, new_scales], 1))
    bank = bank_rows(bank_codes, bank_scales, idx, ue8m0)
    qf = q.float()
    s_win = torch.matmul(qf, keys[:, None].transpose(-1, -2)) / math.sqrt(dh)
    s_win = s_win.masked_fill(~ok[:, :, None, :], float("-inf"))
    s_bank = torch.matmul(qf, bank.transpose(-1, -2)) / math.sqrt(dh)
    s_bank = s_bank.masked_fill((idx < 0)[:, :, None, :], float("-inf"))
    s = torch.cat([s_win, s_bank], -1)
    if mode in ("sink", "nope"):
        top = torch.maximum(s.amax(-1), sink.view(1, 1, -1))
        e = torch.exp(s - top[..., None])
        p = e / (e.sum(-1) + torch.exp(sink.view(1, 1, -1) - top))[..., None]
    elif mode == "bias":  # the look-alike: the sink shifts every score, which softmax ignores
        p = torch.softmax(s + sink.view(1, 1, -1, 1), -1)
    else:
        p = torch.softmax(s, -1)
    nw = keys.shape[1]
    vkeys, vbank = keys, bank
    if mode == "nope":  # the look-alike: values without the RoPE channels (V != K)
        vkeys = torch.cat((keys[..., :-2 * cos.shape[-1]], torch.zeros_like(keys[..., -2 * cos.shape[-1]:])), -1)
        vbank = torch.cat((bank[..., :-2 * cos.shape[-1]], torch.zeros_like(bank[..., -2 * cos.shape[-1]:])), -1)
    o = torch.matmul(p[..., :nw], vkeys[:, None]) + torch.matmul(p[..., nw:], vbank)
    return o.to(q.dtype)


class SparseZoo(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for k in "abcdef":
            self.register_buffer(f"sink_{k}", torch.randn(H, generator=g))

    def forward(self, qs, ring_codes, ring_scales, new_codes, new_scales, ok, bank_codes, bank_scales, bank_s32, idx,
                cos, sin):
        w = (ring_codes, ring_scales, new_codes, new_scales, ok)
        a = derotate(attend(qs[0], *w, bank_codes, bank_scales, idx[0], self.sink_a, cos, sin), cos, sin)  # site:sparse
        b = derotate(attend(qs[1], *w, bank_codes, bank_scales, idx[1], self.sink_b, cos, sin, "plain"), cos, sin)  # site:plain
        c = derotate(attend(qs[2], *w, bank_codes, bank_scales, idx[2], self.sink_c, cos, sin, "bias"), cos, sin)  # site:sinkbias
        d = derotate(attend(qs[3], *w, bank_codes, bank_s32, idx[3], self.sink_d, cos, sin, ue8m0=True), cos, sin)  # site:ue8m0
        e = derotate(attend(qs[4], *w, bank_codes, bank_scales, idx[4], self.sink_e, cos, sin), cos, sin, True)  # site:fwdrope
        f = derotate(attend(qs[5], *w, bank_codes, bank_scales, idx[5], self.sink_f, cos, sin, "nope"), cos, sin)  # site:nopevalues
        return a, b, c, d, e, f


def make_inputs(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    qs = torch.randn(6, B, T, H, D, generator=g).to(dtype)
    rc, rs = quantize_fp8_1x32(torch.randn(B, W, D, generator=g))
    nc, ns = quantize_fp8_1x32(torch.randn(B, T, D, generator=g))
    ok = torch.rand(B, T, W + T, generator=g) < 0.6
    ok[..., -1] = True  # the current token sees itself
    lat = torch.randn(B, N, D, generator=g)
    bc, bs = quantize_fp4_e4m3_1x16(lat)
    _, bs32 = quantize_fp4_ue8m0_1x32(lat)
    idx = torch.randint(0, N, (6, B, T, K), generator=g)
    idx = torch.where(torch.rand(6, B, T, K, generator=g) < 0.3, torch.full_like(idx, -1), idx)
    ang = torch.rand(B, T, R // 2, generator=g) * 6.283
    return qs, rc, rs, nc, ns, ok, bc, bs, bs32, idx, ang.cos(), ang.sin()


# ------------------------------------------------------------------------------------------- float64 reference
def ref_site(q, rc, rs, nc, ns, ok, bc, bs, idx, sink, cos, sin):
    """float64 MODEL.md §2.4 steps 3-6 for one site (sink None: plain softmax); rounded to q.dtype like the op."""
    codes, scales = torch.cat([rc, nc], 1), torch.cat([rs, ns], 1)
    keys = (codes.view(torch.float8_e4m3fn).double().view(B, -1, D // 32, 32)
            * torch.exp2(scales.double() - 127)[..., None]).view(B, -1, D).to(q.dtype).double()
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    nib = torch.stack((bc & 15, bc >> 4), -1).flatten(-2).long()
    val = torch.where((nib & 8) != 0, -table[nib & 7], table[nib & 7])
    bank = (val.view(B, N, D // 16, 16) * bs.view(torch.float8_e4m3fn).double()[..., None]).view(B, N, D)
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            rows = [keys[b, s] for s in range(keys.shape[1]) if ok[b, t, s]] + [bank[b, j] for j in idx[b, t] if j >= 0]
            kv = torch.stack(rows)
            s = q[b, t].double() @ kv.T / math.sqrt(D)
            m = s.max(-1).values if sink is None else torch.maximum(s.max(-1).values, sink.double())
            e = torch.exp(s - m[:, None])
            den = e.sum(-1) + (0 if sink is None else torch.exp(sink.double() - m))
            out[b, t] = e @ kv / den[:, None]
    o = out.to(q.dtype).double()
    re_, im = o[..., -R::2].clone(), o[..., -R + 1::2].clone()
    c, s_ = cos.double()[:, :, None], sin.double()[:, :, None]
    o[..., -R::2], o[..., -R + 1::2] = re_ * c + im * s_, im * c - re_ * s_
    return o


# ------------------------------------------------------------------------------------------- fixtures
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module", params=DTYPES)
def compiled_zoo(request):
    """((dtype name, inputs, module, compiled outputs, report), post-pass GraphModules)."""
    import dsv41

    dtype = getattr(torch, request.param)
    inputs = make_inputs(dtype)
    model = SparseZoo()
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(*inputs)
    return (request.param, inputs, model, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(dtype name, inputs, module, compiled outputs, report)."""
    return compiled_zoo[0]



def _records(report, family="sparse_attention"):
    return [r for g in report.graphs for r in g.records if r.family == family]


def _site_of(rec_dict):
    return site_of(rec_dict, __file__, SITES)


def _loc_dict(loc):
    return None if loc is None else {"stack": list(loc.stack)}


# ------------------------------------------------------------------------------------------- zoo tests
def test_sparse_attention_sites_are_fused_with_their_constants(zoo):
    *_, report = zoo
    matches = [m for r in _records(report) for m in r.matches]
    got = sorted(_site_of({"location": _loc_dict(m.location)}) for m in matches)
    assert got == ["plain", "sparse"]
    details = {_site_of({"location": _loc_dict(m.location)}): dict(m.detail) for m in matches}
    for name, sink in (("sparse", True), ("plain", False)):
        dt = details[name]
        assert dt["sink"] is sink and dt["heads"] == H and dt["head_dim"] == D and dt["topk"] == K
        assert dt["window_rows"] == W + T and dt["window_parts"] == 1 and dt["rope_dim"] == R
        assert dt["softmax_scale"] == pytest.approx(D ** -0.5) and dt["mask"] == "inverted"


def test_look_alikes_are_near_misses_naming_the_failed_check(zoo):
    *_, report = zoo
    misses = {_site_of({"location": _loc_dict(n.location)}): n for r in _records(report) for n in r.near_misses}
    assert set(misses) == {"sinkbias", "ue8m0", "fwdrope", "nopevalues"}
    assert misses["sinkbias"].check == "attention_sink" and "denominator" in misses["sinkbias"].reason
    assert misses["ue8m0"].check == "bank_format" and "UE8M0" in misses["ue8m0"].reason
    assert misses["fwdrope"].check == "inverse_rope" and "+angle" in misses["fwdrope"].reason
    assert misses["nopevalues"].check == "attention_values"


def test_compiled_zoo_equals_float64_references(zoo):
    name, inputs, model, out, _ = zoo
    qs, rc, rs, nc, ns, ok, bc, bs, bs32, idx, cos, sin = inputs
    tol = dict(rtol=1e-5, atol=1e-5) if name == "float32" else dict(rtol=2 ** -7, atol=1e-3)
    for i, sink in ((0, model.sink_a), (1, None)):
        want = ref_site(qs[i], rc, rs, nc, ns, ok, bc, bs, idx[i], sink, cos, sin)
        assert out[i].dtype == qs.dtype and torch.allclose(out[i].double(), want, **tol), i
    # The near-miss sites were left to Inductor and kept their own (different) meaning (bf16: Inductor's CPU code
    # rounds its fused intermediates differently from eager, so a few ulps).
    with torch.no_grad():
        eager = model(*inputs)
    loose = tol if name == "float32" else dict(rtol=2 ** -5, atol=2e-2)
    for i in (2, 3, 4, 5):
        assert torch.allclose(out[i].double(), eager[i].double(), **loose), i


def test_fused_chains_are_gone_from_post_pass_graph(zoo, zoo_after):
    *_, report = zoo
    assert ops_after(zoo_after)["dsv41.sparse_fp4_attention.default"] == 2
    defined = {n.name for n in zoo_after.graph.nodes}
    for rec in _records(report):
        for mt in rec.matches:
            assert mt.nodes_replaced and not defined & set(mt.nodes_replaced)
            assert "aten.bmm.default" in mt.ops_replaced and "aten.index.Tensor" in mt.ops_replaced


def test_sparse_attention_bytes_are_symbolic_and_shrink(zoo):
    import sympy

    *_, report = zoo
    for rec in _records(report):
        for mt in rec.matches:
            before, after = mt.bytes_exprs()
            assert sympy.Symbol("B", positive=True, integer=True) in before.free_symbols
            assert dict(mt.symbols) == {"B": B, "L": T}
            bv, av = mt.bytes_evaluated()
            assert bv > av > 0


def test_family_switched_off_shows_off_and_leaves_the_chains():
    import dsv41

    inputs = make_inputs(torch.float32, seed=2)
    model = SparseZoo()

    def one_site(qs, rc, rs, nc, ns, ok, bc, bs, bs32, idx, cos, sin):
        return derotate(attend(qs[0], rc, rs, nc, ns, ok, bc, bs, idx[0], model.sink_a, cos, sin), cos, sin)

    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        torch.compile(one_site, backend="dsv41", options={"disable": ["sparse_attention"], "debug": True})(*inputs)
    rep = dsv41.last_report()
    recs = _records(rep)
    assert recs and all(r.enabled is False and not r.matches for r in recs)
    ops = ops_after(graphs)
    assert ops["dsv41.sparse_fp4_attention"] == 0 and ops["aten.bmm"] > 0


# ------------------------------------------------------------------------------------------- tiny model
def _layer_of(module_path: str):
    m = re.search(r"layers\D+(\d+)", module_path or "")
    return int(m.group(1)) if m else None


def test_tiny_fuses_every_sparse_attention_layer_and_matches_eager(tiny_dsv41, tiny_model):
    cfg = tiny_model.config
    # Expected from the config roles (MODEL.md §2.5): every backbone layer attends once per decode step. Layers
    # whose role is not `swa` read a bank (top-k slots); `swa` layers attend over the window alone and get the same
    # op with an empty bank (tiny: roles swa, swa, full, reuse, full, reuse, reindex, reuse -> 6 + 2).
    roles = [cfg.layer_role(i) for i in range(cfg.num_hidden_layers)]
    report = tiny_dsv41["report"]
    fam = report["families"]["sparse_attention"]
    assert fam["enabled"] and fam["matches"] == len(roles)
    assert fam["near_misses"] == []
    per_role: dict = {}
    for s in fam["sites"]:
        layer = _layer_of(s["detail"]["module"])
        role = roles[layer] if layer is not None else "?"
        per_role.setdefault(role, []).append(layer)
        assert s["location"]["file"].endswith("attention.py")
        assert s["detail"]["heads"] == cfg.num_attention_heads and s["detail"]["head_dim"] == cfg.head_dim
        banked = role != "swa"
        assert s["detail"]["bank"] is banked
        assert s["detail"]["topk"] == (cfg.index_topk if banked else 0)
        # The ring and the step's own row, read as two parts (no concatenated copy).
        assert s["detail"]["window_rows"] == cfg.sliding_window + 1 and s["detail"]["window_parts"] == 2
        assert s["detail"]["sink"] is True and s["detail"]["softmax_scale"] == pytest.approx(cfg.head_dim ** -0.5)
    want = {}
    for i, r in enumerate(roles):
        want.setdefault(r, []).append(i)
    assert {r: sorted(v) for r, v in per_role.items()} == want
    (graph,) = report["graphs"]
    assert ops_after(graph)["dsv41.sparse_fp4_attention.default"] == len(roles)  # printed code in the JSON
    # Long prompt (40 tokens > window 16 > top-k 8) and short prompt (5 tokens, 12 new: starts below both).
    assert tiny_dsv41["compiled_tokens"] == tiny_dsv41["eager_tokens"]
    assert tiny_dsv41["max_rel_logit_error"] < 1e-4
    assert tiny_dsv41["short_prompt_len"] < min(cfg.sliding_window, cfg.index_topk)
    assert tiny_dsv41["short_compiled_tokens"] == tiny_dsv41["short_eager_tokens"]
    assert tiny_dsv41["short_teacher_forced_argmax_equal"]
    assert tiny_dsv41["short_max_rel_logit_error"] < 1e-4
    # The decode graph is static: the short run reuses it (no recompile).
    assert tiny_dsv41["short_new_graphs"] == 0


def test_missing_inverse_rope_near_miss_says_what_the_search_saw():
    """Without the de-rotation the site is an `output_rope` near-miss whose text shows the forward walk and the
    candidate ends (what a device-specific graph difference would be diagnosed from)."""
    import dsv41

    inputs = make_inputs(torch.float32, seed=4)
    model = SparseZoo()

    def no_rope(qs, rc, rs, nc, ns, ok, bc, bs, bs32, idx, cos, sin):
        return attend(qs[0], rc, rs, nc, ns, ok, bc, bs, idx[0], model.sink_a, cos, sin) * 2.0

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(no_rope, backend="dsv41")(*inputs)
    recs = _records(dsv41.last_report())
    misses = [m for r in recs for m in r.near_misses]
    assert recs and not any(r.matches for r in recs)
    assert [m.check for m in misses] == ["output_rope"]
    why = misses[0].reason
    assert "walked" in why and "stopped at" in why and f"{(B, T, H, D)}: not RoPE-like" in why, why
