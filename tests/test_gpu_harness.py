"""tests/gpu_harness.py's `load_bench` leaves the import system as it found it: a bench script that puts bench/ on
sys.path and imports `kernels` (bench/kernels.py) as a top-level module must not shadow the PyPI package `kernels`
that transformers looks up in later tests of the same process (it did: ImportError 'CUDAProperties' from
bench/kernels.py in tests/test_llama_transformers.py under xdist)."""

import os
import sys

from gpu_harness import load_bench


def test_loading_a_bench_script_does_not_leak_bench_modules_or_paths():
    before = list(sys.path)
    probe = load_bench("grouped_words_probe")  # inserts "bench" into sys.path and imports `kernels` from there
    assert hasattr(probe, "main")
    assert sys.path == before
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    leaked = [k for k, m in sys.modules.items()
              if os.path.abspath(getattr(m, "__file__", None) or "/").startswith(bench_dir + os.sep)]
    assert leaked == []
