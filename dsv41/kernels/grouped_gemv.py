"""Grouped FP4 GEMV over gathered experts: the decode path of the routed MoE experts, fused.

The model's decode path (dsv41/model/moe.py `RoutedExperts.forward_gather`, MODEL.md §2.9, §2.1) gathers the k
selected experts' stacked FP4 weights per token, dequantises them to the activation dtype and multiplies:

    w = dequantize_fp4_1x32(weight[indices], scale[indices], dtype)      # [N, k, out, K], materialised
    y = einsum("nd,nkfd->nkf", fq8(x), w)      # w1, w3: one x row per token, shared by its k experts
    y = einsum("nkf,nkdf->nkd", fq8(h), w)     # w2: one row per (token, expert)

which writes and re-reads the dequantised weights (about 9x the FP4 bytes in bf16, 17x in fp32) every step.
`dsv41::grouped_linear_fp4` computes the same numbers reading only the selected experts' packed bytes, once per
(token, expert) pair.

Op (`dsv41::grouped_linear_fp4(x, weight, scale, indices, act_quant) -> y`):
    x        [N, K] (one row per token, shared by its k experts) or [N, k, K] (one row per (token, expert));
             fp32 / bf16 / fp16, K % 32 == 0.
    weight   uint8 [E, out, K/2]: packed E2M1 codes, two per byte along K, low nibble = even k.
    scale    uint8 [E, out, K/32]: UE8M0 exponents e (value 2^(e-127)), one per 1x32 block along K.
    indices  int64 [N, k]: expert of each (token, slot); values in [-E, E), negatives wrap as in `weight[indices]`.
    act_quant: fake-quantise x to FP8 E4M3 with one UE8M0 scale per 32 along K first (the reference quantises
             every FP4 GEMM input that way).
    y        [N, k, out] in x.dtype: `einsum(fq8(x) if act_quant else x, dequantize_fp4_1x32(weight[indices],
             scale[indices], x.dtype))`.

Index range. CPU (the reference): an index outside [-E, E) raises IndexError naming `indices` and the bad value.
CUDA (Triton): not checked on the host, which would need a device-to-host sync per call and break CUDA-graph
capture; the kernel never reads outside `weight` / `scale` (an invalid expert's loads are masked off) and writes
NaN to every element of y[n, j, :] whose index is invalid, so the error shows up in the output, not as a silent
wrong expert or a memory fault.

Kernels. With act_quant, bf16 / fp32 x and at least `WORDS_MIN_CODES_ACT_QUANT` codes per call, when no plan option
is given, launches run the tensor-core fragment GEMV of `grouped_frag.py` (E2M1 decoded to E4M3 straight into
`mma.sync` fragments; 17.6 / 19.6 us at the h200 shapes, `FRAG_DEFAULT`; `frag=False` refuses it). Otherwise, for
bf16 / fp32 x (and with act_quant, at least `WORDS_MIN_CODES_ACT_QUANT` codes per call), launches run the
word-decode GEMV of `grouped_words.py` (two codes per integer operation, one-warp programs; measured 32.1 / 31.4 us
at the h200 shapes against 37.1 / 36.7 us for the tile kernel below, bench/results/2026-12-01_h200_s19);
`words=False` keeps the tile kernel, which also takes fp16 x and weights that cannot be read as int32 words.
Tile kernel. Program (out-tile, k-split, pair) loads the pair's expert id, then multiplies K_ITERS [BLOCK_N, BLOCK_K]
tiles of that expert's packed weight by the pair's x row with `quant_gemv.gemv_tile` (FP8 1x32 activation quant
inside, FP32 accumulation; or `quant_gemv.mma_tile` on the tensor cores with `mma=True`); the K splits of an
output tile combine through the split-K arrival counters of `_common.split_k_counters`, exactly as `quant_gemv`
does (last program to arrive sums the partials in split order: deterministic). Block sizes come from
`quant_gemv.gemv_plan` for M = 1 (`grouped_gemv_plan`), so a batch-1 decode step of the h200 preset (k = 6;
w1/w3: out = 2304, K = 5120) runs 18 x 20 x 6 = 2160 programs of two 128 x 128 FP4 tiles (8 KiB of codes each).
Measured on the H200 (bench/results/2026-11-30_h200_s7_gemv): 37 us for w1 and for w2, 24 % of copy bandwidth;
the pipelined and tensor-core tile loops of `quant_gemv` take 42 / 59 us there.
Under PDL the program waits (`gdc_wait`) before reading its index (the router's top-k wrote it), so, unlike the
plain GEMV, weight loads cannot start before the previous kernel ends.

Numerics: codes and scales are decoded bit-exactly; sums are FP32 in another order than the reference's matmul,
then rounded once to x.dtype (the fp16 path repeats the reference's fp16 roundings), as in `quant_gemv`.

Only FP4 1x32 experts exist in the model: the shared expert is block-FP8 but is a plain `Linear`
(`dsv41::linear_fp8_block`), never gathered, so there is no block-FP8 grouped variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref import gemv as _ref

from ._common import (check_same_device, check_tensor, is_interpreted, register_cuda, require_launchable,
                      split_k_workspace, use_pdl_for)
from .gemv_tiles import gemv_tile, grouped_store, mma_tile, pair_expert, scale_words
from .quant_gemv import check_mma_dtype, device_sm_count, gemv_plan, split_rows_overrides

__all__ = ["grouped_linear_fp4", "reference_grouped_linear_fp4", "triton_grouped_linear_fp4", "grouped_gemv_plan",
           "grouped_linear_fp4_pair", "reference_grouped_linear_fp4_pair", "triton_grouped_linear_fp4_pair",
           "MAX_TRITON_PAIRS", "MMA_WORDS_DEFAULT", "WORDS_DEFAULT", "WORDS_MIN_CODES_ACT_QUANT", "FRAG_DEFAULT",
           "takes_words_by_default", "words_by_default_for", "takes_frag_by_default", "frag_by_default_for",
           "PAIR_ONE_LAUNCH"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Most (token, expert) pairs one launch takes: the pair is grid dimension 2, limited to 65535 by CUDA. The
#: model's gather path has N * k <= E (at most 384 pairs); beyond the limit the CUDA op runs the reference.
MAX_TRITON_PAIRS = 65535


# ------------------------------------------------------------------------------------------- checks
def _check_args(x, weight, scale, indices):
    """Validate shapes/dtypes/devices; return (N, k, E, out, K, shared). Errors name the argument at fault."""
    check_tensor("x", x, dtypes=_FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=(torch.uint8,), ndim=3)
    check_tensor("scale", scale, dtypes=(torch.uint8,), ndim=3)
    check_tensor("indices", indices, dtypes=(torch.int64,), ndim=2)
    check_same_device(x=x, weight=weight, scale=scale, indices=indices)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [N, K] or [N, k, K], got shape {tuple(x.shape)}")
    n, k = indices.shape
    if x.shape[0] != n or (x.dim() == 3 and x.shape[1] != k):
        want = f"[{n}, K] or [{n}, {k}, K]"
        raise ValueError(f"x has shape {tuple(x.shape)}; indices {tuple(indices.shape)} need x {want}")
    kk = x.shape[-1]
    if kk % 32:
        raise ValueError(f"x.shape[-1] = {kk} must be divisible by 32 (1x32 activation quantisation)")
    e, out = weight.shape[0], weight.shape[1]
    if weight.shape[2] * 2 != kk:
        raise ValueError(f"packed FP4 weight {tuple(weight.shape)} does not match K = {kk} "
                         f"(expected [E, out, {kk // 2}])")
    if tuple(scale.shape) != (e, out, kk // 32):
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected {(e, out, kk // 32)} for weight "
                         f"{tuple(weight.shape)}")
    return n, k, e, out, kk, x.dim() == 2


def _check_index_range(indices: torch.Tensor, e: int) -> None:
    # Host-side check (a sync): only the CPU reference does it; see the module docstring for CUDA.
    if indices.numel() == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < -e or hi >= e:
        bad = lo if lo < -e else hi
        raise IndexError(f"indices holds expert {bad}, out of range for weight with E = {e} experts "
                         f"(valid: -{e} .. {e - 1})")


# ------------------------------------------------------------------------------------------- reference
def reference_grouped_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, indices: torch.Tensor,
                                 act_quant: bool) -> torch.Tensor:
    """Plain-PyTorch `dsv41::grouped_linear_fp4`: the model's gather -> dequantise -> einsum.

    Args:
        x: [N, K] (shared by the k experts of a token) or [N, k, K]; fp32/bf16/fp16, K % 32 == 0.
        weight: uint8 [E, out, K/2] packed E2M1. scale: uint8 [E, out, K/32] UE8M0.
        indices: int64 [N, k], values in [-E, E). act_quant: fake-quantise x to FP8 1x32 first.
    Returns: [N, k, out] in x.dtype.
    Raises: TypeError / ValueError for wrong dtypes or shapes, IndexError for an index outside [-E, E) (all name
        the argument).
    Source: dsv41/model/moe.py `RoutedExperts.forward_gather` / `dequantized_weight`; MODEL.md §2.9, §2.1.
    """
    _, _, e, _, _, _ = _check_args(x, weight, scale, indices)
    _check_index_range(indices, e)
    return _ref.grouped_linear_fp4(x, weight, scale, indices, act_quant)


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _grouped_gemv_kernel(
    x_ptr, w_ptr, s_ptr, idx_ptr, y_ptr, part_ptr, cnt_ptr,
    P, N_OUT, K, E, X_ROW_DIV, stride_xr, stride_we, stride_wn, stride_se, stride_sn,
    ACT_QUANT: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr, K_ITERS: tl.constexpr,
    STAGES: tl.constexpr, SCALE_WORDS: tl.constexpr, MMA: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (n-tile, k-split, pair): pair = token * k + slot owns y[pair, n-tile]; it reads the x row
    # pair // X_ROW_DIV (X_ROW_DIV = k when the token's row is shared by its experts, else 1).
    NKB: tl.constexpr = BLOCK_K // 32
    X_FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.arange(0, NKB)
    j32 = tl.arange(0, 32)
    e_ok, e_safe, n_ok = pair_expert(idx_ptr, pair, E, offs_n, N_OUT, USE_PDL)
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xr
    w_exp = w_ptr + e_safe * stride_we
    s_exp = s_ptr + e_safe * stride_se
    zero = pair * 0  # a tensor 0 (the tile helper calls .to() on its row index)
    offs_m = tl.arange(0, 1)
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    # Software-pipelined K loop (STAGES > 1: tile it + STAGES - 1 is copied while tile it is multiplied); bf16 x
    # multiplies on the tensor cores (`quant_gemv.mma_tile`), other dtypes on the CUDA cores.
    if MMA:
        acc_t = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        for it in tl.range(0, K_ITERS, num_stages=STAGES):
            acc_t = mma_tile(x_row, w_exp, s_exp, acc_t, offs_n, n_ok, (pid_k * K_ITERS + it) * BLOCK_K, zero, 1,
                              K, 0, stride_wn, stride_sn, True, ACT_QUANT, 1, BLOCK_N, BLOCK_K, 16, SCALE_WORDS,
                              DOT_F32)
        acc += tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :], acc_t, 0.0), axis=1)[None, :]
    else:
        for it in tl.range(0, K_ITERS, num_stages=STAGES):
            acc = gemv_tile(x_row, w_exp, s_exp, acc, offs_n, n_ok, offs_m, kb, j32,
                             (pid_k * K_ITERS + it) * BLOCK_K, zero, 1, K, 0, stride_wn, stride_sn,
                             True, ACT_QUANT, X_FP16, 1, BLOCK_N, NKB, False, SCALE_WORDS)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    grouped_store(tl.sum(acc, axis=0), e_ok, offs_n, pair, pid_n, pid_k, y_ptr, part_ptr, cnt_ptr, P, N_OUT,
                   SPLIT_K, SPLIT_POW2)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def grouped_gemv_plan(pairs: int, n: int, k: int, **overrides) -> dict:
    """Launch parameters for `pairs` (token, expert) pairs of an [n, k] FP4 expert weight.

    `quant_gemv.gemv_plan(1, n, k, fp4=True, groups=pairs)`: one x row per pair, the K split sized over every
    pair's tiles (the heuristic and its H200 measurements are documented there); the grid is (n tiles, K splits,
    pairs). `overrides` (block_n, block_k, num_warps, k_iters, stages, sm_count, mma, maxnreg) are passed on. Returns
    gemv_plan's dict with `grid` replaced. Raises ValueError as gemv_plan does, and for early_launch (a plan option
    of `quant_gemv`'s own kernel, which the grouped tile kernel does not have).
    """
    if overrides.get("early_launch") not in (None, False):
        raise ValueError("early_launch applies to quant_gemv's GEMV kernels, not to the grouped expert GEMV")
    overrides.pop("early_launch", None)
    plan = gemv_plan(1, n, k, True, groups=pairs, **overrides)
    n_tiles, split_k, _ = plan["grid"]
    return dict(plan, grid=(n_tiles, split_k, pairs))


#: Whether CUDA launches take the word-decode tensor-core kernel (`grouped_mma`) where it applies
#: (`grouped_mma.mma_words_eligible`, compute capability >= 9.0) when `mma_words` is not given. Off: it measured
#: 50-72 us against this module's 37 us at the h200 decode shapes (bench/results/2026-12-01_h200_s18). Applies
#: only to calls with no other override (a plan option picks the kernel it belongs to).
MMA_WORDS_DEFAULT = False

#: Whether launches take the CUDA-core word-decode kernel (`grouped_words`) where it applies
#: (`grouped_words.words_eligible`: bf16 / fp32 x, a weight readable as int32 words) when `words` is not given.
#: Applies only to calls with no other override (a plan option picks the kernel it belongs to) and, with act_quant,
#: from `WORDS_MIN_CODES_ACT_QUANT` codes per call. Measured on the
#: H200 (bench/results/2026-12-01_h200_s19, CUDA-graph replay, PDL): h200 decode shapes 32.1 / 31.4 us against
#: 37.1 / 36.7 us for the tile kernel (w1 / w2, act_quant); without act_quant 31.7 / 31.4 against 33.6 / 33.7.
#: End to end, h200 decode, same lease (bench/results/2026-12-02_h200_s20): 99.8 against 96.2 tok/s.
WORDS_DEFAULT = True
#: With act_quant the word-decode kernel adds a launch (the activation quantisation, `grouped_words.prepare_x`);
#: below this many codes per call (pairs x out x K) the default stays on the tile kernel: at the `small` shapes
#: (4 x 512 x 1024 = 2.1 M codes) it measured 5.3 / 5.1 us against 5.0 / 5.0 us, at h200's 70.8 M it wins.
WORDS_MIN_CODES_ACT_QUANT = 1 << 23


def _take_mma_words(x, weight, act_quant, overrides) -> bool:
    """Pop `mma_words` from `overrides` and decide whether this launch runs `grouped_mma`; then only its plan keys
    (`grouped_mma.MMA_WORDS_KEYS`, sm_count) may remain. Raises ValueError for mma_words=True where the kernel
    does not compute the reference's numbers, or for tile-loop options next to it."""
    from . import grouped_mma
    asked = overrides.pop("mma_words", None)
    if asked is None:
        asked = (MMA_WORDS_DEFAULT and not overrides and grouped_mma.mma_words_supported(x.device)
                 and grouped_mma.mma_words_eligible(x, weight, act_quant))
    elif asked and not grouped_mma.mma_words_eligible(x, weight, act_quant):
        raise ValueError("mma_words=True needs act_quant=True, bf16 or fp32 x and a weight readable as int32 words "
                         f"(got act_quant={act_quant}, x {x.dtype}, weight strides {weight.stride()})")
    if asked:
        _keep_only(overrides, grouped_mma.MMA_WORDS_KEYS, "mma_words")
    else:
        only = sorted(set(overrides) & {"programs_per_sm"})
        if only and not overrides.get("rows") and not overrides.get("words"):
            raise ValueError(f"{only} need mma_words=True here (the word-decode kernel; the row-streaming kernel, "
                             "rows=True, takes them too)")
    return bool(asked)


