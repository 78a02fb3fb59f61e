"""`row_argmax` family: greedy decoding's argmax over a large last dim becomes one op split across the GPU
(dsv41/kernels/row_argmax.py).

Chain matched (post-grad ATen of `logits.argmax(-1)`, `torch.argmax(x, dim=-1, keepdim=True)`):

    idx = argmax(x, dim=-1 (or x.dim() - 1), keepdim)        x bf16 / fp16 / fp32 [..., N], N >= MIN_N,
                                                            at most MAX_TRITON_ROWS rows (static shapes)
        -> idx = dsv41::row_argmax(x)       (unsqueezed at the end where keepdim)

Semantics need no probe: the op is torch.argmax over the last dim, ties to the first index and NaN as the largest
value, exactly (`reference_row_argmax`; the kernel's tests compare it with torch.argmax on ties, NaN and -inf rows).
Why: Inductor reduces such a row in one program per row, which at batch 1 walks a 128K vocabulary alone (33 µs of a
Llama decode step on an H100).

Not taken (unrecorded, Inductor's own reduction is fine there): another dim, no dim (argmax of the flattened
tensor), more rows than MAX_TRITON_ROWS (prefill), N below MIN_N, symbolic shapes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..kernels.row_argmax import MAX_TRITON_ROWS
from .engine import Chain, ChainFamily, Role, Site, concrete_shape, insert_node, register_family, tensor_val, token_rows

__all__ = ["RowArgmaxFamily", "SPEC", "MIN_N"]

aten = torch.ops.aten
_PATTERN = "argmax(x, -1)"
#: The smallest last dim taken: below a few thousand values one program per row is not the bottleneck.
MIN_N = 4096
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)

SPEC = register_family(
    "row_argmax", "argmax over a large last dim (greedy decoding) -> one op split across the GPU", (
        Chain("row_argmax", "row_argmax", "aten.argmax over the last dim of a float tensor of at most "
              f"{MAX_TRITON_ROWS} rows and at least {MIN_N} columns",
              (Role("x", "[..., N]", "bf16 / fp16 / fp32"),),
              "dsv41.kernels.row_argmax:reference_row_argmax", (), ("exact by definition (no probe)",), ()),
    ),
    # order: independent of the other families (none emits or reads argmax)
    after=("half_gemv",),
    # the kernel has run only under the Triton interpreter
    gpu_validated=False,
)


def _find(graph: fx.Graph, ev) -> tuple[list, list]:
    sites = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target != aten.argmax.default:
            continue
        x = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        xv = tensor_val(x) if isinstance(x, fx.Node) else None
        shape = concrete_shape(xv) if xv is not None else None
        if (xv is None or shape is None or not shape or not all(isinstance(d, int) for d in shape)
                or xv.dtype not in _FLOATS or dim is None or dim not in (-1, len(shape) - 1)):
            continue
        rows = 1
        for d in shape[:-1]:
            rows *= d
        if rows > MAX_TRITON_ROWS or shape[-1] < MIN_N:
            continue
        sites.append(Site(_PATTERN, "row_argmax", n, (x,), (n,), [n], activations=(x,),
                          detail=(("N", shape[-1]), ("rows", rows), ("keepdim", bool(keep)))))
    return sites, []


def _rewrite(graph: fx.Graph, site: Site, op, replaced: dict) -> dict:
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    old = site.anchor
    out = insert_node(graph, old, op, (site.args[0],), like=old)
    if dict(site.detail)["keepdim"]:
        out = insert_node(graph, old, aten.unsqueeze.default, (out, -1), like=old)
    old.replace_all_uses_with(out)
    return {old: out}


def _bytes(site: Site, gone: list):
    """(before, after, symbols): the same bytes (x read once, the indices written); the gain is the split."""
    x = site.args[0]
    shape = concrete_shape(tensor_val(x))
    rows, subs = token_rows(shape[:-1])
    expr = str(rows * (shape[-1] * tensor_val(x).element_size() + 8))
    return expr, expr, subs


class RowArgmaxFamily(ChainFamily):
    """Replace a last-dim `argmax` of a few large rows by `dsv41::row_argmax` (module docstring)."""

    spec = SPEC
    kernels = "dsv41.kernels.row_argmax"
    rewrite = staticmethod(_rewrite)
    traffic = staticmethod(_bytes)

    def finders(self) -> tuple:
        """The one chain."""
        return (_find,)
