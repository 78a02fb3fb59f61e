"""The record types the compiler reads from the fusion passes: what each family matched, missed and found.

Records are frozen dataclasses holding only tuples, strings and numbers, so they are immutable, hashable
and JSON-serialisable (`PassRecord.to_dict` / `from_dict`); the compiler caches them next to Inductor's FX-graph
cache and the fusion report (dsv41/compiler/report.py) renders them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping

import sympy
import torch.fx as fx

__all__ = ["BATCH", "LENGTH", "SourceLocation", "MatchRecord", "NearMiss", "Finding", "PassRecord"]

#: Symbols of the per-match byte expressions: batch size and sequence extent of the step's activations.
BATCH, LENGTH = sympy.symbols("B L", positive=True, integer=True)

_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>[^\n]*)')

@dataclass(frozen=True)
class SourceLocation:
    """A line of the user's source that produced a graph node (from `node.meta["stack_trace"]`).

    `stack` lists every frame of the trace as "file:line (function)", outermost first; `file`/`line`/
    `function`/`code` describe the innermost frame (where the op was called).
    """

    file: str
    line: int
    function: str
    code: str = ""
    stack: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    def short(self) -> str:
        """Innermost frame as `basename:line (function)`, plus its caller when there is one."""
        import os
        here = f"{os.path.basename(self.file)}:{self.line} ({self.function})"
        if len(self.stack) >= 2:
            caller = self.stack[-2]
            path, _, rest = caller.partition(":")
            here += f" <- {os.path.basename(path)}:{rest}"
        return here

    @classmethod
    def from_node(cls, node: fx.Node | None) -> "SourceLocation | None":
        """Parse the node's stack trace; None when the node carries none (e.g. nodes Inductor created)."""
        trace = node.meta.get("stack_trace") if node is not None else None
        if not trace:
            return None
        frames = list(_FRAME_RE.finditer(trace))
        if not frames:
            return None
        last = frames[-1]
        stack = tuple(f"{m['file']}:{m['line']} ({m['fn']})" for m in frames)
        return cls(last["file"], int(last["line"]), last["fn"], last["code"].strip(), stack)


@dataclass(frozen=True)
class MatchRecord:
    """One fused chain.

    Fields:
        family: pass family name (`dispatch`, `rope_fp4`, `normalize`).
        pattern: what matched, e.g. `linear_fp8_block(act_quant=True)` or `rope_fp4_quant(e4m3 1x16)`.
        op: the op that replaced the chain (`dsv41::linear_fp8_block`; for `normalize` the rewrite applied).
        location: user source line of the chain's anchor node.
        nodes_replaced: names of the ATen nodes the rewrite removed from the graph.
        ops_replaced: their targets as strings (e.g. `aten.mul.Tensor`), same order.
        bytes_before / bytes_after: bytes the chain moves before and after fusion, as sympy expressions (str)
            in `B` and `L` (see `token_rows`), per execution of the graph.
        symbols: the values of `B` and `L` for the compiled shapes, as ((name, value), ...).
        detail: extra facts as ((key, value), ...), e.g. (("N", 256), ("K", 512)).
    """

    family: str
    pattern: str
    op: str
    location: SourceLocation | None = None
    nodes_replaced: tuple[str, ...] = ()
    ops_replaced: tuple[str, ...] = ()
    bytes_before: str = "0"
    bytes_after: str = "0"
    symbols: tuple[tuple[str, int], ...] = ()
    detail: tuple[tuple[str, Any], ...] = ()

    def bytes_exprs(self) -> tuple[sympy.Expr, sympy.Expr]:
        """(before, after) as sympy expressions in `BATCH`, `LENGTH`."""
        loc = {"B": BATCH, "L": LENGTH}
        return sympy.sympify(self.bytes_before, locals=loc), sympy.sympify(self.bytes_after, locals=loc)

    def bytes_evaluated(self) -> tuple[int, int]:
        """(before, after) in bytes for the compiled shapes."""
        subs = {BATCH: 1, LENGTH: 1}
        subs.update({BATCH if k == "B" else LENGTH: v for k, v in self.symbols})
        b, a = self.bytes_exprs()
        return int(b.subs(subs)), int(a.subs(subs))


@dataclass(frozen=True)
class NearMiss:
    """A chain that started to match and failed one check.

    Fields: family; pattern (what it looked like, e.g. `dequantize(fp8_block) -> mm`); check (the id of the
    failed check, e.g. `ue8m0_scale_rule`, `rope_channels`); reason (one sentence a user can act on);
    location (user source line of the anchor).
    """

    family: str
    pattern: str
    check: str
    reason: str
    location: SourceLocation | None = None


@dataclass(frozen=True)
class Finding:
    """Something in the graph that stays on a slow path (not a failed match): e.g. a dequantised weight that is
    materialised (`materialised_dequant`) or an ATen op Inductor runs as a fallback kernel (`fallback_op`)."""

    family: str
    kind: str
    message: str
    location: SourceLocation | None = None


@dataclass(frozen=True)
class PassRecord:
    """What one family did to one graph. `enabled=False` records a family switched off by the options;
    `elapsed_s` is the family's wall time on this graph (seconds)."""

    family: str
    enabled: bool
    matches: tuple[MatchRecord, ...] = ()
    near_misses: tuple[NearMiss, ...] = ()
    findings: tuple[Finding, ...] = ()
    note: str = ""
    elapsed_s: float = 0.0

    @property
    def match_count(self) -> int:
        """Number of fused matches."""
        return len(self.matches)

    @property
    def nodes_replaced(self) -> int:
        """Graph nodes removed by all matches of this record."""
        return sum(len(m.nodes_replaced) for m in self.matches)

    def to_dict(self) -> dict:
        """Plain-JSON form (inverse: `PassRecord.from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "PassRecord":
        """Inverse of `to_dict` (used by the record cache next to Inductor's FX-graph cache)."""
        def loc(x):
            """SourceLocation from its dict form (None stays None)."""
            if x is None:
                return None
            return SourceLocation(x["file"], x["line"], x["function"], x.get("code", ""), tuple(x.get("stack", ())))

        def pairs(x):
            """Tuple of (key, value) pairs from a JSON list of pairs."""
            return tuple((k, v) for k, v in x)

        matches = tuple(MatchRecord(m["family"], m["pattern"], m["op"], loc(m["location"]),
                                    tuple(m["nodes_replaced"]), tuple(m["ops_replaced"]), m["bytes_before"],
                                    m["bytes_after"], pairs(m["symbols"]), pairs(m["detail"]))
                        for m in d["matches"])
        misses = tuple(NearMiss(n["family"], n["pattern"], n["check"], n["reason"], loc(n["location"]))
                       for n in d["near_misses"])
        finds = tuple(Finding(f["family"], f["kind"], f["message"], loc(f["location"])) for f in d["findings"])
        return cls(d["family"], d["enabled"], matches, misses, finds, d.get("note", ""), float(d.get("elapsed_s", 0.0)))
