"""Tests of dsv41::indexer_scores / indexer_candidates / indexer_topk (dsv41/kernels/indexer.py).

References are written here, never the code under test: the score in float64 from MODEL.md §2.1 / §2.7 (E2M1
table, low nibble = even channel, UE8M0 scale 2^(e - 127), ReLU, head-weighted sum, -inf at t >= n_visible),
and the selections in plain Python with the documented tie rule (order = score descending, then index
ascending; -0.0 == +0.0), so a kernel that breaks ties another way fails.

Tolerances: scores in FP32 against float64: |got - ref| <= 1e-5 (1 + |ref|) + 2^-16 mag, mag = sum over heads of
|w_h| (|q_h| . |k|) (the products are exact, so the error is FP32 summation over D channels and H heads, at most
about (D + H + 1) 2^-24 mag; the mag term matters only where negative head weights cancel); the -inf pattern
exactly. Selections exactly (indices).

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 unless this process was started
with it (tests/interp_harness.py); every output the launchers allocate starts poisoned (NaN / 0xAB bytes).
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs, sm90_ttir

from dsv41.kernels import indexer as ik

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NEG_INF = float("-inf")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output / workspace the launchers allocate starts as NaN or 0xAB, so a forgotten element fails."""
    poison_outputs(monkeypatch, ik)


# ------------------------------------------------------------------------------------------- references
def ref_keys64(codes, scales):
    """float64 [B, N, D] from packed E2M1 codes [B, N, D/2] and UE8M0 bytes [B, N, D/32] (MODEL.md §2.1)."""
    c = codes.long()
    nib = torch.stack((c & 15, c >> 4), dim=-1).flatten(-2)          # low nibble = even channel
    mag = torch.tensor(E2M1, dtype=torch.float64)[nib & 7]
    val = torch.where((nib & 8) != 0, -mag, mag)
    scale = torch.pow(2.0, scales.double() - 127.0).repeat_interleave(32, dim=-1)
    return val * scale


