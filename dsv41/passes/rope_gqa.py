"""`rope_gqa` family: a layer's `rope_kv_store` and the `gqa_decode_attention` that reads what it wrote become one
op (dsv41/kernels/rope_gqa.py), so a Llama-style layer spends one launch between its q/k/v projection and o_proj.

Chain matched (the two families' ops, after `rope_kv` and `gqa_attention` have run):

    af  = auto_functionalized(dsv41.rope_kv_store, q=q, k=k, v=v, cos=, sin=, pos=, k_cache=kc, v_cache=vc, ...)
    qr  = permute(getitem(af, 0), [0, 2, 1, 3])                        # rope(q) as [B, Hq, M, D]
    out = dsv41.gqa_decode_attention(qr, getitem(af, 1), getitem(af, 2), mask, scale)
        -> out, kc', vc' = auto_functionalized(dsv41.rope_gqa_decode_attention, q, k, v, cos, sin, pos, kc, vc,
                                               layout, round_products, mask, scale)

Semantics need no probe: the fused op is defined as the two ops in turn (`reference_rope_gqa_decode_attention`),
and the chain is exactly that composition: the attention reads the rotated q and the caches as written, and
nothing else reads the rotated q. Why: at batch 1 the `rope_kv_store` launch moves a few kilobytes; its cost is
the launch and the wait between it and the attention.

Near-misses (reported, not fused):

    q_readers      the rotated q is read by more than the attention (the fused op does not return it)
    cache_readers  a cache the op writes is read between the write and the attention (that reader would have to
                   move after the fused op)
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from .engine import (Chain, ChainFamily, Role, Site, concrete_shape, insert_node, positions, register_family,
                     resolve_replaced, tensor_val, token_rows)
from .records import NearMiss, SourceLocation

__all__ = ["RopeGqaFamily", "SPEC"]

aten = torch.ops.aten
_PATTERN = "rope_kv_store -> gqa_decode_attention"
_AF = torch.ops.higher_order.auto_functionalized

SPEC = register_family(
    "rope_gqa", "RoPE + KV-cache write of a layer and the attention that reads them -> one launch", (
        Chain("rope_gqa", "rope_gqa_decode_attention", "dsv41::gqa_decode_attention whose q is the rotated q of a "
              "dsv41::rope_kv_store and whose k / v are the caches it wrote",
              (Role("q", "[B, M, Hq, D]", "bf16 / fp16 / fp32"), Role("k, v", "[B, M, Hkv, D]", "q's dtype"),
               Role("k_cache, v_cache", "[B, Hkv, T, D]", "k's dtype"),
               Role("mask", "broadcastable to [B, Hq, M, T]", "bool / additive")),
              "dsv41.kernels.rope_gqa:reference_rope_gqa_decode_attention", (),
              ("the composition of the two ops by construction (no probe)",), ("q_readers", "cache_readers")),
    ),
    # order: reads the ops both families emit
    after=("rope_kv", "gqa_attention"),
    # the RoPE prologue of the attention kernel has run under the Triton interpreter only
    gpu_validated=False,
)


def _is_rope_kv(n) -> bool:
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target is _AF and n.args
            and n.args[0] == torch.ops.dsv41.rope_kv_store.default)


def _getitem(n, i: int):
    """The auto_functionalized node when `n` is getitem(it, i), else None."""
    if isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem and n.args[1] == i:
        return n.args[0]
    return None


def _find(graph: fx.Graph, ev) -> tuple[list, list]:
    """Sites: every `gqa_decode_attention` reading a `rope_kv_store`'s rotated q and written caches."""
    sites, misses = [], []
    attention = getattr(torch.ops.dsv41, "gqa_decode_attention", None)
    if attention is None:
        return sites, misses
    pos = positions(graph)
    for att in list(graph.nodes):
        if att.op != "call_function" or att.target != attention.default:
            continue
        args = list(att.args) + [None] * (5 - len(att.args))
        qa, kc, vc = args[:3]
        mask = att.kwargs.get("mask", args[3])
        scale = att.kwargs.get("scale", args[4])
        if not (isinstance(qa, fx.Node) and qa.op == "call_function" and qa.target == aten.permute.default
                and list(qa.args[1]) == [0, 2, 1, 3]):
            continue
        af = _getitem(qa.args[0], 0)
        if not _is_rope_kv(af) or _getitem(kc, 1) is not af or _getitem(vc, 2) is not af or af.kwargs["q"] is None:
            continue
        loc = SourceLocation.from_node(att)
        qr = qa.args[0]
        if len(qr.users) != 1 or len(qa.users) != 1:
            misses.append(NearMiss("rope_gqa", _PATTERN, "q_readers", "the rotated q is read by more than the "
                                   "attention; dsv41::rope_gqa_decode_attention does not return it", loc))
            continue
        early = [u for c in (kc, vc) for u in c.users if u is not att and pos[u] < pos[att]]
        if early:
            misses.append(NearMiss("rope_gqa", _PATTERN, "cache_readers", f"{early[0].name} reads a cache the op "
                                   "writes before the attention does", loc))
            continue
        kw = af.kwargs
        op_args = (kw["q"], kw["k"], kw["v"], kw["cos"], kw["sin"], kw["pos"], kw["k_cache"], kw["v_cache"],
                   kw["layout"], kw["round_products"], mask, scale)
        b, m, hq, d = (int(x) for x in concrete_shape(tensor_val(kw["q"])))
        sites.append(Site(_PATTERN, "rope_gqa_decode_attention", att, op_args, (att, kc, vc),
                          [af, qr, qa, kc, vc, att], detail=(("Hq", hq), ("D", d), ("layout", kw["layout"])),
                          activations=(kw["q"],)))
    return sites, misses


def _rewrite(graph: fx.Graph, site: Site, op, replaced: dict) -> dict:
    """auto_functionalized(rope_gqa_decode_attention) before the attention; the attention's users and the cache
    readers move to its outputs."""
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    att = site.anchor
    names = ("q", "k", "v", "cos", "sin", "pos", "k_cache", "v_cache", "layout", "round_products", "mask", "scale")
    # an earlier site's rewrite may have replaced a node this one reads (two writes of one cache in a graph)
    args = [resolve_replaced(a, replaced) for a in site.args]
    af = insert_node(graph, att, _AF, (op,), dict(zip(names, args)), like=att)
    done = {}
    for i, old in enumerate(site.outputs):
        new = insert_node(graph, att, operator.getitem, (af, i), like=old)
        old.replace_all_uses_with(new)
        done[old] = new
    return done


def _bytes(site: Site, gone: list):
    """(before, after, symbols): the rotated q written by one launch and read by the next, against nothing."""
    b, m, hq, d = (int(x) for x in concrete_shape(tensor_val(site.args[0])))
    e = tensor_val(site.args[0]).element_size()
    rows, subs = token_rows((b, m))
    return str(sympy.expand(rows * hq * d * e * 2)), "0", subs


class RopeGqaFamily(ChainFamily):
    """Fuse a `rope_kv_store` and the `gqa_decode_attention` reading its outputs into `rope_gqa_decode_attention`
    (module docstring)."""

    spec = SPEC
    kernels = "dsv41.kernels.rope_gqa"
    rewrite = staticmethod(_rewrite)
    traffic = staticmethod(_bytes)

    def finders(self) -> tuple:
        """The one chain."""
        return (_find,)
