"""`dsv41.precompile`: worker processes that fill each benchmark row's Inductor cache dir, at most N at once.

The orchestration runs against a stub worker (a script that records what it was given); the real worker compiles
a model and is exercised by `dsv41 bench --precompile` (bench/results/2026-11-30_cpu_precompile/)."""

import json
import os
import sys
import textwrap

import pytest

from dsv41.precompile import Precompiler, worker_threads

_STUB = textwrap.dedent('''
    import json, os, sys, time
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.load(open(spec_path))
    t0 = time.time()
    time.sleep(spec["sleep"])
    if spec["name"] == spec.get("fail"):
        print("compile failed: some reason")
        sys.exit(3)
    if spec["name"] == spec.get("hang"):
        time.sleep(60)
    with open(os.path.join(spec["log_dir"], spec["name"] + ".seen"), "w") as f:
        json.dump({"cache": os.environ["TORCHINDUCTOR_CACHE_DIR"], "threads": os.environ["TORCHINDUCTOR_COMPILE_THREADS"],
                   "start": t0, "end": time.time(), "spec": spec}, f)
    json.dump({"name": spec["name"], "wall_s": 1.5}, open(out_path, "w"))
''')


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "stub_worker.py"
    path.write_text(_STUB)
    return [sys.executable, str(path)]


def _seen(log_dir, name):
    with open(os.path.join(log_dir, name + ".seen")) as f:
        return json.load(f)


def test_worker_threads_share_the_cpus():
    assert worker_threads(4, cpus=16) == 4
    assert worker_threads(6, cpus=16) == 2
    assert worker_threads(32, cpus=16) == 1
    with pytest.raises(ValueError, match="workers must be >= 1"):
        worker_threads(0)


def test_each_row_compiles_into_its_own_cache_dir_at_most_n_at_once(tmp_path, stub):
    names = ["dsv41", "dsv41[pdl=false]", "dsv41-no-mhc"]
    caches = {n: str(tmp_path / "caches" / str(i)) for i, n in enumerate(names)}
    spec = {"sleep": 1.0, "log_dir": str(tmp_path), "preset": "tiny"}
    out = Precompiler(spec, names, caches.__getitem__, workers=2, command=stub).start().wait()
    assert out["workers"] == 2 and set(out["rows"]) == set(names)
    seen = {n: _seen(tmp_path, n) for n in names}
    for n in names:
        assert out["rows"][n]["rc"] == 0 and out["rows"][n]["wall_s"] == 1.5 and out["rows"][n]["note"] is None
        assert seen[n]["cache"] == caches[n] and os.path.isdir(caches[n])
        assert seen[n]["threads"] == str(worker_threads(2))
        assert seen[n]["spec"]["name"] == n and seen[n]["spec"]["preset"] == "tiny"
    spans = sorted((s["start"], s["end"]) for s in seen.values())
    # two ran together, the third started only after one of them had ended
    assert spans[1][0] < spans[0][1]
    assert spans[2][0] >= min(spans[0][1], spans[1][1]) - 0.05


def test_a_failed_or_hung_worker_is_reported_with_its_log(tmp_path, stub):
    names = ["ok", "bad", "stuck"]
    spec = {"sleep": 0.0, "log_dir": str(tmp_path), "fail": "bad", "hang": "stuck"}
    out = Precompiler(spec, names, lambda n: str(tmp_path / n), workers=3, timeout_s=5, command=stub).start().wait()
    rows = out["rows"]
    assert rows["ok"]["rc"] == 0
    assert rows["bad"]["rc"] == 3 and rows["bad"]["wall_s"] is None
    assert "exited with 3" in rows["bad"]["note"] and "compile failed: some reason" in rows["bad"]["note"]
    assert rows["stuck"]["rc"] is None and "killed after 5 s" in rows["stuck"]["note"]


def test_no_rows_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no compiled rows"):
        Precompiler({}, [], lambda n: str(tmp_path), workers=1)


