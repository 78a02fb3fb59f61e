"""Numeric formats of DeepSeek-V4.1 Flash in plain PyTorch (MODEL.md §2.1).

Storage conventions used throughout dsv41 (so that `Module.to(dtype)` never touches codes and
Inductor's pattern matcher never meets an exotic dtype):

- FP8 E4M3 values are stored as `uint8` bytes (the bit pattern of `torch.float8_e4m3fn`, OCP "fn").
- UE8M0 scales are stored as `uint8` exponents `e`, value `2^(e-127)`.
- FP4 E2M1 codes are packed two per `uint8` along the last dim, LOW nibble = even element.
- E4M3 scales of the compressed bank are `uint8` bytes of `torch.float8_e4m3fn`.

Every function is differentiable-free, shape-static and host-sync-free, so the model stays
capturable by `torch.compile(fullgraph=True)`.

Sources: MODEL.md §2.1 (table of E2M1 codes, RNE ties, UE8M0 "ceil to power of two" rule, E4M3 bank
scale rule, 32x32 block-FP8 weights, 1x32 FP4 expert weights, 1x32 FP8 activation quantisation);
[R41] `inference/model.py`, [SGL] `torch_quant.py`.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "E2M1_VALUES", "FP8_MAX", "FP4_MAX",
    "e2m1_round", "e2m1_to_float", "pack_e2m1", "unpack_e2m1",
    "ue8m0_exponent", "ue8m0_to_float",
    "e4m3_to_bytes", "e4m3_from_bytes",
    "quantize_fp8_block", "dequantize_fp8_block", "dequantize_fp8_scaled",
    "quantize_fp4_1x32", "dequantize_fp4_1x32", "dequantize_fp4_1x32_table",
    "quantize_fp8_1x32", "dequantize_fp8_1x32", "fake_quant_fp8_1x32",
    "quantize_fp4_e4m3_1x16", "dequantize_fp4_e4m3_1x16", "fake_quant_fp4_e4m3_1x16",
    "quantize_fp4_ue8m0_1x32", "dequantize_fp4_ue8m0_1x32", "fake_quant_fp4_ue8m0_1x32",
]

FP8_MAX = 448.0
FP4_MAX = 6.0
#: The magnitudes of E2M1 codes 0..7 (codes 8..15 are the same, negated).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP8_AMAX_FLOOR = 1e-4
_FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126


# ---------------------------------------------------------------------------------------- E2M1
def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code) and return the 4-bit codes.

    Args:
        x: any float tensor; values are clamped to [-6, 6] first.
    Returns:
        `uint8` tensor of the same shape with codes 0..15 (bit 3 = sign, so -0.1 -> code 8).

    Ties follow MODEL.md §2.1: 0.25, 1.25, 2.5, 5.0 round down; 0.75, 1.75, 3.5 round up.
    """
    xf = x.float().clamp(-FP4_MAX, FP4_MAX)
    a = xf.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
           + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    sign = (xf < 0).to(torch.uint8) << 3
    return mag | sign


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (`uint8` 0..15, one per element) to `dtype`."""
    c = codes.to(torch.int32)
    mag = c & 7
    exp = mag >> 1
    man = (mag & 1).to(torch.float32)
    normal = torch.exp2((exp - 1).to(torch.float32)) * (1.0 + 0.5 * man)
    val = torch.where(exp == 0, 0.5 * man, normal)
    val = torch.where((c & 8) != 0, -val, val)
    return val.to(dtype)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] (K even) into bytes [..., K/2]; the low nibble holds the even element."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] into codes [..., K] (`uint8`), inverse of `pack_e2m1`."""
    lo = packed & 15
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------- UE8M0
def ue8m0_exponent(ratio: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte of `2^ceil(log2(ratio))` for positive FP32 `ratio`, computed exactly on IEEE bits.

    Returns `uint8` e with value 2^(e-127). `ratio` must be a positive normal FP32 number.
    """
    bits = ratio.float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    e = exp + (man != 0).to(torch.int32)
    return e.clamp(0, 254).to(torch.uint8)


def ue8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """Value 2^(e-127) of UE8M0 bytes as FP32 (exact: built from the exponent bits; e=0 gives 0)."""
    return (e.to(torch.int32) << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------- E4M3
def e4m3_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """Round to FP8 E4M3 (fn, RNE, saturating at 448) and return the bytes as `uint8`."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_from_bytes(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode `uint8` E4M3 bytes to `dtype`."""
    return b.view(torch.float8_e4m3fn).to(dtype)


# ---------------------------------------------------------------------------------------- weights
def quantize_fp8_block(w: torch.Tensor, block: int = 32):
    """Block-FP8 quantise a weight [N, K]: E4M3 elements, one UE8M0 scale per `block`x`block` tile.

    Returns:
        (codes `uint8` [N, K] (E4M3 bytes), scale `uint8` [ceil(N/block), ceil(K/block)] (UE8M0)).
    Source: MODEL.md §2.1 "Block-FP8 weight quantization, step by step".
    """
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wp = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    wp[:n, :k] = w.float()
    amax = wp.view(nb, block, kb, block).abs().amax(dim=(1, 3)).clamp(min=_FP8_AMAX_FLOOR)
    e = ue8m0_exponent(amax / FP8_MAX)
    s = ue8m0_to_float(e)
    q = wp / s.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return e4m3_to_bytes(q[:n, :k]), e


def dequantize_fp8_block(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    """Inverse of `quantize_fp8_block`: `codes[n, k] * 2^(scale[n//block, k//block] - 127)` in `dtype`.

    Exact in bf16/fp32 (E4M3 times a power of two). Shapes: codes [N, K] uint8, scale [ceil(N/b), ceil(K/b)].
    """
    n, k = codes.shape
    s = ue8m0_to_float(scale).to(dtype)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return codes.view(torch.float8_e4m3fn).to(dtype) * s


def dequantize_fp8_scaled(codes: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, dtype: torch.dtype,
                          scale_cast: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-FP8 weight as FP8 checkpoints store it: E4M3 codes times one scale per `block_n` x `block_k` block.

    Args:
        codes: [N, K] E4M3 codes, `uint8` bit patterns or `float8_e4m3fn` (0x7F / 0xFF decode to NaN).
        scale: [ceil(N/block_n), ceil(K/block_k)], `float32` values (e.g. DeepSeek-V3's `weight_scale_inv`, 128x128
            blocks; 1x128 blocks have block_n = 1) or `uint8` UE8M0 exponents e (value 2^(e-127)).
        block_n, block_k: block size in weight rows / columns (>= 1).
        dtype: dtype of the result; the FP32 product is rounded to it once.
        scale_cast: dtype the scale is rounded to before the product (float32: unchanged), as eager code that writes
            `w.to(torch.bfloat16) * s.to(torch.bfloat16)` does.
    Returns: [N, K] in `dtype`: `(code.float() * scale.to(scale_cast).float()).to(dtype)` per element, the product
        rounded to FP32 first (what `(w.float() * s).to(dtype)` computes; for a bf16 / fp16 scale_cast the product of
        two such values is exact in FP32, so this is also `w.to(dtype) * s.to(dtype)`).
    Raises: TypeError for other code or scale dtypes; ValueError for a scale grid of another shape.
    Source: DeepSeek-V3 `inference/kernel.py` `weight_dequant` (128x128 blocks, scale multiplies); MODEL.md §2.1
        (UE8M0 value rule).
    """
    if codes.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"codes must be uint8 or float8_e4m3fn E4M3 codes, got {codes.dtype}")
    if scale.dtype not in (torch.uint8, torch.float32):
        raise TypeError(f"scale must be float32 or uint8 (UE8M0), got {scale.dtype}")
    n, k = codes.shape
    grid = (-(-n // block_n), -(-k // block_k))
    if tuple(scale.shape) != grid:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; a {block_n}x{block_k} grid of [{n}, {k}] is {grid}")
    s = ue8m0_to_float(scale) if scale.dtype == torch.uint8 else scale
    s = s.to(scale_cast).float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    c = codes.view(torch.float8_e4m3fn).float() if codes.dtype == torch.uint8 else codes.float()
    return (c * s).to(dtype)


def quantize_fp4_1x32(w: torch.Tensor):
    """FP4 E2M1 quantise a weight [N, K] with one UE8M0 scale per 1x32 block along K.

    Returns:
        (packed `uint8` [N, K/2], scale `uint8` [N, K/32]). Source: MODEL.md §2.1 (routed experts).
    """
    n, k = w.shape
    wb = w.float().view(n, k // 32, 32)
    amax = wb.abs().amax(-1).clamp(min=_FP4_AMAX_FLOOR)
    e = ue8m0_exponent(amax / FP4_MAX)
    codes = e2m1_round(wb / ue8m0_to_float(e)[..., None])
    return pack_e2m1(codes.view(n, k)), e


def dequantize_fp4_1x32(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_fp4_1x32`: packed [..., N, K/2] + scale [..., N, K/32] -> [..., N, K] in `dtype`."""
    codes = unpack_e2m1(packed)
    vals = e2m1_to_float(codes, dtype)
    s = ue8m0_to_float(scale).to(dtype)
    shp = vals.shape
    return (vals.view(*shp[:-1], shp[-1] // 32, 32) * s[..., None]).view(shp)


#: (dtype, device) -> [256, 2] table of `dequantize_fp4_1x32_table` (small; built once per dtype and device).
_FP4_BYTE_TABLES: dict = {}


def dequantize_fp4_1x32_table(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_fp4_1x32` bit for bit (-0.0 included), decoding each byte through a 256-entry table.

    Args: packed `uint8` [..., N, K/2] (two E2M1 codes per byte, low nibble = even element); scale `uint8`
        [..., N, K/32] (UE8M0); dtype of the result.
    Returns: [..., N, K] in `dtype`.
    Raises: TypeError when `packed` is not uint8.
    Why a second form: `dequantize_fp4_1x32` decodes in ~20 elementwise passes over int32 / FP32 temporaries
    (~160 bytes of traffic per weight element), which is what the eager dense (prefill) MoE path spends its time on
    when it dequantises every expert of `h200` (144 G elements per prefill). This form makes three passes (byte
    -> int32 index, table lookup, scale). The table is built from `e2m1_to_float`, and the scale multiply is the
    same `dtype` product, so the bits are equal. Traced code keeps `dequantize_fp4_1x32`: the dispatch pass
    matches its arithmetic form (`dsv41/passes/dispatch.py`).
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 codes must be uint8, got {packed.dtype}")
    # Cache real tables only: a table made from a fake / meta tensor, or while Dynamo traces (a dict guard and a
    # recompile), would serve later real calls. Building it costs 512 elements. `is_compiling` comes first: Dynamo
    # cannot trace `is_fake` (a graph break).
    cacheable = not (torch.compiler.is_compiling() or packed.is_meta or is_fake(packed))
    key = (dtype, packed.device)
    table = _FP4_BYTE_TABLES.get(key) if cacheable else None
    if table is None:
        byte = torch.arange(256, device=packed.device)
        values = e2m1_to_float(torch.arange(16, device=packed.device), dtype)
        table = torch.stack((values[byte & 15], values[byte >> 4]), dim=-1)
        if cacheable:
            _FP4_BYTE_TABLES[key] = table
    vals = torch.nn.functional.embedding(packed.to(torch.int32), table).flatten(-2)
    s = ue8m0_to_float(scale).to(dtype)
    shp = vals.shape
    return (vals.view(*shp[:-1], shp[-1] // 32, 32) * s[..., None]).view(shp)


# ---------------------------------------------------------------------------------------- activations / caches
def quantize_fp8_1x32(x: torch.Tensor):
    """FP8 E4M3 with one UE8M0 scale per 32 consecutive elements of the last dim.

    Returns (codes `uint8` [..., K], scale `uint8` [..., K/32]). Used for activations entering quantised
    GEMMs, the window (SWA) ring (512 + 16 = 528 bytes per entry) and the Engram table rows.
    """
    shp = x.shape
    xb = x.float().view(*shp[:-1], shp[-1] // 32, 32)
    amax = xb.abs().amax(-1).clamp(min=_FP8_AMAX_FLOOR)
    e = ue8m0_exponent(amax / FP8_MAX)
    q = xb / ue8m0_to_float(e)[..., None]
    return e4m3_to_bytes(q).view(shp), e


def dequantize_fp8_1x32(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_fp8_1x32`: [..., K] uint8 + [..., K/32] uint8 -> [..., K] in `dtype`."""
    shp = codes.shape
    v = codes.view(torch.float8_e4m3fn).to(torch.float32).view(*shp[:-1], shp[-1] // 32, 32)
    return (v * ue8m0_to_float(scale)[..., None]).view(shp).to(dtype)


def fake_quant_fp8_1x32(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise FP8 1x32 (UE8M0) in one go; returns `x.dtype` values on the FP8 grid."""
    codes, e = quantize_fp8_1x32(x)
    return dequantize_fp8_1x32(codes, e, x.dtype)


def quantize_fp4_e4m3_1x16(x: torch.Tensor):
    """FP4 E2M1 with one E4M3 scale per 16 elements (the compressed main-KV bank, 256 + 32 = 288 B / 512 ch).

    Scale rule (MODEL.md §2.1): `scale = e4m3_RNE(clamp(amax / 6, 2^-9, 448))`; values are divided by the
    (possibly rounded-down) scale and clamped to +-6 before rounding to E2M1.
    Returns (packed `uint8` [..., K/2], scale `uint8` E4M3 bytes [..., K/16]).
    """
    shp = x.shape
    xb = x.float().view(*shp[:-1], shp[-1] // 16, 16)
    amax = xb.abs().amax(-1)
    sb = e4m3_to_bytes((amax / FP4_MAX).clamp(2.0 ** -9, FP8_MAX))
    s = e4m3_from_bytes(sb)
    codes = e2m1_round(xb / s[..., None]).view(shp)
    return pack_e2m1(codes), sb


def dequantize_fp4_e4m3_1x16(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_fp4_e4m3_1x16`: [..., K/2] + [..., K/16] -> [..., K] in `dtype`."""
    v = e2m1_to_float(unpack_e2m1(packed))
    shp = v.shape
    s = e4m3_from_bytes(scale)
    return (v.view(*shp[:-1], shp[-1] // 16, 16) * s[..., None]).view(shp).to(dtype)


def fake_quant_fp4_e4m3_1x16(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise with `quantize_fp4_e4m3_1x16`; returns `x.dtype`."""
    p, s = quantize_fp4_e4m3_1x16(x)
    return dequantize_fp4_e4m3_1x16(p, s, x.dtype)


def quantize_fp4_ue8m0_1x32(x: torch.Tensor):
    """FP4 E2M1 with one UE8M0 scale per 32 elements (index keys: 64 + 4 = 68 B per 128 ch; index queries).

    Returns (packed `uint8` [..., K/2], scale `uint8` [..., K/32]).
    """
    shp = x.shape
    xb = x.float().view(*shp[:-1], shp[-1] // 32, 32)
    amax = xb.abs().amax(-1).clamp(min=_FP4_AMAX_FLOOR)
    e = ue8m0_exponent(amax / FP4_MAX)
    codes = e2m1_round(xb / ue8m0_to_float(e)[..., None]).view(shp)
    return pack_e2m1(codes), e


def dequantize_fp4_ue8m0_1x32(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_fp4_ue8m0_1x32`: [..., K/2] + [..., K/32] -> [..., K] in `dtype`."""
    v = e2m1_to_float(unpack_e2m1(packed))
    shp = v.shape
    return (v.view(*shp[:-1], shp[-1] // 32, 32) * ue8m0_to_float(scale)[..., None]).view(shp).to(dtype)


def fake_quant_fp4_ue8m0_1x32(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise with `quantize_fp4_ue8m0_1x32`; returns `x.dtype`."""
    p, s = quantize_fp4_ue8m0_1x32(x)
    return dequantize_fp4_ue8m0_1x32(p, s, x.dtype)
