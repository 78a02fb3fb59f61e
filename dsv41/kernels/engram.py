"""Engram lookup (hash -> bucket rows -> FP8 gather -> dequantise) and gate kernels (the pass family that emits
them: `dsv41 report --patterns engram`).

At an Engram layer the eager model (dsv41/model/engram.py, MODEL.md §2.10) runs two chains of small ops; each
becomes one op here:

- `dsv41::engram_lookup(u, multipliers, primes, offsets, weight, scale, dtype) -> x`:
  the input of the layer's `wkv` projection. Per token, with u_s = u[b, t, s] (the n-gram look-back ids,
  s = 0..M-1) and m_s = multipliers[s]: the rolling hash h_1 = (u_0 m_0) XOR (u_1 m_1), h_k = h_{k-1} XOR
  (u_k m_k) in int64 (two's-complement wrap-around, as torch's int64 ops); row j = (k-1) * n_heads + e of
  the R = (M-1) * n_heads rows is `remainder(h_k, primes[j]) + offsets[j]` (floor remainder: the sign of
  primes[j]); the row's E4M3 bytes `weight[row]` [C] times its UE8M0 scales 2^(scale[row, c // 32] - 127)
  in FP32, rounded once to `dtype`; the R rows concatenated.
  u int64 [B, T, M] (M >= 2), multipliers int64 [M], primes / offsets int64 [R], weight uint8 [rows, C]
  (C % 32 == 0), scale uint8 [rows, C/32]; x [B, T, R * C] in `dtype` (fp32 / bf16 / fp16).
  Reference: `engram_row_ids` then `EngramTable.forward` (`dequantize_fp8_1x32`) and `flatten(2)`.
- `dsv41::engram_gate(H, keys, value, q_weight, k_weight, eps) -> H'`: per stream i, all in FP32,
  w = q_weight[i] * k_weight[i]; rs = rsqrt(mean(H_i^2) + eps) * rsqrt(mean(key_i^2) + eps);
  dot = sum_c (H_i[c] w[c]) key_i[c] * rs / sqrt(d); g = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6)));
  H'_i = H_i + g * value, rounded to H.dtype. H, keys [B, T, 4, d]; value [B, T, d]; q_weight, k_weight
  [4, d]; any float dtypes; H' [B, T, 4, d] in H.dtype. Reference: `dsv41.model.engram.engram_update`.

On CPU the ops run the references; on CUDA one Triton launch each (`triton_<name>`, also runnable on CPU
tensors under TRITON_INTERPRET=1, see `_common`).

Kernels. `engram_lookup`: one program per (token, table row j), so a decode step's R = 24 rows are 24
programs; each loads the token's M look-back ids, hashes, and gathers its row (C bytes + C/32 scales). The
work is one chain of dependent loads (u -> row id -> bytes), latency-bound at any split. `engram_gate`:
programs (token, stream, chunk of the output channels). Every program reduces its stream's whole row (the
three sums over d, in the same order in every program, so all chunks of a stream see the same gate) and then
writes only its chunk; the repeated row reads hit L2 (2 d elements per program), which is cheaper at batch 1
than a second launch or a cross-program handshake, and spreads the residual write over ~`_GATE_TARGET_PROGRAMS`.

Exactness. The lookup is bit-exact: integer ops are the reference's (int64 wrap-around products, XOR, floor
remainder), and an E4M3 value times a power of two is exact in FP32, so the one rounding to `dtype` is the
reference's (bf16 rounded on the bits, ties to even). Row ids outside [0, rows) are clamped into range (the
reference raises IndexError; a kernel cannot, and checking would need a host sync); the model's ids are
always in range. The gate keeps the reference's FP32 operation order for the elementwise steps (products
(H w) key, `+ eps`, divisions and square roots correctly rounded, FMA contraction off); the three sums over d
are blocked tree sums and `sigmoid` uses Triton's exp, so it agrees with the reference to FP32 rounding.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv41.ref import engram as _ref

from ._common import (check_same_device, check_tensor, exp2_int, next_power_of_2, register_cuda, require_launchable,
                      round_to, use_pdl_for)

__all__ = [
    "engram_lookup", "engram_gate",
    "reference_engram_lookup", "reference_engram_gate",
    "triton_engram_lookup", "triton_engram_gate",
    "gate_plan", "HC_STREAMS", "GATE_FLOOR",
]

#: Residual streams the gate is specialised for (hc_mult, always 4: MODEL.md §4).
HC_STREAMS = 4
#: Lower bound of |dot| under the signed square root (MODEL.md §2.10 "Gate per stream").
GATE_FLOOR = 1e-6
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Channels per block of the gate's row reductions.
_GATE_REDUCE_BLOCK = 1024
#: Channels per block of the gate's output writes (a chunk is a whole number of these).
_GATE_OUT_BLOCK = 256
#: Programs the gate aims for at decode.
_GATE_TARGET_PROGRAMS = 64
#: Channels of a table row one lookup program holds (the whole row is one tile).
MAX_ROW_DIM = 8192


# ------------------------------------------------------------------------------------------- checks
def _check_lookup(u, multipliers, primes, offsets, weight, scale, dtype):
    """Validate the lookup arguments; return (M, R, n_heads, C)."""
    check_tensor("u", u, dtypes=(torch.int64,), ndim=3)
    for name, t in (("multipliers", multipliers), ("primes", primes), ("offsets", offsets)):
        check_tensor(name, t, dtypes=(torch.int64,), ndim=1)
    check_tensor("weight", weight, dtypes=(torch.uint8,), ndim=2)
    check_tensor("scale", scale, dtypes=(torch.uint8,), ndim=2)
    check_same_device(u=u, multipliers=multipliers, primes=primes, offsets=offsets, weight=weight, scale=scale)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")
    m = u.shape[2]
    if m < 2:
        raise ValueError(f"u must hold at least 2 look-back ids per token (a 2-gram), got {tuple(u.shape)}")
    if tuple(multipliers.shape) != (m,):
        raise ValueError(f"multipliers must be [M] = [{m}] (u.shape[-1]), got {tuple(multipliers.shape)}")
    r = primes.shape[0]
    if r == 0 or r % (m - 1):
        raise ValueError(f"primes must be [(M-1) * n_heads] with M = {m}, got {tuple(primes.shape)}")
    if tuple(offsets.shape) != (r,):
        raise ValueError(f"offsets must be [{r}] like primes, got {tuple(offsets.shape)}")
    rows, c = weight.shape
    if c % 32 or c == 0:
        raise ValueError(f"weight rows must hold a multiple of 32 bytes (1x32 UE8M0 scales), got {tuple(weight.shape)}")
    if tuple(scale.shape) != (rows, c // 32):
        raise ValueError(f"scale must be [rows, C/32] = {(rows, c // 32)} for weight {tuple(weight.shape)}, got "
                         f"{tuple(scale.shape)}")
    if rows == 0:
        raise ValueError("weight has no rows")
    return m, r, r // (m - 1), c


def _check_gate(H, keys, value, q_weight, k_weight, eps):
    check_tensor("H", H, dtypes=_FLOAT_DTYPES, ndim=4)
    check_tensor("keys", keys, dtypes=_FLOAT_DTYPES, ndim=4)
    check_tensor("value", value, dtypes=_FLOAT_DTYPES, ndim=3)
    check_tensor("q_weight", q_weight, dtypes=_FLOAT_DTYPES, ndim=2)
    check_tensor("k_weight", k_weight, dtypes=_FLOAT_DTYPES, ndim=2)
    check_same_device(H=H, keys=keys, value=value, q_weight=q_weight, k_weight=k_weight)
    b, t, n, d = H.shape
    if n != HC_STREAMS or d < 1:
        raise ValueError(f"H must be [B, T, {HC_STREAMS}, d] (four residual streams), got {tuple(H.shape)}")
    if tuple(keys.shape) != tuple(H.shape):
        raise ValueError(f"keys must be [B, T, 4, d] = {tuple(H.shape)} like H, got {tuple(keys.shape)}")
    if tuple(value.shape) != (b, t, d):
        raise ValueError(f"value must be [B, T, d] = {(b, t, d)}, got {tuple(value.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (n, d):
            raise ValueError(f"{name} must be [4, d] = {(n, d)}, got {tuple(w.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


# ------------------------------------------------------------------------------------------- references
def reference_engram_lookup(u: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                            weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain-PyTorch `dsv41::engram_lookup`: the model's row ids, gather and FP8 1x32 dequantisation.

    Args:
        u: int64 [B, T, M] look-back ids (`engram_lookback`), M >= 2.
        multipliers: int64 [M]. primes, offsets: int64 [R], R = (M - 1) * n_heads, order-major.
        weight: uint8 [rows, C] E4M3 bytes, C % 32 == 0. scale: uint8 [rows, C/32] UE8M0 exponents.
        dtype: output dtype (fp32 / bf16 / fp16).
    Returns: [B, T, R * C] in `dtype` (the R dequantised rows of each token, concatenated).
    Raises: TypeError / ValueError naming the bad argument; IndexError for a row id outside [0, rows).
    Source: MODEL.md §2.10 steps 5-6 and "Module"; dsv41/model/engram.py `engram_row_ids`, `EngramTable.forward`,
    `Engram.forward` (`rows.flatten(2)`).
    """
    _check_lookup(u, multipliers, primes, offsets, weight, scale, dtype)
    return _ref.engram_lookup(u, multipliers, primes, offsets, weight, scale, dtype)


