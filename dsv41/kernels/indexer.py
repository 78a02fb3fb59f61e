"""CSA2 lightning-indexer kernels: index scores, two-level candidate blocks, top-k selection (`dsv41 report
--patterns indexer`; MODEL.md §2.7; eager code dsv41/model/csa.py `Indexer.scores`, `candidate_mask`,
`select_topk`).

Three ops replace the indexer's eager chains. None of them materialises a [B, T, N] mask: selections travel as
INDICES (block ids, row ids, -1 = empty); the one per-query vector is the score row itself.

- `dsv41::indexer_scores(q, weights, key_codes, key_scales, n_visible, blocks, block_size) -> scores`:
  `I[t] = sum_h w_h * ReLU(q_h . k_t)` over the FP4 index keys (E2M1 codes two per byte, low nibble = even
  channel; one UE8M0 scale per 32 channels), -inf for rows t >= n_visible. q [B, T, H, D] (fp32/bf16/fp16, the
  RoPE'd FP4-fake-quantised index query), weights [B, T, H] (any float dtype, the head weights including their
  constant factor), key_codes uint8 [B, N, D/2], key_scales uint8 [B, N, D/32], n_visible int64 [B, T].
  `blocks` None: scores fp32 [B, T, N] over every row. `blocks` int64 [B, T, NB] (ascending block ids, -1 =
  empty, as `indexer_candidates` returns): COMPACT scores fp32 [B, T, NB * block_size] over the rows of those
  blocks only (slot j = row blocks[j // block_size] * block_size + j % block_size; -inf for empty blocks and
  rows >= N): the Reindex layers' "scores only inside the candidate pool", without the [B, T, N] pass.
  Reference: `Indexer.scores` (+ `torch.where(candidates, s, -inf)` read at the pool's rows).
- `dsv41::indexer_candidates(scores, n_visible, block_size, n_blocks) -> blocks`: the candidate-source
  layer's pool. Block score = max over `block_size` consecutive rows (-inf padding), the block holding row
  n_visible - 1 forced to +inf when n_visible > 0, the top-`n_blocks` blocks with a finite score kept.
  blocks int64 [B, T, min(n_blocks, ceil(N / block_size))]: kept block ids ascending, then -1.
  Reference: `candidate_mask` (the same set, as ids instead of a mask).
- `dsv41::indexer_topk(scores, k, blocks, block_size, offset) -> idx`: the k best slots of each score row, as
  int64 [B, T, k]: selected row ids ascending, then -1 for the slots a finite score could not fill (the
  reference's score check + invalid-position filter). With `blocks`, slot ids of compact scores are mapped
  back to row ids (the epilogue does it); `offset` is added to every selected id (e.g. the 128 window rows
  placed before the bank rows in attention; 0 in dsv41/model, which keeps the two apart). Reference:
  `select_topk` (k = min(index_topk, N) there).

Tie rule (all three ops, as `select_topk` / `candidate_mask` document it): among equal scores the LOWER row
(block) index wins, i.e. the order is (score descending, index ascending), the order of a stable descending
sort. -0.0 and +0.0 are equal scores (a score of all-negative heads times negative weights is -0.0). NaN
scores are not supported (the index keys and queries are finite FP4 values).

Kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1, see `_common`):
- scores: programs (query row, BLOCK_N key rows); each loads the query's H x D values once, dequantises its
  BLOCK_N x D key tile from the bytes (even and odd channels as two K = D/2 matmuls, so the nibbles never need
  interleaving), and reduces ReLU(logits) * w over the heads. The matmuls run on the tensor cores in TF32 for
  bf16 / fp16 queries, where every product is exact (E2M1 x 2^e keys have 2 significant bits, the queries at
  most 11), and in IEEE FP32 on the CUDA cores for FP32 queries (2026-11-30 analysis: at 131K rows the IEEE dots
  made the kernel issue-bound, bench/results/2026-11-30_h200_small_context/LATENCY_ANALYSIS.md; measured on the
  H200 with TF32: 73.4 -> 57.7 us at 131K, bench/results/2026-11-30_h200_s9/). At batch-1 decode N / BLOCK_N programs fill the
  GPU (128K rows: 2048 programs).
- candidates: a block-max kernel over (query row, BLOCK_B blocks), then the top-k select over the block scores.
- top-k: a radix threshold select on the order-preserving 32-bit key of each score, 8 bits per pass (four
  histogram passes of tl.histogram over the elements still matching the prefix, then one compaction pass
  writing the indices > threshold and the first `rem` indices == threshold in index order, so the output is
  already ascending and ties go to the lower index; no sort). A chunk of at most `_TOPK_REG_ELEMS` elements is
  loaded into registers once and the passes run there (`_select_mode`); longer chunks stream through memory,
  each pass a loop of dependent 1,024-element loads (the fitted cost on the H200 was ~1.1 us per load step,
  bench/results/2026-11-30_h200_small_context/LATENCY_ANALYSIS.md). Long rows are split over programs
  (`topk_plan`): each program selects the top k of its chunk into a workspace (values + indices, in index
  order), and a second launch selects the top k of those k * SPLIT candidates. Deterministic: no atomics, no
  order that depends on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref import indexer as _ref
from dsv41.ref.indexer import candidate_width

from ._common import (check_same_device, check_tensor, e2m1_value, exp2_int, next_power_of_2, register_cuda,
                      require_launchable, use_pdl_for)

__all__ = [
    "indexer_scores", "indexer_candidates", "indexer_topk",
    "reference_indexer_scores", "reference_indexer_candidates", "reference_indexer_topk",
    "triton_indexer_scores", "triton_indexer_candidates", "triton_indexer_topk", "topk_plan",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Key rows per program of the score kernel.
_SCORE_BLOCK_N = 64
#: Elements per step of the select kernel's passes.
_SELECT_BLOCK = 1024
#: Blocks per program of the block-max kernel.
_BMAX_BLOCK_B = 64
#: Programs a long top-k row is spread over at decode (about one per SM of an H200).
_TOPK_TARGET_PROGRAMS = 128
#: A chunk of a split top-k holds at least this many elements (and at least 4 k): shorter rows are one program.
_TOPK_MIN_CHUNK = 8192
#: Largest chunk (a power of two) the select holds in registers; longer chunks stream through memory in passes.
_TOPK_REG_ELEMS = 8192


# ------------------------------------------------------------------------------------------- checks
def _check_scores(q, weights, key_codes, key_scales, n_visible, blocks, block_size):
    check_tensor("q", q, dtypes=_FLOAT_DTYPES, ndim=4)
    check_tensor("weights", weights, dtypes=_FLOAT_DTYPES, ndim=3)
    check_tensor("key_codes", key_codes, dtypes=(torch.uint8,), ndim=3)
    check_tensor("key_scales", key_scales, dtypes=(torch.uint8,), ndim=3)
    check_tensor("n_visible", n_visible, dtypes=(torch.int64, torch.int32), ndim=2)
    check_same_device(q=q, weights=weights, key_codes=key_codes, key_scales=key_scales, n_visible=n_visible)
    b, t, h, d = q.shape
    if d % 32:
        raise ValueError(f"q's head dim must be a multiple of 32 (UE8M0 blocks), got {tuple(q.shape)}")
    if tuple(weights.shape) != (b, t, h):
        raise ValueError(f"weights must be [B, T, H] = {(b, t, h)}, got {tuple(weights.shape)}")
    n = key_codes.shape[1]
    if tuple(key_codes.shape) != (b, n, d // 2):
        raise ValueError(f"key_codes must be [B, N, D/2] = {(b, n, d // 2)}, got {tuple(key_codes.shape)}")
    if tuple(key_scales.shape) != (b, n, d // 32):
        raise ValueError(f"key_scales must be [B, N, D/32] = {(b, n, d // 32)}, got {tuple(key_scales.shape)}")
    if tuple(n_visible.shape) != (b, t):
        raise ValueError(f"n_visible must be [B, T] = {(b, t)}, got {tuple(n_visible.shape)}")
    _check_blocks(blocks, b, t, block_size, q.device)


def _check_blocks(blocks, b, t, block_size, device):
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if blocks is None:
        return
    check_tensor("blocks", blocks, dtypes=(torch.int64,), ndim=3)
    if tuple(blocks.shape[:2]) != (b, t):
        raise ValueError(f"blocks must be [B, T, NB] with B, T = {(b, t)}, got {tuple(blocks.shape)}")
    if blocks.device != device:
        raise ValueError(f"blocks is on {blocks.device}, the scores on {device}")


def _check_topk(scores, k, blocks, block_size, offset):
    check_tensor("scores", scores, dtypes=(torch.float32,), ndim=3)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative int, got {offset!r}")
    b, t, s = scores.shape
    _check_blocks(blocks, b, t, block_size, scores.device)
    if blocks is not None and blocks.shape[2] * block_size != s:
        raise ValueError(f"compact scores have NB * block_size = {blocks.shape[2]} * {block_size} slots, "
                         f"got {s}")


def _check_candidates(scores, n_visible, block_size, n_blocks):
    check_tensor("scores", scores, dtypes=(torch.float32,), ndim=3)
    check_tensor("n_visible", n_visible, dtypes=(torch.int64, torch.int32), ndim=2)
    check_same_device(scores=scores, n_visible=n_visible)
    if tuple(n_visible.shape) != tuple(scores.shape[:2]):
        raise ValueError(f"n_visible must be [B, T] = {tuple(scores.shape[:2])}, got {tuple(n_visible.shape)}")
    for name, v in (("block_size", block_size), ("n_blocks", n_blocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# ------------------------------------------------------------------------------------------- references
def reference_indexer_scores(q, weights, key_codes, key_scales, n_visible, blocks=None, block_size=1):
    """`dsv41::indexer_scores` in plain PyTorch: the eager model's `Indexer.scores` (einsum over the dequantised
    keys, ReLU, head-weighted sum, -inf past n_visible), then for `blocks` the pool's rows gathered into compact
    slots (-inf for empty blocks and rows >= N). See the module docstring for shapes; raises TypeError /
    ValueError naming a bad argument."""
    _check_scores(q, weights, key_codes, key_scales, n_visible, blocks, block_size)
    return _ref.indexer_scores(q, weights, key_codes, key_scales, n_visible, blocks, block_size)


def reference_indexer_topk(scores, k, blocks=None, block_size=1, offset=0):
    """`dsv41::indexer_topk` in plain PyTorch: `select_topk` (stable descending sort, lower index on ties, -1 for
    -inf picks), padded with -1 to k columns, compact slots mapped to rows through `blocks`, then `offset` added
    to every selected id. int64 [B, T, k]. Raises TypeError / ValueError naming a bad argument."""
    _check_topk(scores, k, blocks, block_size, offset)
    return _ref.indexer_topk(scores, k, blocks, block_size, offset)


def reference_indexer_candidates(scores, n_visible, block_size, n_blocks):
    """`dsv41::indexer_candidates` in plain PyTorch: `select_topk` over `block_scores` keeps the blocks
    `candidate_mask` keeps (top n_blocks by block max, lower block on ties, finite only). int64 [B, T, W],
    W = `candidate_width`. Raises TypeError / ValueError naming a bad argument."""
    _check_candidates(scores, n_visible, block_size, n_blocks)
    return _ref.indexer_candidates(scores, n_visible, block_size, n_blocks)


# ------------------------------------------------------------------------------------------- Triton kernels
@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, codes_ptr, scales_ptr, nvis_ptr, blocks_ptr, out_ptr,
    T, N, S, H,
    sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h, sc_b, sc_n, ss_b, ss_n, sv_b, sv_t, sb_b, sb_t,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BLOCKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    slots = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    j = tl.arange(0, HALF)  # byte j holds channels 2j (low nibble) and 2j + 1 (high nibble)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    in_range = slots < S
    if HAS_BLOCKS:
        blk = tl.load(blocks_ptr + b * sb_b + t * sb_t + slots // BLOCK_SIZE, mask=in_range, other=-1)
        rows = blk * BLOCK_SIZE + slots % BLOCK_SIZE
        valid = in_range & (blk >= 0)
    else:
        rows = slots.to(tl.int64)
        valid = in_range
    nv = tl.load(nvis_ptr + b * sv_b + t * sv_t).to(tl.int64)
    valid = valid & (rows < nv) & (rows < N)
    rows = tl.where(valid, rows, 0)
    codes = tl.load(codes_ptr + b * sc_b + rows[:, None] * sc_n + j[None, :], mask=valid[:, None],
                    other=0).to(tl.int32)
    e = tl.load(scales_ptr + b * ss_b + rows[:, None] * ss_n + (j // 16)[None, :], mask=valid[:, None],
                other=0).to(tl.int32)
    sc = exp2_int(e)
    k_even = e2m1_value(codes & 15) * sc  # [BLOCK_N, HALF]: channels 0, 2, 4, ...
    k_odd = e2m1_value(codes >> 4) * sc   # channels 1, 3, 5, ...
    q_row = q_ptr + b * sq_b + t * sq_t + h[:, None] * sq_h
    q_even = tl.load(q_row + (2 * j)[None, :] * sq_d, mask=h_ok[:, None], other=0.0).to(tl.float32)
    q_odd = tl.load(q_row + (2 * j + 1)[None, :] * sq_d, mask=h_ok[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + b * sw_b + t * sw_t + h * sw_h, mask=h_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The selection downstream compares these scores with each other, so every product must be exact. The keys
    # are E2M1 x 2^e (2 significant bits); bf16 / fp16 queries have at most 11, so both are TF32 values and their
    # products (at most 13 bits) are exact: the tensor cores then give the IEEE FP32 dot up to the order of the
    # FP32 sum. FP32 queries may have 24 bits and keep the IEEE FMA path.
    if q_ptr.dtype.element_ty == tl.float32:
        logits = tl.dot(q_even, tl.trans(k_even), input_precision="ieee")
        logits = tl.dot(q_odd, tl.trans(k_odd), logits, input_precision="ieee")  # [BLOCK_H, BLOCK_N]
    else:
        logits = tl.dot(q_even, tl.trans(k_even), input_precision="tf32")
        logits = tl.dot(q_odd, tl.trans(k_odd), logits, input_precision="tf32")
    s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
    s = tl.where(valid, s, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * S + slots, s, mask=in_range)


@triton.jit
def _order_key(x):
    """int64 key of fp32 `x` whose integer order is the float order (-0.0 folded onto +0.0): the IEEE bits with
    the sign bit flipped for positives and all bits flipped for negatives, zero-extended."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, 0, bits)
    neg = (bits >> 31) != 0
    key = tl.where(neg, ~bits, bits | 0x80000000)
    return key.to(tl.int64)