def test_bench_refuses_precompile_it_cannot_honour():
    from dsv41.bench import run_benchmark
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        run_benchmark("tiny", "eager", 8, 2, repeats=1, device="cpu", precompile=2, tp={"moe_mode": "tp"})
    with pytest.raises(ValueError, match="precompile must be >= 0"):
        run_benchmark("tiny", "eager", 8, 2, repeats=1, device="cpu", precompile=-1)
    with pytest.raises(ValueError, match="precompile_only needs precompile workers and a cache_dir"):
        run_benchmark("tiny", "eager", 8, 2, repeats=1, device="cpu", precompile=2, precompile_only=True)


def test_close_kills_running_workers_and_starts_no_more(tmp_path, stub):
    import time

    spec = {"sleep": 0.0, "log_dir": str(tmp_path), "hang": "a"}
    pre = Precompiler(spec, ["a", "b"], lambda n: str(tmp_path / n), workers=1, command=stub).start()
    time.sleep(1.0)  # "a" is running (it hangs 60 s), "b" waits for the slot
    t0 = time.perf_counter()
    pre.close()
    assert time.perf_counter() - t0 < 20
    assert all(p.poll() is not None for p in pre._procs.values())
    assert not os.path.exists(tmp_path / "b.seen")


def test_a_worker_that_cannot_start_leaves_its_row_to_a_cold_compile(tmp_path, stub):
    spec = {"sleep": 0.0, "log_dir": str(tmp_path), "options": {"disable": {"mhc"}}}  # a set is not JSON
    out = Precompiler(spec, ["dsv41"], lambda n: str(tmp_path / n), workers=1, command=stub).start().wait()
    row = out["rows"]["dsv41"]
    assert row["rc"] is None and row["wall_s"] is None and "worker not started: TypeError" in row["note"]


def test_precompile_only_without_compiled_rows_returns_at_once(tmp_path):
    from dsv41.bench import run_benchmark
    res = run_benchmark("tiny", "eager", 8, 2, repeats=1, device="cpu", precompile=2, cache_dir=str(tmp_path),
                        precompile_only=True)
    assert res["backends"]["eager"]["note"] == "precompile only: nothing to compile"
    assert res["backends"]["eager"]["decode_tok_s"] is None


def test_precompile_only_builds_no_model_in_the_benchmark_process(tmp_path, monkeypatch, stub):
    """Only the workers build models in a precompile-only run: h200 (87 GB) fits the GPU once, so a model in the
    benchmark process left the workers out of memory (the H200, 2026-11-30). Regional rows ask for shared weights."""
    from dsv41 import bench, precompile
    from dsv41.bench import run_benchmark

    def no_model(*a, **k):
        raise AssertionError("the benchmark process built a model")

    seen = {}
    real = precompile.Precompiler

    class Recording(real):
        def __init__(self, spec, names, cache_dir_of, workers, **kw):
            seen.update(spec=dict(spec), names=list(names))
            super().__init__({**spec, "sleep": 0.0, "log_dir": str(tmp_path)}, names, cache_dir_of, workers,
                             command=stub)

    monkeypatch.setattr(bench, "bench_model", no_model)
    monkeypatch.setattr(precompile, "Precompiler", Recording)
    res = run_benchmark("tiny", "eager,dsv41,inductor,eager+dspark,dsv41+dspark", 8, 3, repeats=1, device="cpu",
                        precompile=2, cache_dir=str(tmp_path / "c"), precompile_only=True, regional=True,
                        speculative=3.0, row_new_tokens={"inductor": 2})
    assert seen["names"] == ["dsv41", "inductor", "dsv41+dspark"] and seen["spec"]["share_weights"] is True
    # each worker's first run decodes what the row's runs will (a host-bound row asked to run shorter)
    assert seen["spec"]["run_tokens"] == {"eager": 3, "dsv41": 3, "inductor": 2, "eager+dspark": 3,
                                          "dsv41+dspark": 3}
    assert seen["spec"]["speculative_rows"] == {"eager": None, "dsv41": None, "inductor": None,
                                                "eager+dspark": 3.0, "dsv41+dspark": 3.0}
    assert res["dtype"] == "float32" and res["preset"] == "tiny"
    assert res["backends"]["dsv41"]["precompiled"] is True and res["backends"]["dsv41"]["decode_tok_s"] is None
    # what building the model would have rejected fails at once, not in every worker
    for bad, match in (({"dtype": "fp8"}, "unknown dtype"), ({"weight_mode": "bogus"}, "unknown weight_mode"),
                       ({"contexts": [10 ** 9]}, "max_position_embeddings")):
        with pytest.raises(ValueError, match=match):
            run_benchmark("tiny", "dsv41", 8, 2, repeats=1, device="cpu", precompile=1,
                          cache_dir=str(tmp_path / "c"), precompile_only=True, **bad)


