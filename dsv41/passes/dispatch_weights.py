"""Plain weights of family `dispatch` (dispatch.py): the dequantised-weight candidates (codes, scale) and their
formats, the region signature its probe verdict is cached under, and the probe verification and diagnosis of a
weight region against the checkpoint's dequantisation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ref import formats
from . import fp8_layouts
from .engine import (RegionEvaluator, RegionNotClosed, agree_where_representable, close_exact, concrete_shape,
                     is_dataflow_op, is_table_lookup, is_view_op, tensor_val, wide_scale_probes)

__all__ = ["Weight", "FLOATS", "leaf_sets", "formats_for", "candidates", "token_shape", "continues_region", "reader",
           "is_linear_mm", "signature", "probe_weight", "SCALE_RANGE_REASON", "reference_weight", "verify_weight",
           "block_scale", "diagnose_weight"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Weight:
    """A candidate dequantised weight: `node` computed from (`codes`, `scale`) in format `fmt`."""

    node: fx.Node
    codes: fx.Node
    scale: fx.Node
    fmt: str
    n: int
    k: int
    transposed: bool  # node holds W^T [K, N] rather than W [N, K]
    layout: object = None  # fmt "fp8_scaled": a `fp8_layouts.Layout` or `fp8_layouts.Unmatched`


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


_MAX_LEAVES = 3


def leaf_sets(graph: fx.Graph) -> dict:
    """For each tensor node, the set of non-dataflow tensors it is computed from through dataflow ops only
    (None when more than `_MAX_LEAVES`). Graph inputs and non-dataflow ops are their own leaf."""
    leaves: dict = {}
    for n in graph.nodes:
        v = tensor_val(n)
        if v is None:
            continue
        if n.op == "get_attr" and v.numel() <= 256:
            leaves[n] = frozenset()
        elif is_table_lookup(n) and leaves.get(n.args[0]) == frozenset():
            # table[idx] with a constant table (e.g. the 16 E2M1 values) is a pure function of idx.
            acc = set()
            for a in n.args[1]:
                la = leaves.get(a) if a is not None else frozenset()
                if la is None:
                    acc = None
                    break
                acc |= la
            leaves[n] = frozenset(acc) if acc is not None and len(acc) <= _MAX_LEAVES else None
        elif n.op == "call_function" and is_dataflow_op(n):
            acc: set = set()
            for a in n.all_input_nodes:
                if tensor_val(a) is None:
                    continue
                la = leaves.get(a)
                if la is None:
                    acc = None
                    break
                acc |= la
            leaves[n] = frozenset(acc) if acc is not None and len(acc) <= _MAX_LEAVES else None
        else:
            leaves[n] = frozenset({n})
    return leaves


def formats_for(a: fx.Node, b: fx.Node, shape: tuple) -> list:
    """(fmt, codes, scale, N, K, transposed) readings of uint8 tensors `a`, `b` producing a weight of `shape`."""
    out = []
    for codes, scale in ((a, b), (b, a)):
        c, s = concrete_shape(tensor_val(codes)), concrete_shape(tensor_val(scale))
        if len(c) != 2 or len(s) != 2:
            continue
        for transposed in (False, True):
            n, k = (shape[1], shape[0]) if transposed else shape
            if c == (n, k) and s == (-(-n // 32), -(-k // 32)) and k % 32 == 0:  # else linear_fp8_scaled's
                out.append(("fp8_block", codes, scale, n, k, transposed))
            if k % 32 == 0 and c == (n, k // 2) and s == (n, k // 32):
                out.append(("fp4", codes, scale, n, k, transposed))
    return out


def candidates(graph: fx.Graph, leaves: dict) -> list:
    """Boundary nodes of dequantisation regions: float 2-D tensors computed from exactly a (codes, scale) pair
    of uint8 tensors in a known weight format, or of an FP8 checkpoint layout (`fp8_layouts.readings`; an FP8-typed
    weight with another scale is read as `fp8_layouts.unmatched`, to be reported), with a user outside the region.
    One list of `Weight` readings (format, orientation, layout) per boundary node."""
    found = []
    for n in graph.nodes:
        v = tensor_val(n)
        if v is None or v.dtype not in FLOATS or v.dim() != 2 or n.op != "call_function":
            continue
        lv = leaves.get(n)
        if not lv or len(lv) != 2:
            continue
        a, b = sorted(lv, key=lambda x: x.name)
        if all(continues_region(u, lv, leaves) for u in n.users):
            continue
        shape = concrete_shape(v)
        readings = ((formats_for(a, b, shape) if tensor_val(a).dtype == tensor_val(b).dtype == torch.uint8 else [])
                    + fp8_layouts.readings(a, b, shape)) or fp8_layouts.unmatched(a, b, shape)
        if readings:
            # A square weight reads as W or W^T; the transposed reading (what mm's operand holds) goes first.
            readings.sort(key=lambda r: not r[5])
            found.append([Weight(n, codes, scale, fmt, *rest) for fmt, codes, scale, *rest in readings])
    return found


def token_shape(x: fx.Node) -> tuple:
    """Shape of the activation before F.linear flattened its leading dims: walk back through reshapes that keep
    the last dim and the element count (so byte expressions see [B, L, K] rather than [B*L, K])."""
    shape = concrete_shape(tensor_val(x))
    n = x
    while n.op == "call_function" and n.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        src = n.args[0]
        sv = tensor_val(src)
        if sv is None or sv.dim() == 0:
            break
        ss = concrete_shape(sv)
        if math.prod(ss) != math.prod(shape) or ss[-1] != shape[-1]:
            break
        shape, n = concrete_shape(sv), src
    return shape


def continues_region(u: fx.Node, lv: frozenset, leaves: dict) -> bool:
    """`u` is still part of the weight region: a 2-D dataflow op of the same (codes, scale) pair (a cast, a
    transpose); anything else (a matmul, a reduction, a reshape to 3-D, an output) reads the weight."""
    v = tensor_val(u)
    return is_dataflow_op(u) and leaves.get(u) == lv and v is not None and v.dim() == 2


def reader(u: fx.Node) -> fx.Node:
    """The first non-view consumer behind a chain of single-user views (for messages)."""
    while is_view_op(u) and len(u.users) == 1:
        u = next(iter(u.users))
    return u


def is_linear_mm(user: fx.Node, weight: fx.Node) -> bool:
    """`mm(x, W^T)` or `addmm(bias, x, W^T)` (alpha = beta = 1) with `weight` as the W^T operand."""
    if user.target == aten.mm.default:
        return user.args[1] is weight and user.args[0] is not weight
    if user.target == aten.addmm.default:
        return (user.args[2] is weight and user.args[1] is not weight
                and user.kwargs.get("beta", 1) == 1 and user.kwargs.get("alpha", 1) == 1)
    return False


def signature(region: list, inputs: tuple) -> tuple:
    """Structural key of a region (targets, literal args, input shapes/dtypes): equal keys compute the same
    function, so one probe verdict serves every expert / layer with the same code and shapes."""
    index = {n: i for i, n in enumerate(region)}
    index.update({n: f"in{i}" for i, n in enumerate(inputs)})

    def lit(a):
        """A hashable form of argument `a`: nodes by their position in the region (or input slot), literals by repr."""
        if isinstance(a, fx.Node):
            return ("node", index.get(a, a.name))
        if isinstance(a, (list, tuple)):
            return tuple(lit(x) for x in a)
        return repr(a)

    body = tuple((str(n.target), lit(n.args), lit(tuple(sorted(n.kwargs.items())))) for n in region)
    ins = tuple((concrete_shape(tensor_val(i)), str(tensor_val(i).dtype)) for i in inputs)
    return body, ins


def probe_weight(cand: Weight, device) -> tuple:
    """Probe (codes, scale) of the candidate's shapes on `device`: random codes (no FP8 NaN encodings) and scale
    bytes 116..131."""
    gen = torch.Generator().manual_seed(1234)
    cshape = concrete_shape(tensor_val(cand.codes))
    sshape = concrete_shape(tensor_val(cand.scale))
    codes = torch.randint(0, 256, cshape, generator=gen, dtype=torch.uint8)  # uint8 directly: h200 weights are big
    if cand.fmt == "fp8_block":
        codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN encodings
    # Exponents 2^-11 .. 2^4 keep every product normal (and finite) even in float16.
    scale = torch.randint(116, 132, sshape, generator=gen, dtype=torch.uint8)
    return codes.to(device), scale.to(device)


SCALE_RANGE_REASON = ("the region equals the UE8M0 dequantisation only for scale exponents 2^-11 .. 2^4: it "
                       "differs for other scale bytes (clamped or saturated exponent; bytes 1..254 probed)")


def reference_weight(fmt: str, codes, scale, dtype):
    """The checkpoint's dequantisation of (codes, scale) in format `fmt` ("fp8_block" or "fp4") as `dtype`."""
    if fmt == "fp8_block":
        return formats.dequantize_fp8_block(codes, scale, dtype)
    return formats.dequantize_fp4_1x32(codes, scale, dtype)


