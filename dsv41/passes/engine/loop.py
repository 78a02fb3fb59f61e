"""The chain loop every region family runs: finders -> op checks -> rewrite -> dead-code elimination -> toposort
-> records.

A finder takes (graph, evaluator) and returns (sites, near-misses): `Site`s are chains verified on probe tensors,
ready to rewrite. Before a site is rewritten the loop refuses it when it reads a size known only at run time
(`static_refusal`), when its op variant is gated off for this graph (`gpu_unvalidated`), or when its op is not
registered (`op_registered`); each refusal is a near-miss. A finder verifies all of its sites before any is
rewritten, so a site may read a node an earlier site of the same finder replaced; its arguments go through the
replacements (`resolve_replaced`), else the whole eager chain would stay alive next to the fused op.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.fx as fx

from ..records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .edit import insert_node
from .evaluate import RegionEvaluator
from .graph import dsv41_op, eliminate_dead_code, node_label, positions, sourced_nodes
from .symbolic import static_refusal

__all__ = ["Site", "GraphScan", "collect", "ops_or_note", "resolve_replaced", "import_kernels", "run_finders",
           "records_of", "match_record", "keep_removed", "pass_record", "rewrite_outputs", "sort_region",
           "finish_graph"]

aten = torch.ops.aten


@dataclass
class Site:
    """A verified chain, ready to rewrite.

    Fields: pattern (what matched, for the report); op_name (the dsv41 op, without namespace); anchor (the node whose
    source line the report shows); args (the op's arguments: nodes, constants, or a deferred view
    ("permute", node, dims) / ("reshape", node, shape)); outputs (the nodes the op replaces, in its output order);
    region (the nodes of the chain); activations (what the byte rule counts per token); detail (((key, value),
    ...) for the record); params (what the byte rule counts per step); variant (the gate name of an op variant, e.g.
    "mhc_mixes(norm_weight)"); gathered ((gather, table) pairs: a gather reads rows, not its table); inputs_of
    (region node -> its inputs, kept at rewrite time for the byte rule).
    """

    pattern: str
    op_name: str
    anchor: fx.Node
    args: tuple
    outputs: tuple
    region: list
    activations: tuple = ()
    detail: tuple = ()
    params: tuple = ()
    variant: str | None = None
    gathered: tuple = ()
    inputs_of: dict = dataclasses.field(default_factory=dict)

    @property
    def end(self) -> fx.Node:
        """The first output: the end of a single-output chain."""
        return self.outputs[0]


class GraphScan:
    """What a family's run starts from: `graph`, its nodes before any rewrite (`start`), a probe evaluator `ev`
    (evaluating `eval_ops` too) and the nodes fed by graph inputs or large constants (`sourced`)."""

    def __init__(self, gm: fx.GraphModule, eval_ops=frozenset(), hint_args: bool = False):
        self.graph = gm.graph
        self.start = set(self.graph.nodes)
        self.ev = RegionEvaluator(gm, extra_ops=eval_ops, hint_args=hint_args)
        self.sourced = sourced_nodes(self.graph)

    def removed_names(self) -> set:
        """Names of the nodes of `start` no longer in the graph."""
        return {n.name for n in self.start - set(self.graph.nodes)}


def collect(sites: list, misses: list, site, miss) -> None:
    """Append a finder's verdict: `site` to `sites` and `miss` to `misses`, each when not None."""
    if site is not None:
        sites.append(site)
    if miss is not None:
        misses.append(miss)


def ops_or_note(family: str, names, label: str) -> tuple:
    """(the registered ops `dsv41::<name>` for `names`, None), or (None, the family's empty record with the note
    "dsv41::`label` not registered") when one is not registered (a family that rewrites dsv41 ops it finds)."""
    ops = tuple(dsv41_op(n) for n in names)
    if any(op is None for op in ops):
        return None, PassRecord(family, True, note=f"dsv41::{label} not registered")
    return ops, None


def resolve_replaced(arg, replaced: dict):
    """`arg` (a node, a constant, or a tuple of them) with every node an earlier rewrite replaced swapped for its
    replacement (transitively)."""
    if isinstance(arg, tuple):
        return tuple(resolve_replaced(a, replaced) for a in arg)
    while isinstance(arg, fx.Node) and arg in replaced:
        arg = replaced[arg]
    return arg


def import_kernels(module: str) -> None:
    """Import the kernels module `module` that registers a family's ops; a missing one is not an error (each chain
    whose op is then missing becomes a near-miss `op_registered`)."""
    import importlib
    try:
        importlib.import_module(module)
    except ImportError:
        pass


