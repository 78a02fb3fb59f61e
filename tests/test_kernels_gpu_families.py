"""GPU tests of the fusion-family kernels at the h200 preset's real shapes (MODEL.md §4.3).

Ops: `dsv41::engram_lookup`, `engram_gate` (dsv41/kernels/engram.py); `moe_router`, `moe_combine` (moe.py);
`grouped_linear_fp4` (grouped_gemv.py); `c2_pool_norm_rope_fp4_store`, `c2_norm_rope_fp4_store`
(c2_compressor.py). Every size comes from `ModelConfig.preset("h200")`: hidden_size, hc_mult, n_routed_experts,
num_experts_per_tok, moe_intermediate_size, the hash constants and table of the first Engram layer
(`EngramHash`, engram_row_dim, engram_compressed_vocab_size), head_dim and qk_rope_head_dim of the compressor
bank, rms_norm_eps, gate_temp, routed_scaling_factor. Activations in bf16 (the GPU model) and fp32.

Each test runs the CUDA op (`torch.ops.dsv41.*`, i.e. the compiled Triton kernel) with every output the
launchers allocate poisoned first (NaN / 0xAB through the modules' `_empty` seam), then compares on the CPU with
- the independent float64 / big-integer references of the CPU tests (tests/test_kernels_{engram,moe,
  grouped_gemv,c2_compressor}.py, imported by path) under the tolerances stated there, and
- the op's own CPU implementation (the model's math) on the same inputs moved to the CPU: bit for bit where the
  CPU tests demand it (the Engram lookup, the router's ids), else within the sum of the two implementations'
  bounds against float64 (each is within the CPU test's tolerance of the float64 value, so they are within
  twice that of each other: e.g. one bf16 rounding each).
Bank writes: codes and scales bit-exact for the latent the kernel returned, only the rows asked for touched;
against the CPU op (whose latent may differ by an ulp) nearly all bytes of the rows written once agree.
A last test runs one step of all the ops with PDL off, PDL on and replayed from a CUDA graph: bit-identical.

Run on a CUDA machine: `python -m pytest -q tests/test_kernels_gpu_families.py` (about a minute, most of it
Triton compiles and the float64 expert references). Skipped on CPU-only machines and under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_harness import (assert_graph_replay_equals, load_bench, load_reference,  # noqa: E402
                         skip_unless_compiled_gpu)

skip_unless_compiled_gpu()

import dsv41.kernels as kernels  # noqa: E402
from dsv41.kernels import c2_compressor as c2  # noqa: E402
from dsv41.kernels import engram as ek  # noqa: E402
from dsv41.kernels import grouped_gemv as gg  # noqa: E402
from dsv41.kernels import moe as mk  # noqa: E402
from dsv41.kernels.rope_fp4 import FP4_MODES  # noqa: E402
from dsv41.model import ModelConfig  # noqa: E402
from dsv41.model.engram import EngramHash  # noqa: E402
from interp_harness import poison_outputs  # noqa: E402



EN = load_reference("test_kernels_engram")
MO = load_reference("test_kernels_moe")
GG = load_reference("test_kernels_grouped_gemv")
C2 = load_reference("test_kernels_c2_compressor")

CFG = ModelConfig.preset("h200")
DEV = torch.device("cuda")
D = CFG.hidden_size
HC = CFG.hc_mult
N_EXPERTS = CFG.n_routed_experts
TOPK = CFG.num_experts_per_tok
INTER = CFG.moe_intermediate_size
EPS = CFG.rms_norm_eps
#: The router's normalisation eps: a literal 1e-20 in dsv41.model.moe.Gate.forward (not rms_norm_eps).
ROUTER_EPS = 1e-20
ENGRAM_LAYER = CFG.engram_layer_ids[0]
BANK_D = CFG.head_dim
ROPE_HALF = CFG.qk_rope_head_dim // 2
#: Bank rows: E2M1 codes with one E4M3 scale per 16 channels (MODEL.md §2.1; dsv41/model/attention.py _update_csa).
BANK_BLOCK, BANK_E4M3 = FP4_MODES[0]
#: Bank rows of the test caches (the rows a token writes are drawn from these; two are out of range).
CACHE_ROWS = 64
DTYPES = [torch.bfloat16, torch.float32]

_dt = lambda d: str(d).replace("torch.", "")  # noqa: E731
_bt = lambda s: "B{}T{}".format(*s)  # noqa: E731


@pytest.fixture(autouse=True)
def _poisoned_outputs_and_pdl_off(monkeypatch):
    """Every output / workspace the four modules allocate starts as NaN (bytes: 0xAB); PDL off around each test."""
    for mod in (ek, mk, gg, c2):
        poison_outputs(monkeypatch, mod)
    kernels.set_pdl(False)
    yield
    kernels.set_pdl(False)


def test_config_is_what_the_kernels_are_specialised_for():
    assert HC == ek.HC_STREAMS
    assert (BANK_BLOCK, BANK_E4M3) == (16, True) and BANK_D % BANK_BLOCK == 0
    assert CFG.engram_row_dim <= ek.MAX_ROW_DIM and N_EXPERTS <= mk.MAX_EXPERTS and TOPK <= mk.MAX_TOPK


# ------------------------------------------------------------------------------------------- comparison helpers
def _assert_same_nan_aware(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-equal values, NaN exactly where `want` has NaN (the random FP8 table holds NaN codes)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), f"{what}: NaN at {int((nan_g != nan_w).sum())} other places"
    diff = int((got[~nan_g] != want[~nan_w]).sum())
    assert diff == 0, f"{what}: {diff} values differ"


def _assert_pair(got: torch.Tensor, want: torch.Tensor, ref64: torch.Tensor, bound64: torch.Tensor, what: str):
    """|got - want| <= 2 * bound64: two implementations each within `bound64` of the float64 reference."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    assert not torch.isnan(got).any(), f"{what}: NaN in the CUDA result"
    err = (got.double() - want.double()).abs()
    worst = float((err / (2 * bound64)).max())
    assert worst <= 1.0, (f"{what}: |CUDA - CPU op| up to {worst:.3g} x the allowed 2 x bound "
                          f"(max {float(err.max()):.3g})")


