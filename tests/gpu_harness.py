"""Shared set-up of the GPU kernel test files (tests/test_kernels_gpu*.py).

`skip_unless_compiled_gpu()` skips the calling test module at import unless a CUDA GPU is present and
TRITON_INTERPRET is not set (those files check the compiled kernels; the interpreter is covered by the CPU tests).
`load_reference(name)` imports tests/<name>.py by path, for the float64 references the CPU tests define;
`load_bench(name)` imports bench/<name>.py (bench/ is not a package), for the configurations the benchmarks time.
`tiny_cuda_reference(steps)` builds the FP32 `tiny` model on the GPU with its eager greedy tokens, for the
end-to-end GPU tests. `assert_graph_replay_equals(step, want)` replays `step` from a CUDA graph with poisoned
outputs and compares them bit for bit.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def skip_unless_compiled_gpu() -> None:
    """Skip the module being imported without CUDA, or under TRITON_INTERPRET=1."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (compiled Triton kernels)", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: these tests check the compiled kernels", allow_module_level=True)


def _load(path: str, private_name: str):
    spec = importlib.util.spec_from_file_location(private_name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_reference(name: str):
    """The module tests/<name>.py, loaded by path under a private name (not added to sys.modules)."""
    return _load(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"), f"_dsv41_gpu_ref_{name}")


def load_bench(name: str):
    """The module bench/<name>.py, loaded by path under a private name (not added to sys.modules). What the script
    does to the import system at its top (bench scripts put bench/ on sys.path and import siblings as top-level
    modules, e.g. `kernels`) is undone afterwards: a top-level `kernels` from bench/ would shadow the PyPI package
    of that name that transformers looks for, in every later test of the process."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench_dir = os.path.join(root, "bench")
    # A package of the same name imported earlier (PyPI `kernels`, which transformers imports) would be what the
    # script's `import kernels` finds: set it aside while the script loads, and put it back after.
    siblings = {f[:-3] for f in os.listdir(bench_dir) if f.endswith(".py")}
    shadowed = {k: sys.modules.pop(k) for k in siblings & set(sys.modules)}
    path, modules = list(sys.path), set(sys.modules)
    try:
        return _load(os.path.join(bench_dir, f"{name}.py"), f"_dsv41_bench_{name}")
    finally:
        sys.path[:] = path
        for key in set(sys.modules) - modules:
            origin = getattr(sys.modules[key], "__file__", None) or ""
            if os.path.abspath(origin).startswith(bench_dir + os.sep):
                del sys.modules[key]
        sys.modules.update(shadowed)


def tiny_cuda_reference(steps: int, prompt_len: int = 40):
    """(model, prompt, tokens): `tiny` (checkpoint weights, FP32) on CUDA, the benchmark prompt of `prompt_len`
    tokens, and eager `generate`'s greedy tokens [1, steps] (the reference of the end-to-end GPU tests)."""
    from dsv41.cli import build_model
    from dsv41.model import benchmark_prompt, generate

    model = build_model("tiny", "cuda", "checkpoint", "fp32")
    prompt = benchmark_prompt(model.config, prompt_len, device="cuda")
    return model, prompt, generate(model, prompt, steps).tokens


def replay_poisoned(step):
    """Capture `step()` (a sequence of CUDA tensors) in a CUDA graph after one warm-up run on a side stream, fill its
    outputs with NaN, replay it and return the outputs (a read before a write shows as NaN)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for o in out:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


def assert_graph_replay_equals(step, want) -> None:
    """`replay_poisoned(step)` and assert every output equals `want` (same order) bit for bit."""
    out = replay_poisoned(step)
    assert len(out) == len(want) and all(torch.equal(o, r) for o, r in zip(out, want))