def run_finders(family: str, graph: fx.Graph, ev, finders: Iterable[Callable], rewrite: Callable, kernels: str,
                gated_ops: frozenset = frozenset(), check_static: bool = True) -> tuple[list, list, set]:
    """Run each finder on `graph` in turn and rewrite its sites: `rewrite(graph, site, op, replaced)` inserts the op
    and returns {old node: new node}. Before a rewrite a site is refused (a near-miss) when `check_static` and it
    reads a size known only at run time, when its op or op variant is in `gated_ops`, or when its op is not
    registered. Dead code is removed after each finder. Returns (rewritten sites, near-misses, names of ops found
    unregistered). `kernels` names the module that registers the ops (for the near-miss)."""
    sites: list = []
    misses: list = []
    missing: set = set()
    replaced: dict = {}
    for finder in finders:
        found, near = finder(graph, ev)
        misses.extend(near)
        for site in found:
            loc = SourceLocation.from_node(site.anchor)
            if check_static:
                refused = static_refusal(family, site.pattern, [*site.args, *site.outputs, *site.region], loc,
                                         f"dsv41::{site.op_name}")
                if refused is not None:
                    misses.append(refused)
                    continue
            gated = [g for g in (site.op_name, site.variant) if g is not None and g in gated_ops]
            if gated:
                misses.append(NearMiss(family, site.pattern, "gpu_unvalidated",
                                       f"dsv41::{gated[0]} has not yet run on a GPU, so on CUDA this chain stays "
                                       "with Inductor (option gpu_unvalidated=True fuses it)", loc))
                continue
            op = dsv41_op(site.op_name)
            if op is None:
                missing.add(site.op_name)
                misses.append(NearMiss(family, site.pattern, "op_registered",
                                       f"dsv41::{site.op_name} is not registered (import {kernels})", loc))
                continue
            replaced.update(rewrite(graph, site, op, replaced) or {})
            sites.append(site)
        eliminate_dead_code(graph)
    return sites, misses, missing


def finish_graph(graph: fx.Graph) -> None:
    """Put `graph` back in topological order (a fused op is inserted where its chain ended, which may be before an
    input of a later op) and remove what became dead."""
    from torch._inductor.pattern_matcher import stable_topological_sort
    stable_topological_sort(graph)
    eliminate_dead_code(graph)


def records_of(family: str, sites: Iterable[Site], removed: set, byte_rule: Callable,
               first_only: bool = True) -> tuple[MatchRecord, ...]:
    """One `MatchRecord` per site: the removed nodes of its region (with `first_only`, a node shared by two regions
    counts for the first match only) and `byte_rule(site, gone) -> (before, after, {"B": b, "L": l})`."""
    out = []
    for s in sites:
        gone = [n for n in s.region if n in removed]
        out.append(match_record(family, s.pattern, s.op_name, s.anchor, gone, byte_rule(s, gone), s.detail))
        if first_only:
            removed = removed - set(s.region)
    return tuple(out)


def match_record(family: str, pattern: str, op_name: str, anchor: fx.Node, gone: list, traffic: tuple,
                 detail: tuple) -> MatchRecord:
    """The `MatchRecord` of one fusion: `gone` the removed nodes, `traffic` (before, after, {"B": b, "L": l})."""
    before, after, subs = traffic
    return MatchRecord(family, pattern, f"dsv41::{op_name}", SourceLocation.from_node(anchor),
                       tuple(n.name for n in gone), tuple(node_label(n) for n in gone), before, after,
                       tuple(sorted(subs.items())), tuple(detail))


def keep_removed(m: MatchRecord, removed: set) -> MatchRecord:
    """`m` with only the chain nodes that really left the graph (a shared node another consumer still reads
    stays); `removed` holds node names."""
    keep = [(a, b) for a, b in zip(m.nodes_replaced, m.ops_replaced) if a in removed]
    return dataclasses.replace(m, nodes_replaced=tuple(a for a, _ in keep), ops_replaced=tuple(b for _, b in keep))


def pass_record(family: str, matches, misses, missing: set) -> PassRecord:
    """The family's record, with a note naming the ops that were not registered."""
    note = f"ops not registered: {', '.join(sorted(missing))}" if missing else ""
    return PassRecord(family, True, tuple(matches), tuple(misses), (), note)


def rewrite_outputs(graph: fx.Graph, site: Site, op, first: fx.Node, args: list | None = None) -> dict:
    """Insert `op(*args)` (default: `site.args`, deferred ("permute", node, dims) / ("reshape", node, shape) views
    materialised) before `first` and hand it the users of `site.outputs` (through `getitem`s for several outputs);
    returns {old output: its replacement node}."""
    args = list(site.args) if args is None else list(args)
    for i, a in enumerate(args):
        if isinstance(a, tuple) and a and a[0] == "permute":
            args[i] = insert_node(graph, first, aten.permute.default, (a[1], [1, 0]), like=site.anchor)
        elif isinstance(a, tuple) and a and a[0] == "reshape":
            args[i] = insert_node(graph, first, aten.reshape.default, (a[1], a[2]), like=site.anchor)
    out = insert_node(graph, first, op, tuple(args), like=site.anchor)
    if len(site.outputs) == 1:
        site.outputs[0].replace_all_uses_with(out)
        return {site.outputs[0]: out}
    done = {}
    for i, old in enumerate(site.outputs):
        new = insert_node(graph, first, operator.getitem, (out, i), like=site.anchor)
        old.replace_all_uses_with(new)
        done[old] = new
    return done


def sort_region(graph: fx.Graph, site: Site) -> dict:
    """Sort `site.region` into graph order (dropping nodes no longer in the graph) and keep each node's inputs for
    the byte rule (erased nodes lose their args); returns the positions used."""
    pos = positions(graph)
    site.region = sorted((n for n in site.region if n in pos), key=pos.__getitem__)
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    return pos
