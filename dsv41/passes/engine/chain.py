"""Chain declarations: what each fused chain looks for, as data, and the registry the pass manager reads.

A family declares itself (`FamilySpec`: name, summary, chains) and its chains (`Chain`): the anchor each starts
from, the roles of the fused op's inputs with their shapes, the reference function the region is compared with, the
constants the probes discover, the probes, and the checks (near-miss ids) a look-alike can fail, and its place in
the pass order (`after` / `before`: the families it must run after / before). The registry (passes/registry.py,
re-exported as manager.py `FAMILIES`: the family classes found in dsv41/passes/, in pass order, each with its
`spec`) is the one list `FAMILY_ORDER`, the fused-op list of `PassManager.uuid()` and the GPU gate are read from,
and `dsv41 report --patterns` prints (`describe_families`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Role", "Chain", "FamilySpec", "register_family", "fused_ops", "unvalidated_ops", "describe_families"]


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


@dataclass(frozen=True)
class FamilySpec:
    """One family as data: its `name` (the pass manager's key and the report's), a one-line `summary`, its `chains`,
    `rewrites_only` (it normalises the graph for the others and fuses nothing: the report lists its matches as
    rewrites), `gpu_validated` (False: its kernels have not yet run on a GPU, so on CUDA it stays off unless the
    option `gpu_unvalidated` is set), and its place in the pass order: `after` / `before`, the names of the families
    it must run after / before (passes/registry.py sorts the families by these; where they leave a choice, by
    name)."""

    name: str
    summary: str
    chains: tuple[Chain, ...] = ()
    rewrites_only: bool = False
    gpu_validated: bool = True
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()

    def describe(self) -> str:
        """The family's summary, its order constraints and every chain it declares (`Chain.describe`)."""
        body = "\n".join(c.describe() for c in self.chains) if self.chains else (
            "(no chain with a fused op: it rewrites the graph in place, see the family module)")
        order = "; ".join(f"{word} {', '.join(names)}" for word, names in (("after", self.after),
                                                                           ("before", self.before)) if names)
        return f"[{self.name}] {self.summary}\n" + (f"    runs {order}\n" if order else "") + body


def register_family(name: str, summary: str, chains=(), rewrites_only: bool = False, gpu_validated: bool = True,
                    after=(), before=()) -> FamilySpec:
    """The `FamilySpec` of family `name` (a family module's `SPEC`; its class sets `spec = SPEC`, and the registry,
    passes/registry.py, finds the class by walking dsv41/passes/).

    Args: `after` / `before`: names of the families this one must run after / before (a str is one name); the
    registry checks that each names a family and that the constraints have no cycle.
    Raises: ValueError for two chains of the family with the same name, or `name` in its own `after` / `before`."""
    chains = tuple(chains)
    names = [c.name for c in chains]
    if len(set(names)) != len(names):
        raise ValueError(f"family {name!r} declares a chain name twice: {names}")
    after = (after,) if isinstance(after, str) else tuple(after)
    before = (before,) if isinstance(before, str) else tuple(before)
    if name in after or name in before:
        raise ValueError(f"family {name!r} names itself in its order (after={after}, before={before})")
    return FamilySpec(name, summary, chains, rewrites_only, gpu_validated, after, before)


def fused_ops(specs) -> tuple[str, ...]:
    """The distinct dsv41 ops the chains of `specs` become, in order."""
    out: list[str] = []
    for spec in specs:
        for c in spec.chains:
            if c.op not in out:
                out.append(c.op)
    return tuple(out)


def unvalidated_ops(specs) -> tuple[str, ...]:
    """The gate names (`op`, or `op(argument)` for a variant) of the chains of `specs` whose kernels have not yet
    run on a GPU."""
    out: list[str] = []
    for spec in specs:
        for c in spec.chains:
            if not c.gpu_validated:
                out.extend(v for v in (c.variants or (c.op,)) if v not in out)
    return tuple(out)


def describe_families(specs) -> str:
    """Every family of `specs` described (`FamilySpec.describe`), blank lines between."""
    return "\n\n".join(spec.describe() for spec in specs)