#: Whether launches with act_quant take the tensor-core fragment kernel (`grouped_frag`: E2M1 decoded to E4M3 in
#: registers, inline `mma.sync`) where it applies (`grouped_frag.frag_eligible`, `grouped_frag.frag_supported`,
#: at least `WORDS_MIN_CODES_ACT_QUANT` codes per call) when `frag` is not given; it then comes before the
#: word-decode kernel. Applies only to calls with no other override. Measured on the H200 (CUDA-graph replay, PDL,
#: bench/results/2026-12-02_h200_s21): h200 w1 / w3 19.3 us, w2 19.6 us against 32.2 / 31.6 us for `grouped_words`,
#: activation launches included; end to end (h200, same lease) 111.4 against 99.25 tok/s. At `small` it measured
#: 3.7 / 3.6 us against the tile kernel's 5.0 / 4.9 us but stays below the size threshold (launch census unchanged).
FRAG_DEFAULT = True


def frag_by_default_for(dtype: torch.dtype, act_quant: bool, pairs: int, out: int, k: int) -> bool:
    """The part of `takes_frag_by_default` that shapes and dtypes decide (what a compile-time pass can know):
    `FRAG_DEFAULT`, act_quant, x bf16 or fp32 and at least `WORDS_MIN_CODES_ACT_QUANT` codes (pairs x out x K)."""
    return (FRAG_DEFAULT and bool(act_quant) and pairs * out * k >= WORDS_MIN_CODES_ACT_QUANT
            and dtype in (torch.bfloat16, torch.float32))


