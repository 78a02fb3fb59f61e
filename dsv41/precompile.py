"""Fill Inductor's caches for several benchmark rows at once, in worker processes (`dsv41 bench --precompile N`).

Why. A cold whole-model `small` compile took 181 s on the H200 host (bench/results/2026-11-30_h200_s9), nearly all of
it one Python thread (Dynamo, AOT autograd, dsv41's passes, Inductor's scheduling), while the host has 16 cores. A
toggle matrix or the family ladder compiles one model per row, so rows compiled one after another do not fit a
10-minute call. Here each compiled row gets a worker process that builds the same model and runs the same cold
step as the benchmark's (`harness.bench_model`, `harness.make_runner`, `harness.timed_run`), so it compiles the same
graphs into that row's Inductor cache dir; up to N workers run at once. The benchmark then compiles each row in turn
and is served from that cache (dsv41 keeps its pass records and launch counts next to Inductor's, see
compiler/pipeline.py), and times the rows one after another as before: workers have exited before anything is
timed. Measured on CPU, `tiny` in FP32: a cold compile 151 s, one served from the cache it filled 33 s.

Honesty of the numbers: a row compiled after a worker reports its served-from-cache compile as `compile_s`, with
`compile_cache_hits` (Inductor's FX-graph / AOT autograd cache hits of that compile) and `precompiled: true` only
when those say the worker's cache served it; `precompile_wall_s` is the worker's own compile + first run (workers
share the CPUs and the GPU, so that is an upper bound of a solo cold compile). Caveat: Inductor settles some kernel
configurations on the worker's first run, while other workers share the GPU, and the row reuses them.
A worker's log is kept in its row's cache dir (`precompile_<row>.log`); a worker exits when its benchmark is gone.

Regional rows (`share_weights`). The `h200` preset holds 86.7 GB of weights, so a second process with its own copy
does not fit the GPU and its rows compiled one at a time (about 150 s each). A regional compile traces each layer as
its own graph, whose weights are graph inputs: their shapes, not their values, are in the graph and in Inductor's
cache key. So a worker of a regional row builds the model with every layer taking the weights of the first layer
with a weight of the same name, shape and dtype (`blocks_sharing_weights`; `h200`: one layer's worth of each
weight, shared by 40 layers: 8.2 GB), and compiles the same graphs the full model compiles; the caches and buffers
(KV rings, banks, states) stay per layer. The numbers it computes differ, which a compile does not see. Not for
whole-model compiles: there shared weights would be one graph input used for several layers, a different graph.

Worker: `python -m dsv41.precompile SPEC.json RESULT.json`, SPEC the keyword arguments of `run_worker`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Sequence

__all__ = ["Precompiler", "run_worker", "worker_threads", "blocks_sharing_weights"]

#: Lines of a failed worker's log kept in its result.
_LOG_TAIL = 30


def worker_threads(workers: int, cpus: int | None = None) -> int:
    """Inductor compile threads per worker: the host's CPUs shared out among `workers` (at least 1).

    Raises: ValueError for workers < 1.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not cpus:
        try:
            cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use, not the host's
        except AttributeError:  # not on Linux
            cpus = os.cpu_count() or 1
    return max(1, cpus // workers)


@contextlib.contextmanager
def blocks_sharing_weights():
    """While open, each decoder layer (`dsv41.model.model.Block`, not a subclass) that `DeepseekV41Flash` builds
    takes, for each of its parameters, the tensor of the first layer built in this context that has a parameter of
    the same name (within the layer), shape and dtype; its own are freed at once, so at most one layer's worth more
    than the shared tensors is allocated. Within one layer no two parameters share a tensor (their names differ),
    so no graph of one region sees an input twice. Buffers (caches, tables) stay per layer.

    For compile-only workers of regional rows (module docstring); the weights' values then differ from the seeded
    model's. Yields {(name, shape, dtype, device): tensor} of the shared tensors made so far.
    Not thread-safe: it wraps `Block.__init__` while open.
    """
    from .model.model import Block

    real_init = Block.__init__
    shared: dict = {}

    def init(block, *args, **kwargs):
        """`Block.__init__`, then each parameter replaced by the shared tensor of its key (docstring above)."""
        real_init(block, *args, **kwargs)
        if type(block) is not Block:  # a subclass (DSpark's stages) adds parameters after this returns: its own
            return
        for mod_name, mod in block.named_modules():
            for p_name, p in mod._parameters.items():
                if p is not None:
                    key = (f"{mod_name}.{p_name}" if mod_name else p_name, tuple(p.shape), p.dtype, p.device)
                    mod._parameters[p_name] = shared.setdefault(key, p)

    Block.__init__ = init
    try:
        yield shared
    finally:
        Block.__init__ = real_init


def run_worker(preset: str, name: str, prompt_len: int, new_tokens: int, weight_mode: str, device: str,
               options: Mapping | None = None, dtype: str | None = None, speculative: float | None = None,
               contexts: Sequence[int] | None = None, context_tokens: int = 32, regional: bool = False,
               seed: int = 0, share_weights: bool = False, speculative_rows: Mapping | None = None,
               run_tokens: Mapping | None = None) -> dict:
    """Compile benchmark row `name` as `bench.run_benchmark` would and run its cold step once.

    Builds the model with `bench.bench_model` (same preset, weights, dtype and cache allocation; with
    `share_weights`, only for `regional`, layers share their weights: module docstring), compiles it with
    `harness.make_runner` (same backend options) and runs `harness.timed_run` (the benchmark's cold compile + first
    run: prefill, decode steps, and DSpark rounds when `speculative`), then the teacher-forced decode the row's logit
    error comes from. Inductor writes to `TORCHINDUCTOR_CACHE_DIR` of this process.
    `speculative_rows` ({row: E or None}, `bench.row_speculation`), when given, sets this row's `speculative`.
    `run_tokens` ({row: tokens}, the benchmark's per-row run length), when given, sets how many tokens the first
    run decodes (the cache allocation still follows `new_tokens`, as in the benchmark).
    Returns: {"name", "wall_s" (compile + first run), "teacher_forced_s", "tokens" (list)}.
    Raises: ValueError for `share_weights` without `regional`; whatever the compile or the run raises (the caller
    records it).
    """
    import torch

    from .harness import bench_model, make_runner, teacher_forced_logits, timed_run

    any_speculative = speculative is not None if speculative_rows is None else any(speculative_rows.values())
    if speculative_rows is not None:  # the run's per-row DSpark setting (`bench_rows.row_speculation`)
        speculative = speculative_rows.get(name)
    if share_weights and not regional:
        raise ValueError("share_weights is for regional rows only: a whole-model graph would see one weight set as "
                         "one input of several layers, a different graph")
    cuda = device.startswith("cuda")
    with blocks_sharing_weights() if share_weights else contextlib.nullcontext():
        model, prompt = bench_model(preset, device, weight_mode, dtype, prompt_len, new_tokens, contexts,
                                    context_tokens, seed=seed, speculative=any_speculative)
    with torch._dynamo.config.patch(cache_size_limit=max(torch._dynamo.config.cache_size_limit, 64)):
        runner = make_runner(model, name, dict(options) if options else None, regional)
        first = timed_run(runner, prompt, (run_tokens or {}).get(name, new_tokens), cuda, speculative)
        t0 = time.perf_counter()
        teacher_forced_logits(runner, prompt, first["out"].tokens)
    return {"name": name, "wall_s": first["wall_s"], "teacher_forced_s": time.perf_counter() - t0,
            "tokens": first["out"].tokens.tolist()}


class Precompiler:
    """Worker processes that fill the Inductor cache dirs of benchmark rows, at most `workers` at once.

    Args:
        spec: keyword arguments of `run_worker` shared by every row (all but `name`).
        names: the compiled rows (backend names as `bench.expand_backends` gives them).
        cache_dir_of: row name -> the Inductor cache dir the benchmark will compile that row from.
        workers: processes at once (>= 1); each gets `worker_threads(workers)` Inductor compile threads.
        timeout_s: per worker; a worker past it is killed and its row compiles cold in the benchmark.
        command: the worker command line before SPEC RESULT (default `python -m dsv41.precompile`; tests swap it).
    Use: `p = Precompiler(...).start()`, other work, then `p.wait()` -> {"workers", "wall_s", "rows": {name:
    {"rc", "wall_s", "note", "log"}}}. `rc` 0 and `wall_s` the worker's cold compile + first run on success;
    otherwise `note` says why (exit code, timeout) with the tail of the worker's log.
    Raises: ValueError for workers < 1 or an empty `names`.
    """

    def __init__(self, spec: Mapping, names: Sequence[str], cache_dir_of: Callable[[str], str], workers: int,
                 timeout_s: float = 1800.0, command: Sequence[str] | None = None):
        if not names:
            raise ValueError("no compiled rows to precompile")
        self.threads = worker_threads(workers)
        self.spec, self.names, self.cache_dir_of, self.workers = dict(spec), list(names), cache_dir_of, workers
        self.timeout_s = timeout_s
        self.command = list(command) if command else [sys.executable, "-m", "dsv41.precompile"]
        self._pool = self._futures = None
        self._t0 = None
        self._procs: dict = {}
        self._closed = False
        self._lock = threading.Lock()
        self._tmp = tempfile.mkdtemp(prefix="dsv41-precompile-")

    def start(self) -> "Precompiler":
        """Launch the workers (returns at once)."""
        self._t0 = time.perf_counter()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers)
        self._futures = {n: self._pool.submit(self._one, n) for n in self.names}
        return self

    def wait(self) -> dict:
        """Wait for every worker; the summary of the class docstring."""
        rows = {n: f.result() for n, f in self._futures.items()}
        self._pool.shutdown()
        shutil.rmtree(self._tmp, ignore_errors=True)
        return {"workers": self.workers, "compile_threads_per_worker": self.threads,
                "wall_s": time.perf_counter() - self._t0, "rows": rows}

    def close(self) -> None:
        """Kill the workers still running and start no more (for a benchmark that stops early; idempotent)."""
        with self._lock:
            self._closed = True
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _one(self, name: str) -> dict:
        try:
            return self._run(name)
        except Exception as e:  # noqa: BLE001 - a worker that cannot start leaves its row to a cold compile
            return {"rc": None, "wall_s": None, "process_s": 0.0, "log": None,
                    "note": f"worker not started: {type(e).__name__}: {e}"[:500]}

    def _run(self, name: str) -> dict:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        spec_path, out_path = (os.path.join(self._tmp, f"{safe}.{x}.json") for x in ("spec", "result"))
        with open(spec_path, "w") as f:
            json.dump({**self.spec, "name": name}, f)
        cache = self.cache_dir_of(name)
        os.makedirs(cache, exist_ok=True)
        log_path = os.path.join(cache, f"precompile_{safe}.log")  # kept with the cache it explains
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS=str(self.threads))
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            with self._lock:  # close() either sees this worker or stops it from starting
                if self._closed:
                    return {"rc": None, "wall_s": None, "process_s": 0.0, "note": "not started (closed)",
                            "log": None}
                proc = subprocess.Popen([*self.command, spec_path, out_path], env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
                self._procs[name] = proc
            try:
                rc = proc.wait(timeout=self.timeout_s)
                note = None if rc == 0 else f"worker exited with {rc}"
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc, note = None, f"worker killed after {self.timeout_s:.0f} s"
        row = {"rc": rc, "wall_s": None, "process_s": time.perf_counter() - t0, "note": note, "log": log_path}
        if rc == 0:
            try:
                with open(out_path) as f:
                    row["wall_s"] = json.load(f)["wall_s"]
            except (OSError, ValueError, KeyError) as e:
                row["rc"], row["note"] = None, f"worker wrote no result ({type(e).__name__})"
        if row["note"]:
            with open(log_path, errors="replace") as f:
                row["note"] += ": " + " | ".join(f.read().splitlines()[-_LOG_TAIL:])[-2000:]
        return row


def _exit_with_parent(poll_s: float = 2.0) -> None:
    """End this worker when the benchmark that started it is gone (killed before it could stop its workers), so no
    orphan keeps compiling on the GPU while a later run is timed."""
    parent = os.getppid()

    def watch():
        """Poll the parent pid every `poll_s` seconds; exit the process (code 3) once it changed."""
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="dsv41-precompile-parent-watch").start()


def main(argv=None) -> int:
    """Worker entry point: `python -m dsv41.precompile SPEC.json RESULT.json`."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m dsv41.precompile SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    _exit_with_parent()
    out = run_worker(**spec)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
