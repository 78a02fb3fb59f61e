"""`sparse_attention` family: one attention site over [FP8 window ; selected FP4 bank rows] becomes one op.

Chain matched (`SPEC` below, `dsv41 report --patterns sparse_attention`; MODEL.md §2.4 steps 3-6; eager code
dsv41/model/attention.py `Attention.forward`):

    keys  = cat_i(dequantize_fp8_1x32(codes_i, scales_i))              # window ring + the step's new rows
    bank  = dequantize_fp4_e4m3_1x16(bank_codes[b, idx.clamp(0)], bank_scales[b, idx.clamp(0)])
    s     = [where(window_ok, q . keys, -inf) ; where(idx >= 0, q . bank, -inf)] * softmax_scale
    p     = softmax([s ; sink])[..., :-1]                                # the sink only enlarges the denominator
    o     = apply_rope((p_window @ keys + p_bank @ bank).to(q.dtype), cos, sin, inverse=True)
      -> o = dsv41::sparse_fp4_attention(q, codes_0, scales_0, window_ok, bank_codes, bank_scales, idx,
                                         sink, cos, sin, softmax_scale, codes_1, scales_1)

    (the window parts read in place, no concatenated copy). Without a bank (an SWA layer: no gathers) the same
    region over the window alone -> the op with an empty bank and no selected slots (`window_ends`).

Structure (cheap, spelling-independent). The anchor is a pair of gathers `aten.index.Tensor(src, [b, rows])` of
two 3-D uint8 tensors sharing one index list: packed codes [B, N, D/2] and scales [B, N, D/g]. The dequantised
bank tensor is the first float node computed from both gathers, followed through views to [B, T, K, D]. The end
of the site is the first node after it of shape [B, T, H, D] that is an inverse-RoPE-like region (rope_fp4's
walker: one tensor of its own shape and dtype plus two trigonometric leaves). Walking back from that region's
input, every node that does not depend on the gathers is classified: a float [B, T, H, D] tensor is q (an exact
upcast of q is stripped), uint8 tensors are window codes (last dim D) or scales, the one bool tensor not derived
from the indices is the window mask, a float graph input with H elements is the sink; the index tensor is the
nearest int ancestor of the gathers' row index for which the whole region closes. Anything else the region reads
(a matmul output, another graph input) stops the match.

Semantics (how the constants and roles are settled). The region's own ATen nodes are evaluated on probe tensors
(realistic FP8 / FP4 codes from `formats`, random indices with -1 slots and repeats, random visibility, random
angles) and compared with `reference_sparse_fp4_attention` for every assignment the structure leaves open: the
order and pairing of the window parts, cos vs sin, the mask or its negation, and the softmax scale among D^-0.5
and the region's float literals (and their reciprocals). The bank dequantisation alone is first checked against
`formats.dequantize_fp4_e4m3_1x16` on every E4M3 scale byte. A look-alike is a `NearMiss` naming the check:
`bank_format` (another FP4 scale rule or block), `attention_sink` (plain softmax, no sink), `inverse_rope`
(rotation by +angle or another layout), `window_layout` (keys that are not whole FP8 tensors concatenated, e.g.
sliced rows of a later prefill chunk), `output_rope` (no inverse RoPE after the attention), `intermediate_used`
(a value inside the site is read elsewhere), `attention_values` (anything else).

Bytes per match (sympy in B, L): before = what the removed ATen ops read and write as separate eager kernels
(views free); after = the op's q, output, mask, indices, gathered bank rows, trig, and the window once per step.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.fx as fx

from ..ref import formats
from .records import NearMiss, PassRecord, SourceLocation
from .engine import (ByteTally, Chain, FusionFamily, RegionEvaluator, RegionNotClosed, Role, Site,
                     agree_where_representable, concrete_shape, dsv41_op, dtype_of, eliminate_dead_code, import_kernels,
                     insert_node, is_view_op, node_label, per_token_closure, positions, records_of, register_family,
                     shape_of, sourced_nodes, static_refusal, tensor_val)
from .rope_match import match_rope, rope_structure
from .small_ops import view_base
from .sparse_attention_structure import (FORWARD_LIMIT, MATMULS, PRIORITY, Leaves, attention_close, bank_tensor,
                                         candidate_scales, discover, forward_within, gather_pairs, module_path,
                                         sel_candidates, to_bts, why_no_end, window_ends)

__all__ = ["SparseAttentionFamily", "OP_NAME", "ROPE_Q", "SPEC"]

aten = torch.ops.aten
prims = torch.ops.prims
OP_NAME = "sparse_fp4_attention"
#: Gate name of the op rotating its queries itself. Its GPU tests pass (H100, session 33), but `small` decoded
#: 0.3 % slower with it (bench/results/2026-12-07_h100_s33/), so it stays in `GPU_UNVALIDATED_OPS`: off on CUDA
#: unless `gpu_unvalidated`.
ROPE_Q = "sparse_fp4_attention(rope_q)"

#: What the sparse-attention chain looks for (`dsv41 report --patterns`).
SPEC = register_family(
    "sparse_attention", "gather FP4 bank rows (-1 = empty) -> dequantize -> scores with the FP8 window -> softmax "
    "with sink -> weighted sum of the same rows -> inverse RoPE (or the FP8 window alone)", (
    Chain("attention", OP_NAME, "two gathers (index.Tensor with the same two index nodes) of uint8 [B, N, W] banks, "
          "codes twice as wide as scales per 16", (Role("q", "[B, T, H, D]"), Role("window", "FP8 codes + scales"),
                                                   Role("mask", "[B, T, S] bool"), Role("bank", "FP4 codes + scales"),
                                                   Role("indices", "[B, T, K]", "int"), Role("sink", "[H] (optional)"),
                                                   Role("cos / sin", "[.., R/2]")),
          "dsv41.ref.sparse_attention:sparse_fp4_attention",
          ("softmax scale", "window layout", "mask polarity", "inverse RoPE layout"),
          ("random FP8 window, FP4 bank on every E4M3 scale byte",),
          ("static_shapes", "bank_format", "attention_sink", "inverse_rope", "intermediate_used", "window_layout",
           "attention_values", "op_registered")),
    Chain("window attention", OP_NAME, "an inverse-RoPE-like [B, T, H, D] tensor computed from uint8 [B, S, D] "
          "FP8 window codes and from no bank gather (an SWA layer)",
          (Role("q", "[B, T, H, D]"), Role("window", "FP8 codes + scales"), Role("mask", "[B, T, S] bool"),
           Role("sink", "[H] (optional)"), Role("cos / sin", "[.., R/2]")),
          "dsv41.ref.sparse_attention:sparse_fp4_attention",
          ("softmax scale", "window layout", "mask polarity", "inverse RoPE layout"),
          ("random FP8 window, empty bank",),
          ("static_shapes", "attention_sink", "inverse_rope", "intermediate_used", "window_layout", "attention_values",
           "op_registered")),
    Chain("attention + q RoPE", OP_NAME, "either chain above whose q is interleaved RoPE of one tensor on its last R "
          "channels with the angles of the output's inverse RoPE, read by nothing else",
          (Role("q (before RoPE)", "[B, T, H, D]"), Role("cos / sin", "[.., R/2]")),
          "dsv41.ref.rope:apply_rope, then dsv41.ref.sparse_attention:sparse_fp4_attention", ("rope_dim",),
          ("random x and angles (rope_match), then the attention probes",),
          ("gpu_unvalidated", "op_registered"), variants=(ROPE_Q,), gpu_validated=False),
),
    # order: before indexer, so the attention chain is matched intact from the indices it reads; before
    # small_ops, which would share its visibility-mask math, and dispatch, which rewrites the matmuls around it
    after=("normalize",), before=("indexer", "small_ops", "dispatch"),
)


class SparseAttentionFamily(FusionFamily):
    """Fuse gather(FP4 bank) -> dequantize -> attention over [FP8 window ; bank] with sink -> inverse RoPE into
    `dsv41::sparse_fp4_attention` (see module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified sparse-attention site of `gm` with `dsv41::sparse_fp4_attention`; returns the
        record (matches with heads / rows / scale in `detail`, near-misses naming the failed check)."""
        import_kernels("dsv41.kernels.sparse_attention")
        graph = gm.graph
        start = set(graph.nodes)
        op = dsv41_op(OP_NAME)
        ev = RegionEvaluator(gm, extra_ops=MATMULS)
        sourced = sourced_nodes(graph)
        sites, misses = [], []
        pairs = list(gather_pairs(graph))
        # Everything computed from a bank gather belongs to a banked site (fused or a near-miss already named).
        banked = set(forward_within([g for pair in pairs for g in pair], FORWARD_LIMIT * max(1, len(pairs))))
        # Each pair is matched on the graph the rewrites of the pairs before it left (one dead-code pass at the end).
        for gc, gs in pairs:
            found, near = _match(gm, ev, sourced, gc, gs)
            misses.extend(near)
            for site in found:  # sites sharing one gather (a Reuse layer and its source) are all rewritten
                refused = static_refusal(self.name, "sparse fp4 attention", [*site.args, site.end, *site.region],
                                         SourceLocation.from_node(site.anchor), f"dsv41::{OP_NAME}")
                if refused is not None:
                    misses.append(refused)
                    continue
                if op is None:
                    misses.append(NearMiss(self.name, "sparse fp4 attention", "op_registered",
                                           f"dsv41::{OP_NAME} is not registered (import dsv41.kernels."
                                           "sparse_attention)", SourceLocation.from_node(gc)))
                    continue
                site = _absorb_q_rope(ev, site, sourced, self.gated_ops)
                _rewrite(graph, site, op)
                sites.append(site)
        eliminate_dead_code(graph)
        self._window_only(gm, ev, op, banked, sites, misses)
        eliminate_dead_code(graph)
        # A removed node shared by several sites (CSE'd gathers) counts for the first one only.
        matches = records_of(self.name, sites, start - set(graph.nodes), _bytes)
        note = "" if op is not None else f"op not registered: {OP_NAME}"
        return PassRecord(self.name, True, matches, tuple(misses), (), note)

    def _window_only(self, gm, ev, op, banked: set, sites: list, misses: list) -> None:
        """Attention over the FP8 window alone (an SWA layer: no bank rows): the same op with an empty bank and
        no selected slots. Sites already matched or named through a bank gather (`banked`) are skipped."""
        from ..ref.sparse_attention import sparse_fp4_attention as ref_op

        graph = gm.graph
        sourced = sourced_nodes(graph)
        computed, ends = window_ends(graph, sourced, banked)
        for end, x, trig in ends:
            if not end.users:  # inside a site rewritten just before
                continue
            b, t, h, d = shape_of(end)
            leaves = discover(x, set(trig), computed, None, sourced, d, (b, t, h))
            if leaves is None or not leaves.codes:
                continue
            res = _verify(ev, gm, end, None, None, None, leaves, trig, (b, t, h, d, 0), ref_op, sourced)
            if res is None:
                continue
            if not isinstance(res, Site):
                misses.append(NearMiss(self.name, "window attention", res[0], res[1],
                                       SourceLocation.from_node(end)))
                continue
            refused = static_refusal(self.name, "window attention", [*res.args, end, *res.region],
                                     SourceLocation.from_node(end), f"dsv41::{OP_NAME}")
            if refused is not None or op is None:
                misses.append(refused or NearMiss(self.name, "window attention", "op_registered",
                                                  f"dsv41::{OP_NAME} is not registered", SourceLocation.from_node(end)))
                continue
            res = _absorb_q_rope(ev, res, sourced, self.gated_ops)
            _rewrite(graph, res, op)
            sites.append(res)


def _probe_window(shape, gen, device):
    """(codes, scales) of realistic window rows [.., R, D]: FP8 1x32 quantisation of N(0, 2) values."""
    codes, scales = formats.quantize_fp8_1x32(torch.randn(shape, generator=gen, dtype=torch.float64).float() * 2)
    return codes.to(device), scales.to(device)


def _probe_bank(codes_shape, scales_shape, gen, device):
    codes = torch.randint(0, 256, codes_shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    scale_vals = torch.rand(scales_shape, generator=gen, dtype=torch.float64).float() * 0.45 + 0.05
    return codes.to(device), formats.e4m3_to_bytes(scale_vals).to(device)


def _match(gm, ev, sourced, gc: fx.Node, gs: fx.Node):
    """([`Site`, ...], [NearMiss, ...]) for the attention sites reading the gathered bank rows (gc, gs): one per
    inverse-RoPE end after them (several when CSE merged the gathers of layers reading the same bank and
    indices), each verified on its own; a look-alike is a near-miss."""
    from ..ref.sparse_attention import sparse_fp4_attention as ref_op

    graph = gm.graph
    pos = positions(graph)
    loc = SourceLocation.from_node(gc)
    pattern = "gather fp4 bank -> attention with sink -> inverse rope"
    bank = bank_tensor(gc, gs, pos)
    if bank is None:
        return [], []
    refused = static_refusal("sparse_attention", pattern, [gc, gs, bank], loc, f"dsv41::{OP_NAME}")
    if refused is not None:  # before the value checks, which see the compiled sizes only
        return [], [refused]
    bsrc_c, bsrc_s = gc.args[0], gs.args[0]
    b, t, k, wc = shape_of(gc)
    d = 2 * wc
    ok, why = _check_bank_format(ev, gc, gs, bank)
    if not ok:
        return [], [NearMiss("sparse_attention", pattern, "bank_format", why, loc)]
    fwd = forward_within([bank], FORWARD_LIMIT)
    fwd_set = set(fwd) | {bank}
    ends = sorted((n for n in fwd if len(shape_of(n) or ()) == 4 and shape_of(n)[:2] == (b, t) and shape_of(n)[3] == d
                   and dtype_of(n).is_floating_point), key=pos.__getitem__)
    found_ends = []
    for e in ends:
        found = rope_structure(e, sourced)
        if found is not None and found[1] in fwd_set and len(found[2]) == 2:
            found_ends.append((e, found))
    if not found_ends:
        return [], [NearMiss("sparse_attention", pattern, "output_rope",
                             "no inverse RoPE of the attention output follows the site; dsv41::sparse_fp4_attention "
                             "de-rotates its output (MODEL.md §2.4 step 6). "
                             + why_no_end(fwd, fwd_set, ends, sourced),
                             loc)]
    rows = gc.args[1][1]
    sites, misses = [], []
    for end, (_, x, trig) in found_ends:
        h = shape_of(end)[2]
        dep = set(forward_within([gc, gs], FORWARD_LIMIT, pos[end], pos)) | {gc, gs}
        reasons = []
        for sel in sel_candidates(rows, sourced):
            stops = {bsrc_c, bsrc_s, sel, *trig}
            leaves = discover(x, stops, dep, sel, sourced, d, (b, t, h))
            if leaves is None:
                continue
            res = _verify(ev, gm, end, gc, gs, sel, leaves, trig, (b, t, h, d, k), ref_op, sourced)
            if isinstance(res, Site):
                sites.append(res)
                reasons = []
                break
            if res is not None:
                reasons.append(res)
        if reasons:
            check, reason = min(reasons, key=lambda r: PRIORITY.index(r[0]))
            misses.append(NearMiss("sparse_attention", pattern, check, reason, SourceLocation.from_node(end) or loc))
    return sites, misses


def _check_bank_format(ev, gc, gs, bank):
    """The bank dequantisation must be `formats.dequantize_fp4_e4m3_1x16` of the gathered bytes (every E4M3
    scale bytes spread over 0..254 minus the NaN encodings 0x7F, 0xFF); (ok, reason)."""
    gen = torch.Generator().manual_seed(5)
    cv, sv = tensor_val(gc), tensor_val(gs)
    codes = torch.randint(0, 256, concrete_shape(cv), generator=gen, dtype=torch.int32).to(torch.uint8)
    n = sv.numel()
    allowed = torch.tensor([i for i in range(256) if i not in (0x7F, 0xFF)], dtype=torch.uint8)
    scales = allowed[(torch.arange(n) * 7 + 3) % allowed.numel()].reshape(concrete_shape(sv))
    env = {gc: codes.to(cv.device), gs: scales.to(sv.device)}
    try:
        got = ev.evaluate([bank], env)[bank]
    except (RegionNotClosed, RuntimeError):
        return False, "the bank rows are gathered but not dequantised by dataflow ops alone"
    want_d = concrete_shape(cv)[-1] * 2
    if concrete_shape(sv)[-1] * 16 == want_d:
        ref = formats.dequantize_fp4_e4m3_1x16(codes, scales, got.dtype)
        if agree_where_representable(got.cpu(), ref):
            return True, ""
    blk = want_d // concrete_shape(sv)[-1]
    if blk == 32:
        alt = formats.dequantize_fp4_ue8m0_1x32(codes, scales, got.dtype)
        if agree_where_representable(got.cpu(), alt):
            return False, ("the bank rows are FP4 E2M1 with UE8M0 scales per 32 channels (the index-key format); "
                           "dsv41::sparse_fp4_attention reads FP4 E2M1 with one E4M3 scale per 16 channels "
                           "(MODEL.md §2.8 'V41_FP4')")
    return False, (f"the gathered bank bytes are not dequantised as FP4 E2M1 with one E4M3 scale per 16 channels "
                   f"(codes [.., {concrete_shape(cv)[-1]}], scales [.., {concrete_shape(sv)[-1]}]); MODEL.md §2.8")


def _verify(ev, gm, end, gc, gs, sel, lv: Leaves, trig, dims, ref_op, sourced):
    """A `Site` when the region computes the op for one assignment; else (check, reason) or None."""
    b, t, h, d, k = dims
    if len(lv.q) != 1 or len(lv.masks) > 1 or not lv.codes or len(lv.codes) != len(lv.scales):
        return None
    sinks = [p for p in lv.params if tensor_val(p).numel() == h]
    if len(sinks) > 1 or len(lv.params) > len(sinks):
        return None
    q = lv.q[0]
    if prims.convert_element_type.default == q.target and shape_of(q.args[0]) == shape_of(q) \
            and dtype_of(q.args[0]) in (torch.bfloat16, torch.float16) and dtype_of(q.args[0]) == dtype_of(end):
        q_op = q.args[0]
    else:
        q_op = q
    if dtype_of(q_op) != dtype_of(end):
        return None
    for c in lv.codes:
        if len(shape_of(c)) != 3 or shape_of(c)[0] != b:
            return "window_layout", "the window codes are not [B, rows, D] uint8 tensors"
    for s in lv.scales:
        if len(shape_of(s)) != 3 or shape_of(s)[0] != b or shape_of(s)[2] * 32 != d:
            return "window_layout", ("the window scales are not [B, rows, D/32] uint8 (FP8 with UE8M0 per 32 "
                                     "channels, MODEL.md §2.8)")
    device = tensor_val(q).device
    gen = torch.Generator().manual_seed(11)
    env = {}
    qv = tensor_val(q)
    # q's probe lies on q_op's grid, so that the stripped upcast is exact on it.
    qp = torch.randn(concrete_shape(qv), generator=gen, dtype=torch.float64).to(dtype_of(q_op)).to(device)
    env[q] = qp.to(qv.dtype)
    for c in lv.codes:
        env[c] = _probe_window(shape_of(c), gen, device)[0]
    for s in lv.scales:  # scales get their own values; the pairing decides which codes they belong to
        env[s] = _probe_window((*shape_of(s)[:2], d), gen, device)[1]
    if gc is None:  # window only: the op reads an empty bank and no selected rows
        bank_c = torch.zeros(b, 0, d // 2, dtype=torch.uint8)
        bank_s = torch.zeros(b, 0, d // 16, dtype=torch.uint8)
        sel_p = torch.zeros(b, t, 0, dtype=torch.int64)
    else:
        bank_c, bank_s = _probe_bank(concrete_shape(tensor_val(gc.args[0])), concrete_shape(tensor_val(gs.args[0])),
                                     gen, device)
        env[gc.args[0]], env[gs.args[0]] = bank_c, bank_s
        n_rows = concrete_shape(tensor_val(gc.args[0]))[1]
        selv = tensor_val(sel)
        sel_p = torch.randint(-1, n_rows, concrete_shape(selv), generator=gen, dtype=torch.int64)
        env[sel] = sel_p.to(selv.dtype).to(device)
    sink = sinks[0] if sinks else None
    if sink is not None:
        env[sink] = torch.randn(concrete_shape(tensor_val(sink)), generator=gen, dtype=torch.float64) \
            .to(dtype_of(sink)).to(device)
    mask = lv.masks[0] if lv.masks else None
    if mask is not None:
        env[mask] = (torch.rand(concrete_shape(tensor_val(mask)), generator=gen) < 0.7).to(device)
    for tr in trig:
        env[tr] = (torch.rand(concrete_shape(tensor_val(tr)), generator=gen, dtype=torch.float64) * 2 - 1) \
            .to(dtype_of(tr)).to(device)
    try:
        memo = ev.evaluate([end], env)
    except (RegionNotClosed, RuntimeError):
        return None
    got = memo[end]
    region = [n for n in memo if n not in env]
    # Pairings of window codes with scales of the same rows, and their orders.
    pairings = []
    for perm in itertools.permutations(lv.scales):
        pairs = tuple(zip(lv.codes, perm))
        if all(shape_of(c)[:2] == shape_of(s)[:2] for c, s in pairs):
            pairings.extend(itertools.permutations(pairs))
    if not pairings:
        return "window_layout", "the window codes and scales do not pair up row for row"
    s_rows = sum(shape_of(c)[1] for c in lv.codes)
    scales = candidate_scales(region, d)
    sink_val = env[sink].float().cpu() if sink is not None else torch.full((h,), float("-inf"))
    mask_p = env[mask].cpu() if mask is not None else torch.ones(b, t, s_rows, dtype=torch.bool)
    wmask = to_bts(mask_p, b, t, s_rows)
    if wmask is None:
        return "window_layout", f"the window mask {tuple(mask_p.shape)} is not a [B, T, S] visibility mask"
    tvals = {tr: to_bts(env[tr].float().cpu(), b, t, shape_of(tr)[-1]) for tr in trig}
    if any(v is None for v in tvals.values()):
        return None

    def reference(order, cs, sn, inv, sc, sink_v, inverse=True):
        """The op's CPU reference on the probe values for one window order / mask / RoPE / scale hypothesis."""
        wc_ = torch.cat([env[c] for c, _ in order], 1).cpu()
        ws_ = torch.cat([env[s] for _, s in order], 1).cpu()
        m = ~wmask if inv else wmask
        sn_ = tvals[sn] if inverse else -tvals[sn]
        return ref_op(qp.cpu(), wc_, ws_, m.contiguous(), bank_c.cpu(), bank_s.cpu(), sel_p, sink_v,
                      tvals[cs].contiguous(), sn_.contiguous(), sc)

    # Codes and scales got independent probes: whichever scales a part is paired with, the reference reads the
    # same values the region did.
    trig_orders = [(trig[0], trig[1]), (trig[1], trig[0])]
    mask_options = (False, True) if mask is not None else (False,)
    if wmask.shape[-1] != s_rows:
        return "window_layout", ("the keys are not whole FP8 tensors concatenated (e.g. sliced rows of a prefill "
                                 "chunk after the first); left to Inductor")
    for order in pairings:
        for cs, sn in trig_orders:
            for inv in mask_options:
                for sc in scales:
                    try:
                        ref = reference(order, cs, sn, inv, sc, sink_val)
                    except (RuntimeError, IndexError, ValueError):
                        continue
                    if attention_close(got.cpu(), ref):
                        return _site(end, gc, gs, sel, q_op, q, order, mask, inv, sink, cs, sn, sc, region,
                                     (b, t, h, d, k, s_rows))
    # Look-alikes: the most telling alternative that fits.
    for order in pairings[:2]:
        for cs, sn in trig_orders:
            for inv in mask_options:
                for sc in scales[:8]:
                    try:
                        no_sink = torch.full((h,), float("-inf"))
                        if attention_close(got.cpu(), reference(order, cs, sn, inv, sc, no_sink)):
                            return "attention_sink", (
                                "the region reads a per-head sink but its softmax equals a plain softmax over the "
                                "rows (e.g. the sink shifts every score, which softmax ignores); dsv41::sparse_fp4_"
                                "attention adds exp(sink_h - M) to the denominator only (MODEL.md §2.4 step 5)")
                        if attention_close(got.cpu(), reference(order, cs, sn, inv, sc, sink_val, inverse=False)):
                            return "inverse_rope", (
                                "the attention output is rotated by +angle; the op de-rotates (angle -p) the last "
                                "R channels (MODEL.md §2.4 step 6)")
                    except (RuntimeError, IndexError, ValueError):
                        continue
    if gc is None:
        return "attention_values", ("the region reads q, FP8 window rows and a visibility mask but does not compute "
                                    "attention over the window with sink and inverse RoPE (MODEL.md §2.4 steps 3-6)")
    return "attention_values", ("the region reads q, FP8 window rows, a visibility mask, gathered FP4 bank rows, "
                                "indices and a sink but does not compute sparse attention with sink and inverse RoPE "
                                "(MODEL.md §2.4 steps 3-6)")


def _site(end, gc, gs, sel, q_op, q_leaf, order, mask, inv, sink, cs, sn, sc, region, dims):
    b, t, h, d, k, s_rows = dims
    inside = set(region)
    # Values computed from q (scores, probabilities, partial outputs) must not be read outside the site: fusing
    # would compute the attention twice. The bank / window dequantisation and the index math may be shared (CSE
    # merges them between layers reading the same bank and indices); they stay alive while anything reads them.
    from_q = {q_op, q_leaf}
    for n in region:  # evaluation order: inputs first
        if any(a in from_q for a in n.all_input_nodes):
            from_q.add(n)
    for n in region:
        if n is end or n not in from_q:
            continue
        if n.op == "call_function" and any(u not in inside for u in n.users):
            return "intermediate_used", (f"{n.name} ({node_label(n)}) inside the attention site is also read "
                                         "elsewhere; fusing would compute it twice")
    # Window only: the first product of the region (the scores' einsum / matmul in the user's attention code)
    # names the site; the end is often a shared RoPE helper's line.
    products = [n for n in region if n.op == "call_function" and n.target in MATMULS]
    anchor = gc if gc is not None else products[0] if products else end
    detail = (("heads", h), ("head_dim", d), ("window_rows", s_rows), ("topk", k), ("window_parts", len(order)),
              ("rope_dim", 2 * shape_of(cs)[-1]), ("softmax_scale", sc), ("sink", sink is not None),
              ("mask", "inverted" if inv else "as is"), ("bank", gc is not None), ("module", module_path(anchor)))
    bank = (None, None) if gc is None else (gc.args[0], gs.args[0])
    return Site(OP_NAME, OP_NAME, anchor, (q_op, order, mask, inv, *bank, sel, sink, cs, sn, sc, False),
                (end,), region, (q_op, sel), detail)


def _absorb_q_rope(ev, site: Site, sourced, gated) -> Site:
    """`site` with q's own RoPE taken into the op (`rope_q`: the op rotates q while loading it) when q is
    interleaved RoPE of one tensor x on its last R channels (`rope_match.match_rope`, verified on probes), its
    angles are the values of the site's cos / sin (evaluated from the same leaves on probe angles), and nothing
    outside the site reads the rotated q; else `site` unchanged. While the variant is gated on CUDA, an absorbable
    RoPE stays outside and the match's detail says why (`q_rope`)."""
    q, cs, sn = site.args[0], site.args[8], site.args[9]
    inside = set(site.region)
    def in_site(u):
        """u belongs to the site, or is the upcast of q that the site reads (a probe leaf, not in its region)."""
        return u in inside or (u.target is prims.convert_element_type.default and bool(u.users)
                               and all(w in inside for w in u.users))

    if not all(in_site(u) for u in q.users):
        return site
    rope, _ = match_rope(q, ev, sourced)
    if rope is None or rope.sin is None or rope.rope_dim != 2 * shape_of(cs)[-1] \
            or dtype_of(rope.x) != dtype_of(q) or shape_of(rope.x) != shape_of(q):
        return site
    b, t = shape_of(q)[:2]
    half = shape_of(cs)[-1]
    gen = torch.Generator().manual_seed(13)
    # Probe angles at the tensors the output's cos / sin are views of; q's angles must evaluate to the same values.
    env = {}
    for leaf in (cs, sn):
        base = view_base(leaf)
        env[base] = (torch.rand(concrete_shape(tensor_val(base)), generator=gen, dtype=torch.float64) * 2 - 1) \
            .to(dtype_of(base)).to(tensor_val(base).device)
    try:
        got = ev.evaluate([cs, sn, rope.cos, rope.sin], env)
    except (RegionNotClosed, RuntimeError):
        return site  # q's angles come from other tensors than the output's
    for node, leaf in ((rope.cos, cs), (rope.sin, sn)):
        v, w = to_bts(got[node].float().cpu(), b, t, half), to_bts(got[leaf].float().cpu(), b, t, half)
        if v is None or w is None or not torch.equal(v, w):
            return site
    if ROPE_Q in gated:  # absorbable, but the variant has not yet run on a GPU: say so in the match
        return dataclasses.replace(site, detail=site.detail + (("q_rope", f"left to Inductor: {ROPE_Q} is gated "
                                                                          "(gpu_unvalidated)"),))
    region = site.region + [n for n in rope.region if n not in inside and n is not rope.x]
    return dataclasses.replace(site, args=(rope.x, *site.args[1:11], True), region=region,
                               activations=(rope.x, site.activations[1]), detail=site.detail + (("q_rope", True),))


def _rewrite(graph: fx.Graph, site: Site, op) -> None:
    q, order, mask, inv, bc, bs, sel, sink, cs, sn, sc, rope_q = site.args
    end = site.end
    b, t, h, d = shape_of(end)
    pos = positions(graph)
    site.region.sort(key=pos.__getitem__)
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    like = site.anchor  # provenance: the bank gather's line in the user's code

    def ins(target, args):
        """Insert `target(*args)` before the site's end node."""
        return insert_node(graph, end, target, args, like=like)

    codes = [c for c, _ in order]
    scales = [s for _, s in order]
    # The op reads two parts in place (the ring and the step's own rows): no concatenated copy, which Inductor
    # would launch as its own kernels. Parts after the second are concatenated onto it.
    wc, ws = codes[0], scales[0]
    nc = None if len(codes) == 1 else codes[1] if len(codes) == 2 else ins(aten.cat.default, (codes[1:], 1))
    ns = None if len(scales) == 1 else scales[1] if len(scales) == 2 else ins(aten.cat.default, (scales[1:], 1))
    s_rows = sum(shape_of(c)[1] for c in codes)

    def bts(node, last):
        """`node` viewed as [b, t, last] (select the head dim, then expand) for the op's arguments."""
        n = node
        if len(shape_of(n)) == 4:
            n = ins(aten.select.int, (n, 2, 0))
        if shape_of(n) != (b, t, last):
            n = ins(aten.expand.default, (n, [b, t, last]))
        return n

    if mask is None:
        ok = insert_node(graph, end, aten.ones.default, ([b, t, s_rows],), {"dtype": torch.bool,
                                                                              "device": tensor_val(q).device},
                         like=like)
    else:
        ok = bts(mask, s_rows)
        if inv:
            ok = ins(aten.logical_not.default, (ok,))
    if sink is None:
        sk = insert_node(graph, end, aten.full.default, ([h], float("-inf")),
                         {"dtype": torch.float32, "device": tensor_val(q).device}, like=like)
    else:
        sk = sink if dtype_of(sink) == torch.float32 else ins(prims.convert_element_type.default, (sink, torch.float32))
        if shape_of(sk) != (h,):
            sk = ins(aten.reshape.default, (sk, [h]))
    half = shape_of(cs)[-1]
    cos_in, sin_in = bts(cs, half), bts(sn, half)
    idx = sel
    if bc is None:  # window only (an SWA layer): zero bank rows, zero selected slots; allocations, no kernel
        dev = {"device": tensor_val(q).device}
        bc = insert_node(graph, end, aten.empty.memory_format, ([b, 0, d // 2],), {"dtype": torch.uint8, **dev},
                         like=like)
        bs = insert_node(graph, end, aten.empty.memory_format, ([b, 0, d // 16],), {"dtype": torch.uint8, **dev},
                         like=like)
        idx = insert_node(graph, end, aten.empty.memory_format, ([b, t, 0],), {"dtype": torch.int64, **dev},
                          like=like)
    out = ins(op, (q, wc, ws, ok, bc, bs, idx, sk, cos_in, sin_in, float(sc), nc, ns, *((True,) if rope_q else ())))
    end.replace_all_uses_with(out)


def _bytes(site: Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's reads and writes."""
    b, t, h, d = shape_of(site.end)
    q, sel = site.activations
    per_token = per_token_closure(tuple(a for a in (q, sel) if a is not None), site.region, site.inputs_of)
    tally = ByteTally((b, t), per_token.__contains__)
    tally.add_removed(gone, site.inputs_of, lambda key, n, a: None if is_view_op(a) else tally.add(key, a))

    def nbytes(n):
        """Bytes of a node's value (0 without one)."""
        v = tensor_val(n)
        return 0 if v is None else v.numel() * v.element_size()

    k = 0 if sel is None else shape_of(sel)[-1]
    _, order, mask, *_rest = site.args
    cs = site.args[8]
    qb = nbytes(q) // (b * t)
    win = sum(nbytes(c) + nbytes(s) for c, s in order)
    s_rows = sum(shape_of(c)[1] for c, _ in order)
    idx_bytes = 0 if sel is None else tensor_val(sel).element_size()
    per_tok_after = 2 * qb + s_rows + k * (idx_bytes + d // 2 + d // 16) + 8 * shape_of(cs)[-1]
    tally.totals["after"] = [per_tok_after, win + 4 * h]
    return tally.result()