def takes_frag_by_default(x: torch.Tensor, weight: torch.Tensor, act_quant: bool, pairs: int) -> bool:
    """Whether a launch with no plan option runs the fragment kernel (`grouped_frag`): `frag_by_default_for`
    (weight [E, out, K/2], x [..., K]), a layout it reads and a device it runs on."""
    from . import grouped_frag
    return (frag_by_default_for(x.dtype, act_quant, pairs, weight.shape[1], x.shape[-1])
            and grouped_frag.frag_eligible(x, weight, act_quant) and grouped_frag.frag_supported(x.device)
            and not _take_mma_words(x, weight, act_quant, {}))


def _take_frag(x, weight, act_quant, pairs, overrides) -> bool:
    """Pop `frag` from `overrides` and decide whether this launch runs `grouped_frag` (by default
    `takes_frag_by_default` with no other override); then only its plan keys (`grouped_frag.FRAG_KEYS`, sm_count)
    may remain. Raises ValueError for frag=True where the kernel does not compute the reference's numbers or the
    device has no FP8 `mma.sync`, or next to options of another kernel."""
    from . import grouped_frag
    asked = overrides.pop("frag", None)
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"frag={asked!r} must be True, False or None")
    if asked is None:
        asked = not overrides and takes_frag_by_default(x, weight, act_quant, pairs)
    elif asked and not grouped_frag.frag_eligible(x, weight, act_quant):
        raise ValueError("frag=True needs act_quant=True, bf16 or fp32 x and a weight readable as 16-byte vectors "
                         f"(got act_quant={act_quant}, x {x.dtype}, weight strides {weight.stride()}, address "
                         f"{'' if weight.data_ptr() % 16 == 0 else 'not '}16-byte aligned)")
    elif asked and not grouped_frag.frag_supported(x.device):
        raise ValueError(f"frag=True needs FP8 mma.sync (compute capability 8.9 or later); {x.device} has "
                         f"{torch.cuda.get_device_capability(x.device)}")
    return _keep_or_refuse(overrides, asked, grouped_frag.FRAG_KEYS, grouped_frag.FRAG_ONLY_KEYS, "frag",
                           "the fragment kernel")


