"""`rope_fp4` family: RoPE -> FP4 quantisation (-> cache write) becomes the dsv41::rope_fp4_* ops.

One zoo model holds every case, compiled once per activation dtype (module-scoped fixture, debug mode):

    bank      quantize_fp4_e4m3_1x16(apply_rope(x, cos, sin))                   -> rope_fp4_quant(16, True)
    key       quantize_fp4_ue8m0_1x32(apply_rope(k, cos, sin))                  -> rope_fp4_quant(32, False)
    query     fake_quant_fp4_ue8m0_1x32(apply_rope(q, cos[:, :, None], ...))    -> rope_fp4_fake_quant (broadcast cos)
    complex   view_as_complex(q) * freqs_cis, then fake-quant (interleaved pairs) -> rope_fp4_fake_quant
    store     bank chain whose codes/scales are written with index_put_((bi, rows)) -> rope_fp4_quant_store
    flat      codes/scales written into 2-D caches at cache[rows] (not the op's layout): quant fused, write left
    first     RoPE on the FIRST R channels                                      -> near-miss rope_channels
    halves    rotate-half (Hugging Face spelling, full-width cos)               -> near-miss rope_layout
    fp8       RoPE then FP8 1x32 quantisation                                   -> near-miss fp4_quantiser

References are written here: RoPE in FP32 (a*cos - b*sin, a*sin + b*cos, cast to x.dtype), E2M1 rounding
to the nearest grid value with ties to the even code, E4M3 scale rounding to nearest even on the E4M3 grid,
UE8M0 scales from the exact binary exponent. On CPU the fused ops run their references, so the compiled
codes and scales must equal the independent reference exactly; dequantised values likewise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("dsv41.kernels", reason="dsv41.kernels (the fused ops) is not importable")
import dsv41.kernels  # noqa: E402,F401
from dsv41.model import formats as fm  # noqa: E402
from dsv41.model.rope import apply_rope  # noqa: E402
from zoo_sites import site_markers, site_of  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

_OPS = ("rope_fp4_quant", "rope_fp4_fake_quant", "rope_fp4_quant_store")
if not all(hasattr(torch.ops.dsv41, op) for op in _OPS):
    pytest.skip(f"dsv41 ops {_OPS} are not all registered", allow_module_level=True)

SITES = site_markers(__file__)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
R = 16


# ------------------------------------------------------------------------------------------- references
def e4m3_grid() -> torch.Tensor:
    """Non-negative finite E4M3 (fn) values, ascending, from the bit layout (bias 7, 3 mantissa bits)."""
    b = torch.arange(127, dtype=torch.int64)
    e, m = b >> 3, (b & 7).double()
    return torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))


def round_to_grid(mag: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid value to each non-negative `mag` (ties to the even index)."""
    hi = torch.bucketize(mag, grid).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = mag - grid[lo], grid[hi] - mag
    return torch.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = 2 * cos.shape[-1]
    pe = x[..., -r:].float()
    a, b = pe[..., 0::2], pe[..., 1::2]
    out = torch.empty_like(pe)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return torch.cat((x[..., :-r], out.to(x.dtype)), -1)


def ref_fp4(y: torch.Tensor, block: int, e4m3: bool):
    """(packed codes, scale bytes, dequantised values in y.dtype) of FP4 E2M1 quantisation of y."""
    shp = y.shape
    yb = y.float().reshape(*shp[:-1], -1, block)
    amax = yb.abs().amax(-1)
    if e4m3:
        ratio = (amax / 6.0).clamp(2.0 ** -9, 448.0).double()
        idx = round_to_grid(ratio, e4m3_grid())
        scale = e4m3_grid()[idx]
        scale_bytes = idx.to(torch.uint8)
    else:
        ratio = (amax.clamp(min=6.0 * 2.0 ** -126) / 6.0).double()
        mant, ex = torch.frexp(ratio)  # ratio = mant * 2^ex, mant in [0.5, 1)
        e = torch.where(mant == 0.5, ex - 1, ex)  # ceil(log2(ratio)), exact
        scale = torch.pow(2.0, e.double())
        scale_bytes = (e + 127).to(torch.uint8)
    q = (yb / scale.float()[..., None]).double().clamp(-6, 6)
    codes = round_to_grid(q.abs(), E2M1) | ((q < 0).long() << 3)
    deq = torch.where(q < 0, -E2M1[codes & 7], E2M1[codes & 7]) * scale[..., None]
    codes = codes.reshape(shp).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale_bytes.reshape(*shp[:-1], -1), deq.reshape(shp).to(y.dtype)


