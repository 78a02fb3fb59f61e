"""`engram` family: the Engram lookup and gate chains become dsv41::engram_lookup / engram_gate.

A hand-written zoo (not dsv41/model/engram.py: a Python loop of `^=` for the hash, buckets through a
[M-1, heads] view of the primes, `F.embedding` for the FP8 rows and `index_select` for the scales, `exp2`
dequantisation, `torch.split` of the projection, the gate as a dot of two weighted RMSNorms) holds every case,
compiled once per activation dtype (module-scoped fixture, debug mode):

    lookup   M = 4, 3 heads: hash -> remainder(primes) + offsets -> gather -> dequant   -> engram_lookup
    gate     TK formulation with q_weight and k_weight                                 -> engram_gate
    gate_w   the same with one precomputed weight w = q * k                            -> engram_gate (k = ones)
    modulus  buckets reduced by a literal table size, no prime vector   -> near-miss bucket_modulus
    fmod     buckets by torch.fmod (equal until the int64 products wrap) -> near-miss hash_int64_wraparound
    nosqrt   gate = sigmoid(dot), no signed square root                 -> near-miss gate_signed_sqrt

References are written here (row ids on Python integers, float64 dequantisation and gate). The fused ops run
their CPU references under the compiled graph, so the compiled lookup must equal the reference bit for bit and
the gates to FP32 rounding (bf16: one rounding of the output).

The `tiny` model test reads the session's fresh-interpreter dsv41 run of `tiny` (fixture `tiny_dsv41`) and checks
one lookup and one gate per Engram layer of the config, that the hash / gate ops are gone from the post-pass
graph, that `dispatch` then fuses the `wkv` projection with its activation quantisation reading the lookup's
output, and that the logits and greedy tokens match eager.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("dsv41.kernels.engram", reason="dsv41.kernels.engram (the fused ops) is not importable")
import dsv41.kernels.engram  # noqa: E402,F401
from zoo_sites import site_markers, site_of  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

_OPS = ("engram_lookup", "engram_gate")
if not all(hasattr(torch.ops.dsv41, op) for op in _OPS):
    pytest.skip(f"dsv41 ops {_OPS} are not all registered", allow_module_level=True)

SITES = site_markers(__file__)

D = 32          # hidden size of the zoo
C = 32          # table row bytes
EPS = 1e-20


# ------------------------------------------------------------------------------------------- references
def ref_ids(u, mult, primes, offsets):
    """Row ids [B, T, R] on Python integers (the zoo's products never overflow: u < 512, m < 2^63 / 1024)."""
    m = len(mult)
    nh = len(primes) // (m - 1)
    out = []
    for per_b in u.tolist():
        ob = []
        for us in per_b:
            h, rows = us[0] * mult[0], []
            for k in range(1, m):
                h ^= us[k] * mult[k]
                rows += [h % primes[(k - 1) * nh + e] + offsets[(k - 1) * nh + e] for e in range(nh)]
            ob.append(rows)
        out.append(ob)
    return torch.tensor(out)


def ref_lookup(u, mult, primes, offsets, table, scales, dtype):
    ids = ref_ids(u, mult.tolist(), primes.tolist(), offsets.tolist())
    v = table[ids].view(torch.float8_e4m3fn).double()
    s = torch.exp2(scales[ids].double() - 127).repeat_interleave(32, -1)
    return (v * s).flatten(2).to(dtype)


def ref_gate(H, keys, value, qw, kw, eps=EPS):
    h, k, v, w = H.double(), keys.double(), value.double(), qw.double() * kw.double()
    rs = (h.square().mean(-1) + eps).rsqrt() * (k.square().mean(-1) + eps).rsqrt()
    dot = (h * w * k).sum(-1) * rs / math.sqrt(H.shape[-1])
    g = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
    return h + g[..., None] * v[:, :, None, :]


# ------------------------------------------------------------------------------------------- zoo
def lookup(u, mult, primes, offsets, table, scales, dtype, modulus=None, fmod=False):
    """Engram lookup in another spelling than dsv41/model/engram.py."""
    b, t, m = u.shape
    h = u[..., 0] * mult[0]
    hashes = []
    for k in range(1, m):
        h = h ^ (u[..., k] * mult[k])
        hashes.append(h)
    h = torch.stack(hashes, dim=-1).unsqueeze(-1)                    # [B, T, M-1, 1]
    nh = offsets.numel() // (m - 1)
    if modulus is not None:  # the look-alike: one literal modulus for every bucket
        bucket = h % modulus
    elif fmod:  # the look-alike: truncating remainder
        bucket = torch.fmod(h, primes.view(m - 1, nh))
    else:
        bucket = h % primes.view(m - 1, nh)
    ids = (bucket + offsets.view(m - 1, nh)).reshape(b, t, -1)       # [B, T, R]
    codes = F.embedding(ids, table)
    e = torch.index_select(scales, 0, ids.reshape(-1)).view(b, t, ids.shape[-1], -1)
    scale = torch.exp2(e.to(torch.float32) - 127).repeat_interleave(32, -1)
    vals = codes.view(torch.float8_e4m3fn).to(torch.float32) * scale
    return vals.to(dtype).reshape(b, t, -1)


def gate(H, keys, value, qw, kw, eps, signed_sqrt=True):
    """TileKernels' formulation: the dot of two weighted RMSNorms, then the signed square root and sigmoid."""
    Hf = H.float()
    hn = Hf * torch.rsqrt(Hf.pow(2).mean(-1, keepdim=True) + eps) * qw.float()
    kf = keys.float()
    kn = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps)
    dot = (hn * kn * (kw.float() if kw is not None else 1.0)).sum(-1) / H.shape[-1] ** 0.5
    z = dot.sign() * dot.abs().clamp_min(1e-6).sqrt() if signed_sqrt else dot
    return (Hf + torch.sigmoid(z).unsqueeze(-1) * value.float().unsqueeze(-2)).to(H.dtype)