def words_by_default_for(dtype: torch.dtype, act_quant: bool, pairs: int, out: int, k: int) -> bool:
    """The part of `takes_words_by_default` that shapes and dtypes decide (what a compile-time pass can know):
    `WORDS_DEFAULT`, x bf16 or fp32, and with act_quant at least `WORDS_MIN_CODES_ACT_QUANT` codes (pairs x out x K)."""
    big = not act_quant or pairs * out * k >= WORDS_MIN_CODES_ACT_QUANT
    return WORDS_DEFAULT and big and dtype in (torch.bfloat16, torch.float32)


def takes_words_by_default(x: torch.Tensor, weight: torch.Tensor, act_quant: bool, pairs: int) -> bool:
    """Whether a launch with no plan option runs the word-decode kernel (`grouped_words`): `_words_rule` and not
    the fragment kernel (`takes_frag_by_default`)."""
    return _words_rule(x, weight, act_quant, pairs) and not takes_frag_by_default(x, weight, act_quant, pairs)


def _words_rule(x: torch.Tensor, weight: torch.Tensor, act_quant: bool, pairs: int) -> bool:
    """`words_by_default_for` (weight [E, out, K/2], x [..., K]) and a layout the word-decode kernel reads
    (`grouped_words.words_eligible`): its default once the fragment kernel is out (not by default, or frag=False)."""
    from . import grouped_words
    return (words_by_default_for(x.dtype, act_quant, pairs, weight.shape[1], x.shape[-1])
            and grouped_words.words_eligible(x, weight))