def ref_scores64(q, w, codes, scales, n_visible, blocks=None, block=1):
    """float64 index scores (MODEL.md §2.7 step 3), compact over `blocks` when given."""
    k = ref_keys64(codes, scales)
    logits = torch.einsum("bthd,bnd->bthn", q.double(), k)
    s = (logits.clamp(min=0) * w.double()[..., None]).sum(2)
    n = codes.shape[1]
    s = torch.where(torch.arange(n) < n_visible[..., None], s, torch.full_like(s, NEG_INF))
    if blocks is None:
        return s
    b, t, nb = blocks.shape
    out = torch.full((b, t, nb * block), NEG_INF, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            for j in range(nb * block):
                blk = int(blocks[bi, ti, j // block])
                row = blk * block + j % block
                if blk >= 0 and row < n:
                    out[bi, ti, j] = s[bi, ti, row]
    return out


def ref_select(row: list, k: int) -> list:
    """Plain-Python top-k of one score row: the k best finite (> -inf) positions in the order (score descending,
    index ascending), returned ascending, padded with -1 to k."""
    order = sorted((i for i, v in enumerate(row) if v > NEG_INF), key=lambda i: (-row[i], i))[:k]
    return sorted(order) + [-1] * (k - len(order))


def ref_topk(scores, k, blocks=None, block=1, offset=0):
    b, t, _ = scores.shape
    out = torch.empty(b, t, k, dtype=torch.int64)
    for bi in range(b):
        for ti in range(t):
            sel = ref_select(scores[bi, ti].tolist(), k)
            if blocks is not None:
                sel = [int(blocks[bi, ti, j // block]) * block + j % block if j >= 0 else -1 for j in sel]
            out[bi, ti] = torch.tensor([j + offset if j >= 0 else -1 for j in sel])
    return out


def ref_candidates(scores, n_visible, block, n_blocks):
    """Plain-Python candidate blocks (MODEL.md §2.7 step 4): block max, newest block pinned, top blocks."""
    b, t, n = scores.shape
    nb = -(-n // block)
    out = torch.empty(b, t, min(n_blocks, nb), dtype=torch.int64)
    for bi in range(b):
        for ti in range(t):
            row = scores[bi, ti].tolist()
            bmax = [max(row[j * block:(j + 1) * block]) for j in range(nb)]
            nv = int(n_visible[bi, ti])
            if nv > 0:
                bmax[(nv - 1) // block] = math.inf
            out[bi, ti] = torch.tensor(ref_select(bmax, min(n_blocks, nb)))
    return out


def make_keys(b, n, d, gen):
    """Packed codes over every byte value and UE8M0 scales 2^-12 .. 2^6 (the key cache's bytes)."""
    codes = torch.randint(0, 256, (b, n, d // 2), generator=gen, dtype=torch.int64)
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(min(256, codes.numel()))
    scales = torch.randint(115, 134, (b, n, d // 32), generator=gen)
    return codes.to(torch.uint8), scales.to(torch.uint8)


def make_score_inputs(b, t, h, d, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=gen).to(dtype)
    w = torch.randn(b, t, h, generator=gen)  # negative head weights too
    codes, scales = make_keys(b, n, d, gen)
    nv = torch.randint(0, n + 1, (b, t), generator=gen)
    nv.view(-1)[0] = n
    if nv.numel() > 1:
        nv.view(-1)[-1] = 0  # a query that sees no row: all -inf
    return q, w, codes, scales, nv


def assert_scores(got, ref, mag=None):
    """got == ref to FP32 rounding: |err| <= 1e-5 (1 + |ref|), plus 2^-16 mag where `mag` is the sum of the
    terms' magnitudes (`scores_mag64`): a score that cancels (negative head weights) keeps the rounding of its
    large terms (seen: -6.2023 from terms near 1e3, error 7.3e-5, in the interpreter with numpy 2.4)."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert not torch.isnan(got).any(), "NaN left in the scores (an element was never written)"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf) and bool((got[inf] < 0).all())
    err = (got.double() - ref)[~inf].abs()
    bound = 1e-5 * (1 + ref[~inf].abs())
    if mag is not None:
        bound = bound + 2.0 ** -16 * mag[~inf]
    assert bool((err <= bound).all()), f"max error {float(err.max())}"


def scores_mag64(q, w, codes, scales, n_visible, blocks=None, block=1):
    """float64 sum over heads of |w_h| (|q_h| . |k|): the magnitude of every product the score sums (E2M1 sign bits
    cleared: bit 3 of each nibble)."""
    return ref_scores64(q.abs(), w.abs(), codes & 0x77, scales, n_visible, blocks, block)


def assert_scores64(got, q, w, codes, scales, n_visible, blocks=None, block=1):
    """`assert_scores` against the float64 reference of these inputs, with the terms' magnitude."""
    assert_scores(got, ref_scores64(q, w, codes, scales, n_visible, blocks, block),
                  scores_mag64(q, w, codes, scales, n_visible, blocks, block))


def tie_scores(b, t, s, gen):
    """Many exact ties: values in {-1, 0, 1, 2} with zeros of both signs, some -inf."""
    v = torch.randint(-1, 3, (b, t, s), generator=gen).float()
    v = torch.where(torch.rand(b, t, s, generator=gen) < 0.3, torch.full_like(v, -0.0), v)
    return torch.where(torch.rand(b, t, s, generator=gen) < 0.1, torch.full_like(v, NEG_INF), v)


# ------------------------------------------------------------------------------------------- references = model
def test_references_equal_the_eager_model_functions():
    from dsv41.model.csa import candidate_mask, select_topk

    gen = torch.Generator().manual_seed(1)
    s = tie_scores(2, 3, 37, gen)
    nv = torch.tensor([[37, 10, 0], [1, 36, 20]])
    assert torch.equal(ik.reference_indexer_topk(s, 8), select_topk(s, 8))
    assert torch.equal(ik.reference_indexer_topk(s, 8), ref_topk(s, 8))
    blocks = ik.reference_indexer_candidates(s, nv, 4, 3)
    assert torch.equal(blocks, ref_candidates(s, nv, 4, 3))
    mask = torch.zeros(2, 3, 11, dtype=torch.bool)
    mask.scatter_(-1, blocks.clamp(min=0), blocks >= 0)
    assert torch.equal(mask.repeat_interleave(4, -1)[..., :37], candidate_mask(s, nv, 4, 3))
    # The pool top-k over compact scores selects what select_topk selects on the masked full row.
    q, w, codes, scales, _ = make_score_inputs(2, 3, 4, 32, 37, torch.float32, 2)
    full = ik.reference_indexer_scores(q, w, codes, scales, nv)
    blocks = ik.reference_indexer_candidates(full, nv, 4, 3)
    compact = ik.reference_indexer_scores(q, w, codes, scales, nv, blocks, 4)
    masked = torch.where(candidate_mask(full, nv, 4, 3), full, torch.full_like(full, NEG_INF))
    assert torch.equal(ik.reference_indexer_topk(compact, 8, blocks, 4), select_topk(masked, 8))


def test_torch_topk_breaks_ties_another_way_which_is_why_the_rule_is_explicit():
    # The model selects with a stable descending sort (lower index wins). torch.topk's CPU tie order is not that
    # rule (nor documented), so a fused top-k must not follow it: the sets differ on tied rows.
    gen = torch.Generator().manual_seed(3)
    s = torch.randint(-2, 3, (4, 8, 1000), generator=gen).float()
    ref = ik.reference_indexer_topk(s, 64)
    _, via_topk = torch.topk(s, 64)
    assert not torch.equal(via_topk.sort(-1).values, ref)


def test_cpu_ops_match_the_float64_spec():
    q, w, codes, scales, nv = make_score_inputs(2, 2, 4, 64, 45, torch.float32, 4)
    s = torch.ops.dsv41.indexer_scores(q, w, codes, scales, nv, None, 1)
    assert_scores64(s, q, w, codes, scales, nv)
    blocks = torch.ops.dsv41.indexer_candidates(s, nv, 4, 5)
    assert torch.equal(blocks, ref_candidates(s, nv, 4, 5))
    idx = torch.ops.dsv41.indexer_topk(s, 8, None, 1, 0)
    assert torch.equal(idx, ref_topk(s, 8))


# ------------------------------------------------------------------------------------------- scores (interpreted)
SCORE_SHAPES = [(1, 1, 4, 32, 21, torch.float32), (2, 3, 5, 64, 130, torch.bfloat16),
                (1, 2, 32, 128, 70, torch.float32)]


@interpreted
@pytest.mark.parametrize("shape", SCORE_SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}H{s[2]}D{s[3]}N{s[4]}-{s[5]}"[6:])
def test_triton_scores_match_float64_reference(shape, poisoned_outputs):
    b, t, h, d, n, dtype = shape
    q, w, codes, scales, nv = make_score_inputs(b, t, h, d, n, dtype, n + d)
    got = ik.triton_indexer_scores(q, w, codes, scales, nv)
    assert_scores64(got, q, w, codes, scales, nv)


@interpreted
def test_triton_scores_read_strided_cache_slices_and_compact_pool_rows(poisoned_outputs):
    # The key cache is [B, N + 1, ..] with a trash row; the op reads the [:, :N] slice. Compact scores: blocks
    # with -1 (empty) and a last block that runs past N.
    q, w, codes, scales, nv = make_score_inputs(2, 2, 4, 32, 51, torch.float32, 5)
    nv = torch.tensor([[50, 3], [0, 49]])
    got = ik.triton_indexer_scores(q, w, codes[:, :50], scales[:, :50], nv)
    assert_scores64(got, q, w, codes[:, :50], scales[:, :50], nv)
    blocks = torch.tensor([[[0, 5, 12, -1], [0, -1, -1, -1]], [[-1, -1, -1, -1], [3, 7, 11, 12]]])
    got = ik.triton_indexer_scores(q, w, codes[:, :50], scales[:, :50], nv, blocks, 4)
    assert got.shape == (2, 2, 16)
    assert_scores64(got, q, w, codes[:, :50], scales[:, :50], nv, blocks, 4)


# ------------------------------------------------------------------------------------------- top-k (interpreted)
@pytest.fixture(params=["registers", "streaming"])
def select_path(request, monkeypatch):
    """Both select paths: the chunk held in registers (the default up to `_TOPK_REG_ELEMS`) and the streaming
    passes (longer chunks; forced here by a zero register budget)."""
    if request.param == "streaming":
        monkeypatch.setattr(ik, "_TOPK_REG_ELEMS", 0)
    return request.param


@interpreted
@pytest.mark.parametrize("n,k", [(5, 8), (8, 8), (37, 8), (3000, 8)], ids=["shorter", "equal", "longer", "much-longer"])
def test_triton_topk_matches_the_tie_rule_at_every_context(n, k, poisoned_outputs, select_path):
    gen = torch.Generator().manual_seed(n)
    for s in (torch.randn(2, 2, n, generator=gen), tie_scores(2, 2, n, gen)):
        s[0, 1] = NEG_INF  # an all-invalid row: only -1
        got = ik.triton_indexer_topk(s, k)
        want = ref_topk(s, k)
        assert torch.equal(got, want)
        assert bool((got[0, 1] == -1).all())


@interpreted
@pytest.mark.parametrize("split", [1, 2, 5])
def test_triton_topk_split_rows_select_the_same_set_under_ties(split, poisoned_outputs, select_path):
    # 9000 tied scores, k = 64, chunks of whole select blocks (the last one shorter): every chunk's local top k
    # keeps its lowest tied indices, so the merge does too.
    gen = torch.Generator().manual_seed(11)
    s = tie_scores(1, 2, 9000, gen)
    assert ik.topk_plan(2, 9000, 64, split=split)["SPLIT"] == split
    assert torch.equal(ik.triton_indexer_topk(s, 64, split=split), ref_topk(s, 64))


@interpreted
def test_triton_topk_epilogue_maps_pool_slots_and_adds_the_offset(poisoned_outputs, select_path):
    gen = torch.Generator().manual_seed(12)
    blocks = torch.tensor([[[1, 4, 9, -1]], [[0, 2, -1, -1]]])
    s = tie_scores(2, 1, 16, gen)
    s[1, 0, 8:] = NEG_INF  # empty blocks hold -inf (as indexer_scores writes them)
    got = ik.triton_indexer_topk(s, 8, blocks, 4, 128)
    assert torch.equal(got, ref_topk(s, 8, blocks, 4, 128))
    assert bool((got[got >= 0] >= 128).all())


@interpreted
def test_triton_topk_orders_negative_zero_equal_to_zero(poisoned_outputs, select_path):
    # -0.0 and +0.0 are the same score: the lower index wins, whichever sign it carries.
    s = torch.tensor([[[-0.0, 0.0, -0.0, 0.0, -1.0, 0.0]]])
    assert ik.triton_indexer_topk(s, 2).tolist() == [[[0, 1]]]
    assert ik.triton_indexer_topk(s, 5).tolist() == [[[0, 1, 2, 3, 5]]]


def test_topk_plan_spreads_long_decode_rows():
    # h200 decode: the ratio-1 bank at 128K rows -> 16 chunks of 8192; the Reindex pool (16384) -> 2; many query
    # rows (prefill) or short rows need no split.
    assert ik.topk_plan(1, 131072, 512) == {"SPLIT": 16, "CHUNK": 8192}
    assert ik.topk_plan(1, 16384, 512) == {"SPLIT": 2, "CHUNK": 8192}
    assert ik.topk_plan(256, 131072, 512)["SPLIT"] == 1
    assert ik.topk_plan(1, 1000, 8)["SPLIT"] == 1
    with pytest.raises(ValueError, match="split"):
        ik.topk_plan(1, 100, 8, split=0)


def test_select_holds_decode_chunks_in_registers():
    # h200 decode: 8192-element chunks and the 16 x 512 stage-2 candidates fit the register path; a prefill row
    # of 131K elements in one program streams.
    assert ik._select_mode(8192) == {"IN_REGS": True, "REG_P2": 8192, "num_warps": 16}
    assert ik._select_mode(16 * 512)["IN_REGS"] and ik._select_mode(1000)["REG_P2"] == 1024
    assert not ik._select_mode(131072)["IN_REGS"]


# ------------------------------------------------------------------------------------------- candidates (interpreted)
@interpreted
@pytest.mark.parametrize("n,block,n_blocks", [(37, 4, 3), (16, 4, 4), (300, 8, 5)])
def test_triton_candidates_pin_the_newest_block_and_break_ties_low(n, block, n_blocks, poisoned_outputs, select_path):
    gen = torch.Generator().manual_seed(n)
    s = tie_scores(2, 3, n, gen)
    nv = torch.tensor([[n, 1, 0], [n // 2, 5, n - 1]])
    s[1, 2] = NEG_INF  # nothing finite but the pinned block
    got = ik.triton_indexer_candidates(s, nv, block, n_blocks)
    want = ref_candidates(s, nv, block, n_blocks)
    assert torch.equal(got, want)
    assert got[1, 2].tolist() == [(n - 2) // block] + [-1] * (got.shape[-1] - 1)
    assert bool((got[0, 2] >= -1).all())  # n_visible 0: nothing pinned


@interpreted
def test_triton_candidates_split_over_many_blocks(poisoned_outputs, select_path):
    gen = torch.Generator().manual_seed(13)
    s = torch.randn(1, 1, 40000, generator=gen)
    nv = torch.tensor([[40000]])
    got = ik.triton_indexer_candidates(s, nv, 4, 64, split=3)
    assert torch.equal(got, ref_candidates(s, nv, 4, 64))


# ------------------------------------------------------------------------------------------- op registration
def test_ops_pass_torch_library_opcheck():
    q, w, codes, scales, nv = make_score_inputs(1, 2, 4, 32, 20, torch.float32, 6)
    torch.library.opcheck(torch.ops.dsv41.indexer_scores.default, (q, w, codes, scales, nv, None, 1))
    s = ik.reference_indexer_scores(q, w, codes, scales, nv)
    blocks = ik.reference_indexer_candidates(s, nv, 4, 2)
    torch.library.opcheck(torch.ops.dsv41.indexer_scores.default, (q, w, codes, scales, nv, blocks, 4))
    torch.library.opcheck(torch.ops.dsv41.indexer_candidates.default, (s, nv, 4, 2))
    torch.library.opcheck(torch.ops.dsv41.indexer_topk.default, (s, 8, None, 1, 16))


def test_fake_functions_give_shapes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, w = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16), torch.empty(2, 1, 32)
        codes, scales = torch.empty(2, 4096, 64, dtype=torch.uint8), torch.empty(2, 4096, 4, dtype=torch.uint8)
        nv = torch.empty(2, 1, dtype=torch.int64)
        s = torch.ops.dsv41.indexer_scores(q, w, codes, scales, nv, None, 1)
        assert s.shape == (2, 1, 4096) and s.dtype == torch.float32
        blocks = torch.ops.dsv41.indexer_candidates(s, nv, 8, 256)
        assert blocks.shape == (2, 1, 256) and blocks.dtype == torch.int64
        compact = torch.ops.dsv41.indexer_scores(q, w, codes, scales, nv, blocks, 8)
        assert compact.shape == (2, 1, 2048)
        idx = torch.ops.dsv41.indexer_topk(compact, 512, blocks, 8, 128)
        assert idx.shape == (2, 1, 512) and idx.dtype == torch.int64


def test_bad_inputs_raise_errors_naming_the_argument():
    q, w, codes, scales, nv = make_score_inputs(1, 2, 4, 32, 20, torch.float32, 7)
    with pytest.raises(ValueError, match="key_scales must be"):
        ik.reference_indexer_scores(q, w, codes, scales[..., :0], nv)
    with pytest.raises(TypeError, match="key_codes has dtype"):
        ik.reference_indexer_scores(q, w, codes.long(), scales, nv)
    with pytest.raises(ValueError, match="weights must be"):
        ik.reference_indexer_scores(q, w[..., :3], codes, scales, nv)
    with pytest.raises(ValueError, match="multiple of 32"):
        ik.reference_indexer_scores(q[..., :16], w, codes, scales, nv)
    s = torch.randn(1, 2, 20)
    with pytest.raises(ValueError, match="k must be"):
        ik.reference_indexer_topk(s, -1)
    with pytest.raises(ValueError, match="compact scores"):
        ik.reference_indexer_topk(s, 4, torch.zeros(1, 2, 3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="n_blocks"):
        ik.reference_indexer_candidates(s, nv, 4, 0)


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the error raised when Triton is NOT interpreting")
def test_cpu_launch_without_interpreter_says_how_to_enable_it():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ik.triton_indexer_topk(torch.randn(1, 1, 10), 4)


# ------------------------------------------------------------------------------------------- scores (sm_90 build)
def test_scores_use_tf32_tensor_cores_only_where_every_product_is_exact():
    """bf16 / fp16 queries (<= 11 significant bits) times E2M1 x 2^e keys are exact TF32 products; FP32 queries are
    not TF32 values in general and must stay on IEEE FP32. The interpreter does not round to TF32, so only the
    compiled kernel shows which precision each dtype gets."""
    consts = {"HALF": 64, "BLOCK_H": 64, "BLOCK_N": 64, "HAS_BLOCKS": False, "BLOCK_SIZE": 1, "USE_PDL": False}
    dots = {}
    for q_type in ("fp32", "bf16", "fp16"):
        ptrs = {"q_ptr": q_type, "w_ptr": "fp32", "codes_ptr": "u8", "scales_ptr": "u8", "nvis_ptr": "i64",
                "blocks_ptr": "i64", "out_ptr": "fp32"}
        ttir = sm90_ttir(ik._indexer_scores_kernel, ptrs, consts)
        dots[q_type] = [line for line in ttir.splitlines() if "tt.dot" in line]
    assert all(len(d) == 2 for d in dots.values())
    assert not any("tf32" in line for line in dots["fp32"])
    assert all("inputPrecision = tf32" in line for t in ("bf16", "fp16") for line in dots[t])