def reference_engram_gate(H: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-PyTorch `dsv41::engram_gate`: `dsv41.model.engram.engram_update`, contiguous.

    Args: H, keys [B, T, 4, d]; value [B, T, d]; q_weight, k_weight [4, d] (any float dtypes); eps: the RMS
        eps (rms_norm_eps, 1e-20 in V4.1).
    Returns: [B, T, 4, d] in H.dtype.
    Raises: TypeError / ValueError naming the bad argument.
    Source: MODEL.md §2.10 "Gate per stream", "Update"; dsv41/model/engram.py `engram_update`.
    """
    _check_gate(H, keys, value, q_weight, k_weight, eps)
    return _ref.engram_gate(H, keys, value, q_weight, k_weight, eps)


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _engram_lookup_kernel(
    u_ptr, m_ptr, p_ptr, o_ptr, w_ptr, s_ptr, x_ptr,
    T, su_b, su_t, su_m, s_mult, s_prime, s_off, sw_row, ss_row, n_rows,
    M: tl.constexpr, N_HEADS: tl.constexpr, R: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    j = tl.program_id(1)
    b = tok // T
    t = tok % T
    # Row j belongs to n-gram order j // N_HEADS + 1: its hash XORs the products of look-backs 0..order.
    order = j // N_HEADS + 1
    p = tl.load(p_ptr + j * s_prime)
    off = tl.load(o_ptr + j * s_off)
    u_row = u_ptr + b.to(tl.int64) * su_b + t.to(tl.int64) * su_t
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    h = tl.load(u_row) * tl.load(m_ptr)
    for s in tl.static_range(1, M):
        term = tl.load(u_row + s * su_m) * tl.load(m_ptr + s * s_mult)
        h = tl.where(s <= order, h ^ term, h)
    # `%` truncates (C semantics) on the GPU and in the interpreter; torch.remainder floors (sign of p).
    rem = h % p
    rem = tl.where((rem != 0) & ((rem < 0) != (p < 0)), rem + p, rem)
    row = tl.minimum(tl.maximum(rem + off, 0), n_rows - 1)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < C
    codes = tl.load(w_ptr + row * sw_row + cols, mask=ok, other=0)
    e = tl.load(s_ptr + row * ss_row + cols // 32, mask=ok, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # E4M3 value times 2^(e-127) is exact in FP32 (e = 0 gives 0, as formats.ue8m0_to_float). S.1111.111 is
    # NaN in E4M3 (fn); the interpreter decodes it as a finite number, so it is set explicitly.
    v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v = tl.where((codes & 0x7F) == 0x7F, float("nan"), v) * exp2_int(e.to(tl.int32))
    v = round_to(v, x_ptr.dtype.element_ty)
    tl.store(x_ptr + tok.to(tl.int64) * (R * C) + j * C + cols, v.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _engram_gate_kernel(
    h_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, out_ptr,
    T, sh_b, sh_t, sh_s, sk_b, sk_t, sk_s, sv_b, sv_t, sq_s, skw_s, eps, sqrt_d,
    D: tl.constexpr, RBLOCK: tl.constexpr, OBLOCK: tl.constexpr, CHUNK: tl.constexpr, FLOOR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    i = tl.program_id(1)
    chunk = tl.program_id(2)
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    h_row = h_ptr + b * sh_b + t * sh_t + i * sh_s
    k_row = k_ptr + b * sk_b + t * sk_t + i * sk_s
    v_row = v_ptr + b * sv_b + t * sv_t
    rr = tl.arange(0, RBLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc_hh = tl.zeros([RBLOCK], dtype=tl.float32)
    acc_kk = tl.zeros([RBLOCK], dtype=tl.float32)
    acc_dot = tl.zeros([RBLOCK], dtype=tl.float32)
    for d0 in range(0, D, RBLOCK):
        cols = d0 + rr
        ok = cols < D
        h = tl.load(h_row + cols, mask=ok, other=0.0).to(tl.float32)
        k = tl.load(k_row + cols, mask=ok, other=0.0).to(tl.float32)
        # w = q_weight.float() * k_weight.float(), then (H * w) * key, as the reference multiplies.
        w = (tl.load(qw_ptr + i * sq_s + cols, mask=ok, other=0.0).to(tl.float32)
             * tl.load(kw_ptr + i * skw_s + cols, mask=ok, other=0.0).to(tl.float32))
        acc_hh += h * h
        acc_kk += k * k
        acc_dot += (h * w) * k
    # rs = rsqrt(mean(H^2) + eps) * rsqrt(mean(key^2) + eps); mean as sum / d, rsqrt as a correctly rounded
    # sqrt and division.
    mean_h = tl.math.div_rn(tl.sum(acc_hh, axis=0), D * 1.0)
    mean_k = tl.math.div_rn(tl.sum(acc_kk, axis=0), D * 1.0)
    rs = tl.math.div_rn(1.0, tl.sqrt_rn(mean_h + eps)) * tl.math.div_rn(1.0, tl.sqrt_rn(mean_k + eps))
    dot = tl.math.div_rn(tl.sum(acc_dot, axis=0) * rs, sqrt_d)
    # torch.sign keeps 0 and NaN (0 * x stays 0; NaN propagates), clamp(min=) propagates NaN too.
    sgn = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, dot))
    mag = tl.maximum(tl.abs(dot), FLOOR, propagate_nan=tl.PropagateNan.ALL)
    g = tl.sigmoid(sgn * tl.sqrt_rn(mag))
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    oo = tl.arange(0, OBLOCK)
    o_row = out_ptr + tok.to(tl.int64) * (4 * D) + i * D
    for c0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, OBLOCK):
        cols = c0 + oo
        ok = cols < D
        h = tl.load(h_row + cols, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_row + cols, mask=ok, other=0.0).to(tl.float32)
        y = round_to(h + g * v, out_ptr.dtype.element_ty)
        tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gate_plan(rows: int, d: int, chunks: int | None = None) -> dict:
    """Split of the gate's output channels over programs: {"CHUNKS": programs per (token, stream), "CHUNK":
    channels each (a multiple of OBLOCK), "RBLOCK": reduction block, "OBLOCK": output block}.

    About `_GATE_TARGET_PROGRAMS` programs in all at decode (4 streams x chunks per token); prefill rows need no
    split. `chunks` forces a number of chunks (tests); the number used may be smaller after rounding CHUNK up to
    a whole number of output blocks. Raises ValueError for chunks < 1.
    """
    oblock = min(_GATE_OUT_BLOCK, next_power_of_2(d))
    n_blocks = -(-d // oblock)
    if chunks is None:
        chunks = max(1, min(n_blocks, _GATE_TARGET_PROGRAMS // max(HC_STREAMS * rows, 1)))
    elif chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    per = -(-n_blocks // min(chunks, n_blocks))
    return {"CHUNKS": -(-n_blocks // per), "CHUNK": per * oblock,
            "RBLOCK": min(_GATE_REDUCE_BLOCK, next_power_of_2(d)), "OBLOCK": oblock}


def triton_engram_lookup(u: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                         weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton `dsv41::engram_lookup` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result (bit for bit) and errors as `reference_engram_lookup`, except that row ids outside
    [0, rows) are clamped instead of raising IndexError, plus ValueError for C > MAX_ROW_DIM. One launch of
    (B*T, R) programs; weight / scale rows must have unit stride along C (made so if not).
    """
    m, r, n_heads, c = _check_lookup(u, multipliers, primes, offsets, weight, scale, dtype)
    require_launchable(_engram_lookup_kernel, u.device, "triton_engram_lookup")
    if c > MAX_ROW_DIM:
        raise ValueError(f"engram_lookup keeps a table row in one program: C = {c} exceeds MAX_ROW_DIM = {MAX_ROW_DIM}")
    b, t, _ = u.shape
    x = _empty((b, t, r * c), dtype, u.device)
    if b * t == 0:
        return x
    weight = _last_dim_contiguous(weight)
    scale = _last_dim_contiguous(scale)
    pdl = use_pdl_for(_engram_lookup_kernel, u.device)
    _engram_lookup_kernel[(b * t, r)](
        u, multipliers, primes, offsets, weight, scale, x,
        t, u.stride(0), u.stride(1), u.stride(2), multipliers.stride(0), primes.stride(0), offsets.stride(0),
        weight.stride(0), scale.stride(0), weight.shape[0],
        M=m, N_HEADS=n_heads, R=r, C=c, BLOCK_C=next_power_of_2(c), USE_PDL=pdl,
        num_warps=1 if c <= 256 else 4, **({"launch_pdl": True} if pdl else {}))
    return x