@triton.jit
def _load_keys(v_row, pos, hi):
    """(pos, in range, scores (-inf outside), order keys) of the scores at positions `pos` < hi of a row."""
    ok = pos < hi
    x = tl.load(v_row + pos, mask=ok, other=float("-inf"))
    return pos, ok, x, _order_key(x)


@triton.jit
def _radix_start(K: tl.constexpr):
    """Radix select state before the first pass: (prefix, prefix mask, elements still to take, take-all flag)."""
    return (tl.zeros([], dtype=tl.int64), tl.zeros([], dtype=tl.int64), tl.full([], K, dtype=tl.int32),
            tl.zeros([], dtype=tl.int32))


@triton.jit
def _radix_narrow(hist, total, rem, prefix, pmask, bins, shift):
    """One radix pass's update from its 256-bin histogram (`total` = its sum) of the elements still matching
    `prefix`: the bin that holds the rem-th best element joins the prefix; `rem` drops by the elements in
    higher bins (all taken)."""
    at_or_above = total - tl.cumsum(hist, axis=0) + hist
    bsel = tl.max(tl.where(at_or_above >= rem, bins, -1), axis=0)
    rem = rem - tl.sum(tl.where(bins > bsel, hist, 0), axis=0)
    prefix = prefix | (tl.maximum(bsel, 0).to(tl.int64) << shift)
    pmask = pmask | (tl.full([], 255, dtype=tl.int64) << shift)
    return rem, prefix, pmask


