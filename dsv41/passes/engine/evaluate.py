"""Probe evaluation: run a region's own ATen nodes eagerly on real tensors, whichever fake or dispatch modes the
compile has active, so a family can compare the region with its op's reference semantics."""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx

from .graph import is_dataflow_op, is_table_lookup, node_label, size_hint

__all__ = ["RegionNotClosed", "RegionEvaluator", "collect_region", "real_tensors", "probe_runs"]


class RegionNotClosed(Exception):
    """Raised by `RegionEvaluator` when a region reads a graph input that was not given a probe value."""


def collect_region(outputs: Iterable[fx.Node], inputs: Iterable[fx.Node]) -> list[fx.Node]:
    """Nodes needed to compute `outputs` from `inputs`: every ancestor of `outputs` up to (excluding)
    `inputs`, in graph order. Shape-only nodes (SymInt arithmetic) are included; the caller checks closure."""
    stop = set(inputs)
    seen: set[fx.Node] = set()
    stack = [o for o in outputs if o not in stop]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            if a not in stop and a not in seen:
                stack.append(a)
    order = {n: i for i, n in enumerate(next(iter(seen)).graph.nodes)} if seen else {}
    return sorted(seen, key=order.__getitem__)


class RegionEvaluator:
    """Evaluate graph nodes eagerly on real probe tensors.

    `evaluate(nodes, env)` computes each node of `nodes` (recursively through its ancestors) by calling the
    node's ATen target on real tensors, starting from `env` (node -> real tensor). Symbolic sizes are
    replaced by their hints; `get_attr` constants are read from the GraphModule. A placeholder (or an
    ancestor that is not a pure dataflow op) missing from `env` raises `RegionNotClosed`, so a region that
    secretly depends on another tensor is never accepted. `extra_ops`: further targets evaluated as they are
    (a family's matmuls, top-k, gathers), with symbolic int arguments replaced by hints when `hint_args`.
    """

    def __init__(self, gm: fx.GraphModule, max_nodes: int = 2000, extra_ops=frozenset(), hint_args: bool = False):
        self.gm = gm
        self.max_nodes = max_nodes
        #: deterministic non-dataflow targets a family lets its regions contain (matmuls, top-k, sort, gather)
        self.extra_ops = frozenset(extra_ops)
        self._hint_args = hint_args

    def evaluate(self, nodes: Iterable[fx.Node], env: Mapping[fx.Node, Any]) -> dict[fx.Node, Any]:
        """Run the region's own ATen nodes eagerly on real probe tensors `env` (node -> value); value per node."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._python_dispatch import _disable_current_modes

        memo: dict[fx.Node, Any] = dict(env)
        with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
            for n in nodes:
                self._eval(n, memo)
        return memo

    def _eval(self, root: fx.Node, memo: dict) -> Any:
        # Iterative post-order walk: regions can be hundreds of nodes deep.
        stack = [root]
        steps = 0
        while stack:
            n = stack[-1]
            if n in memo:
                stack.pop()
                continue
            pending = [a for a in n.all_input_nodes if a not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            steps += 1
            if steps > self.max_nodes:
                raise RegionNotClosed(f"region larger than {self.max_nodes} nodes")
            memo[n] = self._compute(n, memo)
        return memo[root]

    def _compute(self, n: fx.Node, memo: dict) -> Any:
        if n.op == "call_function" and n.target in self.extra_ops:
            # hint_args: symbolic ints among the arguments become their hints (a top-k's k)
            def conv(a):
                """Probe value of a node argument; a symbolic int's hint when `hint_args`."""
                return memo[a] if isinstance(a, fx.Node) else (size_hint(a) if self._hint_args else a)

            return n.target(*fx.node.map_aggregate(n.args, conv), **fx.node.map_aggregate(n.kwargs, conv))
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) and isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat,
                                                                   torch.SymBool)):
            return size_hint(val)  # shape arithmetic: its value is the compiled shape
        if n.op == "get_attr":
            obj = self.gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            return obj
        if n.op != "call_function":
            raise RegionNotClosed(f"region reads {n.op} {n.name} without a probe value")
        if n.target is operator.getitem:
            base = memo[n.args[0]]
            return base[n.args[1]]
        if not (is_dataflow_op(n) or is_table_lookup(n)):
            raise RegionNotClosed(f"region contains {node_label(n)} ({n.name}), not a pure dataflow op")

        def conv(a):
            """Probe value of a node argument, or the size hint of a symbolic int."""
            if isinstance(a, fx.Node):
                return memo[a]
            return size_hint(a)

        args = fx.node.map_aggregate(n.args, conv)
        kwargs = fx.node.map_aggregate(n.kwargs, conv)
        if "device" in kwargs and isinstance(val, torch.Tensor):
            kwargs = dict(kwargs, device=val.device)
        return n.target(*args, **kwargs)


@contextlib.contextmanager
def real_tensors():
    """Run reference math on real tensors even inside Inductor's compile (no fake mode, no dispatch modes, no grad)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
        yield


def probe_runs(ev: RegionEvaluator, end: fx.Node, envs) -> list | None:
    """The value of `end` on each probe environment of `envs` (node -> tensor), or None when the region cannot be
    evaluated on them (not closed over the probes, or an op raised)."""
    try:
        return [ev.evaluate([end], env)[end] for env in envs]
    except (RegionNotClosed, RuntimeError):
        return None