def _gate_bound(ref64: torch.Tensor, dtype) -> torch.Tensor:
    # tests/test_kernels_engram.py assert_gate
    rtol = 1e-5 if dtype == torch.float32 else 2.0 ** -8 + 1e-5
    return 1e-5 + rtol * ref64.abs()


def _rounded_bound(ref64: torch.Tensor, dtype) -> torch.Tensor:
    # tests/test_kernels_moe.py assert_rounded
    if dtype == torch.float32:
        return 1e-5 + 1e-5 * ref64.abs()
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    return 1e-5 + (unit + 1e-5) * ref64.abs()


# ------------------------------------------------------------------------------------------- Engram
@pytest.fixture(scope="module")
def engram_table():
    """Hash constants of the first Engram layer and a random table of its h200 size (~3.1M rows x 256 B: every
    E4M3 byte, NaN codes included; UE8M0 scales 2^-17 .. 2^12), on the GPU and as a CPU copy."""
    h = EngramHash(CFG)
    consts = tuple(torch.tensor(v, dtype=torch.int64)
                   for v in (h.multipliers(ENGRAM_LAYER), h.primes(ENGRAM_LAYER), h.offsets(ENGRAM_LAYER)))
    rows, c = h.num_rows(ENGRAM_LAYER), CFG.engram_row_dim
    gen = torch.Generator(device=DEV).manual_seed(1)
    w = torch.randint(0, 256, (rows, c), dtype=torch.uint8, device=DEV, generator=gen)
    s = torch.randint(110, 140, (rows, c // 32), dtype=torch.uint8, device=DEV, generator=gen)
    return {"consts": consts, "consts_dev": tuple(t.to(DEV) for t in consts), "w": w, "s": s,
            "w_cpu": w.cpu(), "s_cpu": s.cpu()}


def _engram_float64(u, consts, w, s, dtype):
    """[B, T, R * C] from the big-integer row ids of the CPU test (ref_row_ids) and E4M3 / UE8M0 values decoded
    bit by bit (e4m3_value, ue8m0_value), in float64, rounded once to dtype. Only the gathered rows are decoded."""
    mults, primes, offsets = consts
    ids = torch.tensor(EN.ref_row_ids(u.tolist(), mults.tolist(), primes.tolist(), offsets.tolist(),
                                      CFG.engram_n_heads), dtype=torch.int64)
    assert int(ids.min()) >= 0 and int(ids.max()) < w.shape[0], "the h200 hash constants keep row ids in the table"
    e4m3 = torch.tensor([EN.e4m3_value(b) for b in range(256)], dtype=torch.float64)
    ue8m0 = torch.tensor([EN.ue8m0_value(e) for e in range(256)], dtype=torch.float64)
    vals = e4m3[w[ids].long()] * ue8m0[s[ids].long()].repeat_interleave(32, dim=-1)  # [B, T, R, C]
    return vals.flatten(2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("bt", [(1, 1), (2, 3)], ids=_bt)
def test_engram_lookup_is_bit_exact_at_h200_shapes(engram_table, bt, dtype):
    b, t = bt
    m = CFG.engram_max_ngram
    u = torch.randint(0, CFG.engram_compressed_vocab_size, (b, t, m), generator=torch.Generator().manual_seed(b + t))
    x = torch.ops.dsv41.engram_lookup(u.to(DEV), *engram_table["consts_dev"], engram_table["w"], engram_table["s"],
                                      dtype)
    r = (m - 1) * CFG.engram_n_heads
    assert x.device.type == "cuda" and x.shape == (b, t, r * CFG.engram_row_dim) and x.dtype == dtype
    got = x.cpu()
    want = torch.ops.dsv41.engram_lookup(u, *engram_table["consts"], engram_table["w_cpu"], engram_table["s_cpu"],
                                         dtype)
    _assert_same_nan_aware(got, want, "engram_lookup vs the CPU op")
    _assert_same_nan_aware(got, _engram_float64(u, engram_table["consts"], engram_table["w_cpu"],
                                                engram_table["s_cpu"], dtype), "engram_lookup vs float64")


def _gate_inputs(b, t, dtype, seed):
    """H [B, T, 4, d], the wkv output kv [B, T, 5d] (keys / value are views of it, as in the model), q / k weights."""
    gen = torch.Generator().manual_seed(seed)
    H = (torch.randn(b, t, HC, D, generator=gen) * 2).to(dtype)
    kv = torch.randn(b, t, (HC + 1) * D, generator=gen).to(dtype)
    qw, kw = (1 + 0.1 * torch.randn(2, HC, D, generator=gen)).to(dtype)
    return H, kv, qw, kw


def _split_kv(kv):
    return kv[..., :HC * D].unflatten(-1, (HC, D)), kv[..., HC * D:]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("bt", [(1, 1), (2, 2)], ids=_bt)
def test_engram_gate_at_h200_shapes(bt, dtype):
    b, t = bt
    H, kv, qw, kw = _gate_inputs(b, t, dtype, 10 * b + t)
    keys, value = _split_kv(kv)
    kv_d = kv.to(DEV)
    keys_d, value_d = _split_kv(kv_d)  # views of one buffer on the GPU, as the wkv output is sliced
    assert keys_d.data_ptr() == kv_d.data_ptr() and value_d.data_ptr() == kv_d.data_ptr() + HC * D * kv.element_size()
    if b * t > 1:
        assert not keys_d.is_contiguous() and not value_d.is_contiguous()
    out = torch.ops.dsv41.engram_gate(H.to(DEV), keys_d, value_d, qw.to(DEV), kw.to(DEV), EPS)
    assert out.device.type == "cuda" and out.shape == H.shape and out.is_contiguous()
    got = out.cpu()
    ref64 = EN.ref_gate(H, keys, value, qw, kw, eps=EPS)
    EN.assert_gate(got, ref64, dtype, "engram_gate vs float64")
    want = torch.ops.dsv41.engram_gate(H, keys, value, qw, kw, EPS)
    _assert_pair(got, want, ref64, _gate_bound(ref64, dtype), "engram_gate vs the CPU op")


# ------------------------------------------------------------------------------------------- MoE router and tail
def _router_inputs(n, dtype, seed):
    """`make_router_inputs` of the CPU test at the h200 sizes (W ~ N(0, 1/d), bias ~ N(0, 0.05^2)), redrawn
    until the top k + 1 biased scores of every row are >= 1e-4 apart: FP32 rounding of a 5120-long dot product
    is ~1e-6, so the selection and its order are then fixed (the CPU test's probes have no near-ties either)."""
    for s in range(seed, seed + 200):
        x, W, bias = MO.make_router_inputs((n,), N_EXPERTS, D, dtype, s)
        logits = x.double() @ W.double().t() / CFG.gate_temp
        biased = torch.sqrt(torch.nn.functional.softplus(logits)) + bias.double()
        top = biased.topk(TOPK + 1, dim=-1).values
        if float((top[:, :-1] - top[:, 1:]).min()) >= 1e-4:
            return x, W, bias
    raise AssertionError("no router probe without near-ties in 200 seeds")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("tokens", [1, 4])
def test_moe_router_at_h200_shapes(tokens, dtype):
    x, W, bias = _router_inputs(tokens, dtype, 100 * tokens)
    if tokens == 1:
        assert mk.router_plan(1, N_EXPERTS, D)["SPLIT_E"] > 1  # the decode GEMV is spread over programs
    w, ids = torch.ops.dsv41.moe_router(x.to(DEV), W.to(DEV), bias.to(DEV), TOPK, CFG.gate_temp,
                                        CFG.routed_scaling_factor, ROUTER_EPS)
    assert w.device.type == "cuda" and ids.device.type == "cuda"
    got = (w.cpu(), ids.cpu())
    want64 = MO.ref_router(x, W, bias, TOPK, temp=CFG.gate_temp, scale=CFG.routed_scaling_factor, eps=ROUTER_EPS)
    MO.assert_router(got, want64, "moe_router vs float64")
    op_w, op_ids = torch.ops.dsv41.moe_router(x, W, bias, TOPK, CFG.gate_temp, CFG.routed_scaling_factor, ROUTER_EPS)
    assert torch.equal(got[1], op_ids), f"ids {got[1].tolist()} != CPU op {op_ids.tolist()}"
    _assert_pair(got[0], op_w, want64[0], 1e-6 + 1e-5 * want64[0].abs(), "moe_router weights vs the CPU op")


COMBINE_CASES = [(1, torch.bfloat16, False), (4, torch.bfloat16, False), (1, torch.float32, False),
                 (2, torch.bfloat16, True)]


@pytest.mark.parametrize("case", COMBINE_CASES, ids=lambda c: f"N{c[0]}-{_dt(c[1])}-{'weighted' if c[2] else 'v41'}")
def test_moe_combine_at_h200_shapes(case):
    # V4.1's tail passes weights=None (the routing weight is applied before w2); `weighted` covers the other use.
    tokens, dtype, weighted = case
    gen = torch.Generator().manual_seed(7 + tokens)
    y = torch.randn(tokens, TOPK, D, generator=gen).to(dtype)
    sh = torch.randn(tokens, D, generator=gen).to(dtype)
    w = torch.rand(tokens, TOPK, generator=gen) if weighted else None
    out = torch.ops.dsv41.moe_combine(y.to(DEV), sh.to(DEV), None if w is None else w.to(DEV), dtype)
    assert out.device.type == "cuda" and out.shape == (tokens, D)
    got = out.cpu()
    ref64 = MO.ref_combine(y, sh, w)
    MO.assert_rounded(got, ref64, dtype, "moe_combine vs float64")
    want = torch.ops.dsv41.moe_combine(y, sh, w, dtype)
    _assert_pair(got, want, ref64, _rounded_bound(ref64, dtype), "moe_combine vs the CPU op")


# ------------------------------------------------------------------------------------------- grouped FP4 experts
@pytest.fixture(scope="module")
def expert_stacks():
    """Random FP4 expert stacks of the h200 size, made on the GPU, with CPU copies: w1 (and w3, same shape)
    [E, moe_intermediate_size, hidden/2] and w2 [E, hidden, moe_intermediate_size/2], UE8M0 scales 2^-10 .. 2^-4
    (the CPU test's make_experts)."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    out = {}
    for name, (n_out, k_in) in {"w13": (INTER, D), "w2": (D, INTER)}.items():
        w = torch.randint(0, 256, (N_EXPERTS, n_out, k_in // 2), dtype=torch.uint8, device=DEV, generator=gen)
        s = torch.randint(117, 124, (N_EXPERTS, n_out, k_in // 32), dtype=torch.uint8, device=DEV, generator=gen)
        out[name] = (w, s, w.cpu(), s.cpu())
    return out


def _grouped_indices(tokens, seed):
    """[tokens, k] distinct experts per token; the second token shares one expert with the first (as routers do)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)])
    if tokens > 1 and int(idx[0, 0]) not in idx[1].tolist():
        idx[1, -1] = idx[0, 0]
    return idx