def hash_buffers(layer, m, nh, start):
    """Multipliers (odd, below 2^63 / 512 / 2 as the model's), consecutive primes from `start`, offsets."""
    import numpy as np
    import sympy

    mult = [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer).integers(0, (2 ** 63 - 1) // 512 // 2, m)]
    primes, p = [], start
    for _ in range((m - 1) * nh):
        p = int(sympy.nextprime(p))
        primes.append(p)
    offsets = [sum(primes[:i]) for i in range(len(primes))]
    return torch.tensor(mult), torch.tensor(primes), torch.tensor(offsets)


class EngramZoo(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        from dsv41.model.formats import quantize_fp8_1x32

        g = torch.Generator().manual_seed(0)
        for name, (layer, m, nh, start) in {"a": (1, 4, 3, 60), "b": (2, 3, 2, 120), "c": (3, 3, 2, 180)}.items():
            mult, primes, offsets = hash_buffers(layer, m, nh, start)
            self.register_buffer(f"mult_{name}", mult)
            self.register_buffer(f"primes_{name}", primes)
            self.register_buffer(f"offsets_{name}", offsets)
        table, scales = quantize_fp8_1x32(torch.randn(2048, C, generator=g) * 2)
        self.register_buffer("table", table)
        self.register_buffer("scales", scales)
        for name, k in (("a", 9 * C), ("b", 4 * C), ("c", 4 * C)):
            self.register_buffer(f"wkv_{name}", (torch.randn(5 * D, k, generator=g) / math.sqrt(k)).to(dtype))
        for name in ("q1", "k1", "w2", "q3", "k3"):
            self.register_buffer(name, (1 + 0.1 * torch.randn(4, D, generator=g)).to(dtype))
        self.dtype = dtype

    def kv(self, x, w):
        keys, value = torch.split(x @ w.t(), [4 * D, D], dim=-1)
        return keys.unflatten(-1, (4, D)), value

    def forward(self, H, u):
        dt, tab, sc = self.dtype, self.table, self.scales
        x1 = lookup(u, self.mult_a, self.primes_a, self.offsets_a, tab, sc, dt)  # site:lookup
        k1, v1 = self.kv(x1, self.wkv_a)
        H1 = gate(H, k1, v1, self.q1, self.k1, EPS)  # site:gate
        x2 = lookup(u[..., :3], self.mult_b, None, self.offsets_b, tab, sc, dt, modulus=1031)  # site:modulus
        k2, v2 = self.kv(x2, self.wkv_b)
        H2 = gate(H1, k2, v2, self.w2, None, EPS)  # site:gate_w
        x3 = lookup(u[..., :3], self.mult_c, self.primes_c, self.offsets_c, tab, sc, dt, fmod=True)  # site:fmod
        k3, v3 = self.kv(x3, self.wkv_c)
        H3 = gate(H2, k3, v3, self.q3, self.k3, EPS, signed_sqrt=False)  # site:nosqrt
        return x1, k1, v1, H1, x2, k2, v2, H2, x3, H3


DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module", params=DTYPES)
def compiled_zoo(request):
    """((dtype name, inputs (H, u), module, compiled outputs, report), post-pass GraphModules)."""
    import dsv41

    dtype = getattr(torch, request.param)
    gen = torch.Generator().manual_seed(1)
    H = (torch.randn(2, 3, 4, D, generator=gen) * 2).to(dtype)
    u = torch.randint(0, 512, (2, 3, 4), generator=gen)
    model = EngramZoo(dtype)
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(H, u)
    return (request.param, (H, u), model, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(dtype name, inputs (H, u), module, compiled outputs, report)."""
    return compiled_zoo[0]



def _fam(report):
    return report.to_dict()["families"]["engram"]


def _site_of(s):
    return site_of(s, __file__, SITES)


# ------------------------------------------------------------------------------------------- zoo tests
def test_each_engram_chain_is_fused_once_with_its_constants(zoo):
    name, *_, report = zoo
    fam = _fam(report)
    got = sorted((_site_of(s), s["pattern"]) for s in fam["sites"])
    assert got == [("gate", "engram_gate"), ("gate_w", "engram_gate"), ("lookup", "engram_lookup")]
    details = {_site_of(s): s["detail"] for s in fam["sites"]}
    assert details["lookup"] == {"M": 4, "n_heads": 3, "R": 9, "C": C, "rows": 2048, "dtype": name}
    assert details["gate"]["eps"] == EPS and details["gate"]["d"] == D
    assert details["gate"]["weights"] == "q_weight * k_weight"
    assert details["gate_w"]["weights"].startswith("w ")


def test_look_alikes_are_near_misses_naming_the_failed_check(zoo):
    *_, report = zoo
    misses = {_site_of(m): m for m in _fam(report)["near_misses"]}
    assert set(misses) == {"modulus", "fmod", "nosqrt"}
    assert misses["modulus"]["check"] == "bucket_modulus" and "prime" in misses["modulus"]["reason"]
    assert misses["fmod"]["check"] == "hash_int64_wraparound" and "wrap" in misses["fmod"]["reason"]
    assert misses["nosqrt"]["check"] == "gate_signed_sqrt" and "square root" in misses["nosqrt"]["reason"]


def test_compiled_zoo_equals_references(zoo):
    name, (H, u), m, out, _ = zoo
    x1, k1, v1, H1, x2, k2, v2, H2, x3, H3 = out
    dt = H.dtype
    assert x1.dtype == dt and torch.equal(x1, ref_lookup(u, m.mult_a, m.primes_a, m.offsets_a, m.table, m.scales, dt))
    tol = dict(rtol=1e-5, atol=1e-5) if name == "float32" else dict(rtol=2 ** -7, atol=1e-5)
    assert H1.dtype == dt and torch.allclose(H1.double(), ref_gate(H, k1, v1, m.q1, m.k1), **tol)
    assert torch.allclose(H2.double(), ref_gate(H1, k2, v2, m.w2, torch.ones_like(m.w2)), **tol)
    # The look-alikes were left unfused and kept their meaning (the fmod one agrees in the model's range).
    assert torch.equal(x3, ref_lookup(u[..., :3], m.mult_c, m.primes_c, m.offsets_c, m.table, m.scales, dt))
    assert not torch.allclose(H3.double(), ref_gate(H2, *m.kv(x3, m.wkv_c), m.q3, m.k3), **tol)


def test_fused_chains_are_gone_from_post_pass_graph(zoo, zoo_after):
    *_, report = zoo
    (graph,) = report.graphs
    ops = ops_after(zoo_after)
    assert ops["dsv41.engram_lookup.default"] == 1
    assert ops["dsv41.engram_gate.default"] == 2
    assert ops["aten.remainder.Scalar"] == 1 and ops["aten.remainder.Tensor"] == 0  # look-alike
    assert ops["aten.fmod.Tensor"] == 1
    assert ops["aten.embedding.default"] == 2  # the two unfused look-alikes
    defined = {n.name for n in zoo_after.graph.nodes}
    for rec in graph.records:
        if rec.family == "engram":
            for mt in rec.matches:
                assert mt.nodes_replaced and not defined & set(mt.nodes_replaced), mt.pattern
    lookup = next(mt for rec in graph.records if rec.family == "engram" for mt in rec.matches
                  if mt.pattern == "engram_lookup")
    ops = set(lookup.ops_replaced)
    assert {"aten.bitwise_xor.Tensor", "aten.remainder.Tensor", "aten.embedding.default", "aten.index.Tensor",
            "aten.exp2.default"} <= ops


def test_engram_bytes_are_symbolic_and_shrink(zoo):
    import sympy

    *_, report = zoo
    B, L = sympy.symbols("B L", positive=True, integer=True)
    for s in _fam(report)["sites"]:
        before = sympy.sympify(s["bytes_before"], locals={"B": B, "L": L})
        assert B in before.free_symbols and L in before.free_symbols
        assert s["symbols"] == {"B": 2, "L": 3}
        assert s["bytes_before_value"] > s["bytes_after_value"] > 0
    lookup = next(s for s in _fam(report)["sites"] if s["pattern"] == "engram_lookup")
    # After: u (4 int64) + the 9 gathered rows (32 + 1 bytes each) + the output row (9 * 32 elements) per token,
    # and the constants (4 + 9 + 9 int64) once per step; never the 2048-row tables.
    esize = 4 if lookup["detail"]["dtype"] == "float32" else 2
    assert lookup["bytes_after"] == f"{4 * 8 + 9 * 33 + 9 * 32 * esize}*B*L + {22 * 8}"


def test_family_switched_off_shows_off_and_leaves_the_chains():
    import dsv41

    gen = torch.Generator().manual_seed(2)
    m = EngramZoo(torch.float32)
    H, u = torch.randn(1, 1, 4, D, generator=gen), torch.randint(0, 512, (1, 1, 4), generator=gen)

    def one_site(H, u):
        x = lookup(u, m.mult_a, m.primes_a, m.offsets_a, m.table, m.scales, torch.float32)
        k, v = m.kv(x, m.wkv_a)
        return gate(H, k, v, m.q1, m.k1, EPS)

    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        torch.compile(one_site, backend="dsv41", options={"disable": ["engram"], "debug": True})(H, u)
    rep = dsv41.last_report()
    fam = _fam(rep)
    assert fam["enabled"] is False and fam["matches"] == 0
    ops = ops_after(graphs)
    assert ops["dsv41.engram_lookup"] == ops["dsv41.engram_gate"] == 0
    assert ops["aten.bitwise_xor.Tensor"] > 0


# ------------------------------------------------------------------------------------------- tiny model
def test_tiny_decode_fuses_every_engram_layer_and_matches_eager(tiny_dsv41, tiny_model):
    # Session fixture: the fresh-interpreter dsv41 run of `tiny` (tests/fresh_tiny_dsv41.py, 32 decode steps).
    report = tiny_dsv41["report"]
    cfg = tiny_model.config
    n = len(cfg.engram_layer_ids)
    assert n >= 1
    fam = report["families"]["engram"]
    counts = {}
    for s in fam["sites"]:
        counts[s["pattern"]] = counts.get(s["pattern"], 0) + 1
    assert counts == {"engram_lookup": n, "engram_gate": n}
    assert fam["near_misses"] == []
    r = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    for s in fam["sites"]:
        if s["pattern"] == "engram_lookup":
            assert s["detail"]["M"] == cfg.engram_max_ngram and s["detail"]["R"] == r
            assert s["detail"]["C"] == cfg.engram_row_dim
        else:
            assert s["detail"]["eps"] == cfg.rms_norm_eps and s["detail"]["d"] == cfg.hidden_size
    (graph,) = report["graphs"]
    after = graph["graph_after"]
    ops = ops_after(graph)  # the JSON report keeps printed code only
    # The hash XOR and the gate's sign exist only in the Engram chains (attention keeps its own remainder).
    for gone in ("aten.bitwise_xor", "aten.sign.default", "aten.sigmoid.default"):
        assert ops[gone] == 0, gone
    defined = set(re.findall(r"^\s+(\w+) = ", after, flags=re.M))
    for rec in graph["records"]:
        if rec["family"] == "engram":
            for mt in rec["matches"]:
                assert not defined & set(mt["nodes_replaced"]), mt["pattern"]
    # dispatch then fuses each wkv projection, activation quantisation included, reading the lookup's rows.
    wkv = [s for s in report["families"]["dispatch"]["sites"]
           if s["detail"]["K"] == r * cfg.engram_row_dim and s["detail"]["N"] == (cfg.hc_mult + 1) * cfg.hidden_size]
    assert len(wkv) == n and all(s["detail"]["act_quant"] for s in wkv)
    # Logits: the fused ops run the model's own reference math on CPU, the rest is Inductor's code (FP32).
    assert tiny_dsv41["max_rel_logit_error"] < 1e-4
    assert tiny_dsv41["compiled_tokens"] == tiny_dsv41["eager_tokens"]
