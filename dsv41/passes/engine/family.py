"""The base class of a pass family."""

from __future__ import annotations

import torch.fx as fx

from ..records import PassRecord

__all__ = ["FusionFamily"]


class FusionFamily:
    """Base class of a pass family: `name`, a one-line `summary`, and `run(gm) -> PassRecord`.

    `run` rewrites `gm.graph` in place (post-grad ATen IR, functional except for the trailing input
    mutations) and returns the immutable record of what it did. Families must leave the graph valid and
    topologically sorted.
    """

    name: str = ""
    summary: str = ""
    #: Fused ops this family must not emit on this graph (set by the pass manager: ops whose kernels have not yet
    #: run on a GPU, for a graph on CUDA); a chain that would become one is a near-miss `gpu_unvalidated`.
    gated_ops: frozenset = frozenset()

    def run(self, gm: fx.GraphModule) -> PassRecord:  # pragma: no cover - interface
        """Rewrite `gm` in place and return what was matched, skipped and why (abstract: each family implements it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement run()")