# (stack, activation dtype, tokens): w1/w3 read one x row per token, w2 one row per (token, expert).
GROUPED_CASES = [("w13", torch.bfloat16, 1), ("w2", torch.bfloat16, 1), ("w13", torch.float32, 1),
                 ("w13", torch.bfloat16, 2)]


@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: f"{c[0]}-{_dt(c[1])}-N{c[2]}")
def test_grouped_linear_fp4_at_h200_shapes(expert_stacks, case):
    name, dtype, tokens = case
    w, s, w_cpu, s_cpu = expert_stacks[name]
    n_out, k_in = w.shape[1], w.shape[2] * 2
    idx = _grouped_indices(tokens, 20 + tokens)
    gen = torch.Generator().manual_seed(30 + tokens)
    x = (torch.randn(*((tokens, k_in) if name == "w13" else (tokens, TOPK, k_in)), generator=gen) * 2).to(dtype)
    plan = gg.grouped_gemv_plan(tokens * TOPK, n_out, k_in)
    assert math.prod(plan["grid"]) >= 132  # every SM of the H200 has a program
    y = torch.ops.dsv41.grouped_linear_fp4(x.to(DEV), w, s, idx.to(DEV), True)
    assert y.device.type == "cuda" and y.shape == (tokens, TOPK, n_out) and y.dtype == dtype
    got = y.cpu()
    y64, abs64 = GG.ref_grouped(x, w_cpu, s_cpu, idx, True)
    GG.assert_close_to_ref(got, y64, abs64)
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}[dtype]  # assert_close_to_ref's bound
    want = torch.ops.dsv41.grouped_linear_fp4(x, w_cpu, s_cpu, idx, True)
    _assert_pair(got, want, y64, 2.0 ** -16 * abs64 + rel * y64.abs() + 1e-30, "grouped_linear_fp4 vs the CPU op")


