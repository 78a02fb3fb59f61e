"""The family registry: every family of dsv41/passes/, found by walking the package, in the order the families'
own declarations give (ARCHITECTURE.md "Adding a family").

A family module declares `SPEC = register_family(name, summary, chains, after=(...), before=(...))`
(engine/chain.py) and a `FusionFamily` subclass with `spec = SPEC`. `discover()` imports every module of the package
(not its subpackages: `engine/` holds no family) except the few that are not family modules and must not be
imported from here (`NOT_FAMILY_MODULES`), and keeps each class that carries a spec of its own. `family_order()`
sorts the families topologically by their `after` / `before` constraints (networkx); where the constraints leave a
choice, the family whose name sorts first runs first, so the order never depends on the file system. So a new
family is one new module here (plus its kernel module and its tests): no list in this package names it.

Public names: `discover`, `family_order`, `FamilyRegistryError`, `NOT_FAMILY_MODULES`.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import networkx as nx

from .engine import FamilySpec, FusionFamily

__all__ = ["discover", "family_order", "FamilyRegistryError", "NOT_FAMILY_MODULES"]

#: Modules of dsv41/passes/ the walk does not import, with why: `manager` and `registry` are the registry's readers
#: (importing them from here is an import circle), `testing` is the family test harness (it imports the whole
#: backend and no compile reads it), `records` holds the record types only. Any other module is imported; one that
#: declares no family (a helper such as `rope_match` or `mhc_structure`) is simply not listed.
NOT_FAMILY_MODULES = frozenset({"manager", "registry", "testing", "records"})


class FamilyRegistryError(ImportError):
    """The family declarations cannot be put in order: an `after` / `before` name that is no family, two families
    with one name, a `SPEC` without a family class, or constraints with a cycle. Raised at import of the pass
    manager, so a broken declaration fails every compile and test at once, with the family and names in the
    message."""


def _family_classes(module: ModuleType) -> list[type[FusionFamily]]:
    """The `FusionFamily` subclasses defined in `module` (not imported into it) that set a `spec` of their own."""
    return [obj for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, FusionFamily) and obj.__module__ == module.__name__
            and obj.__dict__.get("spec") is not None]


def discover(package: str = __package__, path=None) -> dict[str, type[FusionFamily]]:
    """{family name: class} of every family module of `package`, in module-name order (not yet the pass order).

    Args: package: the dotted package name (default dsv41.passes); path: its `__path__` (default: the imported
    package's).
    Raises: FamilyRegistryError for two families with one name, or a module whose `SPEC` no class of it carries.
    """
    if path is None:
        path = importlib.import_module(package).__path__
    found: dict[str, type[FusionFamily]] = {}
    for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
        if info.ispkg or info.name in NOT_FAMILY_MODULES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        classes = _family_classes(module)
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, FamilySpec) and not any(c.spec is spec for c in classes):
            raise FamilyRegistryError(f"{module.__name__} declares SPEC {spec.name!r} but no FusionFamily subclass "
                                      "with `spec = SPEC`")
        for cls in classes:
            other = found.get(cls.spec.name)
            if other is not None:
                raise FamilyRegistryError(f"two families named {cls.spec.name!r}: {other.__module__}."
                                          f"{other.__qualname__} and {cls.__module__}.{cls.__qualname__}")
            found[cls.spec.name] = cls
    return found


def family_order(specs) -> tuple[str, ...]:
    """The names of the families of `specs` (`FamilySpec`s) in the order they run: a topological order of their
    `after` / `before` constraints, ties broken by name.

    Raises: FamilyRegistryError naming the family and the unknown name when a constraint names no family of
    `specs`, or the families of a cycle.
    """
    specs = list(specs)
    names = {s.name for s in specs}
    g = nx.DiGraph()
    g.add_nodes_from(names)
    for s in specs:
        for word, others in (("after", s.after), ("before", s.before)):
            unknown = [o for o in others if o not in names]
            if unknown:
                raise FamilyRegistryError(f"family {s.name!r} declares {word}={tuple(others)}, but {unknown} is no "
                                          f"family; families: {', '.join(sorted(names))}")
            g.add_edges_from((o, s.name) if word == "after" else (s.name, o) for o in others)
    try:
        return tuple(nx.lexicographical_topological_sort(g, key=str))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(g)
        raise FamilyRegistryError("the families' after / before declarations form a cycle: "
                                  + " -> ".join(a for a, _ in cycle) + f" -> {cycle[0][0]}") from None