def verify_weight(cand: Weight, ev: RegionEvaluator) -> tuple[bool, str, str, tuple]:
    """(ok, failed check id, reason, op params) for a candidate dequantised weight, by probe evaluation (params:
    `fp8_layouts.verify`'s for its layouts, else ())."""
    if cand.fmt == "fp8_scaled":
        return fp8_layouts.verify(cand, ev)
    val = tensor_val(cand.node)
    codes, scale = probe_weight(cand, val.device)
    try:
        got = ev.evaluate([cand.node], {cand.codes: codes, cand.scale: scale})[cand.node]
    except RegionNotClosed as e:
        return False, "region_closed", f"the weight region is not a pure function of (codes, scale): {e}", ()
    if cand.transposed:
        got = got.t()
    ref = reference_weight(cand.fmt, codes, scale, val.dtype)
    if not close_exact(got, ref):
        return (False, *diagnose_weight(cand, codes, scale, got, ref), ())
    for wide in wide_scale_probes(scale):
        got = ev.evaluate([cand.node], {cand.codes: codes, cand.scale: wide})[cand.node]
        if not agree_where_representable(got.t() if cand.transposed else got,
                                          reference_weight(cand.fmt, codes, wide, val.dtype)):
            return False, "scale_range", SCALE_RANGE_REASON, ()
    return True, "", "", ()