def triton_engram_gate(H: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, chunks: int | None = None) -> torch.Tensor:
    """Triton `dsv41::engram_gate` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result (to FP32 rounding, see the module docstring) and errors as `reference_engram_gate`.
    One launch over (token, stream, chunk) programs (`gate_plan`; `chunks` overrides the split). Any strides
    (e.g. keys and value as views of the `wkv` output); last dims are made contiguous if they are not.
    """
    _check_gate(H, keys, value, q_weight, k_weight, eps)
    require_launchable(_engram_gate_kernel, H.device, "triton_engram_gate")
    b, t, n, d = H.shape
    out = _empty((b, t, n, d), H.dtype, H.device)
    if b * t == 0:
        return out
    H, keys, value = (_last_dim_contiguous(x) for x in (H, keys, value))
    q_weight, k_weight = _last_dim_contiguous(q_weight), _last_dim_contiguous(k_weight)
    plan = gate_plan(b * t, d, chunks)
    pdl = use_pdl_for(_engram_gate_kernel, H.device)
    _engram_gate_kernel[(b * t, n, plan["CHUNKS"])](
        H, keys, value, q_weight, k_weight, out,
        t, H.stride(0), H.stride(1), H.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        value.stride(0), value.stride(1), q_weight.stride(0), k_weight.stride(0), float(eps), float(math.sqrt(d)),
        D=d, RBLOCK=plan["RBLOCK"], OBLOCK=plan["OBLOCK"], CHUNK=plan["CHUNK"], FLOOR=GATE_FLOOR, USE_PDL=pdl,
        num_warps=4, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return out


# ------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("dsv41::engram_lookup", mutates_args=(), device_types="cpu")
def engram_lookup(u: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                  weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Engram n-gram hash -> bucket rows -> FP8 gather -> dequantised wkv input; see `reference_engram_lookup`."""
    return reference_engram_lookup(u, multipliers, primes, offsets, weight, scale, dtype)


@register_cuda(engram_lookup, "dsv41::engram_lookup")
def _engram_lookup_cuda(u, multipliers, primes, offsets, weight, scale, dtype):
    return triton_engram_lookup(u, multipliers, primes, offsets, weight, scale, dtype)


@engram_lookup.register_fake
def _engram_lookup_fake(u, multipliers, primes, offsets, weight, scale, dtype):
    return u.new_empty((u.shape[0], u.shape[1], primes.shape[0] * weight.shape[1]), dtype=dtype)


@torch.library.custom_op("dsv41::engram_gate", mutates_args=(), device_types="cpu")
def engram_gate(H: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Engram per-stream gate with the residual add; see `reference_engram_gate`."""
    return reference_engram_gate(H, keys, value, q_weight, k_weight, eps)


@register_cuda(engram_gate, "dsv41::engram_gate")
def _engram_gate_cuda(H, keys, value, q_weight, k_weight, eps):
    return triton_engram_gate(H, keys, value, q_weight, k_weight, eps)


@engram_gate.register_fake
def _engram_gate_fake(H, keys, value, q_weight, k_weight, eps):
    return torch.empty_like(H, memory_format=torch.contiguous_format)