def _take_words(x, weight, act_quant, pairs, overrides) -> bool:
    """Pop `words` from `overrides` and decide whether this launch runs `grouped_words` (by default: `WORDS_DEFAULT`,
    no other override, eligible arguments, and with act_quant at least `WORDS_MIN_CODES_ACT_QUANT` codes over the
    `pairs` (token, expert) pairs; called once the fragment kernel is out); then only its plan keys
    (`grouped_words.WORDS_KEYS`, sm_count) may remain.
    Raises ValueError for words=True with x or weight it does not take, or next to options of another kernel."""
    from . import grouped_words
    asked = overrides.pop("words", None)
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"words={asked!r} must be True, False or None")
    if asked is None:
        asked = not overrides and _words_rule(x, weight, act_quant, pairs)
    elif asked and not grouped_words.words_eligible(x, weight):
        raise ValueError("words=True needs bf16 or fp32 x and a weight readable as int32 words "
                         f"(got x {x.dtype}, weight strides {weight.stride()})")
    return _keep_or_refuse(overrides, asked, grouped_words.WORDS_KEYS, grouped_words.WORDS_ONLY_KEYS, "words",
                           "the word-decode kernel")


def _keep_or_refuse(overrides: dict, asked, keys, only_keys, flag: str, kernel: str) -> bool:
    """After `flag` (a kernel's option) was decided as `asked`: if it runs, `_keep_only` its keys; otherwise refuse
    the options only it takes (`only_keys`, ValueError naming them and `kernel`). Returns bool(asked)."""
    if asked:
        _keep_only(overrides, keys, flag)
    else:
        only = sorted(k for k in only_keys if overrides.get(k) is not None)
        if only:
            raise ValueError(f"{only} apply to {kernel} only ({flag}=True)")
    return bool(asked)


def _keep_only(overrides: dict, keys, flag: str) -> None:
    """Leave only `keys` and sm_count in `overrides` for the kernel `flag`=True picked. Options set to None / False
    say "not this" and are dropped; any other option is a ValueError naming it."""
    for key in [k for k, v in overrides.items() if v is None or v is False]:
        if key not in keys:
            del overrides[key]
    bad = sorted(set(overrides) - set(keys) - {"sm_count"})
    if bad:
        raise ValueError(f"options {bad} do not apply to {flag}=True (its keys: {list(keys) + ['sm_count']})")