def test_grouped_pair_at_h200_shapes_equals_two_calls_also_in_a_pdl_graph(expert_stacks):
    # dsv41::grouped_linear_fp4_pair (the grouped_pair pass's op): w1 and w3 of one token, x quantised once; bit
    # for bit the two single ops, eagerly and replayed from a CUDA graph with PDL; the single ops match float64.
    from dsv41 import kernels
    w, s, w_cpu, s_cpu = expert_stacks["w13"]
    w3, s3 = w.flip(0).contiguous(), s.flip(0).contiguous()  # another expert stack of the same shape
    idx = _grouped_indices(1, 40).to(DEV)
    x = (torch.randn(1, w.shape[2] * 2, generator=torch.Generator().manual_seed(41)) * 2).bfloat16().to(DEV)

    def step():
        return (*torch.ops.dsv41.grouped_linear_fp4_pair(x, w, s, w3, s3, idx, True),
                torch.ops.dsv41.grouped_linear_fp4(x, w, s, idx, True),
                torch.ops.dsv41.grouped_linear_fp4(x, w3, s3, idx, True))

    kernels.set_pdl(True)
    try:
        a, b, a1, b1 = step()
        assert torch.equal(a, a1) and torch.equal(b, b1)
        GG.assert_close_to_ref(a.cpu(), *GG.ref_grouped(x.cpu(), w_cpu, s_cpu, idx.cpu(), True))
        assert_graph_replay_equals(step, (a, b, a1, b1))
    finally:
        kernels.set_pdl(False)


