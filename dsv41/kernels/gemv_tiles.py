"""Triton tiles shared by the GEMV kernels: weight / scale tile loads, E2M1 and E4M3 decoding, FP8 1x32 activation
fake-quantisation, the FMA and tensor-core tile products, the program-to-tile mapping and the split-K epilogues (of
the dense kernels and of the grouped-expert kernels).

The op modules (`quant_gemv`, `grouped_gemv`, `gemv_scaled`, `gemv_multi`) and their variants (`gemv_tma`,
`gemv_rows`, `gemv_frag`, `grouped_mma`, `grouped_frag`, `grouped_words`) import these; this module imports none
of them, so the variants no longer import their op module back for a tile (tests/test_layers.py).
Formats: MODEL.md §2.1 (E4M3 / E2M1 codes, UE8M0 scales, 1x32 activation blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (E2M1_HALF_SCALE, e2m1_value_scaled_down, e4m3_round, exp2_int, round_bf16, round_to,
                      split_k_merge_2d, ue8m0_exponent)

__all__ = ["load_weight_tile", "load_scale_tile", "decode_codes", "fake_quant_fp8_tile", "fp8_1x32_parts",
           "gemv_tile", "tile_products", "mma_tile", "program_tile", "store_gemv_result", "pair_expert",
           "grouped_store", "scale_words", "pick_operand", "weight_slot", "row_rstd", "rms_apply"]


@triton.jit
def load_weight_tile(w_ptr, s_ptr, offs_n, n_ok, kb, k0, K, stride_wn, stride_sn, FP4: tl.constexpr,
                      SCALE_WORDS: tl.constexpr):
    """(codes, scale bytes, k_ok) of the weight tile W[offs_n, k0 : k0 + 32 * NKB] (NKB = len(kb)), zero where
    masked: codes uint8 [BLOCK_N, NKB, 32] (E4M3) or [BLOCK_N, NKB, 16] (two E2M1 per byte), scale bytes (uint8,
    or int32 with SCALE_WORDS) [BLOCK_N, NKB] (one per row for FP4 1x32, per 32 rows for block FP8), k_ok [NKB]
    (32-block inside K).

    SCALE_WORDS: `s_ptr` / `stride_sn` address the scale rows as int32 words (four UE8M0 bytes, little-endian),
    which the software pipeliner can copy asynchronously; byte loads (SCALE_WORDS False) it cannot, and they stall
    every iteration on a DRAM round trip. Needs K % 128 == 0 and k0 % 128 == 0 (the caller checks).
    """
    k_ok = (k0 + kb * 32) < K
    w_mask = n_ok[:, None, None] & k_ok[None, :, None]
    if FP4:
        j16 = tl.arange(0, 16)
        w_raw = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
                        + (k0 // 2 + kb[None, :, None] * 16 + j16[None, None, :]), mask=w_mask, other=0)
    else:
        j32 = tl.arange(0, 32)
        w_raw = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
                        + (k0 + kb[None, :, None] * 32 + j32[None, None, :]), mask=w_mask, other=0)
    return w_raw, load_scale_tile(s_ptr, offs_n, n_ok, kb, k0, k_ok, stride_sn, FP4, SCALE_WORDS), k_ok


@triton.jit
def load_scale_tile(s_ptr, offs_n, n_ok, kb, k0, k_ok, stride_sn, FP4: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """UE8M0 bytes [BLOCK_N, NKB] of weight rows `offs_n` and the 32-blocks k0 / 32 + kb (0 where masked), one per
    row (FP4 1x32) or per 32 rows (block FP8); read as int32 words with SCALE_WORDS (see `load_weight_tile`)."""
    s_rows = offs_n if FP4 else offs_n // 32
    if SCALE_WORDS:
        s_off = s_rows[:, None].to(tl.int64) * stride_sn + (k0 // 128 + kb[None, :] // 4)
    else:
        s_off = s_rows[:, None].to(tl.int64) * stride_sn + (k0 // 32 + kb[None, :])
    s_raw = tl.load(s_ptr + s_off, mask=n_ok[:, None] & k_ok[None, :], other=0)
    if SCALE_WORDS:
        s_raw = (s_raw >> ((kb % 4) * 8)[None, :]) & 255
    return s_raw


@triton.jit
def decode_codes(w_raw, FP4: tl.constexpr, BLOCK_N: tl.constexpr, NKB: tl.constexpr):
    """FP32 values [BLOCK_N, NKB, 32] of the codes `load_weight_tile` returns: E4M3 exactly; E2M1 divided by 2^14
    (a four-instruction decode, see _common: callers multiply the scale by `E2M1_HALF_SCALE`)."""
    if FP4:
        c = w_raw.to(tl.int32)
        w3 = tl.reshape(tl.join(e2m1_value_scaled_down(c & 15), e2m1_value_scaled_down(c >> 4)), [BLOCK_N, NKB, 32])
    else:
        w3 = w_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return w3


@triton.jit
def fake_quant_fp8_tile(x):
    """formats.quantize_fp8_1x32 of fp32 `x` whose axis 1 is a 32-block (any rank >= 2), as values: q times its
    scale (`fp8_1x32_parts`)."""
    q, e = fp8_1x32_parts(x)
    return q * exp2_int(e)


@triton.jit
def fp8_1x32_parts(x):
    """(q, e) of formats.quantize_fp8_1x32 of fp32 `x` whose axis 1 is a 32-block (any rank >= 2): amax floored at
    1e-4, UE8M0 ceil scale byte e (int32, axis 1 kept with size 1) from the IEEE bits of amax / 448 (correctly
    rounded division), q = clamp(x / 2^(e-127), +-448) -> E4M3 RNE (fp32 values); NaN where x is NaN."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1, keep_dims=True), 1e-4)
    e = ue8m0_exponent(tl.math.div_rn(amax, 448.0))
    # The floor keeps e in [105, 247], so 2^(127-e) is a normal number and x * 2^(127-e) is exact.
    q = tl.minimum(tl.maximum(x * exp2_int(254 - e), -448.0), 448.0)
    qr = e4m3_round(tl.abs(q))
    # A NaN stays NaN (as in formats.quantize_fp8_1x32); the clamp above would have made it +-448.
    return tl.where(x != x, x, tl.where(q < 0, -qr, qr)), e


