"""`normalize` family (runs first): remove no-op views, casts and copies so graphs share one form.

Eager code and its functionalised ATen graph are full of value-preserving detours that make the same math
look different to a structural matcher (MODEL.md §2.1 storage convention: codes travel as uint8 and are
re-viewed as float8 before use). Rewrites, each an Inductor pattern (`register_graph_pattern` into a
`PatternMatcherPass`; inner nodes must have a single user, so nothing another consumer reads is touched):

    dtype_view_roundtrip   view.dtype(view.dtype(x, a), x.dtype)                       -> x
    dtype_view_reshape     view.dtype(reshape(view.dtype(x, a), s), x.dtype), |a|=|x|   -> reshape(x, s)
    exact_cast_roundtrip   convert(convert(x, wide), x.dtype), wide holds every x value -> x
    reshape_chain          reshape(reshape(x, s1), s2)  (view or reshape)               -> reshape(x, s2)
    contiguous_clone       clone(x) of a contiguous x, not mutated afterwards            -> x
    alias                  alias(x)                                                     -> x
    batch1_bmm             unsqueeze(mm(squeeze(a, 0), squeeze(b, 0)), 0), a, b [1, m, k] / [1, k, n] -> bmm(a, b)

A cast round trip that is NOT value-preserving (`convert(convert(x, narrow), x.dtype)` where `narrow` does not hold
every value of x, e.g. float32 -> bfloat16 -> float32) is the program's own rounding and stays; it is reported once
per source line as a near-miss `cast_rounds`, so a user who expected it gone sees why.

Inductor's own `remove_noop_ops` (run before dsv41's passes) already drops casts to the same dtype and
views to the same shape; these are the two-step detours it leaves.

`batch1_bmm` undoes a device-dependent rewrite: on GPUs Inductor's joint-graph pattern `bmm_to_mm` turns every
`bmm` whose batch is 1 (every attention product at batch size 1 decode) into squeeze -> mm -> unsqueeze, so the
graphs dsv41 matched on CPU would look different on CUDA (on the H200 it hid every sparse-attention site of
`tiny`: the walk from the bank stopped at the 2-D `mm`, which in the CPU form is the output projection). The
bmm nodes this creates are tagged (`BATCH1_TAG`); `restore_batch1_mm`, run by the pass manager after every
family, gives the ones no fusion consumed back to Inductor in its own mm form.
"""

from __future__ import annotations

import threading

import torch
import torch.fx as fx

from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import FusionFamily, eliminate_dead_code, node_label, register_family, tensor_val

__all__ = ["NormalizeFamily", "SPEC", "EXACT_CASTS", "BATCH1_TAG", "restore_batch1_mm"]

aten = torch.ops.aten
prims = torch.ops.prims
_F8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
#: source dtype -> dtypes that represent every value of it exactly (so a round trip through them is a no-op).
EXACT_CASTS = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
    torch.uint8: (torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64),
    torch.int8: (torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64),
    torch.int16: (torch.int32, torch.int64, torch.float32, torch.float64),
    torch.int32: (torch.int64, torch.float64),
    torch.bool: (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                 torch.float32, torch.float64),
}
for _f8 in _F8:
    EXACT_CASTS[_f8] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_RESHAPES = (aten.reshape.default, aten.view.default)
#: meta key of the bmm nodes `batch1_bmm` created from Inductor's batch-1 mm form.
BATCH1_TAG = "dsv41_batch1_bmm"
_local = threading.local()
_PASS = None


def _dtype_of(n) -> torch.dtype | None:
    v = tensor_val(n)
    return v.dtype if v is not None else None


def _record(match, rewrite: str, removed: list[fx.Node], detail: tuple = ()) -> None:
    sink = getattr(_local, "sink", None)
    if sink is not None:
        sink.append(MatchRecord("normalize", rewrite, rewrite, SourceLocation.from_node(removed[-1]),
                                tuple(n.name for n in removed), tuple(node_label(n) for n in removed),
                                detail=detail))


def _replace(match, new: fx.Node, rewrite: str, detail: tuple = ()) -> None:
    out = match.output_node()
    removed = [n for n in match.nodes if n.op == "call_function"]
    out.replace_all_uses_with(new)
    match.erase_nodes()
    _record(match, rewrite, removed, detail)