# ------------------------------------------------------------------------------------------- zoo
def rope_first(x, cos, sin):
    """Interleaved RoPE on the FIRST R channels (a look-alike)."""
    r = 2 * cos.shape[-1]
    pf = x[..., :r].float().unflatten(-1, (r // 2, 2))
    a, b = pf[..., 0], pf[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    return torch.cat((rot.to(x.dtype), x[..., r:]), -1)


def rope_complex(x, freqs):
    """Interleaved RoPE spelled as a complex multiply (the same pairs as dsv41's)."""
    r = 2 * freqs.shape[-1]
    pc = torch.view_as_complex(x[..., -r:].float().reshape(*x.shape[:-1], r // 2, 2))
    return torch.cat((x[..., :-r], torch.view_as_real(pc * freqs).flatten(-2).to(x.dtype)), -1)


def rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), -1)


def rope_halves(x, cos_full, sin_full):
    """Hugging Face rotate-half RoPE on the last R channels (channel i paired with i + R/2)."""
    r = cos_full.shape[-1]
    pe = x[..., -r:].float()
    return torch.cat((x[..., :-r], (pe * cos_full + rotate_half(pe) * sin_full).to(x.dtype)), -1)


class RopeZoo(nn.Module):
    def __init__(self, batch: int, rows: int):
        super().__init__()
        self.register_buffer("codes_cache", torch.zeros(batch, rows, 32, dtype=torch.uint8))
        self.register_buffer("scale_cache", torch.zeros(batch, rows, 4, dtype=torch.uint8))
        self.register_buffer("flat_codes", torch.zeros(rows, 32, dtype=torch.uint8))
        self.register_buffer("flat_scales", torch.zeros(rows, 4, dtype=torch.uint8))

    def forward(self, x, k, q, cos, sin, rows):
        bank = fm.quantize_fp4_e4m3_1x16(apply_rope(x, cos, sin))  # site:bank
        key = fm.quantize_fp4_ue8m0_1x32(apply_rope(k, cos, sin))  # site:key
        query = fm.fake_quant_fp4_ue8m0_1x32(apply_rope(q, cos[:, :, None], sin[:, :, None]))  # site:query
        freqs = torch.complex(cos, sin)[:, :, None]
        cplx = fm.fake_quant_fp4_ue8m0_1x32(rope_complex(q * 2, freqs))  # site:complex
        bi = torch.arange(x.shape[0])[:, None].expand_as(rows)
        sc, ss = fm.quantize_fp4_e4m3_1x16(apply_rope(x * 3, cos, sin))  # site:store
        self.codes_cache.index_put_((bi, rows), sc)
        self.scale_cache.index_put_((bi, rows), ss)
        fc, fs = fm.quantize_fp4_e4m3_1x16(apply_rope(x * 5, cos, sin))  # site:flat
        self.flat_codes[rows.flatten()] = fc.reshape(-1, 32)
        self.flat_scales[rows.flatten()] = fs.reshape(-1, 4)
        first = fm.fake_quant_fp4_ue8m0_1x32(rope_first(q * 3, cos[:, :, None], sin[:, :, None]))  # site:first
        cf, sf = torch.cat((cos, cos), -1)[:, :, None], torch.cat((sin, sin), -1)[:, :, None]
        halves = fm.fake_quant_fp4_ue8m0_1x32(rope_halves(q * 4, cf, sf))  # site:halves
        fp8 = fm.quantize_fp8_1x32(apply_rope(k * 2, cos, sin))[0]  # site:fp8
        return bank, key, query, cplx, first, halves, fp8


DTYPES = ("float32", "bfloat16")


def _inputs(dtype):
    gen = torch.Generator().manual_seed(5)
    b, t = 2, 2
    x = (torch.randn(b, t, 64, generator=gen) * 4).to(dtype)
    k = (torch.randn(b, t, 32, generator=gen) * 4).to(dtype)
    q = (torch.randn(b, t, 2, 32, generator=gen) * 4).to(dtype)
    ang = torch.rand(b, t, R // 2, generator=gen) * 6.28
    rows = torch.tensor([[0, 5], [-1, 2]])  # -1: index_put wraps it to the last row; so must the fused write
    return x, k, q, ang.cos(), ang.sin(), rows


@pytest.fixture(scope="module", params=DTYPES)
def compiled_zoo(request):
    """((dtype, inputs, eager model after the step, eager outputs, compiled model, compiled outputs, report), post-pass GraphModules)."""
    import dsv41

    dtype = getattr(torch, request.param)
    inputs = _inputs(dtype)
    eager_model = RopeZoo(2, 8)
    model = copy.deepcopy(eager_model)
    with torch.no_grad(), capture_graphs() as graphs:
        eager = eager_model(*inputs)
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(*inputs)
    return (request.param, inputs, eager_model, eager, model, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(dtype, inputs, eager model after the step, eager outputs, compiled model, compiled outputs, report)."""
    return compiled_zoo[0]



def _fam(report):
    return report.to_dict()["families"]["rope_fp4"]


def _site_of(s):
    return site_of(s, __file__, SITES)


# ------------------------------------------------------------------------------------------- tests
def test_each_rope_fp4_chain_is_fused_once(zoo):
    *_, report = zoo
    fam = _fam(report)
    got = sorted((_site_of(s), s["pattern"]) for s in fam["sites"])
    assert got == sorted([("bank", "rope_fp4_quant(e4m3_1x16)"), ("key", "rope_fp4_quant(ue8m0_1x32)"),
                          ("query", "rope_fp4_fake_quant(ue8m0_1x32)"),
                          ("complex", "rope_fp4_fake_quant(ue8m0_1x32)"),
                          ("store", "rope_fp4_quant_store(e4m3_1x16)"), ("flat", "rope_fp4_quant(e4m3_1x16)")])
    assert fam["matches"] == 6


def test_look_alikes_are_near_misses_with_reasons(zoo):
    *_, report = zoo
    misses = {_site_of(m): m for m in _fam(report)["near_misses"]}
    assert set(misses) == {"first", "halves", "fp8"}
    assert misses["first"]["check"] == "rope_channels" and "FIRST 16 of 32" in misses["first"]["reason"]
    assert misses["halves"]["check"] == "rope_layout" and "rotate-half" in misses["halves"]["reason"]
    assert misses["fp8"]["check"] == "fp4_quantiser" and "FP8 E4M3" in misses["fp8"]["reason"]


def test_compiled_codes_and_values_equal_independent_reference(zoo):
    name, (x, k, q, cos, sin, rows), _, eager, _, out, _ = zoo
    bank = ref_fp4(ref_rope(x, cos, sin), 16, True)
    key = ref_fp4(ref_rope(k, cos, sin), 32, False)
    query = ref_fp4(ref_rope(q, cos[:, :, None], sin[:, :, None]), 32, False)
    cplx = ref_fp4(ref_rope(q * 2, cos[:, :, None], sin[:, :, None]), 32, False)
    assert torch.equal(out[0][0], bank[0]) and torch.equal(out[0][1], bank[1])
    assert torch.equal(out[1][0], key[0]) and torch.equal(out[1][1], key[1])
    assert out[2].dtype == x.dtype and torch.equal(out[2], query[2])
    assert torch.equal(out[3], cplx[2])
    # The unfused look-alikes are Inductor's code: in float32 it matches eager exactly; in bfloat16 Inductor keeps
    # the RoPE output in FP32 inside its fused kernel (no bf16 rounding before the quantiser), so a few values
    # may land one FP4 step away: at most 5% of them.
    for i in (4, 5, 6):
        if name == "float32":
            assert torch.equal(out[i], eager[i]), i
        else:
            assert (out[i] != eager[i]).float().mean() <= 0.05, i


def test_fused_cache_write_stays_correct_under_functionalisation(zoo):
    name, (x, k, q, cos, sin, rows), eager_model, _, model, _, report = zoo
    codes, scales, _ = ref_fp4(ref_rope(x * 3, cos, sin), 16, True)
    want_c = torch.zeros(2, 8, 32, dtype=torch.uint8)
    want_s = torch.zeros(2, 8, 4, dtype=torch.uint8)
    for b in range(2):
        for t in range(2):
            want_c[b, rows[b, t]] = codes[b, t]  # Python indexing: row -1 is the last row
            want_s[b, rows[b, t]] = scales[b, t]
    assert torch.equal(model.codes_cache, want_c) and torch.equal(model.scale_cache, want_s)
    assert torch.equal(eager_model.codes_cache, want_c)
    fc, fs, _ = ref_fp4(ref_rope(x * 5, cos, sin), 16, True)
    assert torch.equal(model.flat_codes, eager_model.flat_codes)
    assert torch.equal(model.flat_codes[rows.flatten()], fc.reshape(-1, 32))
    sites = {_site_of(s): s for s in _fam(report)["sites"]}
    assert sites["store"]["detail"]["cache_write"] == "fused (rope_fp4_quant_store)"
    assert "left to Inductor" in sites["flat"]["detail"]["cache_write"]


def test_replaced_chains_are_gone_from_post_pass_graph(zoo, zoo_after):
    *_, report = zoo
    (graph,) = report.graphs
    ops = ops_after(zoo_after)
    assert ops["dsv41.rope_fp4_quant.default"] == 3
    assert ops["dsv41.rope_fp4_fake_quant.default"] == 2
    # the store mutates its cache: the functional graph runs it through auto_functionalized, and only there
    (store,) = [n for n in zoo_after.graph.nodes if n.target is torch.ops.higher_order.auto_functionalized]
    assert store.args[0] is torch.ops.dsv41.rope_fp4_quant_store.default
    assert ops["dsv41.rope_fp4_quant_store.default"] == 1
    assert ops["aten.index_put.default"] == 2  # only the flat caches' writes remain
    defined = {n.name for n in zoo_after.graph.nodes}
    for rec in graph.records:
        if rec.family == "rope_fp4":
            for m in rec.matches:
                assert len(m.nodes_replaced) > 20 and not defined & set(m.nodes_replaced), m.pattern


def test_broadcast_cos_is_expanded_to_the_leading_dims(zoo_after):
    # the query's cos [B, T, 1, R/2] reaches the op expanded to q's leading dims [B, T, H, R/2]
    expands = zoo_after.graph.find_nodes(op="call_function", target=torch.ops.aten.expand.default)
    assert [2, 2, 2, 8] in [list(n.args[1]) for n in expands], zoo_after.code


def test_rope_fp4_bytes_shrink_and_are_symbolic(zoo):
    import sympy

    *_, report = zoo
    B, L = sympy.symbols("B L", positive=True, integer=True)
    for s in _fam(report)["sites"]:
        before = sympy.sympify(s["bytes_before"], locals={"B": B, "L": L})
        assert before.free_symbols == {B, L}
        assert s["symbols"] == {"B": 2, "L": 2}
        assert s["bytes_before_value"] > s["bytes_after_value"] > 0


# ------------------------------------------------------------------------------------------- tiny model
def test_tiny_decode_rope_fp4_matches_follow_the_layer_roles(tiny_dsv41, tiny_model):
    # Session fixture: the fresh-interpreter dsv41 run of `tiny` (tests/fresh_tiny_dsv41.py).
    # Expected from the config: every Indexer fake-quantises its RoPE'd query (UE8M0 1x32); every layer that
    # Index-key rows (k_norm -> RoPE -> FP4 UE8M0 -> write) and every Compressor's bank row (E4M3 1x16) are
    # taken earlier by the c2_compressor family (RMSNorm -> RoPE -> FP4 -> write in one op), so no store is left.
    indexers = [m for m in tiny_model.modules() if type(m).__name__ == "Indexer"]
    compressors = [m for m in tiny_model.modules() if type(m).__name__ == "Compressor"]
    key_writers = [m for m in indexers if getattr(m, "wk", None) is not None]
    fam = tiny_dsv41["report"]["families"]["rope_fp4"]
    counts = {}
    for s in fam["sites"]:
        counts[s["pattern"]] = counts.get(s["pattern"], 0) + 1
    assert counts == {"rope_fp4_fake_quant(ue8m0_1x32)": len(indexers)}
    assert (len(indexers), len(key_writers), len(compressors)) == (3, 2, 2)
    # What stays unfused, and says why: each layer's window-ring write quantises its RoPE output to FP8, not FP4.
    layers = tiny_model.config.num_hidden_layers
    assert len(fam["near_misses"]) == layers
    assert {n["check"] for n in fam["near_misses"]} == {"fp4_quantiser"}
    ops = ops_after(tiny_dsv41["report"]["graphs"][0])  # the JSON report keeps printed code only
    assert ops["dsv41.rope_fp4_fake_quant.default"] == len(indexers)
    # The store mutates the caches, so the post-grad graph holds it as auto_functionalized(dsv41.rope_fp4_quant_store)
    assert ops["dsv41.rope_fp4_quant_store.default"] == 0
    assert ops["dsv41.c2_pool_norm_rope_fp4_store.default"] + ops[
        "dsv41.c2_norm_rope_fp4_store.default"] == len(key_writers) + len(compressors)
