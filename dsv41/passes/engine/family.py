"""The base classes of a pass family: `FusionFamily` (any rewrite of a graph) and `ChainFamily` (a family whose
chains run the engine's loop: finders -> op checks -> rewrite -> dead-code elimination -> toposort -> records)."""

from __future__ import annotations

import abc

import torch.fx as fx

from ..records import NearMiss, PassRecord, SourceLocation
from .evaluate import RegionEvaluator
from .graph import group_by_key, positions
from .loop import finish_graph, import_kernels, ops_or_note, pass_record, records_of, run_finders

__all__ = ["FusionFamily", "ChainFamily", "HorizontalFamily"]


class FusionFamily(abc.ABC):
    """Base class of a pass family: `name`, a one-line `summary`, and `run(gm) -> PassRecord`.

    `run` rewrites `gm.graph` in place (post-grad ATen IR, functional except for the trailing input
    mutations) and returns the immutable record of what it did. Families must leave the graph valid and
    topologically sorted.
    """

    name: str = ""
    summary: str = ""
    #: The family as data (`FamilySpec`); a subclass that sets it gets its `name` and `summary` from it.
    spec = None
    #: Fused ops this family must not emit on this graph (set by the pass manager: ops whose kernels have not yet
    #: run on a GPU, for a graph on CUDA); a chain that would become one is a near-miss `gpu_unvalidated`.
    gated_ops: frozenset = frozenset()
    #: Whether the side-stream schedule will be applied to this graph (set by the pass manager from the `streams`
    #: option): work off the critical path then overlaps other kernels, so a family may leave it apart.
    side_stream: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("spec") is not None:
            cls.name, cls.summary = cls.spec.name, cls.spec.summary

    @abc.abstractmethod
    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Rewrite `gm` in place and return what was matched, skipped and why (abstract: each family implements it)."""


class ChainFamily(FusionFamily):
    """A family described by data: its finders, the module registering its ops, what its regions may evaluate,
    its rewrite and byte rule; `run` is the engine's chain loop (`run_finders`).

    Class attributes: `kernels` (module that registers the ops); `eval_ops` (non-dataflow targets the probe
    evaluator runs, e.g. matmuls) and `hint_args` (their symbolic int arguments become hints); `check_static`
    (refuse chains reading sizes known only at run time; off when the finders refuse them before their value
    checks); `toposort` (sort the graph after the rewrites); `first_only` (a node removed by two matches counts for
    the first); `count_created` (the removed nodes are the region nodes no longer in the graph, including nodes a
    finder created, rather than the graph's nodes before the pass that are gone).
    Methods to provide: `finders()` (functions (graph, evaluator) -> (sites, near-misses)), `rewrite(graph, site,
    op, replaced) -> {old: new}` and `traffic(site, gone) -> (before, after, {"B": b, "L": l})`; `cleanup()` runs
    after the finders, also when one raised.
    """

    kernels: str = ""
    eval_ops: frozenset = frozenset()
    hint_args: bool = False
    check_static: bool = True
    toposort: bool = True
    first_only: bool = True
    count_created: bool = False

    @abc.abstractmethod
    def finders(self) -> tuple:
        """The finder functions, in the order they run (abstract)."""

    @abc.abstractmethod
    def rewrite(self, graph: fx.Graph, site, op, replaced: dict) -> dict:
        """Insert `op` for `site` and hand it the users of what it replaces; returns {old node: new node} (abstract)."""

    @abc.abstractmethod
    def traffic(self, site, gone: list) -> tuple:
        """(bytes before, bytes after, {"B": b, "L": l}) of one match (abstract)."""

    def cleanup(self) -> None:
        """Drop per-run caches (called after the finders, also when one raised)."""

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Run the finders on `gm`, rewrite every site that passes the op checks, and return the record."""
        import_kernels(self.kernels)
        graph = gm.graph
        start = set(graph.nodes)
        ev = RegionEvaluator(gm, extra_ops=self.eval_ops, hint_args=self.hint_args)
        try:
            sites, misses, missing = run_finders(self.name, graph, ev, self.finders(), self.rewrite, self.kernels,
                                                 self.gated_ops, self.check_static)
        finally:
            self.cleanup()
        if self.toposort:
            finish_graph(graph)
        alive = set(graph.nodes)
        removed = {n for s in sites for n in s.region if n not in alive} if self.count_created else start - alive
        return pass_record(self.name, records_of(self.name, sites, removed, self.traffic, self.first_only), misses,
                           missing)


class HorizontalFamily(FusionFamily):
    """A family that merges dsv41 ops of one input into one op (`grouped_pair`, `sibling_gemv`).

    Class attributes: `single_op` (the name of the op it merges; the merged op is its spec's chain's op),
    `miss_pattern` (the pattern of a near-miss). Methods to provide:
    `members(graph, single) -> {key: [nodes]}` (the single ops by shared input, graph order), `most()` (members per
    group), `mismatch(first, later, order) -> (check, reason) | None`, `fuse(graph, group, merged) -> MatchRecord`;
    `admit(node)` may keep a node out of every group ((check, reason), default None). Every group is decided on the
    graph as it is, then rewritten: a rewrite replaces an output that a later group may read as its input.
    """

    single_op: str = ""
    miss_pattern: str = ""

    @abc.abstractmethod
    def members(self, graph: fx.Graph, single) -> dict:
        """{key: nodes calling `single` that share the key}, in graph order (abstract)."""

    @abc.abstractmethod
    def most(self) -> int:
        """Members per group at the most (abstract)."""

    @abc.abstractmethod
    def mismatch(self, first: fx.Node, later: fx.Node, order: dict):
        """None when `later` can join the group `first` starts, else (check, reason) (abstract)."""

    @abc.abstractmethod
    def fuse(self, graph: fx.Graph, group: list, merged):
        """Replace `group` by one call of `merged`; returns the `MatchRecord` (abstract)."""

    def admit(self, node: fx.Node):
        """None when `node` may join a group, else (check, reason)."""
        return None

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Merge every group of `gm` in place; a near-miss names an op that found a candidate but stays alone."""
        graph = gm.graph
        merged_op = self.spec.chains[0].op
        suffix = merged_op[len(self.single_op):] if merged_op.startswith(self.single_op + "_") else ", " + merged_op
        found, empty = ops_or_note(self.name, (self.single_op, merged_op), f"{self.single_op}({suffix})")
        if empty is not None:
            return empty
        single, merged = found
        order = positions(graph)
        groups, alone = group_by_key(self.members(graph, single).values(),
                                     lambda a, b: self.mismatch(a, b, order), self.most(), self.admit)
        misses = [NearMiss(self.name, self.miss_pattern, why[0], why[1], SourceLocation.from_node(n))
                  for n, why in alone.items()]
        matches = [self.fuse(graph, g, merged) for g in groups]
        return PassRecord(self.name, True, tuple(matches), tuple(misses))
