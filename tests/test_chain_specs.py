"""The family registry (issue [house] item 1): every family declares itself as data (`FamilySpec`, its chains as
`Chain`s), and the pass manager's order, fused-op list and GPU gate are read from those declarations. Fast: no
compile, no model."""

from __future__ import annotations

import glob
import os
import re

import pytest

from dsv41.passes import manager
from dsv41.passes.engine import Chain, FamilySpec, fused_ops, register_family, unvalidated_ops

_PASSES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dsv41", "passes")


def test_every_family_has_a_spec_whose_name_is_its_key():
    for name, cls in manager.FAMILIES.items():
        assert isinstance(cls.spec, FamilySpec), name
        assert cls.name == cls.spec.name == name and cls.summary == cls.spec.summary


def test_manager_lists_are_read_from_the_specs():
    specs = [manager.FAMILIES[n].spec for n in manager.FAMILY_ORDER]
    assert manager.FAMILY_ORDER[0] == "normalize" and manager.FAMILY_ORDER[-1] == "half_gemv"
    assert manager.REWRITE_FAMILIES == ("normalize",)
    assert manager._FUSED_OPS == fused_ops(specs)
    # every op a family emits is declared: the kernels register exactly these dsv41 linear / fused ops
    assert {"mhc_mixes", "moe_router", "sparse_fp4_attention", "linear_fp8_block_multi", "grouped_linear_fp4_pair",
            "linear_upcast", "c2_pool_norm_rope_fp4_store", "rope_fp4_quant_store"} <= set(manager._FUSED_OPS)
    assert manager.GPU_UNVALIDATED == tuple(s.name for s in specs if not s.gpu_validated)
    assert manager.GPU_UNVALIDATED_OPS == unvalidated_ops(specs)


def test_an_unvalidated_chain_names_its_variants_for_the_gate():
    spec = FamilySpec("x", "demo", (Chain("a", "op_a", "anchor", gpu_validated=False),
                                    Chain("b", "op_b", "anchor", variants=("op_b(w)",), gpu_validated=False),
                                    Chain("c", "op_c", "anchor")))
    assert unvalidated_ops([spec]) == ("op_a", "op_b(w)")
    assert fused_ops([spec]) == ("op_a", "op_b", "op_c")


def test_a_family_cannot_declare_one_chain_name_twice():
    with pytest.raises(ValueError, match="twice"):
        register_family("dup_demo", "demo", (Chain("a", "op", "x"), Chain("a", "op", "y")))


def test_declared_checks_are_check_ids_the_passes_use():
    """Each near-miss id a chain declares is written in the passes outside the declarations (a renamed check would
    leave a stale declaration)."""
    text = ""
    for path in glob.glob(os.path.join(_PASSES, "*.py")) + glob.glob(os.path.join(_PASSES, "engine", "*.py")):
        src = open(path).read()
        text += re.sub(r"(?ms)^SPEC = register_family\(.*?^\)+\n", "", src)
    for name, cls in manager.FAMILIES.items():
        for chain in cls.spec.chains:
            for check in chain.checks:
                assert f'"{check}"' in text, (name, chain.name, check)


def test_report_patterns_prints_every_chain(capsys):
    from dsv41.cli import main

    assert main(["report", "--patterns"]) == 0
    out = capsys.readouterr().out
    for name in manager.FAMILY_ORDER:
        assert f"[{name}]" in out
        for chain in manager.FAMILIES[name].spec.chains:
            assert f"{chain.name} -> dsv41::{chain.op}" in out
    assert main(["report", "--patterns", "mhc"]) == 0
    assert "[moe]" not in capsys.readouterr().out
    assert main(["report", "--patterns", "nope"]) == 2
    assert "unknown families" in capsys.readouterr().err