_BENCH = load_bench("kernels")
_SWEEP_REF: dict = {}


@pytest.mark.parametrize("cfg", _BENCH.GROUPED_SWEEP, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()) if isinstance(c, dict) else "-".join(map(str, c)))
@pytest.mark.parametrize("name", ["w13", "w2"])
def test_grouped_sweep_configs_are_correct(expert_stacks, name, cfg):
    # bench/kernels.py --sweep times these launch configurations of the grouped GEMV; each must compute the same
    # result as the float64 reference at both h200 shapes (w2: K = 2304, a partial last K tile in every split).
    over, _ = _BENCH.sweep_overrides(cfg, True)
    w, s, w_cpu, s_cpu = expert_stacks[name]
    k_in = w.shape[2] * 2
    idx = _grouped_indices(1, 7)
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(*((1, k_in) if name == "w13" else (1, TOPK, k_in)), generator=gen) * 2).to(torch.bfloat16)
    if name not in _SWEEP_REF:  # the float64 reference once per shape, not per configuration
        _SWEEP_REF[name] = GG.ref_grouped(x, w_cpu, s_cpu, idx, True)
    y = gg.triton_grouped_linear_fp4(x.to(DEV), w, s, idx.to(DEV), True, **over)
    GG.assert_close_to_ref(y.cpu(), *_SWEEP_REF[name])


