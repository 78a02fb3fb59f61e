"""Value-preserving detours: views and exact casts that a family looks through to find the tensor a chain reads."""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph import is_view_op, shape_of, tensor_val

__all__ = ["PASS_THROUGH", "FP32_EXACT", "exact_cast", "chain_back", "casts_after"]

aten = torch.ops.aten
#: Copies and casts: value-preserving when `exact_cast` holds.
PASS_THROUGH = {torch.ops.prims.convert_element_type.default, aten.clone.default, aten._to_copy.default}
#: dtypes that FP32 holds exactly.
FP32_EXACT = (torch.float32, torch.bfloat16, torch.float16)


def exact_cast(src: fx.Node, dst: fx.Node) -> bool:
    """Whether going from `src`'s dtype to `dst`'s keeps every value (same dtype, or a widening to FP32 / FP64)."""
    a, b = tensor_val(src).dtype, tensor_val(dst).dtype
    return a == b or (b == torch.float32 and a in FP32_EXACT) or (b == torch.float64 and a.is_floating_point)


def chain_back(n) -> list:
    """`n` and the tensors it is an exact view / copy / widening of, nearest first (a narrowing cast, e.g. to
    bf16, ends the chain: the tensor before it holds other values)."""
    out = []
    while isinstance(n, fx.Node) and tensor_val(n) is not None:
        out.append(n)
        if n.op != "call_function" or not (is_view_op(n) or n.target in PASS_THROUGH):
            break
        ins = [a for a in n.all_input_nodes if tensor_val(a) is not None]
        if len(ins) != 1 or not exact_cast(ins[0], n):
            break
        n = ins[0]
    return out


def casts_after(n: fx.Node, shape) -> list:
    """`n` and the copies / casts of the same shape that follow it, each the only user of the one before: the
    candidates for a chain's output (a result may be cast back to its input's dtype after the last op)."""
    out = [n]
    while len(out[-1].users) == 1:
        u = next(iter(out[-1].users))
        if u.op != "call_function" or u.target not in PASS_THROUGH or shape_of(u) != tuple(shape):
            break
        out.append(u)
    return out
