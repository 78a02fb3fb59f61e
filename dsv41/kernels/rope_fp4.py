"""RoPE + FP4 E2M1 quantisation in one pass (`dsv41 report --patterns rope_fp4`).

The model rotates a latent (`dsv41.ref.rope.apply_rope`: interleaved pairs on the LAST R channels,
rotation in FP32, result cast back to x.dtype) and immediately quantises it to FP4 (MODEL.md §2.1):

- compressed main-KV bank: E2M1 with one E4M3 scale per 16 channels (`formats.quantize_fp4_e4m3_1x16`),
  selected by `scale_block=16, e4m3_scale=True`;
- index keys / index queries: E2M1 with one UE8M0 scale per 32 (`formats.quantize_fp4_ue8m0_1x32`),
  selected by `scale_block=32, e4m3_scale=False`.

Ops (all take x [..., D] fp32/bf16/fp16 and cos, sin fp32 broadcastable to [..., R/2], R = 2*cos.shape[-1]
<= D; the Triton path expands cos/sin to x's leading shape as stride-0 views, so pass them expanded or
broadcastable, never materialised per head):

- `dsv41::rope_fp4_quant(x, cos, sin, scale_block, e4m3_scale) -> (codes, scales)`:
  codes uint8 [..., D/2] (packed E2M1, low nibble = even channel), scales uint8 [..., D/scale_block]
  (E4M3 bytes or UE8M0 exponents).
- `dsv41::rope_fp4_fake_quant(...) -> y` [..., D] in x.dtype: the dequantised values (index queries).
- `dsv41::rope_fp4_quant_store(x, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows) -> ()`:
  x [B, T, D], rows int64 [B, T]; writes codes_cache[b, rows[b, t]] ([B, Rows, D/2]) and
  scale_cache[b, rows[b, t]] ([B, Rows, D/scale_block]) in place. Rows outside [0, Rows) are skipped
  (both implementations); when two tokens of a batch share a row (the model's trash row) which one lands is
  unspecified.

Kernel: one program per `ROWS` vectors, tile [ROWS, NB, HB] of channel pairs (NB scale blocks of HB =
scale_block/2 pairs); even/odd channels are loaded as two tensors so a RoPE pair is one lane. Bit-exactness
with the reference needs: FMA contraction off (`a*cos - b*sin` rounds after each op in eager PyTorch),
correctly rounded division (`div_rn`), and bf16 / E4M3 rounding done on the bits (see `_common`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref import rope_fp4 as _ref

from ._common import (check_same_device, check_tensor, e2m1_code, e2m1_value, fp4_block_scale, next_power_of_2,
                      register_cuda, require_launchable, round_bf16, use_pdl_for)

__all__ = [
    "rope_fp4_quant", "rope_fp4_fake_quant", "rope_fp4_quant_store",
    "reference_rope_fp4_quant", "reference_rope_fp4_fake_quant", "reference_rope_fp4_quant_store",
    "triton_rope_fp4_quant", "triton_rope_fp4_fake_quant", "triton_rope_fp4_quant_store",
    "FP4_MODES",
]

#: The two (scale_block, e4m3_scale) combinations the model uses (MODEL.md §2.1 block layout table).
FP4_MODES = ((16, True), (32, False))
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Elements of x one program handles (ROWS = this / padded D, at least 1): a few KB per program.
_ELEMS_PER_PROGRAM = 2048
_MAX_LEAD_DIMS = 4


# ------------------------------------------------------------------------------------------- checks
def check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale):
    """Check the arguments of the rope_fp4 ops (x [..., D] float, fp32 cos / sin, a mode of `FP4_MODES`); also
    used by the compressor ops, which end in the same write. Raises TypeError / ValueError naming the argument."""
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, min_ndim=1)
    check_tensor("cos", cos, dtypes=(torch.float32,), min_ndim=1)
    check_tensor("sin", sin, dtypes=(torch.float32,), min_ndim=1)
    check_same_device(x=x, cos=cos, sin=sin)
    if (int(scale_block), bool(e4m3_scale)) not in FP4_MODES:
        raise ValueError(f"(scale_block, e4m3_scale) = ({scale_block}, {e4m3_scale}) is not a supported FP4 mode; "
                         f"expected one of {FP4_MODES}")
    d = x.shape[-1]
    if d % scale_block:
        raise ValueError(f"x.shape[-1] = {d} must be divisible by scale_block = {scale_block}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    r = 2 * cos.shape[-1]
    if r > d:
        raise ValueError(f"rope width 2*cos.shape[-1] = {r} exceeds x.shape[-1] = {d}")
    try:
        lead = torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1])
    except RuntimeError:
        lead = None
    if lead != x.shape[:-1]:
        raise ValueError(f"cos/sin leading shape {tuple(cos.shape[:-1])} does not broadcast to x's "
                         f"{tuple(x.shape[:-1])}")


def check_store_args(x, rows, codes_cache, scale_cache, scale_block):
    """Check the cache arguments of a store op: x [B, T, D], rows int64 [B, T], codes_cache uint8 [B, Rows, D/2],
    scale_cache uint8 [B, Rows, D/scale_block], one device. Raises TypeError / ValueError naming the argument."""
    check_tensor("x", x, ndim=3)
    check_tensor("rows", rows, dtypes=(torch.int64,), ndim=2)
    check_tensor("codes_cache", codes_cache, dtypes=(torch.uint8,), ndim=3)
    check_tensor("scale_cache", scale_cache, dtypes=(torch.uint8,), ndim=3)
    check_same_device(x=x, rows=rows, codes_cache=codes_cache, scale_cache=scale_cache)
    b, t, d = x.shape
    if tuple(rows.shape) != (b, t):
        raise ValueError(f"rows has shape {tuple(rows.shape)}; expected {(b, t)} (x is {tuple(x.shape)})")
    n_rows = codes_cache.shape[1]
    if tuple(codes_cache.shape) != (b, n_rows, d // 2):
        raise ValueError(f"codes_cache has shape {tuple(codes_cache.shape)}; expected [{b}, rows, {d // 2}]")
    if tuple(scale_cache.shape) != (b, n_rows, d // scale_block):
        raise ValueError(f"scale_cache has shape {tuple(scale_cache.shape)}; expected "
                         f"[{b}, {n_rows}, {d // scale_block}]")


# ------------------------------------------------------------------------------------------- references
def reference_rope_fp4_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                             e4m3_scale: bool):
    """Plain-PyTorch `dsv41::rope_fp4_quant`: `quantize_fp4_*(apply_rope(x, cos, sin))`.

    Args:
        x: [..., D] fp32/bf16/fp16; the last R = 2*cos.shape[-1] channels are rotated as interleaved pairs.
        cos, sin: fp32, broadcastable to [..., R/2].
        scale_block, e4m3_scale: (16, True) = E4M3 scale per 16 (bank); (32, False) = UE8M0 per 32 (index).
    Returns: (codes uint8 [..., D/2], scales uint8 [..., D/scale_block]).
    Raises: TypeError / ValueError naming the bad argument (dtype, mode, D not divisible, R > D, shapes).
    Source: MODEL.md §2.1, §2.2; dsv41/ref/rope.py, dsv41/ref/formats.py.
    """
    check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale)
    return _ref.rope_fp4_quant(x, cos, sin, scale_block, e4m3_scale)


def reference_rope_fp4_fake_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                                  e4m3_scale: bool) -> torch.Tensor:
    """Plain-PyTorch `dsv41::rope_fp4_fake_quant`: `fake_quant_fp4_*(apply_rope(x, cos, sin))`, [..., D] x.dtype.

    Arguments and errors as `reference_rope_fp4_quant`. Source: dsv41/model/csa.py (index queries).
    """
    check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale)
    return _ref.rope_fp4_fake_quant(x, cos, sin, scale_block, e4m3_scale)


def reference_rope_fp4_quant_store(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                                   e4m3_scale: bool, codes_cache: torch.Tensor, scale_cache: torch.Tensor,
                                   rows: torch.Tensor) -> None:
    """Plain-PyTorch `dsv41::rope_fp4_quant_store`: quantise like `reference_rope_fp4_quant`, then write
    codes_cache[b, rows[b, t]] and scale_cache[b, rows[b, t]] for every (b, t) with 0 <= rows[b, t] < Rows.

    Args: x [B, T, D]; cos, sin broadcastable to [B, T, R/2]; rows int64 [B, T];
        codes_cache uint8 [B, Rows, D/2]; scale_cache uint8 [B, Rows, D/scale_block] (mutated).
    Raises: TypeError / ValueError naming the bad argument.
    Source: dsv41/model/attention.py `_update_csa` (bank and index-key writes).
    """
    check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale)
    check_store_args(x, rows, codes_cache, scale_cache, scale_block)
    _ref.rope_fp4_quant_store(x, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _rope_fp4_kernel(
    x_ptr, cos_ptr, sin_ptr, rows_ptr, out_ptr, outs_ptr,
    n_vec, L1, L2, L3,
    sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, sr2, sr3,
    so_a, so_b, sso_a, sso_b, cache_rows,
    D: tl.constexpr, R_HALF: tl.constexpr, SCALE_BLOCK: tl.constexpr, E4M3_SCALE: tl.constexpr,
    MODE: tl.constexpr, ROWS: tl.constexpr, NB_P2: tl.constexpr, USE_PDL: tl.constexpr,
):
    # MODE 0: codes + scales to contiguous outputs; 1: dequantised values; 2: codes + scales into cache rows.
    HB: tl.constexpr = SCALE_BLOCK // 2
    NB: tl.constexpr = D // SCALE_BLOCK
    P0: tl.constexpr = D // 2 - R_HALF  # first rotated pair
    pid = tl.program_id(0)
    r = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    r_ok = r < n_vec
    i3 = r % L3
    t = r // L3
    i2 = t % L2
    t = t // L2
    i1 = t % L1
    i0 = t // L1
    x_row = i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3
    c_row = i0 * sc0 + i1 * sc1 + i2 * sc2 + i3 * sc3
    s_row = i0 * ss0 + i1 * ss1 + i2 * ss2 + i3 * ss3

    nb = tl.arange(0, NB_P2)
    p = nb[:, None] * HB + tl.arange(0, HB)[None, :]  # pair index [NB_P2, HB]
    ok = r_ok[:, None, None] & (nb < NB)[None, :, None]
    ci = p - P0
    rot = (ci >= 0)[None, :, :]
    rot_ok = ok & rot

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    xe_ptr = x_ptr + x_row[:, None, None] + 2 * p[None, :, :]
    a = tl.load(xe_ptr, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(xe_ptr + 1, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + c_row[:, None, None] + ci[None, :, :], mask=rot_ok, other=1.0)
    s = tl.load(sin_ptr + s_row[:, None, None] + ci[None, :, :], mask=rot_ok, other=0.0)
    if MODE == 2:
        dst_row = tl.load(rows_ptr + i2 * sr2 + i3 * sr3, mask=r_ok, other=-1)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    # apply_rope: each product and the sum rounded separately (launched with FMA contraction off).
    ar = a * c - b * s
    br = a * s + b * c
    a = tl.where(rot, ar, a)
    b = tl.where(rot, br, b)
    # apply_rope casts the rotated slice back to x.dtype; the pass-through channels are already exact.
    if x_ptr.dtype.element_ty == tl.bfloat16:
        a = round_bf16(a)
        b = round_bf16(b)
    elif x_ptr.dtype.element_ty == tl.float16:
        a = a.to(tl.float16).to(tl.float32)
        b = b.to(tl.float16).to(tl.float32)

    amax = tl.maximum(tl.max(tl.abs(a), axis=2), tl.max(tl.abs(b), axis=2))  # [ROWS, NB_P2]
    scale, sbyte = fp4_block_scale(amax, E4M3_SCALE)
    code_a = e2m1_code(a, scale[:, :, None])
    code_b = e2m1_code(b, scale[:, :, None])

    if MODE == 1:
        va = e2m1_value(code_a) * scale[:, :, None]
        vb = e2m1_value(code_b) * scale[:, :, None]
        if out_ptr.dtype.element_ty == tl.bfloat16:
            va = round_bf16(va)
            vb = round_bf16(vb)
        y_ptr = out_ptr + r[:, None, None] * so_a + 2 * p[None, :, :]
        tl.store(y_ptr, va.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(y_ptr + 1, vb.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        packed = (code_a | (code_b << 4)).to(tl.uint8)
        if MODE == 2:
            w_ok = r_ok & (dst_row >= 0) & (dst_row < cache_rows)
            c_base = i2 * so_a + dst_row * so_b
            s_base = i2 * sso_a + dst_row * sso_b
        else:
            w_ok = r_ok
            c_base = r * so_a
            s_base = r * sso_a
        tl.store(out_ptr + c_base[:, None, None] + p[None, :, :], packed, mask=ok & w_ok[:, None, None])
        tl.store(outs_ptr + s_base[:, None] + nb[None, :], sbyte.to(tl.uint8),
                 mask=w_ok[:, None] & (nb < NB)[None, :])


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch(x, cos, sin, scale_block, e4m3_scale, mode, out, outs, rows=None):
    """Shared launch: pad leading dims to 4, expand cos/sin as stride-0 views, pick ROWS, launch."""
    require_launchable(_rope_fp4_kernel, x.device, "triton_rope_fp4_*")
    d = x.shape[-1]
    lead = tuple(x.shape[:-1])
    if len(lead) > _MAX_LEAD_DIMS:
        raise ValueError(f"x has {len(lead)} leading dims; the Triton path supports at most {_MAX_LEAD_DIMS}")
    n_vec = 1
    for s in lead:
        n_vec *= s
    if n_vec == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    r_half = cos.shape[-1]
    cos = cos.expand(*lead, r_half)
    sin = sin.expand(*lead, r_half)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    pad = _MAX_LEAD_DIMS - len(lead)
    sizes = (1,) * pad + lead
    sx = (0,) * pad + tuple(x.stride()[:-1])
    sc = (0,) * pad + tuple(cos.stride()[:-1])
    ss = (0,) * pad + tuple(sin.stride()[:-1])
    nb_p2 = next_power_of_2(d // scale_block)
    rows_per_prog = max(1, min(next_power_of_2(n_vec), _ELEMS_PER_PROGRAM // (nb_p2 * scale_block)))
    if mode == 2:
        sr = tuple(rows.stride())
        so = (out.stride(0), out.stride(1))
        sso = (outs.stride(0), outs.stride(1))
        cache_rows = out.shape[1]
        rows_arg = rows
    else:
        sr = (0, 0)
        so = (out.stride(-2) if out.dim() > 1 else 0, 0)
        sso = (outs.stride(-2) if outs is not None and outs.dim() > 1 else 0, 0)
        cache_rows = 0
        rows_arg = x  # unused when MODE != 2
    if outs is None:
        outs = out  # unused in MODE 1
    pdl = use_pdl_for(_rope_fp4_kernel, x.device)
    extra = {"launch_pdl": True} if pdl else {}
    grid = (-(-n_vec // rows_per_prog),)
    _rope_fp4_kernel[grid](
        x, cos, sin, rows_arg, out, outs,
        n_vec, sizes[1], sizes[2], sizes[3],
        *sx, *sc, *ss, *sr, *so, *sso, cache_rows,
        D=d, R_HALF=r_half, SCALE_BLOCK=scale_block, E4M3_SCALE=bool(e4m3_scale), MODE=mode,
        ROWS=rows_per_prog, NB_P2=nb_p2, USE_PDL=pdl,
        num_warps=4, enable_fp_fusion=False, **extra)


def triton_rope_fp4_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                          e4m3_scale: bool):
    """Triton `dsv41::rope_fp4_quant` on the tensors' device (interpreted on CPU).

    Same arguments, results (bit-identical codes and scales) and errors as `reference_rope_fp4_quant`;
    x may have at most 4 leading dims. One launch; ROWS = max(1, 2048 // (padded D)) vectors per program.
    """
    check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale)
    lead, d = x.shape[:-1], x.shape[-1]
    codes = _empty((*lead, d // 2), torch.uint8, x.device)
    scales = _empty((*lead, d // scale_block), torch.uint8, x.device)
    _launch(x, cos, sin, scale_block, e4m3_scale, 0, codes.view(-1, d // 2), scales.view(-1, d // scale_block))
    return codes, scales


def triton_rope_fp4_fake_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                               e4m3_scale: bool) -> torch.Tensor:
    """Triton `dsv41::rope_fp4_fake_quant` on the tensors' device (interpreted on CPU).

    Same arguments, result (bit-identical) and errors as `reference_rope_fp4_fake_quant`.
    """
    check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale)
    y = _empty(x.shape, x.dtype, x.device)
    _launch(x, cos, sin, scale_block, e4m3_scale, 1, y.view(-1, x.shape[-1]), None)
    return y


def triton_rope_fp4_quant_store(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                                e4m3_scale: bool, codes_cache: torch.Tensor, scale_cache: torch.Tensor,
                                rows: torch.Tensor) -> None:
    """Triton `dsv41::rope_fp4_quant_store` on the tensors' device (interpreted on CPU).

    Same arguments, effect (bit-identical rows written, rows outside [0, Rows) skipped) and errors as
    `reference_rope_fp4_quant_store`. Cache last-dim stride must be 1 (ValueError otherwise).
    """
    check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale)
    check_store_args(x, rows, codes_cache, scale_cache, scale_block)
    for name, t in (("codes_cache", codes_cache), ("scale_cache", scale_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1 (it is written in place), got {t.stride()}")
    _launch(x, cos, sin, scale_block, e4m3_scale, 2, codes_cache, scale_cache, rows)


# ------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("dsv41::rope_fp4_quant", mutates_args=(), device_types="cpu")
def rope_fp4_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                   e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE then FP4 quantisation; see `reference_rope_fp4_quant` for shapes and modes."""
    return reference_rope_fp4_quant(x, cos, sin, scale_block, e4m3_scale)


@register_cuda(rope_fp4_quant, "dsv41::rope_fp4_quant")
def _rope_fp4_quant_cuda(x, cos, sin, scale_block, e4m3_scale):
    return triton_rope_fp4_quant(x, cos, sin, scale_block, e4m3_scale)


@rope_fp4_quant.register_fake
def _rope_fp4_quant_fake(x, cos, sin, scale_block, e4m3_scale):
    lead, d = x.shape[:-1], x.shape[-1]
    return (x.new_empty((*lead, d // 2), dtype=torch.uint8),
            x.new_empty((*lead, d // scale_block), dtype=torch.uint8))


@torch.library.custom_op("dsv41::rope_fp4_fake_quant", mutates_args=(), device_types="cpu")
def rope_fp4_fake_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                        e4m3_scale: bool) -> torch.Tensor:
    """RoPE then FP4 quantise-dequantise; see `reference_rope_fp4_fake_quant`."""
    return reference_rope_fp4_fake_quant(x, cos, sin, scale_block, e4m3_scale)


@register_cuda(rope_fp4_fake_quant, "dsv41::rope_fp4_fake_quant")
def _rope_fp4_fake_quant_cuda(x, cos, sin, scale_block, e4m3_scale):
    return triton_rope_fp4_fake_quant(x, cos, sin, scale_block, e4m3_scale)


@rope_fp4_fake_quant.register_fake
def _rope_fp4_fake_quant_fake(x, cos, sin, scale_block, e4m3_scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dsv41::rope_fp4_quant_store", mutates_args=("codes_cache", "scale_cache"),
                         device_types="cpu")
def rope_fp4_quant_store(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                         e4m3_scale: bool, codes_cache: torch.Tensor, scale_cache: torch.Tensor,
                         rows: torch.Tensor) -> None:
    """RoPE, FP4 quantisation and the cache-row write in one op; see `reference_rope_fp4_quant_store`."""
    reference_rope_fp4_quant_store(x, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)


@register_cuda(rope_fp4_quant_store, "dsv41::rope_fp4_quant_store")
def _rope_fp4_quant_store_cuda(x, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows):
    triton_rope_fp4_quant_store(x, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)


@rope_fp4_quant_store.register_fake
def _rope_fp4_quant_store_fake(x, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows):
    return None