def _build():
    """Register the rewrites into one PatternMatcherPass (done once, on first use)."""
    from torch._inductor.pattern_matcher import (CallFunction, KeywordArg, Match, PatternMatcherPass,
                                                 register_graph_pattern)

    pm = PatternMatcherPass(pass_name="dsv41_normalize")

    def roundtrip_ok(match: Match) -> bool:
        """The round trip ends in the dtype it started from."""
        x, out = match.kwargs["x"], match.output_node()
        return _dtype_of(x) is not None and _dtype_of(x) == _dtype_of(out)

    @register_graph_pattern(
        CallFunction(aten.view.dtype, CallFunction(aten.view.dtype, KeywordArg("x"), KeywordArg("mid")),
                     KeywordArg("dt")), extra_check=roundtrip_ok, pass_dict=pm)
    def dtype_view_roundtrip(match: Match, x, mid, dt):
        """view.dtype(view.dtype(x, a), x.dtype) -> x."""
        _replace(match, x, "dtype_view_roundtrip")

    for reshape in _RESHAPES:
        def same_width(match: Match) -> bool:
            """A round trip through a dtype of the same element size (so the reshape sees the same elements)."""
            x = match.kwargs["x"]
            return roundtrip_ok(match) and match.kwargs["mid"].itemsize == _dtype_of(x).itemsize

        @register_graph_pattern(
            CallFunction(aten.view.dtype,
                         CallFunction(reshape, CallFunction(aten.view.dtype, KeywordArg("x"), KeywordArg("mid")),
                                      KeywordArg("shape")),
                         KeywordArg("dt")), extra_check=same_width, pass_dict=pm)
        def dtype_view_reshape(match: Match, x, mid, shape, dt):
            """view.dtype(reshape(view.dtype(x, a), s), x.dtype) -> reshape(x, s)."""
            from .engine import insert_node
            new = insert_node(match.graph, match.output_node(), aten.reshape.default, (x, shape),
                              like=match.output_node())
            _replace(match, new, "dtype_view_reshape")

    def exact_roundtrip(match: Match) -> bool:
        """The intermediate dtype holds every value of x exactly (`EXACT_CASTS`)."""
        x, wide = match.kwargs["x"], match.kwargs["wide"]
        return roundtrip_ok(match) and wide in EXACT_CASTS.get(_dtype_of(x), ())

    @register_graph_pattern(
        CallFunction(prims.convert_element_type.default,
                     CallFunction(prims.convert_element_type.default, KeywordArg("x"), KeywordArg("wide")),
                     KeywordArg("back")), extra_check=exact_roundtrip, pass_dict=pm)
    def exact_cast_roundtrip(match: Match, x, wide, back):
        """convert(convert(x, wide), x.dtype) -> x."""
        _replace(match, x, "exact_cast_roundtrip")

    for outer in _RESHAPES:
        for inner in _RESHAPES:
            @register_graph_pattern(
                CallFunction(outer, CallFunction(inner, KeywordArg("x"), KeywordArg("s1")), KeywordArg("s2")),
                pass_dict=pm)
            def reshape_chain(match: Match, x, s1, s2):
                """reshape(reshape(x, s1), s2) -> reshape(x, s2)."""
                from .engine import insert_node
                new = insert_node(match.graph, match.output_node(), aten.reshape.default, (x, s2),
                                  like=match.output_node())
                _replace(match, new, "reshape_chain")

    def clone_is_noop(match: Match) -> bool:
        """A clone of a contiguous, non-placeholder x that nothing writes in place afterwards."""
        x, out = match.kwargs["x"], match.output_node()
        xv, ov = tensor_val(x), tensor_val(out)
        if xv is None or ov is None or not xv.is_contiguous() or not ov.is_contiguous():
            return False
        fmt = out.kwargs.get("memory_format")
        if fmt not in (None, torch.contiguous_format, torch.preserve_format):
            return False
        # A clone that is later written in place (or whose source is) must stay a copy.
        for n in (out, x):
            for u in n.users:
                t = u.target
                if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable:
                    return False
        return x.op != "placeholder"

    for clone in (CallFunction(aten.clone.default, KeywordArg("x")),
                  CallFunction(aten.clone.default, KeywordArg("x"), memory_format=KeywordArg("memory_format"))):
        @register_graph_pattern(clone, extra_check=clone_is_noop, pass_dict=pm)
        def contiguous_clone(match: Match, x, memory_format=None):
            """clone(x) -> x."""
            _replace(match, x, "contiguous_clone")

    @register_graph_pattern(CallFunction(aten.alias.default, KeywordArg("x")), pass_dict=pm)
    def alias(match: Match, x):
        """alias(x) -> x."""
        _replace(match, x, "alias")

    def batch1_operands(match: Match) -> bool:
        """Both matmul operands are 3-D with batch 1 (the form Inductor's bmm_to_mm rewrites)."""
        a, b = tensor_val(match.kwargs["a"]), tensor_val(match.kwargs["b"])
        return (a is not None and b is not None and a.dim() == 3 and b.dim() == 3
                and a.shape[0] == 1 and b.shape[0] == 1)

    for dim in (0, -3):
        @register_graph_pattern(
            CallFunction(aten.unsqueeze.default,
                         CallFunction(aten.mm.default, CallFunction(aten.squeeze.dim, KeywordArg("a"), dim),
                                      CallFunction(aten.squeeze.dim, KeywordArg("b"), dim)), 0),
            extra_check=batch1_operands, pass_dict=pm)
        def batch1_bmm(match: Match, a, b):
            """unsqueeze(mm(squeeze(a, 0), squeeze(b, 0)), 0) -> bmm(a, b), tagged `BATCH1_TAG`."""
            from .engine import insert_node
            new = insert_node(match.graph, match.output_node(), aten.bmm.default, (a, b), like=match.output_node())
            new.meta[BATCH1_TAG] = True
            _replace(match, new, "batch1_bmm", (("bmm", new.name),))

    return pm