def triton_grouped_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, indices: torch.Tensor,
                              act_quant: bool, **overrides) -> torch.Tensor:
    """Run the grouped Triton GEMV on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result and shape/dtype errors as `reference_grouped_linear_fp4`, except that indices are not
    range-checked: an index outside [-E, E) gives NaN in its y[n, j, :] (module docstring). `overrides`
    (block_n, block_k, num_warps, k_iters, stages, mma, sm_count, maxnreg) replace the `quant_gemv.gemv_plan`
    heuristic and pick the tile kernel; `frag=True` / `frag=False` force / refuse the tensor-core fragment kernel of
    `grouped_frag` (the default where `takes_frag_by_default`; overrides then `grouped_frag.FRAG_KEYS`);
    `words=True` / `words=False` force / refuse the word-decode kernel of `grouped_words` (the default where
    `takes_words_by_default`; overrides then `grouped_words.WORDS_KEYS`);
    `rows=True` runs the row-streaming kernel of `gemv_rows` instead (one launch for every pair; options
    as in `quant_gemv.split_rows_overrides`; measured slower on the H200); `mma_words=True` runs the word-decode
    tensor-core kernel of `grouped_mma` (overrides then `grouped_mma.MMA_WORDS_KEYS`; default `MMA_WORDS_DEFAULT`).
    Raises: RuntimeError on CPU tensors without the interpreter; ValueError for more than `MAX_TRITON_PAIRS`
        (token, expert) pairs, for mma=True with x not bf16, for words=True with fp16 x or a weight that is not
        word-readable, for frag=True without act_quant, with fp16 x, a weight not readable as 16-byte vectors or a
        GPU without FP8 mma.sync, for more than one of words / mma_words / frag set True, for invalid plan values
        and for mixing the options of different kernels.
    """
    n, k, e, out, kk, shared = _check_args(x, weight, scale, indices)
    if sum(bool(overrides.get(f)) for f in ("words", "mma_words", "frag")) > 1:
        raise ValueError("words=True, mma_words=True and frag=True pick different kernels; give one")
    words_mode = _take_mma_words(x, weight, act_quant, overrides)
    frag = False if words_mode else _take_frag(x, weight, act_quant, n * k, overrides)
    cuda_words = False if words_mode or frag else _take_words(x, weight, act_quant, n * k, overrides)
    check_mma_dtype(x, overrides)
    overrides.setdefault("sm_count", device_sm_count(x.device))
    rows = None if words_mode or cuda_words or frag else split_rows_overrides(overrides, 1, True)
    require_launchable(_grouped_gemv_kernel, x.device, "triton_grouped_linear_fp4")
    pairs = n * k
    if pairs > MAX_TRITON_PAIRS:
        raise ValueError(f"{pairs} (token, expert) pairs exceed the {MAX_TRITON_PAIRS} one launch takes")
    if pairs == 0 or out == 0:
        return _empty((n, k, out), x.dtype, x.device)
    if kk == 0:  # an empty sum: zeros, as the reference's einsum gives
        return torch.zeros((n, k, out), dtype=x.dtype, device=x.device)
    x2 = x.reshape(n if shared else pairs, kk)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    idx = indices.reshape(pairs).contiguous()
    if rows is not None:
        from . import gemv_rows
        plan = gemv_rows.rows_plan(out, kk, True, pairs=pairs, **rows)
        return gemv_rows.launch_rows(x2, weight, scale, act_quant, True, plan, indices=idx,
                                     x_row_div=k if shared else 1, pairs=pairs).reshape(n, k, out)
    y = _empty((n, k, out), x.dtype, x.device)
    if words_mode:
        from . import grouped_mma
        plan = grouped_mma.grouped_mma_plan(pairs, out, kk, **overrides)
        n_tiles, split_k, _ = plan["grid"]
        part, cnt = split_k_workspace(_empty, x.device, split_k, (pairs, out), n_tiles * pairs)
        grouped_mma.launch_grouped_mma(x2, weight, scale, idx, y.view(pairs, out), part, cnt, k if shared else 1,
                                       plan, grouped_mma.pdl_for(x.device))
        return y
    if frag:
        from . import grouped_frag
        plan = grouped_frag.grouped_frag_plan(pairs, out, kk, **overrides)
        pdl = grouped_frag.pdl_for(x.device)
        xq, xs = grouped_frag.prepare_frag_x(x2, _empty, pdl)
        return _launch_frag(xq, xs, weight, scale, idx, y, k if shared else 1, plan, pdl)
    if cuda_words:
        from . import grouped_words
        plan = grouped_words.grouped_words_plan(pairs, out, kk, **overrides)
        pdl = grouped_words.pdl_for(x.device)
        xw = grouped_words.prepare_x(x2, act_quant, plan["X_PERM"], _empty, pdl)
        return _launch_words(xw, weight, scale, idx, y, k if shared else 1, plan, pdl)
    plan = grouped_gemv_plan(pairs, out, kk, **overrides)
    n_tiles, split_k, _ = plan["grid"]
    # Scale words only where the K loop is pipelined (cp.async copies 4+ bytes); the tile-at-once layout keeps
    # its byte loads, as measured (equal times on the H200, fewer registers with Triton 3.9).
    words = scale_words(scale, kk, plan["BLOCK_K"]) if plan["STAGES"] > 1 else None
    if words is not None:
        scale = words
    part, cnt = split_k_workspace(_empty, x.device, split_k, (pairs, out), n_tiles * pairs)
    pdl = use_pdl_for(_grouped_gemv_kernel, x.device)
    extra = {"launch_pdl": True} if pdl else {}
    if plan["MAXNREG"] is not None:
        extra["maxnreg"] = plan["MAXNREG"]
    _grouped_gemv_kernel[plan["grid"]](
        x2, weight, scale, idx, y, part, cnt,
        pairs, out, kk, e, k if shared else 1, x2.stride(0), weight.stride(0), weight.stride(1), scale.stride(0),
        scale.stride(1),
        ACT_QUANT=bool(act_quant), SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"],
        STAGES=plan["STAGES"], SCALE_WORDS=words is not None, MMA=plan["MMA"],
        DOT_F32=is_interpreted(_grouped_gemv_kernel), BLOCK_N=plan["BLOCK_N"],
        BLOCK_K=plan["BLOCK_K"], USE_PDL=pdl, num_warps=plan["num_warps"], **extra)
    return y


