"""Every family's zoo compiled with `dynamic=True` (issue [robust] item 2): sizes known only at run time are
ordinary input.

Each zoo of tests/test_pass_<family>.py is compiled again with every non-1 size symbolic (batch, sequence, cache
lengths, and the buffers Dynamo does not treat as parameters). The suite is strict (conftest), so a family that
raises on a symbolic size or argument fails here. The compiled outputs must equal eager's, and a chain the family
cannot fuse at run-time sizes must say so: its near-miss is `static_shapes` / `static_k`, never a check about the
chain's values (before this, symbolic sizes surfaced as `router_inputs`, `dequant_values`, `tie_rule` and
`fp4_quantiser` reasons that were not true). Where a family can take the symbolic size (a dense block-FP8 GEMV
whose activation rows are symbolic) it fuses.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import dsv41

STATIC = {"static_shapes", "static_k"}


def _zoo(name: str):
    """(module, inputs) of a family zoo, built as its own test file builds it (float32)."""
    t = importlib.import_module(name)
    g = torch.Generator().manual_seed(1)
    if name == "test_pass_mhc":
        return t.MhcZoo(torch.float32), (torch.randn(2, 3, 4, t.D, generator=g) * 2,)
    if name == "test_pass_moe":
        return t.MoeZoo(torch.float32), (torch.randn(2, 3, t.D, generator=g), torch.randn(2, 3, t.D, generator=g))
    if name == "test_pass_engram":
        return t.EngramZoo(torch.float32), (torch.randn(2, 3, 4, t.D, generator=g) * 2,
                                            torch.randint(0, 512, (2, 3, 4), generator=g))
    if name == "test_pass_indexer":
        return t.IndexerZoo(), t.zoo_inputs(torch.float32)
    if name == "test_pass_sparse_attention":
        return t.SparseZoo(), t.make_inputs(torch.float32)
    if name == "test_pass_rope_fp4":
        return t.RopeZoo(2, 8), t._inputs(torch.float32)
    if name == "test_pass_dispatch":
        torch.manual_seed(1)
        return t.DispatchZoo(torch.float32).eval(), (torch.randn(2, 3, 64) * 3,)
    raise KeyError(name)


def _tensors(out):
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


# (zoo module, family under test, checks its dynamic compile may name besides the static ones, fuses anyway)
CASES = [
    ("test_pass_mhc", "mhc", set(), False),
    ("test_pass_moe", "moe", set(), False),
    ("test_pass_engram", "engram", set(), False),
    ("test_pass_indexer", "indexer", set(), False),
    ("test_pass_sparse_attention", "sparse_attention", set(), False),
    ("test_pass_rope_fp4", "rope_fp4", set(), False),
    # The dense GEMVs take symbolic rows; the look-alike's scale rule is checked on the static weight.
    ("test_pass_dispatch", "dispatch", {"ue8m0_scale_rule"}, True),
]


@pytest.mark.parametrize("zoo, family, also, fuses", CASES, ids=[c[1] for c in CASES])
def test_dynamic_zoo_compiles_equals_eager_and_names_symbolic_sizes(zoo, family, also, fuses):
    model, inputs = _zoo(zoo)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(*inputs)
        got = torch.compile(model, backend="dsv41", dynamic=True)(*inputs)
    for a, b in zip(_tensors(got), _tensors(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    fam = dsv41.last_report().to_dict()["families"][family]
    checks = {m["check"] for m in fam["near_misses"]}
    assert checks <= STATIC | also, {m["check"]: m["reason"] for m in fam["near_misses"] if m["check"] not in STATIC}
    assert fam["matches"] > 0 if fuses else (fam["matches"] == 0 and checks & STATIC)
    for m in fam["near_misses"]:
        if m["check"] in STATIC:
            assert "known only at run time" in m["reason"] and m["location"] is not None