@triton.jit
def _compact(x, key, valid, pos, written, eq_seen, prefix, rem, take_all, i_row, blocks_ptr, row, T, sb_b, sb_t,
             out_ptr, out_vals_ptr, o_row, offset, HAS_IDX: tl.constexpr, MAP_BLOCKS: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, FINAL: tl.constexpr):
    """Write the selected elements of one block (keys above the threshold `prefix`, and the first `rem` equal to
    it counting the `eq_seen` of earlier blocks; every valid one when `take_all`) at `written` onwards, in index
    order; returns (elements written, elements equal to the threshold) of this block."""
    eq = (valid & (key == prefix)).to(tl.int32)
    eq_rank = eq_seen + tl.cumsum(eq, axis=0) - eq
    # Integer arithmetic, not scalar-bool | block-bool: the interpreter mis-types that mix (int32 mask).
    want = tl.maximum((key > prefix).to(tl.int32), eq * (eq_rank < rem).to(tl.int32)) + take_all
    sel = valid.to(tl.int32) * tl.minimum(want, 1)
    sel_b = sel != 0
    dst = written + tl.cumsum(sel, axis=0) - sel
    if HAS_IDX:
        ids = tl.load(i_row + pos, mask=sel_b, other=-1)
    else:
        ids = pos.to(tl.int64)
    if MAP_BLOCKS:
        blk = tl.load(blocks_ptr + (row // T).to(tl.int64) * sb_b + (row % T).to(tl.int64) * sb_t
                      + ids // BLOCK_SIZE, mask=sel_b, other=0)
        ids = blk * BLOCK_SIZE + ids % BLOCK_SIZE
    if FINAL:
        ids = ids + offset
    else:
        tl.store(out_vals_ptr + o_row + dst, x, mask=sel_b)
    tl.store(out_ptr + o_row + dst, ids, mask=sel_b)
    return tl.sum(sel, axis=0), tl.sum(eq, axis=0)


@triton.jit
def _topk_select_kernel(
    vals_ptr, idx_ptr, blocks_ptr, out_ptr, out_vals_ptr,
    T, S, CHUNK, sv_row, si_row, sb_b, sb_t, so_row, offset,
    K: tl.constexpr, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, HAS_IDX: tl.constexpr,
    MAP_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, FINAL: tl.constexpr, USE_PDL: tl.constexpr,
    IN_REGS: tl.constexpr, REG_P2: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, S)
    v_row = vals_ptr + row.to(tl.int64) * sv_row
    i_row = idx_ptr + row.to(tl.int64) * si_row
    o_row = (row.to(tl.int64) * nsplit + split) * so_row
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    # Radix threshold select: after the four passes `prefix` is the key of the K-th best element (in the order
    # score descending) and `rem` how many elements equal to it are still to take, lowest index first; then the
    # compaction in index order (the output is ascending, and equal keys are taken lowest index first).
    if IN_REGS:
        # The whole chunk in registers (REG_P2 >= hi - lo): one load, four histograms and one compaction on
        # registers, instead of five dependent streaming passes over memory (the loop below).
        pos, ok, x, key = _load_keys(v_row, lo + tl.arange(0, REG_P2), hi)
        valid = ok & (x > float("-inf"))
        prefix, pmask, rem, take_all = _radix_start(K)
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            m = valid & ((key & pmask) == prefix)
            hist = tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=m)
            total = tl.sum(hist, axis=0)
            if p == 0:
                take_all = (total <= rem).to(tl.int32)
            rem, prefix, pmask = _radix_narrow(hist, total, rem, prefix, pmask, bins, shift)
        written, _ = _compact(x, key, valid, pos, tl.zeros([], dtype=tl.int32), tl.zeros([], dtype=tl.int32),
                              prefix, rem, take_all, i_row, blocks_ptr, row, T, sb_b, sb_t, out_ptr, out_vals_ptr,
                              o_row, offset, HAS_IDX, MAP_BLOCKS, BLOCK_SIZE, FINAL)
    else:
        prefix, pmask, rem, take_all = _radix_start(K)
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], dtype=tl.int32)
            start = lo
            while start < hi:
                pos, ok, x, key = _load_keys(v_row, start + offs, hi)
                m = ok & (x > float("-inf")) & ((key & pmask) == prefix)
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=m)
                start += BLOCK
            total = tl.sum(hist, axis=0)
            if p == 0:
                take_all = (total <= rem).to(tl.int32)  # no more finite elements than K: every one is selected
            rem, prefix, pmask = _radix_narrow(hist, total, rem, prefix, pmask, bins, shift)

        written = tl.zeros([], dtype=tl.int32)
        eq_seen = tl.zeros([], dtype=tl.int32)
        start = lo
        while start < hi:
            pos, ok, x, key = _load_keys(v_row, start + offs, hi)
            n_sel, n_eq = _compact(x, key, ok & (x > float("-inf")), pos, written, eq_seen, prefix, rem, take_all,
                                   i_row, blocks_ptr, row, T, sb_b, sb_t, out_ptr, out_vals_ptr, o_row, offset,
                                   HAS_IDX, MAP_BLOCKS, BLOCK_SIZE, FINAL)
            written += n_sel
            eq_seen += n_eq
            start += BLOCK
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # -1 (and -inf for a workspace) in the slots no finite score filled.
    kk = tl.arange(0, K_BLOCK)
    for k0 in tl.static_range(0, K, K_BLOCK):
        fill = (k0 + kk >= written) & (k0 + kk < K)
        tl.store(out_ptr + o_row + k0 + kk, tl.full([K_BLOCK], -1, dtype=tl.int64), mask=fill)
        if not FINAL:
            tl.store(out_vals_ptr + o_row + k0 + kk, tl.full([K_BLOCK], float("-inf"), dtype=tl.float32),
                     mask=fill)