def test_a_worker_decodes_its_rows_run_tokens():
    """`run_tokens` sets the length of the worker's first run (the row's `row_new_tokens`); the cache allocation
    still follows `new_tokens`."""
    from dsv41.precompile import run_worker
    out = run_worker("tiny", "eager", 8, 6, "checkpoint", "cpu", run_tokens={"eager": 3, "dsv41": 6})
    assert len(out["tokens"][0]) == 3
    assert len(run_worker("tiny", "eager", 8, 4, "checkpoint", "cpu")["tokens"][0]) == 4


class _Stop(Exception):
    pass


def test_with_precompile_workers_the_benchmark_builds_its_model_after_they_exit(tmp_path, monkeypatch, stub):
    """The benchmark's own model waits for the workers: beside 2 workers, the benchmark's `h200` model (87 GB) left
    one out of GPU memory (the H200, 2026-12-01, `precompile` without `precompile_only`)."""
    from dsv41 import bench, precompile
    from dsv41.bench import run_benchmark

    order = []
    real = precompile.Precompiler

    class Recording(real):
        def __init__(self, spec, names, cache_dir_of, workers, **kw):
            super().__init__({**spec, "sleep": 0.5, "log_dir": str(tmp_path)}, names, cache_dir_of, workers,
                             command=stub)

        def wait(self):
            out = super().wait()
            order.append("workers exited")
            return out

    def model_then_stop(*a, **k):
        order.append("model built")
        raise _Stop

    monkeypatch.setattr(bench, "bench_model", model_then_stop)
    monkeypatch.setattr(precompile, "Precompiler", Recording)
    with pytest.raises(_Stop):
        run_benchmark("tiny", "eager,dsv41", 8, 2, repeats=1, device="cpu", precompile=1,
                      cache_dir=str(tmp_path / "c"))
    assert order == ["workers exited", "model built"]


def test_a_worker_ends_when_the_benchmark_that_started_it_is_killed(tmp_path):
    """The worker's parent watch: a parent killed before it could close its workers leaves no orphan compiling."""
    import subprocess
    import time

    child_code = ("import time; from dsv41.precompile import _exit_with_parent; _exit_with_parent(0.2); "
                  "time.sleep(60)")
    parent_code = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child_code!r}]); "
                   "print(p.pid, flush=True); import time; time.sleep(1.0)")
    parent = subprocess.run([sys.executable, "-c", parent_code], capture_output=True, text=True, timeout=60)
    pid = int(parent.stdout.split()[0])
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError("the worker outlived its parent by 15 s")


def test_cache_hits_count_a_compile_served_from_inductors_cache(tmp_path, monkeypatch):
    """`bench._cache_hits` reads the counters that say whether a row's compile was served from its cache (what
    marks a row `precompiled`) and `_cache_misses` those that compiled: a second compile of the same function from
    the same cache dir hits and does not miss."""
    import torch

    from dsv41 import bench

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))

    def f(x):
        return torch.sin(x) * 2 + 1

    x = torch.randn(8)
    seen = []
    for _ in range(2):
        bench._use_cache_dir(str(tmp_path / "cache"))
        torch._dynamo.reset()
        before, miss = bench._cache_hits(), bench._cache_misses()
        torch.testing.assert_close(torch.compile(f)(x), f(x))
        seen.append({**{k: v - before[k] for k, v in bench._cache_hits().items()},
                     "miss": bench._cache_misses() - miss})
    assert seen[0] == {"fxgraph": 0, "aot_autograd": 0, "miss": 1}
    assert seen[1]["fxgraph"] + seen[1]["aot_autograd"] >= 1 and seen[1]["miss"] == 0


