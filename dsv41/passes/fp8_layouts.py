"""Block-FP8 checkpoint layouts of the `dispatch` family: the weights FP8 releases ship, beside dsv41's own.

dsv41 stores block-FP8 weights as uint8 E4M3 codes with one uint8 UE8M0 scale per 32x32 block (`dispatch`'s
`fp8_block` format). Most FP8 checkpoints store them otherwise, and eager code dequantises them by hand:

    codes   [N, K] `float8_e4m3fn` (or uint8 E4M3 bit patterns)
    scale   [ceil(N/bn), ceil(K/bk)] `float32` (`weight_scale_inv`: it multiplies) or uint8 UE8M0 (2^(e-127))
    blocks  bn x bk = 128 x 128 (DeepSeek-V3 / R1), 1 x 128 (one scale per row and 128 columns), 32 x 32

    w = w8.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]        (or .to(bf16) after)
    w = (w8.float().view(N // 128, 128, K // 128, 128) * s[:, None, :, None]).view(N, K)  (block views)
    w = w8.to(torch.bfloat16) * torch.kron(s, torch.ones(128, 128)).to(torch.bfloat16)    (kron, expand, ...)
    y = F.linear(x, w)  /  x @ w.T

Each such chain becomes `dsv41::linear_fp8_scaled(x, codes_u8, scale, bn, bk, weight_dtype, scale_cast)`
(dsv41/kernels/gemv_scaled.py), where codes_u8 is `aten.view.dtype(w8, uint8)`: a free reinterpretation, never a
copy; the scale is passed as stored (no conversion, nothing computed per step). dsv41's own layout typed
`float8_e4m3fn` (UE8M0 32x32, K % 32 == 0, weight rounded as `formats.dequantize_fp8_block` rounds it) becomes
`dsv41::linear_fp8_block` on the viewed codes, with the activation fake-quant detection `dispatch` applies to it.

Structure (found by `dispatch`'s candidate walk, `readings`): a float 2-D tensor computed by dataflow ops from
exactly two tensors, codes [N, K] (or [K, N], the transposed weight) typed uint8 or float8_e4m3fn, and a scale of
one of the grid shapes above typed float32 or uint8 (several blocks may fit one shape: each reading is probed).
Semantics (`verify`): the region is evaluated on probe codes (every byte, NaN encodings included) and scales and
must equal `formats.dequantize_fp8_scaled` of them bit for bit (UE8M0: within 2 ulps, a hand-written exp2 may
round its last bit), for one of the roundings eager spellings make (`_roundings`: the FP32 product rounded to the
region's dtype; the scale first rounded to bf16 / fp16; a bf16 / fp16 weight widened to float32), which becomes the
op's `weight_dtype` / `scale_cast`. Ordinary probe scales are 2^-5 .. 2^6 (every product normal even in fp16, full
FP32 mantissas so the roundings differ); the region must then also agree on wide-range scales (`_wide_scales`:
FP32 of every exponent 2^-126 .. 2^127, both signs and zero; UE8M0 bytes 1..254), where a clamp or saturation
shows.

Near-misses (a chain that reaches a matmul and fails a check; check id, then what it means):

    region_closed    the weight region reads something besides its codes and scale
    weight_shape     the region's weight has another shape than the codes
    weight_rounding  the values are the dequantisation, rounded in a way the op does not reproduce
    ue8m0_scale_rule / ue8m0_exponent_bias   a UE8M0 byte used as a plain multiplier / with another bias than 127
    scale_divisor    the codes are divided by the scale (the checkpoint's `weight_scale_inv` multiplies)
    scale_missing    the codes are not multiplied by any scale
    scale_grid       the grid is read transposed (scale[k // bk, n // bn]), or stored transposed
    block_size       the scales are applied in other blocks than the grid's shape says (e.g. 128x128 blocks
                     read from a 32x32 grid)
    scale_range      equal on ordinary scales, different on wide-range ones (a clamp, a saturation, an abs)
    scale_dtype / codes_dtype / weight_format   an FP8-typed weight whose scale dtype, code format (E5M2) or scale
                     shape (per-tensor, per-channel, another grid) no fused op takes
    dequant_values   none of the above: the largest difference is named

Public names: `Layout`, `Unmatched`, `readings`, `unmatched`, `verify`, `fused_call`, `pattern`, `BLOCKS`.

Sources: DeepSeek-V3 `inference/kernel.py` (`weight_dequant`, 128x128 blocks) and its config's
`quantization_config` (`weight_block_size`, `fmt: e4m3`); MODEL.md §2.1 (E4M3, UE8M0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ref import formats
from .engine import (RegionEvaluator, RegionNotClosed, agree_where_representable, concrete_shape, dsv41_op, insert_node,
                     tensor_val, wide_scale_probes)

__all__ = ["Layout", "Unmatched", "BLOCKS", "FP8", "readings", "unmatched", "verify", "fused_call", "pattern"]

FP8 = torch.float8_e4m3fn
_E5M2 = getattr(torch, "float8_e5m2", None)
#: (block_n, block_k) of the recognised layouts, most common first.
BLOCKS = ((128, 128), (1, 128), (32, 32))
_CODE_DTYPES = (torch.uint8, FP8)
_SCALE_DTYPES = (torch.float32, torch.uint8)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_SCALED_OP = "linear_fp8_scaled"
_BLOCK_OP = "linear_fp8_block"
#: Rows / columns of the weight the diagnosis compares (a crop: a real weight has 10^8 elements).
_DIAG_CROP = 1024
#: Most wide-range FP32 scale probes per region (a small grid needs several to show every exponent).
_MAX_WIDE_PROBES = 16


@dataclass(frozen=True)
class Layout:
    """A block-FP8 layout: codes of `codes_dtype` (uint8 E4M3 bit patterns or float8_e4m3fn) [N, K] and one scale of
    `scale_dtype` (float32 value, or uint8 UE8M0 exponent) per `block_n` x `block_k` block, grid
    [ceil(N/block_n), ceil(K/block_k)]."""

    codes_dtype: torch.dtype
    scale_dtype: torch.dtype
    block_n: int
    block_k: int

    @property
    def ue8m0(self) -> bool:
        """Whether the scales are UE8M0 bytes (value 2^(e-127)) rather than float32 values."""
        return self.scale_dtype == torch.uint8

    @property
    def own(self) -> bool:
        """dsv41's own block size and scale format (UE8M0 per 32x32), which `dsv41::linear_fp8_block` computes."""
        return self.ue8m0 and (self.block_n, self.block_k) == (32, 32)

    def grid(self, n: int, k: int) -> tuple[int, int]:
        """Scale grid shape [ceil(n/block_n), ceil(k/block_k)] of an [n, k] weight."""
        return -(-n // self.block_n), -(-k // self.block_k)

    def describe(self) -> str:
        """e.g. `float8_e4m3fn codes, float32 scales per 128x128 block` (for reports)."""
        scale = "UE8M0 (uint8)" if self.ue8m0 else "float32"
        return f"{_name(self.codes_dtype)} codes, {scale} scales per {self.block_n}x{self.block_k} block"


@dataclass(frozen=True)
class Unmatched:
    """An FP8-typed weight whose scale no fused op takes: the near-miss `check` id and its `reason`."""

    check: str
    reason: str


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(node: fx.Node) -> tuple:
    return concrete_shape(tensor_val(node))


def _orientations(codes: fx.Node, shape: tuple) -> list:
    """(n, k, transposed) for which the codes [n, k] make a weight of `shape` ([n, k], or [k, n] when transposed)."""
    c = _shape(codes)
    if len(c) != 2 or len(shape) != 2:
        return []
    return [(n, k, tr) for tr in (False, True) for n, k in [(shape[1], shape[0]) if tr else tuple(shape)]
            if c == (n, k)]


# ------------------------------------------------------------------------------------------------ structure
def readings(a: fx.Node, b: fx.Node, shape: tuple) -> list:
    """(fmt "fp8_scaled", codes, scale, N, K, transposed, `Layout`) readings of leaves `a`, `b` producing a float
    weight of `shape`, one per (codes / scale role, orientation, block size) whose shapes fit. dsv41's own layout with
    uint8 codes and K % 32 == 0 is left to `dispatch`'s `fp8_block` reading."""
    out = []
    for codes, scale in ((a, b), (b, a)):
        cv, sv = tensor_val(codes), tensor_val(scale)
        if cv.dtype not in _CODE_DTYPES or sv.dtype not in _SCALE_DTYPES or sv.dim() != 2:
            continue
        for n, k, tr in _orientations(codes, shape):
            for bn, bk in BLOCKS:
                lay = Layout(cv.dtype, sv.dtype, bn, bk)
                if _shape(scale) != lay.grid(n, k) or (lay.own and cv.dtype == torch.uint8 and k % 32 == 0):
                    continue
                out.append(("fp8_scaled", codes, scale, n, k, tr, lay))
    return out


def unmatched(a: fx.Node, b: fx.Node, shape: tuple) -> list:
    """For a weight of `shape` computed from an FP8-typed leaf [N, K] (float8_e4m3fn or float8_e5m2) and another
    leaf that is no scale grid of `readings`: one ("fp8_scaled", codes, scale, N, K, transposed, `Unmatched`) reading
    saying why, so the chain is reported rather than skipped. Empty otherwise (uint8 leaves are not reported: a
    uint8 tensor need not be E4M3 codes)."""
    for codes, scale in ((a, b), (b, a)):
        cv, sv = tensor_val(codes), tensor_val(scale)
        if cv.dtype not in (FP8, _E5M2) or (sv.dtype in (FP8, _E5M2) and _shape(scale) == _shape(codes)):
            continue
        for n, k, tr in _orientations(codes, shape):
            return [("fp8_scaled", codes, scale, n, k, tr, _why_unmatched(cv.dtype, sv, n, k))]
    return []


def _why_unmatched(codes_dtype, sv: torch.Tensor, n: int, k: int) -> Unmatched:
    if codes_dtype != FP8:
        return Unmatched("codes_dtype", f"the weight's codes are {_name(codes_dtype)}; the fused block-FP8 ops read "
                                        "E4M3 codes (float8_e4m3fn or their uint8 bit patterns)")
    if sv.dtype not in _SCALE_DTYPES:
        return Unmatched("scale_dtype", f"the FP8 weight's scale is {_name(sv.dtype)}; the fused ops take float32 "
                                        "scales or UE8M0 exponent bytes (uint8), read as stored")
    s = concrete_shape(sv)
    for bn, bk in BLOCKS:
        grid = Layout(FP8, sv.dtype, bn, bk).grid(n, k)
        if s == grid[::-1] and s != grid:
            return Unmatched("scale_grid", f"the scale {list(s)} is the {bn}x{bk} block grid of the [{n}, {k}] weight "
                                           f"stored transposed; the fused op reads scale[n // {bn}, k // {bk}] from "
                                           f"a {list(grid)} grid (transpose it once when loading the checkpoint)")
    grids = ", ".join(f"{bn}x{bk} {list(Layout(FP8, sv.dtype, bn, bk).grid(n, k))}" for bn, bk in BLOCKS)
    return Unmatched("weight_format", f"the scale {list(s)} of the FP8 weight [{n}, {k}] is no block grid the fused "
                                      f"ops take ({grids}); per-tensor and per-channel scales are not fused")


# ------------------------------------------------------------------------------------------------ probes
def _probe_codes(shape: tuple, device) -> torch.Tensor:
    """Random E4M3 bytes with every byte value present (the first 256 in turn; NaN encodings 0x7F, 0xFF included: a
    region must keep them NaN). uint8 drawn directly: a real weight has 10^8 elements."""
    gen = torch.Generator().manual_seed(1234)
    codes = torch.randint(0, 256, (math.prod(shape),), generator=gen, dtype=torch.uint8)
    codes[:256] = torch.arange(min(256, codes.numel()), dtype=torch.uint8)
    return codes.reshape(shape).to(device)


def _probe_scale(lay: Layout, shape: tuple, device) -> torch.Tensor:
    """Ordinary probe scales of a grid: UE8M0 bytes 116..131, or float32 (1 + u) * 2^e, u uniform with a full
    mantissa, e in -5..5: every product with an E4M3 code is normal in fp16 (2^-14 .. 28672), and the roundings of
    `_roundings` give different bits."""
    gen = torch.Generator().manual_seed(4321)
    if lay.ue8m0:
        return torch.randint(116, 132, shape, generator=gen, dtype=torch.uint8).to(device)
    e = torch.randint(-5, 6, shape, generator=gen).float()
    return ((1 + torch.rand(shape, generator=gen)) * torch.exp2(e)).to(device)


def _wide_scales(lay: Layout, scale: torch.Tensor) -> list:
    """Wide-range probe scales shaped like `scale`: UE8M0 bytes 1..254 (`base.wide_scale_probes`), or float32
    (1 + u) * 2^e for every e in -126..127, both signs, and zeros (every 7th element). A grid with few elements gets
    several probes (at most `_MAX_WIDE_PROBES`), taking exponents alternately nearest to and farthest from the
    ordinary probes' 2^-5 .. 2^6, so a clamp bound near that range and one far from it both show."""
    if lay.ue8m0:
        return wide_scale_probes(scale)
    near = sorted(range(-126, 128), key=lambda e: max(-5 - e, e - 5, 0))
    order = [v for pair in zip(near[:127], near[:126:-1]) for v in pair]
    n = scale.numel()
    gen = torch.Generator().manual_seed(2468)
    out = []
    for i in range(min(_MAX_WIDE_PROBES, -(-len(order) // max(n, 1)))):
        e = torch.tensor([order[(i * n + j) % len(order)] for j in range(n)], dtype=torch.float32)
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        v = sign * (1 + torch.rand(n, generator=gen)) * torch.exp2(e)
        v[torch.arange(n) % 7 == 3] = 0.0
        out.append(v[torch.randperm(n, generator=gen)].reshape(scale.shape).to(scale.device))
    return out


def _roundings(out_dtype: torch.dtype) -> list:
    """(scale_cast, weight_dtype) pairs an eager spelling may compute, most likely first: the FP32 product rounded to
    the region's dtype; the scale rounded to that dtype first (`w.to(bf16) * s.to(bf16)`); for a float32 region a
    bf16 / fp16 weight widened again, or a rounded scale times FP32 codes."""
    pairs = [(torch.float32, out_dtype), (out_dtype, out_dtype)]
    if out_dtype == torch.float32:
        for low in (torch.bfloat16, torch.float16):
            pairs += [(torch.float32, low), (low, low), (low, torch.float32)]
    return list(dict.fromkeys(pairs))


def _same(got: torch.Tensor, ref: torch.Tensor, ulps: int) -> bool:
    """NaN where `ref` is NaN and equal elsewhere (within `ulps` of the dtype; 0: bit for bit)."""
    if got.shape != ref.shape or got.dtype != ref.dtype or not torch.equal(got.isnan(), ref.isnan()):
        return False
    g, r = got.nan_to_num(0.0), ref.nan_to_num(0.0)
    if torch.equal(g, r):
        return True
    return ulps > 0 and bool(torch.allclose(g.float(), r.float(), rtol=ulps * torch.finfo(ref.dtype).eps, atol=0.0))


def _evaluate(ev: RegionEvaluator, cand, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The region's weight [N, K] on probe `codes` (uint8, viewed as the leaf's dtype) and `scale`."""
    leaf = codes.view(FP8) if tensor_val(cand.codes).dtype == FP8 else codes
    got = ev.evaluate([cand.node], {cand.codes: leaf, cand.scale: scale})[cand.node]
    return got.t() if cand.transposed else got


# ------------------------------------------------------------------------------------------------ semantics
def verify(cand, ev: RegionEvaluator) -> tuple:
    """(ok, failed check id, reason, op params) for a `dispatch` candidate of format "fp8_scaled" (its `layout` a
    `Layout` or `Unmatched`), by probe evaluation (module docstring). On success the params are (("op", name),
    ("weight_dtype", dtype), ("scale_cast", dtype)): `linear_fp8_block` for dsv41's own layout computed as that op
    computes it (K % 32 == 0), else `linear_fp8_scaled`; () on failure."""
    lay = cand.layout
    if isinstance(lay, Unmatched):
        return False, lay.check, lay.reason, ()
    val = tensor_val(cand.node)
    codes = _probe_codes((cand.n, cand.k), val.device)
    scale = _probe_scale(lay, lay.grid(cand.n, cand.k), val.device)
    try:
        got = _evaluate(ev, cand, codes, scale)
    except RegionNotClosed as e:
        return False, "region_closed", f"the weight region is not a pure function of (codes, scale): {e}", ()
    if tuple(got.shape) != (cand.n, cand.k):
        return False, "weight_shape", f"the region produces shape {tuple(got.shape)}, expected {(cand.n, cand.k)}", ()
    ulps = 2 if lay.ue8m0 else 0  # a hand-written exp2(e - 127) may round its last bit; FP32 scales are multiplied
    matched, wide_got = [], {}
    for scale_cast, weight_dtype in _roundings(val.dtype):
        ref = formats.dequantize_fp8_scaled(codes, scale, lay.block_n, lay.block_k, weight_dtype, scale_cast)
        if not _same(got, ref.to(val.dtype), ulps):
            continue
        matched.append((scale_cast, weight_dtype))
        # Wide-range scales settle what ordinary ones cannot (e.g. a scale rounded to fp16 first: only its range
        # differs), so a rounding is chosen only when it holds on them too.
        for i, wide in enumerate(_wide_scales(lay, scale)):
            if i not in wide_got:
                wide_got[i] = _evaluate(ev, cand, codes, wide)
            r = formats.dequantize_fp8_scaled(codes, wide, lay.block_n, lay.block_k, weight_dtype, scale_cast)
            r = r.to(val.dtype)
            if not (_same(wide_got[i], r, 0) or agree_where_representable(wide_got[i], r)):
                break
        else:
            eff = _effective(lay)
            op = (_BLOCK_OP if lay.own and cand.k % 32 == 0
                  and (eff(scale_cast), eff(weight_dtype)) == (eff(val.dtype), eff(val.dtype)) else _SCALED_OP)
            return True, "", "", (("op", op), ("weight_dtype", weight_dtype), ("scale_cast", scale_cast))
    if not matched:
        return (False, *_diagnose(cand, codes, scale, got), ())
    what = ("UE8M0 bytes 1..254" if lay.ue8m0
            else "float32 scales of every exponent 2^-126 .. 2^127, of both signs, and zero")
    ordinary = "exponents 2^-11 .. 2^4" if lay.ue8m0 else "2^-5 .. 2^6"
    return (False, "scale_range", f"the region equals the block-FP8 dequantisation for scales {ordinary} only: it "
            f"differs for others (a clamped, saturated or sign-dropping scale; {what} probed)", ())


def _effective(lay: Layout):
    """dtype -> the rounding it makes in this layout: a UE8M0 scale and its products with E4M3 codes are exact in
    float32 and bfloat16 (powers of two, same exponent range), so those two round alike; fp16's range does not."""
    def eff(dtype: torch.dtype) -> torch.dtype:
        """The dtype whose rounding `dtype` makes in this layout (float32 where it rounds nothing)."""
        return torch.float32 if lay.ue8m0 and dtype == torch.bfloat16 else dtype
    return eff


def _expand(s: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _diagnose(cand, codes: torch.Tensor, scale: torch.Tensor, got: torch.Tensor) -> tuple[str, str]:
    """(check, reason) naming the rule the region follows instead of the layout's dequantisation (module docstring),
    compared on the top-left `_DIAG_CROP` x `_DIAG_CROP` elements in float64 (to 1 %)."""
    lay = cand.layout
    n, k = min(cand.n, _DIAG_CROP), min(cand.k, _DIAG_CROP)
    c = codes[:n, :k].view(FP8).double()
    g = got[:n, :k].double()
    sv = (formats.ue8m0_to_float(scale) if lay.ue8m0 else scale).double()
    ok = ~c.isnan()

    def like(w: torch.Tensor) -> bool:
        """Whether the region's crop equals the candidate rule's weight `w` (1 %, NaN codes left out)."""
        return w.shape == g.shape and bool(torch.allclose(g[ok], w[ok], rtol=1e-2, atol=0.0))

    bn, bk = lay.block_n, lay.block_k
    where = f"scale[n // {bn}, k // {bk}]"
    if like(c * _expand(sv, bn, bk, n, k)):
        return "weight_rounding", ("the region's weight is the block-FP8 dequantisation but rounded otherwise than "
                                   "the fused op reproduces (the FP32 product of code and scale rounded once to the "
                                   "weight's dtype, the scale optionally rounded to it first)")
    if lay.ue8m0:
        if like(c * _expand(scale.double(), bn, bk, n, k)):
            return "ue8m0_scale_rule", ("the scale byte is used as a plain multiplier (value e) instead of the UE8M0 "
                                        "exponent 2^(e-127)")
        nz = ok & (c != 0) & (g != 0)
        if nz.any():
            shift = torch.log2((g[nz] / c[nz]).abs()) - (_expand(scale.double(), bn, bk, n, k)[nz] - 127)
            if bool(((g[nz] / c[nz]) > 0).all()) and torch.allclose(shift, shift[0].expand_as(shift), atol=1e-6):
                return "ue8m0_exponent_bias", (f"the scale exponent bias is {127 - float(shift[0]):g}, not 127 (UE8M0 "
                                               "value 2^(e-127))")
    if bool((sv != 0).all()) and like(c / _expand(sv, bn, bk, n, k)):
        return "scale_divisor", (f"the codes are divided by the scale; the checkpoint's scale (`weight_scale_inv`) "
                                 f"multiplies them: w = code * {where}")
    if like(c):
        return "scale_missing", "the element values are not multiplied by the block scale"
    if sv.shape[0] == sv.shape[1] and like(c * _expand(sv.t(), bn, bk, n, k)):
        return "scale_grid", (f"the region reads the scale grid transposed, scale[k // {bk}, n // {bn}]; the "
                              f"checkpoint's {list(sv.shape)} grid is {where}")
    rows, cols = sv.shape
    for bn2 in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        for bk2 in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            gr, gc = -(-cand.n // bn2), -(-cand.k // bk2)
            if (bn2, bk2) == (bn, bk) or gr > rows or gc > cols:
                continue
            if like(c * _expand(sv, bn2, bk2, n, k)):
                return "block_size", (f"the region applies the scales per {bn2}x{bk2} block (scale[n // {bn2}, "
                                      f"k // {bk2}]), but the scale grid {list(sv.shape)} is that of {bn}x{bk} blocks "
                                      f"of the [{cand.n}, {cand.k}] weight")
    ref = formats.dequantize_fp8_scaled(codes, scale, bn, bk, got.dtype)[:n, :k].double()
    diff = (g - ref).abs().nan_to_num(float("inf"))
    idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
    return "dequant_values", (f"the weight computed from (codes, scale) differs from the {lay.describe()} "
                              f"dequantisation (max |diff| {float(diff.max()):.3g} at {idx})")


# ------------------------------------------------------------------------------------------------ rewrite
def _param(params: tuple, key: str):
    return dict(params)[key]


def fused_call(graph: fx.Graph, mm: fx.Node, cand, params: tuple, x_in: fx.Node, act_quant: bool) -> fx.Node:
    """Insert the fused op for verified candidate `cand` (with `verify`'s `params`) before matmul `mm` and return
    its node: `linear_fp8_block(x_in, codes_u8, scale, act_quant)` or `linear_fp8_scaled(x_in, codes_u8, scale, bn,
    bk, weight_dtype, scale_cast)`, where codes_u8 is `aten.view.dtype(codes, uint8)` for float8_e4m3fn codes (a
    reinterpretation Inductor makes without a kernel) and the codes themselves otherwise. Raises KeyError for params
    without "op"."""
    codes = cand.codes
    if tensor_val(codes).dtype == FP8:
        codes = insert_node(graph, mm, torch.ops.aten.view.dtype, (codes, torch.uint8), like=mm)
    op = dsv41_op(_param(params, "op"))
    if _param(params, "op") == _BLOCK_OP:
        return insert_node(graph, mm, op, (x_in, codes, cand.scale, act_quant), like=mm)
    lay = cand.layout
    return insert_node(graph, mm, op, (x_in, codes, cand.scale, lay.block_n, lay.block_k,
                                       _param(params, "weight_dtype"), _param(params, "scale_cast")), like=mm)


def pattern(cand, params: tuple, act_quant: bool) -> tuple[str, str, tuple]:
    """(pattern, op name, detail pairs) of a verified candidate for its `MatchRecord`."""
    lay = cand.layout
    op = _param(params, "op")
    detail = (("layout", lay.describe()), ("weight_dtype", _name(_param(params, "weight_dtype"))),
              ("scale_cast", _name(_param(params, "scale_cast"))))
    if op == _BLOCK_OP:
        return f"{op}(act_quant={act_quant})", op, detail
    scale = "ue8m0" if lay.ue8m0 else "fp32"
    return f"{op}({scale} {lay.block_n}x{lay.block_k})", op, detail