@triton.jit
def _block_max_kernel(
    s_ptr, nvis_ptr, out_ptr, T, N, NB, ss_row, sv_b, sv_t,
    BLOCK_SIZE: tl.constexpr, BS_P2: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    r = tl.arange(0, BS_P2)
    rows = blk[:, None] * BLOCK_SIZE + r[None, :]
    ok = (blk[:, None] < NB) & (r[None, :] < BLOCK_SIZE) & (rows < N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(s_ptr + row.to(tl.int64) * ss_row + rows, mask=ok, other=float("-inf"))
    nv = tl.load(nvis_ptr + (row // T).to(tl.int64) * sv_b + (row % T).to(tl.int64) * sv_t).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.max(x, axis=1)
    newest = tl.maximum(nv - 1, 0) // BLOCK_SIZE
    m = tl.where((blk == newest) & (nv > 0), float("inf"), m)
    tl.store(out_ptr + row.to(tl.int64) * NB + blk, m, mask=blk < NB)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result / workspace allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_opts(kernel, device):
    pdl = use_pdl_for(kernel, device)
    return pdl, ({"launch_pdl": True} if pdl else {})


def topk_plan(rows: int, n: int, k: int, split: int | None = None) -> dict:
    """Programs per score row of `indexer_topk`: {"SPLIT": programs, "CHUNK": elements each}.

    One program per row unless the rows alone leave the GPU idle: then a row of n elements is cut into chunks
    of at least max(`_TOPK_MIN_CHUNK`, 4k) elements so that about `_TOPK_TARGET_PROGRAMS` programs work (a
    second launch selects from their k * SPLIT candidates). `split` forces a number of chunks (tests); CHUNK is
    rounded up to the select block, so the split used may be smaller. Raises ValueError for split < 1.
    """
    if split is None:
        min_chunk = max(_TOPK_MIN_CHUNK, 4 * k)
        split = max(1, min(-(-n // min_chunk), _TOPK_TARGET_PROGRAMS // max(rows, 1)))
    elif split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    chunk = -(-max(n, 1) // split)
    chunk = -(-chunk // _SELECT_BLOCK) * _SELECT_BLOCK
    return {"SPLIT": max(1, -(-n // chunk)), "CHUNK": chunk}


def _select_mode(chunk: int) -> dict:
    """IN_REGS / REG_P2 / num_warps of a select program over at most `chunk` elements: in registers when the chunk
    fits `_TOPK_REG_ELEMS`, with enough warps (4-16) that a thread holds at most 16 scores and their keys (built
    offline for sm_90 with Triton 3.9: 117-147 registers, no spills; 8 warps at 8,192 used 255 and spilled),
    else the streaming passes (4 warps)."""
    p2 = next_power_of_2(max(chunk, 1))
    if p2 <= _TOPK_REG_ELEMS:
        return {"IN_REGS": True, "REG_P2": p2, "num_warps": min(16, max(4, p2 // 512))}
    return {"IN_REGS": False, "REG_P2": 1, "num_warps": 4}


def _select(vals2d, k, *, idx2d=None, blocks=None, block_size=1, t=1, offset=0, split=None):
    """Top-k select of every row of fp32 `vals2d` [R, S] -> int64 [R, k] (see `_topk_select_kernel`)."""
    r, s = vals2d.shape
    dev = vals2d.device
    out = _empty((r, k), torch.int64, dev)
    if r == 0 or k == 0:
        return out
    plan = topk_plan(r, s, k, split)
    n_split, chunk = plan["SPLIT"], plan["CHUNK"]
    k_block = min(1024, next_power_of_2(k))
    bl = blocks if blocks is not None else torch.empty((1, 1, 1), dtype=torch.int64, device=dev)
    common = dict(K=k, BLOCK=_SELECT_BLOCK, K_BLOCK=k_block, BLOCK_SIZE=block_size)
    pdl, extra = _launch_opts(_topk_select_kernel, dev)
    if n_split == 1:
        ids = idx2d if idx2d is not None else vals2d
        _topk_select_kernel[(r, 1)](
            vals2d, ids, bl, out, vals2d, t, s, chunk, vals2d.stride(0), ids.stride(0), bl.stride(0), bl.stride(1),
            k, offset, HAS_IDX=idx2d is not None, MAP_BLOCKS=blocks is not None, FINAL=True, USE_PDL=pdl,
            **common, **_select_mode(min(chunk, s)), **extra)
        return out
    ws_vals = _empty((r, n_split * k), torch.float32, dev)
    ws_idx = _empty((r, n_split * k), torch.int64, dev)
    ids = idx2d if idx2d is not None else vals2d
    # Stage 1: each chunk's top k (row ids already mapped through the blocks), in index order.
    _topk_select_kernel[(r, n_split)](
        vals2d, ids, bl, ws_idx, ws_vals, t, s, chunk, vals2d.stride(0), ids.stride(0), bl.stride(0), bl.stride(1),
        k, 0, HAS_IDX=idx2d is not None, MAP_BLOCKS=blocks is not None, FINAL=False, USE_PDL=pdl, **common,
        **_select_mode(chunk), **extra)
    # Stage 2: the top k of the SPLIT * k candidates; their positions are in index order, so ties still go low.
    m = n_split * k
    _topk_select_kernel[(r, 1)](
        ws_vals, ws_idx, bl, out, ws_vals, t, m, m, m, m, bl.stride(0), bl.stride(1), k, offset,
        HAS_IDX=True, MAP_BLOCKS=False, FINAL=True, USE_PDL=pdl, **common, **_select_mode(m), **extra)
    return out


def _rows2d(x):
    """[B, T, S] -> a [B * T, S] view with a contiguous last dim (copied only if needed)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    b, t, s = x.shape
    if b * t > 1 and not (x.stride(0) == t * x.stride(1)):
        x = x.contiguous()
    return x.reshape(b * t, s)


def triton_indexer_scores(q, weights, key_codes, key_scales, n_visible, blocks=None, block_size=1):
    """Triton `dsv41::indexer_scores` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result (to FP32 rounding of the head-dim dot products) and errors as
    `reference_indexer_scores`. One launch over (query, BLOCK_N slots) programs. Raises RuntimeError for CPU
    tensors without the interpreter.
    """
    _check_scores(q, weights, key_codes, key_scales, n_visible, blocks, block_size)
    require_launchable(_indexer_scores_kernel, q.device, "triton_indexer_scores")
    b, t, h, d = q.shape
    n = key_codes.shape[1]
    s = n if blocks is None else blocks.shape[2] * block_size
    out = _empty((b, t, s), torch.float32, q.device)
    if b * t == 0 or s == 0:
        return out
    if key_codes.stride(-1) != 1:
        key_codes = key_codes.contiguous()
    if key_scales.stride(-1) != 1:
        key_scales = key_scales.contiguous()
    bl = blocks if blocks is not None else torch.empty((1, 1, 1), dtype=torch.int64, device=q.device)
    pdl, extra = _launch_opts(_indexer_scores_kernel, q.device)
    _indexer_scores_kernel[(b * t, triton.cdiv(s, _SCORE_BLOCK_N))](
        q, weights, key_codes, key_scales, n_visible, bl, out,
        t, n, s, h,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3), weights.stride(0), weights.stride(1), weights.stride(2),
        key_codes.stride(0), key_codes.stride(1), key_scales.stride(0), key_scales.stride(1),
        n_visible.stride(0), n_visible.stride(1), bl.stride(0), bl.stride(1),
        HALF=d // 2, BLOCK_H=max(16, next_power_of_2(h)), BLOCK_N=_SCORE_BLOCK_N, HAS_BLOCKS=blocks is not None,
        BLOCK_SIZE=block_size, USE_PDL=pdl, num_warps=4, **extra)
    return out


def triton_indexer_topk(scores, k, blocks=None, block_size=1, offset=0, split=None):
    """Triton `dsv41::indexer_topk` (interpreted on CPU under TRITON_INTERPRET=1): same arguments, result (exactly)
    and errors as `reference_indexer_topk`; `split` forces the number of chunks per row (`topk_plan`)."""
    _check_topk(scores, k, blocks, block_size, offset)
    require_launchable(_topk_select_kernel, scores.device, "triton_indexer_topk")
    b, t, _ = scores.shape
    bl = None if blocks is None else blocks.contiguous()
    out = _select(_rows2d(scores), k, blocks=bl, block_size=block_size, t=t, offset=offset, split=split)
    return out.view(b, t, k)


def triton_indexer_candidates(scores, n_visible, block_size, n_blocks, split=None):
    """Triton `dsv41::indexer_candidates` (interpreted on CPU under TRITON_INTERPRET=1): same arguments, result
    (exactly) and errors as `reference_indexer_candidates`. Two launches: block maxima, then the select."""
    _check_candidates(scores, n_visible, block_size, n_blocks)
    require_launchable(_block_max_kernel, scores.device, "triton_indexer_candidates")
    b, t, n = scores.shape
    nb = -(-n // block_size)
    w = candidate_width(n, block_size, n_blocks)
    if b * t == 0 or nb == 0:
        return _empty((b, t, w), torch.int64, scores.device)
    s2 = _rows2d(scores)
    bmax = _empty((b * t, nb), torch.float32, scores.device)
    pdl, extra = _launch_opts(_block_max_kernel, scores.device)
    _block_max_kernel[(b * t, triton.cdiv(nb, _BMAX_BLOCK_B))](
        s2, n_visible, bmax, t, n, nb, s2.stride(0), n_visible.stride(0), n_visible.stride(1),
        BLOCK_SIZE=block_size, BS_P2=next_power_of_2(block_size), BLOCK_B=_BMAX_BLOCK_B, USE_PDL=pdl,
        num_warps=4, **extra)
    return _select(bmax, w, split=split).view(b, t, w)


# ------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("dsv41::indexer_scores", mutates_args=(), device_types="cpu")
def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor,
                   n_visible: torch.Tensor, blocks: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """Index scores over the FP4 index keys (all rows, or the compact rows of `blocks`); see
    `reference_indexer_scores`."""
    return reference_indexer_scores(q, weights, key_codes, key_scales, n_visible, blocks, block_size)


@register_cuda(indexer_scores, "dsv41::indexer_scores")
def _indexer_scores_cuda(q, weights, key_codes, key_scales, n_visible, blocks, block_size):
    return triton_indexer_scores(q, weights, key_codes, key_scales, n_visible, blocks, block_size)


@indexer_scores.register_fake
def _indexer_scores_fake(q, weights, key_codes, key_scales, n_visible, blocks, block_size):
    s = key_codes.shape[1] if blocks is None else blocks.shape[2] * block_size
    return q.new_empty((q.shape[0], q.shape[1], s), dtype=torch.float32)


@torch.library.custom_op("dsv41::indexer_topk", mutates_args=(), device_types="cpu")
def indexer_topk(scores: torch.Tensor, k: int, blocks: torch.Tensor | None, block_size: int,
                 offset: int) -> torch.Tensor:
    """Top-k rows per score row, ascending, -1 padded, compact slots mapped through `blocks`, + `offset`; see
    `reference_indexer_topk`."""
    return reference_indexer_topk(scores, k, blocks, block_size, offset)


@register_cuda(indexer_topk, "dsv41::indexer_topk")
def _indexer_topk_cuda(scores, k, blocks, block_size, offset):
    return triton_indexer_topk(scores, k, blocks, block_size, offset)


@indexer_topk.register_fake
def _indexer_topk_fake(scores, k, blocks, block_size, offset):
    return scores.new_empty((scores.shape[0], scores.shape[1], k), dtype=torch.int64)


@torch.library.custom_op("dsv41::indexer_candidates", mutates_args=(), device_types="cpu")
def indexer_candidates(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int,
                       n_blocks: int) -> torch.Tensor:
    """Candidate-pool block ids of the candidate-source layer; see `reference_indexer_candidates`."""
    return reference_indexer_candidates(scores, n_visible, block_size, n_blocks)


@register_cuda(indexer_candidates, "dsv41::indexer_candidates")
def _indexer_candidates_cuda(scores, n_visible, block_size, n_blocks):
    return triton_indexer_candidates(scores, n_visible, block_size, n_blocks)


@indexer_candidates.register_fake
def _indexer_candidates_fake(scores, n_visible, block_size, n_blocks):
    w = candidate_width(scores.shape[2], block_size, n_blocks)
    return scores.new_empty((scores.shape[0], scores.shape[1], w), dtype=torch.int64)