# ------------------------------------------------------------------------ weight sharing for regional workers
def _weight_sets(model):
    """{param signature of a layer: [layer indices]} of a built model."""
    out = {}
    for i, b in enumerate(model.layers):
        sig = tuple((n, tuple(p.shape), p.dtype) for n, p in b.named_parameters())
        out.setdefault(sig, []).append(i)
    return out


def test_blocks_sharing_weights_gives_each_weight_name_and_shape_one_tensor(monkeypatch):
    """Across layers, parameters of equal name, shape and dtype share one tensor; within a layer none do; DSpark's
    stages (a Block subclass) keep their own; caches stay per layer; `Block.__init__` is restored even when the
    build raises."""
    from dsv41.cli import build_model
    from dsv41.model.model import Block
    from dsv41.precompile import blocks_sharing_weights, run_worker

    real_init = Block.__init__
    plain = build_model("tiny", "cpu")
    with blocks_sharing_weights() as shared_tensors:
        shared = build_model("tiny", "cpu")
    assert Block.__init__ is real_init
    keys = {(n, tuple(p.shape), p.dtype) for l in plain.layers for n, p in l.named_parameters()}
    assert len(shared_tensors) == len(keys)
    first = {}
    for i, layer in enumerate(shared.layers):
        ptrs = [p.data_ptr() for p in layer.parameters()]
        assert len(set(ptrs)) == len(ptrs), f"layer {i} sees one tensor twice"
        for n, p in layer.named_parameters():
            assert first.setdefault((n, tuple(p.shape), p.dtype), p.data_ptr()) == p.data_ptr(), (i, n)
    layer_ptrs = {p.data_ptr() for l in shared.layers for p in l.parameters()}
    assert len(layer_ptrs) == len(keys) < len({p.data_ptr() for l in plain.layers for p in l.parameters()})
    assert _weight_sets(shared) == _weight_sets(plain)  # same shapes everywhere
    stages = [m for m in shared.mtp.modules() if isinstance(m, Block)]
    assert stages and not {p.data_ptr() for s in stages for p in s.parameters()} & layer_ptrs
    shared.setup_cache(1, 32)
    rings = [l.attn.ring_codes.data_ptr() for l in shared.layers]
    assert len(set(rings)) == len(rings)

    with pytest.raises(RuntimeError, match="build failed"):
        with blocks_sharing_weights():
            raise RuntimeError("build failed")
    assert Block.__init__ is real_init
    with pytest.raises(ValueError, match="regional rows only"):
        run_worker("tiny", "dsv41", 4, 2, "checkpoint", "cpu", share_weights=True, regional=False)


def test_a_shared_weight_model_traces_the_graphs_of_the_full_model():
    """What makes a regional worker's cache serve the full model: region by region, Dynamo hands the backend the
    same graphs with the same input shapes, strides and dtypes for the shared-weight model as for the seeded one
    (a recording backend, no Inductor; `generate` prefills uncompiled, then decodes through the regions)."""
    import torch

    from dsv41.cli import build_model
    from dsv41.compiler.regional import RegionalModel
    from dsv41.model import benchmark_prompt, generate
    from dsv41.precompile import blocks_sharing_weights

    def traced(model):
        seen = []

        def record(gm, example_inputs):
            """Note the graph's code and input metadata; run it as traced."""
            seen.append((gm.code, tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor)
                                        else repr(t) for t in example_inputs)))
            return gm.forward

        torch._dynamo.reset()
        rm = RegionalModel(model, lambda fn: torch.compile(fn, backend=record, dynamic=False), "record")
        generate(rm, benchmark_prompt(model.config, 6), 3)
        torch._dynamo.reset()
        return seen

    full = traced(build_model("tiny", "cpu"))
    with blocks_sharing_weights():
        shared_model = build_model("tiny", "cpu")
    shared = traced(shared_model)
    assert len(full) >= len(_weight_sets(shared_model)) + 2  # a decode graph per weight set, embedding, head
    assert shared == full