def block_scale(cand: Weight, scale: torch.Tensor) -> torch.Tensor:
    """The scale tensor broadcast to one value per weight element [N, K] (as float64 of the raw byte)."""
    s = scale.double()
    if cand.fmt == "fp8_block":
        return s.repeat_interleave(32, 0)[:cand.n].repeat_interleave(32, 1)[:, :cand.k]
    return s.repeat_interleave(32, 1)


def diagnose_weight(cand: Weight, codes, scale, got, ref) -> tuple[str, str]:
    """Name the rule the region follows instead of the checkpoint's dequantisation."""
    if got.shape != ref.shape:
        return "weight_shape", f"the region produces shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    g = got.double()
    unit = ref.double() / torch.exp2(block_scale(cand, scale) - 127)  # the element values without scale
    e = block_scale(cand, scale)
    nz = unit != 0
    if torch.allclose(g, unit * e, rtol=1e-2):
        return ("ue8m0_scale_rule", "the scale byte is used as a plain multiplier (value e) instead of the UE8M0 "
                "exponent 2^(e-127)")
    if torch.allclose(g, unit, rtol=1e-2):
        return "scale_missing", "the element values are not multiplied by the block scale"
    if nz.any():
        ratio = (g[nz] / unit[nz]).abs()
        if bool((ratio > 0).all()):
            shift = torch.log2(ratio) - (e[nz] - 127)
            if torch.allclose(shift, shift.flatten()[0].expand_as(shift), atol=1e-6):
                bias = 127 - float(shift.flatten()[0])
                return ("ue8m0_exponent_bias", f"the scale exponent bias is {bias:g}, not 127 "
                        "(UE8M0 value 2^(e-127))")
    if cand.fmt == "fp4":
        swapped = ((codes & 15) << 4) | (codes >> 4)
        alt = formats.dequantize_fp4_1x32(swapped, scale, ref.dtype)
        if close_exact(got, alt):
            return ("e2m1_nibble_order", "the packed E2M1 nibbles are read high-first; the checkpoint stores the even "
                    "element in the LOW nibble")
    diff = (g - ref.double()).abs()
    idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
    return ("dequant_values", f"the weight computed from (codes, scale) differs from the {cand.fmt} dequantisation "
            f"(max |diff| {float(diff.max()):.3g} at {idx})")