def _launch_words(xw, weight, scale, idx, y, x_row_div: int, plan: dict, pdl: bool) -> torch.Tensor:
    """One `grouped_words` launch into y [N, k, out] from prepared activation rows xw (`grouped_words.prepare_x`)."""
    from . import grouped_words
    pairs, out = idx.numel(), weight.shape[1]
    n_tiles, split_k, _ = plan["grid"]
    part, cnt = split_k_workspace(_empty, y.device, split_k, (pairs, out), n_tiles * pairs)
    grouped_words.launch_grouped_words(xw, weight, scale, idx, y.view(pairs, out), part, cnt, x_row_div, plan, pdl)
    return y


def _launch_frag(xq, xs, weight, scale, idx, y, x_row_div: int, plan: dict, pdl: bool) -> torch.Tensor:
    """One `grouped_frag` launch into y [N, k, out] from prepared activations (`grouped_frag.prepare_frag_x`)."""
    from . import grouped_frag
    pairs, out = idx.numel(), weight.shape[1]
    n_tiles, split_k, _ = plan["grid"]
    part, cnt = split_k_workspace(_empty, y.device, split_k, (pairs, out), n_tiles * pairs)
    grouped_frag.launch_grouped_frag(xq, xs, weight, scale, idx, y.view(pairs, out), part, cnt, x_row_div, plan, pdl)
    return y


#: Whether the pair op runs both fragment GEMVs in one launch (`grouped_frag.launch_grouped_frag(second=...)`) where
#: `grouped_frag.paired_launch_fits`: one grid, one ramp and tail. h200 w1 + w3 (6 of 96 experts, CUDA-graph replay,
#: PDL, the activation launch included): 30.87 us for the two as one [E, 2 N] stack against 33.85 us as two launches
#: (bench/results/2026-12-02_h200_s23, sibling_probe.json).
PAIR_ONE_LAUNCH = True