# ------------------------------------------------------------------------------------------- C2 bank write
def _write_counts(rows: torch.Tensor) -> torch.Tensor:
    """int64 [B, CACHE_ROWS]: how many tokens of each batch row write each cache row (rows out of range skipped)."""
    b, t = rows.shape
    count = torch.zeros(b, CACHE_ROWS, dtype=torch.int64)
    for i in range(b):
        for j in range(t):
            r = int(rows[i, j])
            if 0 <= r < CACHE_ROWS:
                count[i, r] += 1
    return count


@pytest.mark.parametrize("pool", [True, False], ids=["ratio2_pool", "ratio1_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("bt", [(1, 1), (2, 3)], ids=_bt)
def test_c2_bank_write_at_h200_shapes(bt, dtype, pool):
    b, t = bt
    # C2._setup: norm weight, cos / sin fp32 [B, T, R/2], rows int64 [B, T] (for B*T > 2 one row past the
    # cache and one negative: both skipped), caches filled with 0x5A.
    gen, w, cos, sin, rows, codes, scales = C2._setup((b, t, BANK_D, ROPE_HALF, CACHE_ROWS), dtype, BANK_BLOCK,
                                                      3 + int(pool))
    if pool:
        k, g, pk, pg = (torch.randn(b, t, BANK_D, generator=gen) * 2 for _ in range(4))
        pg[0, 0] = float("-inf")  # the empty pending state: the latent is norm(k)
        pk[0, 0] = 0.0
        args = (k, g, pk, pg, w, EPS, dtype)
        op = torch.ops.dsv41.c2_pool_norm_rope_fp4_store
        u64 = C2.ref_pool(k, g, pk, pg).to(dtype).double()
    else:
        x = (torch.randn(b, t, BANK_D, generator=gen) * 3).to(dtype)
        args = (x, w, EPS)
        op = torch.ops.dsv41.c2_norm_rope_fp4_store
        u64 = x.double()
    tail = (BANK_BLOCK, BANK_E4M3)
    codes_d, scales_d = codes.to(DEV), scales.to(DEV)
    lat = op(*(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args), cos.to(DEV), sin.to(DEV), *tail,
             codes_d, scales_d, rows.to(DEV))
    assert lat.device.type == "cuda" and lat.shape == (b, t, BANK_D) and lat.dtype == dtype
    lat_cpu, codes_gpu, scales_gpu = lat.cpu(), codes_d.cpu(), scales_d.cpu()
    # Latent vs float64 (tests/test_kernels_c2_compressor.py tolerance); rows bit-exact for that latent.
    ref = C2.ref_norm(u64, w, EPS)
    tol = 2 * torch.finfo(dtype).eps
    atol = tol * float(ref.abs().max())
    torch.testing.assert_close(lat_cpu.double(), ref.to(dtype).double(), rtol=tol, atol=atol)
    C2._check_written(lat_cpu, cos, sin, BANK_BLOCK, BANK_E4M3, rows, codes_gpu, scales_gpu)
    # The CPU op (the model's math) on the same inputs and caches.
    cc, sc = codes.clone(), scales.clone()
    lat_op = op(*args, cos, sin, *tail, cc, sc, rows)
    torch.testing.assert_close(lat_cpu.double(), lat_op.double(), rtol=tol, atol=atol)
    once = _write_counts(rows) == 1  # a row two tokens write holds either one: compare rows written once
    assert once.any()
    # An ulp in the latent can move an FP4 code or a block scale in rare cases; nearly all bytes must agree.
    assert float((codes_gpu[once] != cc[once]).float().mean()) < 0.02
    assert float((scales_gpu[once] != sc[once]).float().mean()) < 0.02
    untouched = _write_counts(rows) == 0
    assert torch.equal(codes_gpu[untouched], cc[untouched]) and torch.equal(scales_gpu[untouched], sc[untouched])


# ------------------------------------------------------------------------------------------- PDL and CUDA graphs
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    return torch.equal(a, b)


def test_family_ops_are_identical_with_pdl_and_replayed_from_a_cuda_graph(engram_table, expert_stacks):
    # One decode step's worth of the family ops at h200 shapes, chained where the model chains them (the
    # router's ids feed the grouped GEMV, its weights the combine), with PDL off, PDL on, and from a graph.
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(40)
    u = torch.randint(0, CFG.engram_compressed_vocab_size, (1, 1, CFG.engram_max_ngram), generator=gen).to(DEV)
    H, kv, qw, kw = (a.to(DEV) for a in _gate_inputs(1, 1, dt, 41))
    keys, value = _split_kv(kv)
    x, W, bias = (a.to(DEV) for a in _router_inputs(1, dt, 42))
    w13, s13 = expert_stacks["w13"][:2]
    sh = torch.randn(1, D, generator=gen).to(dt).to(DEV)
    yk = torch.randn(1, TOPK, D, generator=gen).to(dt).to(DEV)
    pk, pg, k, g = (torch.randn(1, 1, BANK_D, generator=gen).to(DEV) for _ in range(4))
    wn = (0.5 + torch.rand(BANK_D, generator=gen)).to(dt).to(DEV)
    ang = (torch.rand(1, 1, ROPE_HALF, generator=gen) * 6).to(DEV)
    cos, sin = ang.cos(), ang.sin()
    rows = torch.tensor([[5]], device=DEV)
    codes = torch.zeros(1, CACHE_ROWS, BANK_D // 2, dtype=torch.uint8, device=DEV)
    scales = torch.zeros(1, CACHE_ROWS, BANK_D // BANK_BLOCK, dtype=torch.uint8, device=DEV)

    def step():
        look = torch.ops.dsv41.engram_lookup(u, *engram_table["consts_dev"], engram_table["w"], engram_table["s"], dt)
        gate = torch.ops.dsv41.engram_gate(H, keys, value, qw, kw, EPS)
        rw, ids = torch.ops.dsv41.moe_router(x, W, bias, TOPK, CFG.gate_temp, CFG.routed_scaling_factor, ROUTER_EPS)
        h = torch.ops.dsv41.grouped_linear_fp4(x, w13, s13, ids, True)
        tail = torch.ops.dsv41.moe_combine(yk, sh, rw, dt)
        lat = torch.ops.dsv41.c2_pool_norm_rope_fp4_store(k, g, pk, pg, wn, EPS, dt, cos, sin, BANK_BLOCK, BANK_E4M3,
                                                          codes, scales, rows)
        return [look, gate, rw, ids, h, tail, lat, codes.clone(), scales.clone()]

    kernels.set_pdl(False)
    want = step()
    assert not any(torch.isnan(t).any() for t in want[1:] if t.dtype.is_floating_point)
    kernels.set_pdl(True)
    got = step()
    assert all(_same(p, q) for p, q in zip(want, got)), "PDL changed a result"
    kernels.prepare_device(DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and allocate outside the capture, on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    codes.zero_()
    scales.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(_same(p, q) for p, q in zip(want, out)), "the CUDA-graph replay changed a result"