@triton.jit
def row_rstd(x_ptr, offs_m, M, K, stride_xm, eps, KP: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of each x row offs_m ([BLOCK_M] FP32 summed in FP32; finite garbage for rows past M),
    as `ref.norm.rms_norm_spelled` computes the statistic up to the order of its sum. KP = K rounded up to a power
    of two (a compile-time size): the chunks are unrolled so that every load of x is in flight at once (a loop of
    dependent L2 round trips in front of every program's K loop cost Llama-1B on an H100 500 against 629 tok/s)."""
    CH: tl.constexpr = 1024 if KP > 1024 else KP
    offs_k = tl.arange(0, CH)
    ss = tl.zeros([offs_m.shape[0], CH], dtype=tl.float32)
    for k0 in tl.static_range(0, KP, CH):
        kk = k0 + offs_k
        xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                     mask=(offs_m < M)[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
        ss += xt * xt
    return 1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def rms_apply(xv, r, nw, NORM: tl.constexpr, DT: tl.constexpr):
    """FP32 x values `xv` RMS-normalised by the statistic `r` (broadcast against xv) and weighted by FP32 `nw`
    (ignored by modes 3 and 6) as spelling NORM (1-6) of `ref.norm.NORM_SPELLINGS` rounds them to DT, returned in
    FP32."""
    y = xv * r
    if NORM == 1:
        y = round_to(round_to(y, DT) * nw, DT)
    elif NORM == 2:
        y = round_to(y * nw, DT)
    elif NORM == 3:
        y = round_to(y, DT)
    elif NORM == 4:
        y = round_to(y, DT) * nw
    elif NORM == 5:
        y = y * nw
    return y


@triton.jit
def gemv_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j32, k0, pid_m, M, K, stride_xm, stride_wn,
               stride_sn, FP4: tl.constexpr, ACT_QUANT: tl.constexpr, X_FP16: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, NKB: tl.constexpr, USE_PDL: tl.constexpr, SCALE_WORDS: tl.constexpr,
               nw_ptr=None, eps=0.0, NORM: tl.constexpr = 0, KP: tl.constexpr = 32):
    """acc [BLOCK_M, BLOCK_N] + x[:, k0:k0+32*NKB] @ dequant(W[offs_n, k0:k0+32*NKB])^T (one weight tile; scale
    addressing SCALE_WORDS as in `load_weight_tile`); with NORM (1-6) x is first RMS-normalised over its K
    (KP = K rounded up to a power of two) with weight `nw_ptr` [K] and `eps` (`tile_products`)."""
    # Weights and scales first: they never come from the previous kernel, so under PDL their reads
    # overlap that kernel's tail.
    w_raw, s_raw, k_ok = load_weight_tile(w_ptr, s_ptr, offs_n, n_ok, kb, k0, K, stride_wn, stride_sn, FP4,
                                           SCALE_WORDS)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    return tile_products(x_ptr, w_raw, s_raw, k_ok, acc, offs_m, kb, j32, k0, pid_m, M, stride_xm, FP4, ACT_QUANT,
                          X_FP16, BLOCK_M, BLOCK_N, NKB, nw_ptr, eps, K, NORM, KP)


@triton.jit
def tile_products(x_ptr, w_raw, s_raw, k_ok, acc, offs_m, kb, j32, k0, pid_m, M, stride_xm, FP4: tl.constexpr,
                   ACT_QUANT: tl.constexpr, X_FP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   NKB: tl.constexpr, nw_ptr=None, eps=0.0, K=0, NORM: tl.constexpr = 0, KP: tl.constexpr = 32):
    """acc [BLOCK_M, BLOCK_N] + fq8(x[:, k0:k0+32*NKB]) @ dequant(tile)^T for a loaded weight tile: codes `w_raw`
    and UE8M0 bytes `s_raw` as `load_weight_tile` returns them (zero where masked), `k_ok` [NKB] the 32-blocks
    inside K. x rows pid_m * BLOCK_M + (0 .. BLOCK_M-1) below M are read here (after any PDL wait).
    NORM (1-6, `ref.norm.NORM_SPELLINGS`): x is RMS-normalised first (`row_rstd` over its K columns, KP = K rounded
    up to a power of two, `rms_apply` with weight `nw_ptr` [K] of x's dtype, modes 3 / 6 none) before the
    quantisation, as `ref.gemv.linear_fp8_block(norm_mode=NORM)` computes it."""
    # Decode to FP32 codes [BLOCK_N, NKB, 32] and the UE8M0 scales 2^(e-127) [BLOCK_N, NKB]. FP4 codes are
    # decoded divided by 2^14 (a four-instruction decode, see _common) and multiplied back per block sum.
    sw = exp2_int(s_raw.to(tl.int32))
    if X_FP16:
        # Reference: codes.to(fp16) * scale.to(fp16), rounded in fp16.
        s16 = sw.to(tl.float16).to(tl.float32)
    w3 = decode_codes(w_raw, FP4, BLOCK_N, NKB)
    if FP4:
        sw = sw * E2M1_HALF_SCALE  # exact unless the scale exceeds 2^113 (UE8M0 byte > 240)
        if X_FP16:
            s16 = s16 * E2M1_HALF_SCALE
    if X_FP16:
        w3 = (w3 * s16[:, :, None]).to(tl.float16).to(tl.float32)

    if NORM != 0:
        rstd = row_rstd(x_ptr, offs_m, M, K, stride_xm, eps, KP)
        if NORM != 3 and NORM != 6:
            nw = tl.load(nw_ptr + (k0 + kb[:, None] * 32 + j32[None, :]), mask=k_ok[:, None], other=0.0
                         ).to(tl.float32)
        else:
            nw = 1.0
    for mm in tl.static_range(BLOCK_M):
        m = pid_m * BLOCK_M + mm
        # Row validity as a vector: the interpreter mis-types scalar-bool & block-bool (int32 mask).
        m_ok = (j32 * 0 + m) < M
        xv = tl.load(x_ptr + m.to(tl.int64) * stride_xm + (k0 + kb[:, None] * 32 + j32[None, :]),
                     mask=k_ok[:, None] & m_ok[None, :], other=0.0).to(tl.float32)
        if NORM != 0:
            r = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
            xv = rms_apply(xv, r, nw, NORM, x_ptr.dtype.element_ty)
        if ACT_QUANT:
            xq = fake_quant_fp8_tile(xv)
            if X_FP16:
                xq = xq.to(tl.float16).to(tl.float32)
        else:
            xq = xv
        # Per 32-block dot of codes, times the power-of-two weight scale (exact), summed over blocks.
        part = tl.sum(w3 * xq[None, :, :], axis=2)
        if not X_FP16:
            part = part * sw
        acc += tl.where((offs_m == m)[:, None], tl.sum(part, axis=1)[None, :], 0.0)

    return acc


@triton.jit
def mma_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, k0, pid_m, M, K, stride_xm, stride_wn, stride_sn,
              FP4: tl.constexpr, ACT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, MMA_N: tl.constexpr, SCALE_WORDS: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BLOCK_N, MMA_N] + dequant(W[offs_n, k0:k0+BLOCK_K]) @ fq8(x[m-tile, k0:k0+BLOCK_K])^T on the tensor
    cores, for bf16 x: the weight tile is dequantised to bf16 (code x UE8M0 scale, exact, as the reference's
    dequantize to x.dtype rounds it) and x is fake-quantised to E4M3 x UE8M0 values, also exact in bf16, so the
    bf16 MMA with FP32 accumulation computes the reference's F.linear. Columns >= BLOCK_M of the x^T operand are
    zero (an MMA needs MMA_N >= 16). Scale addressing (SCALE_WORDS) as in `load_weight_tile`. DOT_F32 (the
    interpreter, whose bf16 tl.dot is wrong in Triton 3.9: errors of 2e10 on a 16 x 16 product of randn values)
    multiplies the same bf16 values in FP32."""
    NKB: tl.constexpr = BLOCK_K // 32
    kb = tl.arange(0, NKB)
    w_raw, s_raw, k_ok = load_weight_tile(w_ptr, s_ptr, offs_n, n_ok, kb, k0, K, stride_wn, stride_sn, FP4,
                                           SCALE_WORDS)
    w3 = decode_codes(w_raw, FP4, BLOCK_N, NKB)
    sw = exp2_int(s_raw.to(tl.int32))
    if FP4:
        sw = sw * E2M1_HALF_SCALE  # exact unless the UE8M0 byte exceeds 240
    w_bf16 = tl.reshape((w3 * sw[:, :, None]).to(tl.bfloat16), [BLOCK_N, BLOCK_K])

    # x^T tile [BLOCK_K, MMA_N]; one real row for M = 1 (quantised once, then widened), else MMA_N rows.
    offs_k = k0 + tl.arange(0, BLOCK_K)
    XN: tl.constexpr = 1 if BLOCK_M == 1 else MMA_N
    offs_x = pid_m * BLOCK_M + tl.arange(0, XN)
    x_ok = (offs_x < M) & (offs_x < pid_m * BLOCK_M + BLOCK_M)
    xv = tl.load(x_ptr + offs_x[None, :].to(tl.int64) * stride_xm + offs_k[:, None],
                 mask=(offs_k < K)[:, None] & x_ok[None, :], other=0.0).to(tl.float32)
    if ACT_QUANT:
        xv = tl.reshape(fake_quant_fp8_tile(tl.reshape(xv, [NKB, 32, XN])), [BLOCK_K, XN])
    if BLOCK_M == 1:
        xt = tl.where((tl.arange(0, MMA_N) == 0)[None, :], xv, 0.0)
    else:
        xt = xv
    if DOT_F32:
        return tl.dot(w_bf16.to(tl.float32), xt.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w_bf16, xt.to(tl.bfloat16), acc)


@triton.jit
def program_tile(N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NKB: tl.constexpr):
    """(pid_n, pid_k, pid_m, offs_n, offs_m, kb, j32, n_ok) of a GEMV program on the grid (n tiles, K splits,
    m tiles): its weight rows offs_n (n_ok: below N), x rows offs_m, the 32-blocks kb of a K tile, j32 within one."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_n, pid_k, pid_m, offs_n, offs_m, tl.arange(0, NKB), tl.arange(0, 32), offs_n < N


@triton.jit
def store_gemv_result(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, n_ok, pid_m, pid_n, pid_k, M, N, stride_ym,
                       SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """Write the [BLOCK_M, BLOCK_N] FP32 partial `acc` of program (pid_n, pid_k, pid_m) to y (rounded once to y's
    dtype), through the split-K merge when SPLIT_K > 1 (the last program of the output tile to arrive stores)."""
    mask_mn = (offs_m[:, None] < M) & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        total = acc
    else:
        p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        total, arrived = split_k_merge_2d(acc, p_ptrs, M * N, mask_mn, cnt_ptr, pid_m * tl.num_programs(0) + pid_n,
                                          pid_k, SPLIT_K, SPLIT_POW2)
        mask_mn = mask_mn & ((offs_n * 0 + arrived) == SPLIT_K - 1)[None, :]
    if y_ptr.dtype.element_ty == tl.bfloat16:
        total = round_bf16(total)  # RNE on the bits; exact for the cast below
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def pair_expert(idx_ptr, pair, E, offs_n, N_OUT, USE_PDL: tl.constexpr):
    """(e_ok [BLOCK_N] bool, e_safe int64, n_ok [BLOCK_N] bool) of the grouped kernels' (token, expert) `pair`:
    its expert index (negatives wrapped as `weight[indices]` does), whether it is inside [0, E), the index to read
    (0 for an invalid one, whose y row becomes NaN) and the rows offs_n to compute (< N_OUT, valid expert)."""
    if USE_PDL:
        # The expert index is the previous kernel's output (router top-k): wait before reading it.
        tl.extra.cuda.gdc_wait()
    e = tl.load(idx_ptr + pair)
    e = tl.where(e < 0, e + E, e)
    # Index validity as a vector (the interpreter mis-types scalar-bool & block-bool).
    e_vec = offs_n.to(tl.int64) * 0 + e
    e_ok = (e_vec >= 0) & (e_vec < E)
    e_safe = tl.where((e >= 0) & (e < E), e, 0).to(tl.int64)
    return e_ok, e_safe, (offs_n < N_OUT) & e_ok


@triton.jit
def grouped_store(acc1, e_ok, offs_n, pair, pid_n, pid_k, y_ptr, part_ptr, cnt_ptr, P, N_OUT,
                   SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """Epilogue of the grouped kernels (this module's and `grouped_mma`'s): store FP32 row sums `acc1` [BLOCK_N] of
    y[pair, offs_n], merging K splits through the arrival counters (the last program to arrive sums the partials
    in split order), rounded to y's dtype; NaN where the pair's expert index was invalid (`e_ok` False)."""
    out_ok = offs_n < N_OUT
    y_ptrs = y_ptr + pair.to(tl.int64) * N_OUT + offs_n
    if SPLIT_K == 1:
        total = acc1
        store_ok = out_ok
    else:
        p_ptrs = part_ptr + pair.to(tl.int64) * N_OUT + offs_n
        tl.store(p_ptrs + pid_k.to(tl.int64) * P * N_OUT, acc1, mask=out_ok)
        # Every thread's partial must be visible before the counter moves (release at GPU scope).
        tl.debug_barrier()
        tile = pair * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        total = tl.zeros_like(acc1)
        if arrived == SPLIT_K - 1:
            # All partials in one load, summed by a fixed tree over the split axis (deterministic); .cg reads L2.
            sp = tl.arange(0, SPLIT_POW2)
            parts = tl.load(p_ptrs[None, :] + sp[:, None].to(tl.int64) * P * N_OUT,
                            mask=(sp < SPLIT_K)[:, None] & out_ok[None, :], other=0.0, cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            tl.atomic_xchg(cnt_ptr + tile, 0)
        store_ok = out_ok & ((offs_n * 0 + arrived) == SPLIT_K - 1)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        total = round_bf16(total)  # RNE on the bits; exact for the cast below
    total = tl.where(e_ok, total, float("nan"))
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=store_ok)


def scale_words(scale: torch.Tensor, k: int, block_k: int) -> torch.Tensor | None:
    """`scale` (uint8 [..., K/32], last dim contiguous) viewed as int32 words of four UE8M0 bytes, or None when
    the pipelined kernel cannot read it that way (K or BLOCK_K not a multiple of 128, rows or start not 4-byte
    aligned, which also checks the address: memory from DLPack or `frombuffer` need not be): the kernel then loads
    bytes (`SCALE_WORDS` in `gemv_tile`)."""
    if (k % 128 or block_k % 128 or scale.storage_offset() % 4 or scale.data_ptr() % 4
            or any(st % 4 for st in scale.stride()[:-1])):
        return None
    return scale.view(torch.int32)


@triton.jit
def pick_operand(c1, c2, c3, v0, v1, v2, v3, COUNT: tl.constexpr):
    """v_i of the weight whose tile range holds this program (c_i: past the start of weight i's range), for the
    kernels that take up to four weights in one launch (`gemv_multi`, `gemv_frag`)."""
    v = tl.where(c1, v1, v0)
    if COUNT > 2:
        v = tl.where(c2, v2, v)
    if COUNT > 3:
        v = tl.where(c3, v3, v)
    return v


@triton.jit
def weight_slot(pid_g, N0, N1, N2, TILE: tl.constexpr, COUNT: tl.constexpr):
    """(c1, c2, c3, pid_n, col0) of program `pid_g` of a grid over up to four weights of N0, N1, N2, (N3) rows in
    tiles of TILE rows, weight i's tiles after weight i - 1's: c_i whether the program is past weight i's first tile
    (for `pick_operand`), pid_n its tile within its weight, col0 its weight's first column in the concatenated
    output (the split-K workspace offset). The multi-weight kernels of `gemv_multi`, `gemv_frag` and `half_gemv`."""
    p1 = tl.cdiv(N0, TILE)
    p2 = p1 + tl.cdiv(N1, TILE)
    p3 = p2 + tl.cdiv(N2, TILE)
    c1 = pid_g >= p1
    c2 = pid_g >= p2
    c3 = pid_g >= p3
    pid_n = pid_g - pick_operand(c1, c2, c3, 0, p1, p2, p3, COUNT)
    col0 = pick_operand(c1, c2, c3, 0, N0, N0 + N1, N0 + N1 + N2, COUNT)
    return c1, c2, c3, pid_n, col0