def restore_batch1_mm(gm: fx.GraphModule) -> set:
    """Give the `batch1_bmm` nodes that no fusion consumed back to Inductor in the form its GPU rewrite chose
    (squeeze -> mm -> unsqueeze, so its mm templates and epilogue fusions still apply); returns the names of the
    restored bmm nodes (their `batch1_bmm` records are then dropped: the graph is as Inductor left it there)."""
    from .engine import insert_node
    done = set()
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != aten.bmm.default or not n.meta.get(BATCH1_TAG):
            continue
        a, b = n.args
        sa = insert_node(gm.graph, n, aten.squeeze.dim, (a, 0), like=n)
        sb = insert_node(gm.graph, n, aten.squeeze.dim, (b, 0), like=n)
        mm = insert_node(gm.graph, n, aten.mm.default, (sa, sb), like=n)
        out = insert_node(gm.graph, n, aten.unsqueeze.default, (mm, 0), like=n)
        n.replace_all_uses_with(out)
        done.add(n.name)
        gm.graph.erase_node(n)
    return done


#: The family as data (`dsv41 report --patterns`).
SPEC = register_family(
    "normalize", "remove no-op dtype-view / cast round trips, reshape chains, contiguous clones, aliases",
    rewrites_only=True)


class NormalizeFamily(FusionFamily):
    """Remove value-preserving detours (see module docstring); each rewrite is one match in the record."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Remove the value-preserving detours of `gm` in place; returns the record of what was rewritten."""
        global _PASS
        if _PASS is None:
            _PASS = _build()
        _local.sink = sink = []
        try:
            # One sweep can expose another rewrite (an alias removed between two dtype views): repeat to a fixpoint.
            for _ in range(4):
                if not _PASS.apply(gm.graph):
                    break
        finally:
            _local.sink = None
        eliminate_dead_code(gm.graph)
        return PassRecord(self.name, True, tuple(sink), tuple(_rounding_roundtrips(gm.graph)))


def _rounding_roundtrips(graph: fx.Graph) -> list:
    """Near-misses `cast_rounds`: the cast round trips left in `graph` whose intermediate dtype rounds (one per
    source line and dtype pair)."""
    out, seen = [], set()
    for n in graph.nodes:
        if n.op != "call_function" or n.target != prims.convert_element_type.default:
            continue
        inner = n.args[0]
        if not (isinstance(inner, fx.Node) and inner.op == "call_function"
                and inner.target == prims.convert_element_type.default and isinstance(inner.args[0], fx.Node)):
            continue
        src, mid, dst = _dtype_of(inner.args[0]), _dtype_of(inner), _dtype_of(n)
        if src is None or src != dst or mid in EXACT_CASTS.get(src, ()):
            continue
        loc = SourceLocation.from_node(inner)
        key = (src, mid, str(loc))
        if key in seen:
            continue
        seen.add(key)
        out.append(NearMiss("normalize", "cast round trip", "cast_rounds",
                            f"{inner.args[0].name} goes {src} -> {mid} -> {src}: {mid} does not hold every {src} value, "
                            "so the round trip rounds (the program's own rounding) and stays", loc))
    return out
