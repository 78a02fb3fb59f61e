"""Shared harness for Triton interpreter tests (imported by tests/test_kernels_*.py; not a test module).

Triton chooses interpreter or compiler when `triton` is first imported and when `@triton.jit` decorates, so
TRITON_INTERPRET=1 must be in the environment before `import triton`. Setting it from a test module would be too
late if another module imported triton first, and would turn every later `@triton.jit` in the process into
interpreted code. So, unless this process was started with TRITON_INTERPRET=1, a module's interpreter tests run
once in a child `pytest` with the variable set, and each test reports its child's outcome.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import pytest
import torch

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class InterpreterHarness:
    """Per test module: `interpreted` decorator + the autouse fixture that records the running test's name.

    Usage in a test module::

        _harness = InterpreterHarness(__file__)
        interpreted = _harness.interpreted
        _record_node = _harness.record_node_fixture()
    """

    def __init__(self, test_file: str):
        self.test_file = os.path.abspath(test_file)
        self.names: list[str] = []
        self.child: dict = {}
        self.node: dict = {}

    def child_results(self) -> dict:
        """Run the module's interpreter tests once in a child pytest with TRITON_INTERPRET=1; parse JUnit XML."""
        if "results" in self.child:
            return self.child["results"]
        xml_path = os.path.join(tempfile.mkdtemp(prefix="dsv41_interp_"), "junit.xml")
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", self.test_file, "-q", "-p", "no:cacheprovider",
               "-k", " or ".join(self.names), f"--junitxml={xml_path}"]
        proc = subprocess.run(cmd, env=env, cwd=_REPO, capture_output=True, text=True, timeout=1500)
        results = {}
        if os.path.exists(xml_path):
            for case in ET.parse(xml_path).getroot().iter("testcase"):
                outcome, text = "passed", ""
                for c in case:
                    if c.tag in ("failure", "error", "skipped"):
                        outcome = c.tag
                        text = (c.get("message") or "") + "\n" + (c.text or "")
                results[case.get("name")] = (outcome, text)
        self.child["results"] = results
        self.child["log"] = proc.stdout[-4000:] + proc.stderr[-4000:]
        return results

    def interpreted(self, fn):
        """Mark a test that launches Triton on CPU tensors: run here under the interpreter, or in the child."""
        self.names.append(fn.__name__)
        if IN_INTERPRETER:
            return fn

        @functools.wraps(fn)
        def from_child(*args, **kwargs):
            name = self.node["name"]
            outcome, text = self.child_results().get(name, ("missing", self.child.get("log", "")))
            if outcome == "skipped":
                pytest.skip(text.strip().splitlines()[0] if text.strip() else "skipped in interpreter child")
            if outcome != "passed":
                pytest.fail(f"[TRITON_INTERPRET=1 child] {name}: {outcome}\n{text}", pytrace=False)

        return from_child

    def record_node_fixture(self):
        """An autouse fixture storing the running test's node name (assign it to a module-level name)."""
        @pytest.fixture(autouse=True)
        def _record_node(request):
            self.node["name"] = request.node.name
        return _record_node


def poison_outputs(monkeypatch, module, float_fill: float = float("nan")) -> None:
    """Make every output/workspace `module._empty` allocates start as `float_fill` (floats; NaN by default, a finite
    value where a test expects NaN from the kernel itself) or 0xAB (bytes)."""
    def poisoned(shape, dtype, device):
        fill = float_fill if dtype.is_floating_point else 0xAB
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(module, "_empty", poisoned)


def sm90_ttir(kernel, ptr_types: dict, consts: dict, scalar_types: dict | None = None, num_warps: int = 4,
              stage: str = "ttir", aligned: tuple = (), maxnreg: int | None = None) -> str:
    """TTIR (or another `stage` of `CompiledKernel.asm`, e.g. "ptx") of `kernel` built offline for sm_90 (Triton's
    own ptxas; no GPU needed), for checks of what the compiled kernel does that the interpreter cannot show (e.g.
    TF32 rounding, which it skips; the order of PDL and prefetch instructions).

    ptr_types: {pointer argument: Triton element type, e.g. "bf16"}; consts: {constexpr argument: value};
    scalar_types: {other argument: Triton type} for non-i32 ones (e.g. "tensordesc<u8[64, 128]>" for a TMA
    descriptor); aligned: arguments specialised as the launcher specialises values divisible by 16 (pointers
    16-byte aligned, integers multiples of 16), which is what lets Triton prove vector loads; maxnreg: the register
    cap a launch passes. Skips the calling test under TRITON_INTERPRET=1, where `kernel` is not a compilable
    JITFunction.
    """
    if IN_INTERPRETER:
        pytest.skip("builds the kernel for sm_90; TRITON_INTERPRET=1 is set")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import inspect
    scalar_types = scalar_types or {}
    # Constexpr parameters left out take their defaults, as a launch does (e.g. an optional prologue's NORM = 0).
    defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()
                if p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation)}
    consts = {**{n: v for n, v in defaults.items() if n not in consts}, **consts}
    sig = {n: "constexpr" if n in consts else ("*" + ptr_types[n] if n in ptr_types else scalar_types.get(n, "i32"))
           for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(kernel, sig, {(kernel.arg_names.index(n),): v for n, v in consts.items()}, attrs)
    options = {"num_warps": num_warps} if maxnreg is None else {"num_warps": num_warps, "maxnreg": maxnreg}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm[stage]
