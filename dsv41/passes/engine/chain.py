"""Chain declarations: what each fused chain looks for, as data, and the registry the pass manager reads.

A family declares its chains (`Chain`): the anchor it starts from, the roles of the fused op's inputs with their
shapes, the reference function the region is compared with, the constants the probes discover, the probes, and the
checks (near-miss ids) a look-alike can fail. The registry (`register_chains`) keeps them per family in pass order;
`FAMILY_ORDER`, the fused-op list of `PassManager.uuid()` and the GPU gate are read from it, and
`dsv41 report --patterns` prints it (`describe_chains`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Role", "Chain", "register_chains", "registered_chains", "chains_of", "fused_ops", "describe_chains"]


@dataclass(frozen=True)
class Role:
    """One input of a fused op: its name (`H`, `y`, `pre`), shape in words (`[B, T, 4, d]`) and dtypes in words."""

    name: str
    shape: str
    dtype: str = "float"


@dataclass(frozen=True)
class Chain:
    """What one chain of a family looks for.

    Fields: name (unique within the family); op (the dsv41 op it becomes, without namespace); anchor (the
    structural start of the search, in words); roles (`Role`s of the op's inputs); reference (the function the
    region is compared with on probes, as `module:function`); constants (what the probes discover, e.g. eps, round
    counts); probes (what the probe tensors pin, in words); checks (the ids of the near-misses a look-alike gets);
    variants (gate names of op variants, e.g. `mhc_mixes(norm_weight)`); gpu_validated (False: the op's kernel has
    not yet run on a GPU, so on CUDA the chain stays unfused unless the option `gpu_unvalidated` is set).
    """

    name: str
    op: str
    anchor: str
    roles: tuple[Role, ...] = ()
    reference: str = ""
    constants: tuple[str, ...] = ()
    probes: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()
    variants: tuple[str, ...] = ()
    gpu_validated: bool = True

    def describe(self) -> str:
        """Several lines a user can read: the op, anchor, roles, reference, constants, probes and checks."""
        lines = [f"{self.name} -> dsv41::{self.op}", f"    anchor: {self.anchor}"]
        if self.roles:
            lines.append("    roles: " + ", ".join(f"{r.name} {r.shape} {r.dtype}" for r in self.roles))
        if self.reference:
            lines.append(f"    reference: {self.reference}")
        if self.constants:
            lines.append("    discovers: " + ", ".join(self.constants))
        if self.probes:
            lines.append("    probes: " + "; ".join(self.probes))
        if self.checks:
            lines.append("    checks: " + ", ".join(self.checks))
        if self.variants:
            lines.append("    variants: " + ", ".join(self.variants))
        return "\n".join(lines)


_REGISTRY: dict[str, tuple[Chain, ...]] = {}


def register_chains(family: str, chains) -> tuple[Chain, ...]:
    """Record the chains of `family` (called once per family module, at import); returns them as a tuple.
    Raises ValueError for two chains of one family with the same name."""
    chains = tuple(chains)
    names = [c.name for c in chains]
    if len(set(names)) != len(names):
        raise ValueError(f"family {family!r} declares a chain name twice: {names}")
    _REGISTRY[family] = chains
    return chains


def registered_chains() -> dict[str, tuple[Chain, ...]]:
    """family -> its declared chains, in registration order (a copy)."""
    return dict(_REGISTRY)


def chains_of(family: str) -> tuple[Chain, ...]:
    """The chains `family` declared (empty when it declared none)."""
    return _REGISTRY.get(family, ())


def fused_ops(families) -> tuple[str, ...]:
    """The distinct dsv41 ops the chains of `families` (names, in order) become, in declaration order."""
    out: list[str] = []
    for f in families:
        for c in chains_of(f):
            if c.op not in out:
                out.append(c.op)
    return tuple(out)


def describe_chains(families) -> str:
    """Every chain of `families` (names, in order), described (`Chain.describe`), one block per family."""
    blocks = []
    for f in families:
        chains = chains_of(f)
        body = "\n".join(c.describe() for c in chains) if chains else "(no declared chain: see the family module)"
        blocks.append(f"[{f}]\n{body}")
    return "\n\n".join(blocks)