def triton_grouped_linear_fp4_pair(x: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor,
                                   weight_b: torch.Tensor, scale_b: torch.Tensor, indices: torch.Tensor,
                                   act_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two grouped FP4 GEMVs of the same x and experts (the MoE's w1 and w3): `(y_a, y_b)` =
    `(triton_grouped_linear_fp4(x, weight_a, scale_a, indices, act_quant), ... weight_b, scale_b ...)`.

    Where both launches take the fragment kernel (`takes_frag_by_default`) or the word-decode kernel
    (`takes_words_by_default`) by default with act_quant (not the tensor-core `grouped_mma` by
    `MMA_WORDS_DEFAULT`, the same weight shape), x is FP8-quantised once (`grouped_frag.prepare_frag_x` or
    `grouped_words.prepare_x`, one launch) and both GEMVs read that copy: one launch fewer than two separate calls,
    the same numbers (the preparation is a pure function of x). The two fragment GEMVs themselves run as one launch
    where `PAIR_ONE_LAUNCH` and `grouped_frag.paired_launch_fits` (the same numbers: each program computes what it
    would alone).
    Otherwise the two calls run as they would alone.
    Same arguments (each weight / scale as in `reference_grouped_linear_fp4`), results and errors as the two calls
    (a ValueError about the second weight starts with "weight_b / scale_b").
    """
    n, k, e, out, kk, shared = _check_args(x, weight_a, scale_a, indices)
    try:
        _check_args(x, weight_b, scale_b, indices)
    except ValueError as err:
        raise ValueError(f"weight_b / scale_b: {err}") from None
    pairs = n * k
    shareable = act_quant and weight_a.shape == weight_b.shape and 0 < pairs <= MAX_TRITON_PAIRS and out > 0 and kk > 0
    frag = shareable and all(takes_frag_by_default(x, w, True, pairs) for w in (weight_a, weight_b))
    words = shareable and not frag and all(takes_words_by_default(x, w, True, pairs)
                                           and not _take_mma_words(x, w, True, {}) for w in (weight_a, weight_b))
    if frag or words:
        require_launchable(_grouped_gemv_kernel, x.device, "triton_grouped_linear_fp4_pair")
        x2 = x.reshape(n if shared else pairs, kk)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        idx = indices.reshape(pairs).contiguous()
        ws = [(w, s if s.stride(-1) == 1 else s.contiguous()) for w, s in ((weight_a, scale_a), (weight_b, scale_b))]
        if frag:
            from . import grouped_frag
            plan = grouped_frag.grouped_frag_plan(pairs, out, kk)
            pdl = grouped_frag.pdl_for(x.device)
            xq, xs = grouped_frag.prepare_frag_x(x2, _empty, pdl)
            ys = [_empty((n, k, out), x.dtype, x.device) for _ in ws]
            (wa, sa), (wb, sb) = ws
            if PAIR_ONE_LAUNCH and grouped_frag.paired_launch_fits(wa, sa, ys[0].view(pairs, out), wb, sb,
                                                                   ys[1].view(pairs, out)):
                n_tiles, split_k, _ = plan["grid"]
                part, cnt = split_k_workspace(_empty, x.device, split_k, (2 * pairs, out), n_tiles * 2 * pairs)
                grouped_frag.launch_grouped_frag(xq, xs, wa, sa, idx, ys[0].view(pairs, out), part, cnt,
                                                 k if shared else 1, plan, pdl,
                                                 second=(wb, sb, ys[1].view(pairs, out)))
                return tuple(ys)
            return tuple(_launch_frag(xq, xs, w, s, idx, y, k if shared else 1, plan, pdl)
                         for (w, s), y in zip(ws, ys))
        from . import grouped_words
        plan = grouped_words.grouped_words_plan(pairs, out, kk, sm_count=device_sm_count(x.device))
        pdl = grouped_words.pdl_for(x.device)
        xw = grouped_words.prepare_x(x2, True, plan["X_PERM"], _empty, pdl)
        return tuple(_launch_words(xw, w, s, idx, _empty((n, k, out), x.dtype, x.device), k if shared else 1, plan,
                                   pdl) for w, s in ws)
    return (triton_grouped_linear_fp4(x, weight_a, scale_a, indices, act_quant),
            triton_grouped_linear_fp4(x, weight_b, scale_b, indices, act_quant))


def reference_grouped_linear_fp4_pair(x: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor,
                                      weight_b: torch.Tensor, scale_b: torch.Tensor, indices: torch.Tensor,
                                      act_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `dsv41::grouped_linear_fp4_pair`: `reference_grouped_linear_fp4` for each weight (see it for
    shapes, dtypes and errors)."""
    return (reference_grouped_linear_fp4(x, weight_a, scale_a, indices, act_quant),
            reference_grouped_linear_fp4(x, weight_b, scale_b, indices, act_quant))


# ------------------------------------------------------------------------------------------- op
@torch.library.custom_op("dsv41::grouped_linear_fp4", mutates_args=(), device_types="cpu")
def grouped_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, indices: torch.Tensor,
                       act_quant: bool) -> torch.Tensor:
    """`y[n, j] = fq8(x[n] or x[n, j]) @ dequant_fp4(weight[indices[n, j]])^T`; see the module docstring."""
    return reference_grouped_linear_fp4(x, weight, scale, indices, act_quant)


@register_cuda(grouped_linear_fp4, "dsv41::grouped_linear_fp4")
def _grouped_linear_fp4_cuda(x, weight, scale, indices, act_quant):
    if indices.numel() <= MAX_TRITON_PAIRS:
        return triton_grouped_linear_fp4(x, weight, scale, indices, act_quant)
    return reference_grouped_linear_fp4(x, weight, scale, indices, act_quant)


@grouped_linear_fp4.register_fake
def _grouped_linear_fp4_fake(x, weight, scale, indices, act_quant):
    return x.new_empty((indices.shape[0], indices.shape[1], weight.shape[1]))


@torch.library.custom_op("dsv41::grouped_linear_fp4_pair", mutates_args=(), device_types="cpu")
def grouped_linear_fp4_pair(x: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor, weight_b: torch.Tensor,
                            scale_b: torch.Tensor, indices: torch.Tensor,
                            act_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(grouped_linear_fp4(x, weight_a, scale_a, ...), grouped_linear_fp4(x, weight_b, scale_b, ...))` for one x
    and one set of experts (MoE w1 / w3; the `grouped_pair` pass); see `triton_grouped_linear_fp4_pair`."""
    return reference_grouped_linear_fp4_pair(x, weight_a, scale_a, weight_b, scale_b, indices, act_quant)


@register_cuda(grouped_linear_fp4_pair, "dsv41::grouped_linear_fp4_pair")
def _grouped_linear_fp4_pair_cuda(x, weight_a, scale_a, weight_b, scale_b, indices, act_quant):
    if indices.numel() <= MAX_TRITON_PAIRS:
        return triton_grouped_linear_fp4_pair(x, weight_a, scale_a, weight_b, scale_b, indices, act_quant)
    return reference_grouped_linear_fp4_pair(x, weight_a, scale_a, weight_b, scale_b, indices, act_quant)


@grouped_linear_fp4_pair.register_fake
def _grouped_linear_fp4_pair_fake(x, weight_a, scale_a, weight_b, scale_b, indices, act_quant):
    return (x.new_empty((indices.shape[0], indices.shape[1], weight_a.shape[1])),
            x.new_empty((indices.shape[0], indices.shape[1], weight_b.shape[1])))
