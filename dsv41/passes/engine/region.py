"""Region growth and cut search: from a chain's end, the nodes that compute it from a chosen set of inputs.

A family names the inputs of its fused op by role (H, y, pre, ...) and shape; the search ranks the nodes behind the
chain's end that could play each role, nearest first, and keeps the first combination (a *cut*) such that every path
from the end back to graph inputs crosses exactly those nodes, through ops the family accepts. That is how an op's
inputs are found whichever way eager code spelled the chain.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Iterable, Iterator

import torch.fx as fx

from .graph import is_small_constant

__all__ = ["backward_distances", "walk_inputs", "closed_region", "ranked", "cut_search", "ancestors_within",
           "walk_forward"]


def backward_distances(end: fx.Node, limit: int, walkable: Callable[[fx.Node], bool],
                       boundary: Callable[[fx.Node], None] | None = None) -> dict:
    """node -> distance (edges) from `end`, breadth first, walking back through `walkable` nodes while fewer than
    `limit` nodes are known; the boundary nodes (not walked through) are included, and each is passed to
    `boundary` when given."""
    dist = {end: 0}
    queue = deque([end])
    while queue:
        n = queue.popleft()
        for a in n.all_input_nodes:
            if a in dist:
                continue
            dist[a] = dist[n] + 1
            if walkable(a) and len(dist) < limit:
                queue.append(a)
            elif boundary is not None:
                boundary(a)
    return dist


def walk_inputs(root: fx.Node, limit: int | None, step: Callable[[fx.Node, set], list | None]) -> set | None:
    """Depth-first walk back from `root`: `step(n, seen)` returns the inputs of `n` to walk next (it may mark nodes
    seen itself), or None to abandon the walk. Returns the nodes seen, or None when abandoned or when more than
    `limit` (None: no limit) were seen."""
    seen: set = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if limit is not None and len(seen) > limit:
            return None
        nxt = step(n, seen)
        if nxt is None:
            return None
        stack.extend(nxt)
    return seen


def closed_region(end: fx.Node, cut: Iterable[fx.Node], limit: int, accept: Callable[[fx.Node], bool],
                  constant: Callable[[fx.Node], bool] = is_small_constant) -> list | None:
    """Nodes computing `end` from exactly the `cut` nodes (each of them reached) and constants, in the order the
    depth-first walk from `end` meets them; None when the walk reaches a placeholder, a `get_attr` that is not
    `constant`, a node `accept` refuses, or more than `limit` nodes."""
    cutset = set(cut)
    nodes: list = []
    reached: set = set()

    def step(n, seen):
        """Stop at a cut node or a constant; walk on through an accepted op (None: the region is not closed)."""
        if n in cutset:
            reached.add(n)
            return []
        if n.op == "get_attr":
            return [] if constant(n) else None
        if n.op != "call_function" or not accept(n):
            return None
        nodes.append(n)
        return None if len(nodes) > limit else n.all_input_nodes

    if walk_inputs(end, None, step) is None:
        return None
    return nodes if reached == cutset else None


def ranked(nodes: Iterable[fx.Node], dist: dict, pos: dict, most: int) -> list:
    """The `most` of `nodes` nearest to the chain's end (`dist`), later graph position first among equals."""
    return sorted(nodes, key=lambda n: (dist[n], -pos.get(n, 0)))[:most]


def cut_search(cands: dict, dist: dict, region_of: Callable[[tuple], list | None],
               most: int | None = None) -> Iterator[tuple[dict, list]]:
    """Yields (role -> node, region) for each combination of the per-role candidates `cands` (role -> nodes), in
    order of total distance from the end (`dist`), whose nodes are distinct and for which `region_of(combo)` gives a
    region (not None); at most the `most` nearest combinations are tried. Nothing when a role has no candidate."""
    if not all(cands.values()):
        return
    combos = sorted(itertools.product(*cands.values()), key=lambda c: sum(dist[n] for n in c))
    for combo in combos[:most]:
        if len(set(combo)) != len(combo):
            continue
        region = region_of(combo)
        if region is not None:
            yield dict(zip(cands, combo)), region


def ancestors_within(outputs: Iterable[fx.Node], allowed: set) -> set:
    """The nodes of `allowed` reachable backwards from `outputs` without leaving `allowed`."""
    seen: set = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in seen or n not in allowed:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def walk_forward(anchor: fx.Node, limit: int, walkable: Callable[[fx.Node], bool]) -> list:
    """Users of `anchor`, breadth first through `walkable` nodes, at most `limit` of them (anchor excluded)."""
    seen, out, queue = {anchor}, [], deque(anchor.users)
    while queue and len(out) < limit:
        u = queue.popleft()
        if u in seen or not walkable(u):
            continue
        seen.add(u)
        out.append(u)
        queue.extend(u.users)
    return out
