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
    assert manager.FAMILY_ORDER[0] == "normalize" and manager.FAMILY_ORDER[-1] == "row_argmax"
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


# ------------------------------------------------------------------------------------------- the registry
#: The pass order (the 13 families from before the registry found them by itself, then half_gemv, the first family
#: added as only its spec file, kernel file and tests); the declarations' after / before must give it.
_ORDER = ("normalize", "c2_compressor", "rope_fp4", "mhc", "engram", "mhc_fold", "moe", "sparse_attention", "indexer",
          "small_ops", "upcast_linear", "dispatch", "grouped_pair", "sibling_gemv", "half_gemv", "rope_kv", "gqa_attention",
          "rope_gqa", "row_argmax")


def test_the_declarations_give_the_pass_order_exactly():
    assert manager.FAMILY_ORDER == _ORDER
    assert tuple(manager.FAMILIES) == _ORDER


def _declaring_modules() -> set[str]:
    """Modules of dsv41/passes/ whose source assigns `SPEC = register_family(...)` at module level (read with ast,
    independently of the registry's import walk)."""
    import ast

    out = set()
    for path in glob.glob(os.path.join(_PASSES, "*.py")):
        for node in ast.parse(open(path).read()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", None) == "register_family"):
                out.add("dsv41.passes." + os.path.basename(path)[:-3])
    return out


def test_every_declaring_module_is_a_family_and_nothing_else_is():
    from dsv41.passes.registry import NOT_FAMILY_MODULES

    declaring = _declaring_modules()
    assert len(declaring) == len(_ORDER)
    assert {cls.__module__ for cls in manager.FAMILIES.values()} == declaring
    assert not {f"dsv41.passes.{m}" for m in NOT_FAMILY_MODULES} & declaring


def _spec(name, after=(), before=()):
    return FamilySpec(name, "demo", after=tuple(after), before=tuple(before))


def test_the_order_is_topological_with_ties_broken_by_name():
    from dsv41.passes.registry import family_order

    specs = [_spec("c", after=("a",)), _spec("b"), _spec("a", before=("b",)), _spec("d", before=("a",))]
    assert family_order(specs) == ("d", "a", "b", "c")
    assert family_order(reversed(specs)) == ("d", "a", "b", "c")


@pytest.mark.parametrize("specs, message", [
    ([_spec("a", after=("nope",))], r"family 'a' declares after=\('nope',\), but \['nope'\] is no family"),
    ([_spec("a", before=("b",)), _spec("b", before=("a",))], r"form a cycle: (a -> b -> a|b -> a -> b)"),
])
def test_a_bad_order_fails_with_the_names(specs, message):
    from dsv41.passes.registry import FamilyRegistryError, family_order

    with pytest.raises(FamilyRegistryError, match=message):
        family_order(specs)


def test_a_family_cannot_order_itself_against_itself():
    with pytest.raises(ValueError, match="names itself"):
        register_family("self_demo", "demo", after="self_demo")


_DEMO_FAMILY = '''"""A throwaway family: declared, found and ordered by the registry, matching nothing."""
from .engine import Chain, FusionFamily, register_family
from .records import PassRecord

SPEC = register_family("zz_demo", "demo family", (Chain("demo", "zz_demo_double", "any node"),),
                       after=("dispatch",), before=("grouped_pair",))


class DemoFamily(FusionFamily):
    """Matches nothing."""

    spec = SPEC

    def run(self, gm):
        """No rewrite."""
        return PassRecord(self.name, True)
'''

_DEMO_KERNEL = '''"""A throwaway op."""
import torch


@torch.library.custom_op("dsv41::zz_demo_double", mutates_args=(), device_types="cpu")
def zz_demo_double(x: torch.Tensor) -> torch.Tensor:
    """2 x."""
    return x * 2
'''

_PROBE = '''
import json, torch
import dsv41.kernels
from dsv41.passes import manager
print(json.dumps({"file": dsv41.kernels.__file__, "order": manager.FAMILY_ORDER, "ops": manager._FUSED_OPS,
                  "registered": hasattr(torch.ops.dsv41, "zz_demo_double")}))
'''


def _run_copy(tmp_path, files: dict):
    """Copy dsv41/ to tmp_path, add `files` ({path under dsv41/: text}), and import its registry and kernels in a
    fresh interpreter; returns the completed process."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(os.path.dirname(_PASSES), tmp_path / "dsv41", ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in files.items():
        (tmp_path / "dsv41" / rel).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_new_family_is_its_spec_file_and_its_kernel_file(tmp_path):
    """Adding the two files (and nothing else) to a copy of the package gives the family its declared place in the
    order, its op in the fused-op list, and the op registered."""
    import json

    proc = _run_copy(tmp_path, {"passes/zz_demo.py": _DEMO_FAMILY, "kernels/zz_demo.py": _DEMO_KERNEL})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(tmp_path))
    at = _ORDER.index("dispatch") + 1  # after dispatch, before grouped_pair
    assert tuple(out["order"]) == _ORDER[:at] + ("zz_demo",) + _ORDER[at:]
    assert "zz_demo_double" in out["ops"] and out["registered"] is True


def test_a_spec_without_a_family_class_fails_at_import(tmp_path):
    proc = _run_copy(tmp_path, {"passes/zz_demo.py": _DEMO_FAMILY.split("\n\nclass")[0] + "\n"})
    assert proc.returncode != 0
    assert "dsv41.passes.zz_demo declares SPEC 'zz_demo' but no FusionFamily subclass" in proc.stderr
