"""The decode benchmark (dsv41/bench.py) and its plot (dsv41/plots.py), on CPU without Inductor compiles.

References are written here by hand: statistics from sorted lists, throughput from hand-made timestamps, the
roofline from a worked example, and the result schema from BENCHMARK.md / the issue's field list.
"""

import json
import os
import re
import struct
import types
import zlib

import pytest
import torch

from dsv41 import bench
from dsv41.model import GenerateResult
from dsv41.model.results import base_model

#: Fields every backend row carries (the issue's schema; other checks read them).
ROW_KEYS = {"decode_tok_s", "prefill_tok_s", "kernels_per_step", "roofline_fraction", "compile_s", "peak_mem_gb",
            "tokens_match_eager"}
TOP_KEYS = {"date", "gpu", "torch", "triton", "preset", "prompt_len", "new_tokens", "copy_bandwidth_tb_s",
            "decode_bytes_per_step", "backends"}
#: Extra fields of every dsv41 row (issue 7: kernels per step per layer role for dsv41).
DSV41_ROW_KEYS = {"fusion_matches", "kernels_per_step_by_role", "kernels_per_step_static",
                  "kernels_static_minus_profiler"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------ statistics
def test_summarize_odd_count_median_is_the_middle_value():
    assert bench.summarize([5.0, 1.0, 3.0]) == {"median": 3.0, "min": 1.0, "max": 5.0}


def test_summarize_even_count_median_is_the_mean_of_the_middle_two():
    assert bench.summarize([4.0, 1.0, 10.0, 2.0]) == {"median": 3.0, "min": 1.0, "max": 10.0}


def test_summarize_single_value_and_empty_input():
    assert bench.summarize([7]) == {"median": 7.0, "min": 7.0, "max": 7.0}
    with pytest.raises(ValueError, match="at least one"):
        bench.summarize([])


# ------------------------------------------------------------------------------------------ alternation
def test_alternation_order_is_round_robin():
    assert bench.alternation_order(["A", "B", "C"], 2) == ["A", "B", "C", "A", "B", "C"]
    assert bench.alternation_order(["A"], 0) == []
    with pytest.raises(ValueError, match="repeats"):
        bench.alternation_order(["A"], -1)


def test_measure_alternating_calls_backends_in_a_b_c_a_b_c_order():
    log = []
    fns = {n: (lambda n=n: log.append(n) or len(log)) for n in ("A", "B", "C")}
    results, errors, order = bench.measure_alternating(fns, 3)
    assert log == ["A", "B", "C"] * 3
    assert order == log and errors == {}
    assert results == {"A": [1, 4, 7], "B": [2, 5, 8], "C": [3, 6, 9]}


def test_measure_alternating_reports_a_failing_backend_and_keeps_the_others():
    calls = []

    def bad():
        calls.append("B")
        raise RuntimeError("boom")

    fns = {"A": lambda: calls.append("A"), "B": bad, "C": lambda: calls.append("C")}
    results, errors, order = bench.measure_alternating(fns, 2)
    assert calls == ["A", "B", "C", "A", "C"]
    assert errors == {"B": "RuntimeError: boom"}
    assert len(results["A"]) == 2 and results["B"] == []


# ------------------------------------------------------------------------------------------ roofline
def test_roofline_matches_a_hand_computed_case():
    # 2.5 GB per step at 4.0 TB/s: 4e12 / 2.5e9 = 1600 tokens/s.
    assert bench.roofline(2.5e9, 4.0) == pytest.approx(1600.0, rel=1e-12)
    with pytest.raises(ValueError):
        bench.roofline(0, 4.0)
    with pytest.raises(ValueError):
        bench.roofline(1e9, 0.0)


def _result(timestamps, tokens, prompt_len=10):
    return GenerateResult(tokens=torch.tensor([tokens]), timestamps=list(timestamps), prompt_len=prompt_len)


def test_summarize_runs_throughput_and_roofline_fraction_by_hand():
    ref = torch.tensor([[5, 6, 7, 8, 9]])
    # run 1: first token at 0.5 s, 4 more tokens by 2.5 s -> 4 / 2.0 = 2.0 tok/s; prefill 10 / 0.5 = 20 tok/s
    # run 2: 4 tokens over 1.0 s -> 4.0 tok/s, prefill 10 / 0.25 = 40; run 3: 4 over 4.0 s -> 1.0, prefill 10
    runs = [_result([0.5, 1.0, 1.5, 2.0, 2.5], [5, 6, 7, 8, 9]),
            _result([0.25, 0.5, 0.75, 1.0, 1.25], [5, 6, 7, 8, 9]),
            _result([1.0, 2.0, 3.0, 4.0, 5.0], [5, 6, 7, 8, 9])]
    row = bench.summarize_runs(runs, ref, roofline_tok_s=8.0)
    assert row["decode_tok_s"] == pytest.approx({"median": 2.0, "min": 1.0, "max": 4.0})
    assert row["prefill_tok_s"] == pytest.approx({"median": 20.0, "min": 10.0, "max": 40.0})
    assert row["roofline_fraction"] == pytest.approx(2.0 / 8.0)
    assert row["tokens_match_eager"] is True and row["matching_prefix_tokens"] == 5


def test_summarize_runs_flags_a_token_mismatch_and_its_position():
    ref = torch.tensor([[5, 6, 7, 8]])
    runs = [_result([1, 2, 3, 4], [5, 6, 7, 8]), _result([1, 2, 3, 4], [5, 6, 0, 8])]
    row = bench.summarize_runs(runs, ref, roofline_tok_s=None)
    assert row["tokens_match_eager"] is False
    assert row["matching_prefix_tokens"] == 2
    assert row["roofline_fraction"] is None


def test_decode_bytes_per_step_uses_weights_plus_kv_at_the_mean_context():
    from dsv41.model.budget import budget, decode_kv_read_bytes
    # prompt 100, 50 new tokens: mean decode context 100 + 25 = 125
    assert bench.decode_context(100, 50) == 125
    want = budget("tiny", max_seq_len=150).decode_weight_bytes + decode_kv_read_bytes("tiny", 125)
    assert bench.decode_bytes_per_step("tiny", 100, 50) == want


def test_max_rel_logit_err_is_max_abs_diff_over_max_abs_reference():
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    got = torch.tensor([[1.5, -4.0], [2.0, 0.25]])
    assert bench.max_rel_logit_err(got, ref) == pytest.approx(0.5 / 4.0)
    with pytest.raises(ValueError, match="shapes"):
        bench.max_rel_logit_err(got[:1], ref)


# ------------------------------------------------------------------------------------------ backends
def test_expand_backends_all_puts_one_ablation_per_family_after_dsv41():
    got = bench.expand_backends("all", ("normalize", "rope_fp4"))
    assert got == ["eager", "inductor", "inductor-cudagraphs", "dsv41", "dsv41-no-normalize", "dsv41-no-rope_fp4",
                   "torch_tensorrt"]
    assert bench.expand_backends("eager,ablations,eager", ("x",)) == ["eager", "dsv41-no-x"]


def test_expand_backends_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown backend 'tvm'"):
        bench.expand_backends("eager,tvm", ("x",))
    with pytest.raises(ValueError, match="unknown pass family"):
        bench.expand_backends("dsv41-no-nope", ("x",))


def test_ablation_families_come_from_the_pass_registry():
    from dsv41.passes import FAMILY_ORDER
    fams, note = bench.ablation_families()
    assert fams == tuple(FAMILY_ORDER) and note is None


def test_ablation_options_switch_exactly_one_family_off():
    from dsv41.compiler.options import parse_options
    opts = bench.row_options("dsv41-no-rope_fp4", {"count_kernels": True, "disable": ["dispatch"]})
    assert opts == {"count_kernels": True, "disable": ["dispatch", "rope_fp4"]}
    assert parse_options(opts).disable == frozenset({"dispatch", "rope_fp4"})
    assert bench.row_options("inductor", {"disable": ["dispatch"]}) is None


def test_toggle_rows_flip_one_option_each_over_the_run_options():
    from dsv41.compiler.options import parse_options
    got = bench.expand_backends("eager,dsv41,toggles,dsv41[pdl=false;streams=true]", ("x",))
    assert got == ["eager", "dsv41", "dsv41[cuda_graphs=false]", "dsv41[pdl=false]", "dsv41[streams=false]",
                   "dsv41[pdl=false;streams=true]"]
    base = {"gpu_unvalidated": True, "pdl": True}
    assert bench.row_options("dsv41[cuda_graphs=false]", base) == {**base, "cuda_graphs": False}
    assert bench.row_options("dsv41[pdl=false;streams=true]", base) == {"gpu_unvalidated": True, "pdl": False,
                                                                             "streams": True}
    o = parse_options(bench.row_options("dsv41[streams=true]", None))
    assert o.streams is True
    lists = bench.expand_backends('eager,dsv41[disable=["moe","mhc"];pdl=false],inductor', ("moe", "mhc"))
    assert lists == ["eager", 'dsv41[disable=["moe","mhc"];pdl=false]', "inductor"]
    assert bench.row_options(lists[1], None) == {"disable": ["moe", "mhc"], "pdl": False}


@pytest.mark.parametrize("name, match", [("dsv41[nope=1]", "unknown dsv41 option"),
                                         ("dsv41[pdl=maybe]", "pdl"), ("dsv41[pdl]", "KEY=VALUE")])
def test_toggle_rows_with_bad_options_are_rejected_by_name(name, match):
    with pytest.raises(ValueError, match=match):
        bench.expand_backends(f"eager,{name}", ("x",))


# ------------------------------------------------------------------------------------------ a CPU run
@pytest.fixture(scope="module")
def cpu_result():
    """A real CPU run of tiny with eager (and torch_tensorrt, which reports itself when absent)."""
    return bench.run_benchmark("tiny", "eager,torch_tensorrt", prompt_len=20, new_tokens=4, repeats=2,
                               device="cpu")


def _tensorrt_installed():
    try:
        import torch_tensorrt  # noqa: F401
    except Exception:
        return False
    return True


def test_cpu_run_result_has_the_schema(cpu_result):
    r = json.loads(json.dumps(cpu_result))  # plain JSON all the way down
    assert TOP_KEYS <= set(r)
    assert r["preset"] == "tiny" and r["prompt_len"] == 20 and r["new_tokens"] == 4
    assert r["copy_bandwidth_tb_s"] is None and r["roofline_tok_s"] is None and r["gpu"] is None
    assert isinstance(r["decode_bytes_per_step"], int) and r["decode_bytes_per_step"] > 0
    assert list(r["backends"]) == ["eager", "torch_tensorrt"]
    for row in r["backends"].values():
        assert ROW_KEYS <= set(row)
    assert r["run_order"] == ["eager", "eager"] or _tensorrt_installed()


def test_cpu_run_eager_row_is_measured_and_matches_itself(cpu_result):
    e = cpu_result["backends"]["eager"]
    d = e["decode_tok_s"]
    assert set(d) == {"median", "min", "max"} and 0 < d["min"] <= d["median"] <= d["max"]
    assert e["prefill_tok_s"]["median"] > 0
    assert e["tokens_match_eager"] is True and e["max_rel_logit_err"] == 0.0
    assert e["kernels_per_step"] is None and e["roofline_fraction"] is None and e["peak_mem_gb"] is None
    assert e["compile_s"] is None and "CUDA-only" in e["note"]


@pytest.mark.skipif(_tensorrt_installed(), reason="torch_tensorrt is installed here")
def test_cpu_run_lists_torch_tensorrt_as_not_installed(cpu_result):
    row = cpu_result["backends"]["torch_tensorrt"]
    assert row["note"] == "not installed"
    assert all(row[k] is None for k in ROW_KEYS)


def test_teacher_forcing_eager_reproduces_generate_logits(tiny_model, tiny_prompt):
    """Teacher-forcing the greedy tokens must give back exactly the logits whose argmax chose them."""
    from dsv41.model import generate
    prompt = tiny_prompt[:20]
    out = generate(tiny_model, prompt, 4)
    logits = bench.teacher_forced_logits(tiny_model, prompt, out.tokens)
    assert logits.shape == (1, 3, tiny_model.config.vocab_size)
    assert torch.equal(logits.argmax(-1), out.tokens[:, 1:])
    # the bench's eager reference takes these logits from the greedy run itself (return_logits), not a second pass
    kept = generate(tiny_model, prompt, 4, return_logits=True)
    assert torch.equal(kept.tokens, out.tokens)
    assert kept.logits.dtype == torch.float32 and torch.equal(kept.logits, logits)
    assert generate(tiny_model, prompt, 4).logits is None
    with pytest.raises(ValueError, match="return_logits"):
        generate(tiny_model, prompt, 1, return_logits=True)
    with pytest.raises(ValueError, match="return_logits"):
        generate(tiny_model, prompt, 4, speculative=True, return_logits=True)


def test_run_benchmark_rejects_bad_sizes_before_building():
    with pytest.raises(ValueError, match="new_tokens >= 2"):
        bench.run_benchmark("tiny", "eager", prompt_len=8, new_tokens=1, device="cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        bench.run_benchmark("tiny", "eager,nope", prompt_len=8, new_tokens=4, device="cpu")


def test_bench_main_writes_json_png_and_prints_the_table_last(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_benchmark", lambda *a, **k: _fake_result())
    out = tmp_path / "r.json"
    assert bench.main(["--backends", "eager", "--json", str(out), "--png"]) == 0
    assert json.loads(out.read_text())["backends"]["eager"]["decode_tok_s"]["median"] == 10.0
    assert not (tmp_path / "r.json.tmp").exists()  # written to a temporary file, then renamed
    _assert_png(tmp_path / "r.png")
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert "decode benchmark" in "\n".join(printed[-12:]) and printed[-1].startswith("└")


# ------------------------------------------------------------------------------------------ the plot
def _fake_result():
    row = dict.fromkeys(ROW_KEYS)
    return {"preset": "tiny", "weight_mode": "checkpoint", "prompt_len": 20, "new_tokens": 4, "repeats": 2,
            "gpu": "Fake GPU", "copy_bandwidth_tb_s": 4.0, "decode_bytes_per_step": 2.5e8, "decode_context": 22,
            "roofline_tok_s": 16.0,
            "backends": {"eager": {**row, "decode_tok_s": {"median": 10.0, "min": 9.0, "max": 11.0},
                                   "prefill_tok_s": {"median": 5.0, "min": 5.0, "max": 5.0}, "kernels_per_step": 900,
                                   "roofline_fraction": 10 / 16, "tokens_match_eager": True, "note": None},
                         "dsv41": {**row, "decode_tok_s": {"median": 14.0, "min": 13.0, "max": 15.0},
                                   "kernels_per_step": 120, "compile_s": 30.0, "tokens_match_eager": True},
                         "torch_tensorrt": {**row, "note": "not installed"}}}


def _assert_png(path):
    """A PNG signature, an IHDR chunk with a correct CRC, a positive size, and an IEND at the end."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, ctype = struct.unpack(">I4s", data[8:16])
    assert ctype == b"IHDR" and length == 13
    w, h = struct.unpack(">II", data[16:24])
    assert w > 100 and h > 100
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert crc == zlib.crc32(data[12:16 + length]) & 0xFFFFFFFF
    assert data[-8:-4] == b"IEND"
    return w, h


def test_plot_is_written_as_a_valid_png(tmp_path):
    from dsv41.plots import plot_benchmark
    path = plot_benchmark(_fake_result(), tmp_path / "sub" / "plot.png")
    w, h = _assert_png(tmp_path / "sub" / "plot.png")
    assert str(path).endswith("plot.png")
    import matplotlib.image
    img = matplotlib.image.imread(str(path))
    assert img.shape[:2] == (h, w)
    assert img[..., :3].std() > 0.01  # something was drawn


def test_plot_uses_a_log_axis_for_a_wide_spread_and_marks_rows_that_ran_shorter():
    """Eager at 3.5 tok/s beside dsv41 at 473 and a roofline of 11,600 (small, H200): on a linear axis eager's
    bar is invisible, so the axis is logarithmic; a row that decoded fewer tokens says so over its bar."""
    from dsv41.plots import _figure
    close = _figure(_fake_result())
    assert close.axes[0].get_yscale() == "linear"
    wide = _fake_result()
    wide["roofline_tok_s"] = 11600.0
    wide["backends"]["eager"]["decode_tok_s"] = {"median": 3.5, "min": 3.2, "max": 3.8}
    wide["backends"]["eager"]["new_tokens"] = 2
    wide["backends"]["dsv41"]["decode_tok_s"] = {"median": 473.0, "min": 472.0, "max": 474.0}
    wide["backends"]["dsv41"]["new_tokens"] = 4
    fig = _figure(wide)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] <= 3.5 and ax.get_ylim()[1] >= 11600
    labels = [t.get_text() for t in ax.texts]
    assert "3.5\n(2 tok)" in labels and "473.0" in labels and "n/a" in labels


def test_plot_rejects_a_result_without_backends():
    from dsv41.plots import benchmark_png
    with pytest.raises(ValueError, match="backends"):
        benchmark_png({"backends": {}})
    with pytest.raises(TypeError):
        benchmark_png([1, 2])


def test_dsv41_rows_carry_the_fusion_report_of_their_compile(monkeypatch):
    import dsv41
    from dsv41.compiler.report import FusionReport, GraphReport
    from dsv41.passes.records import MatchRecord, PassRecord
    rep = FusionReport()
    m = MatchRecord("dispatch", "linear_fp8_block", "dsv41::linear_fp8_block", None, ("mm",), ("aten.mm",), "8", "4")
    rep.add_graph(GraphReport(0, "0/0", (PassRecord("dispatch", True, (m, m)), PassRecord("rope_fp4", False))))
    monkeypatch.setattr(dsv41, "last_report", lambda: rep)
    full, ablation = {"note": None}, {"note": None}
    bench._attach_report(full, True)
    bench._attach_report(ablation, False)
    assert full["fusion_matches"]["dispatch"] == 2 and full["fusion_matches"]["rope_fp4"] == 0
    assert full["report"]["families"]["dispatch"]["matches"] == 2
    assert "report" not in ablation and ablation["fusion_matches"] == full["fusion_matches"]
    monkeypatch.setattr(dsv41, "last_report", lambda: None)
    missing = {"note": None}
    bench._attach_report(missing, True)
    assert "no fusion report" in missing["note"]


def test_dsv41_rows_carry_static_launches_per_step_by_layer_role(monkeypatch):
    import dsv41
    from dsv41.compiler.kernel_counts import LayerKernelCounts
    from dsv41.compiler.report import FusionReport, GraphReport
    from dsv41.passes.records import PassRecord
    rep = FusionReport()
    # layers 0..3 with 5, 6, 9, 7 launches, 4 outside the layers: 31 in all
    counts = LayerKernelCounts(31, ((0, 5), (1, 6), (2, 9), (3, 7)), 4)
    rep.add_graph(GraphReport(0, "0/0", (PassRecord("dispatch", True),), layer_kernels=counts))
    monkeypatch.setattr(dsv41, "last_report", lambda: rep)
    row = {"note": None}
    bench._attach_report(row, True, ["swa", "full", "reuse", "reuse"])
    assert DSV41_ROW_KEYS <= set(row)
    by_role = row["kernels_per_step_by_role"]
    assert {k: v for k, v in by_role.items() if k != "per_layer"} == {"swa": 5, "full": 6, "reuse": 16, "other": 4}
    assert by_role["per_layer"]["reuse"] == {"layers": 2, "min": 7, "max": 9, "mean": 8.0}
    assert row["kernels_per_step_static"] == 31 and row["kernels_static_minus_profiler"] is None
    assert row["report"]["kernels_by_role"] == by_role
    json.dumps(row)  # plain JSON


def test_table_prints_notes_with_brackets_verbatim():
    import io

    from rich.console import Console
    res = _fake_result()
    res["backends"]["dsv41"]["note"] = "failed: KeyError: [bold]x[/bold] [min, max]"
    buf = io.StringIO()
    bench.print_table(res, Console(file=buf, width=400))
    text = buf.getvalue()
    assert "[bold]x[/bold] [min, max]" in text and "decode tok/s med [min, max]" in text


def test_without_warm_compile_the_cold_runner_is_measured():
    """Also: every phase hands the partial result to on_update (a run killed by a time limit keeps it)."""
    partial = []
    r = bench.run_benchmark("tiny", "eager", prompt_len=8, new_tokens=2, repeats=1, device="cpu",
                            warm_compile=False, on_update=lambda d: partial.append(json.loads(json.dumps(d))))
    assert len(partial) >= 5 and all(p["partial"] is True for p in partial) and "partial" not in r
    assert partial[0]["backends"]["eager"]["decode_tok_s"] is None  # before anything was measured
    assert partial[0]["reference_tokens"] == r["reference_tokens"]
    # the last update comes after the measured runs: the tok/s and notes are the final ones
    assert partial[-1]["backends"] == json.loads(json.dumps(r["backends"]))
    assert r["warm_compile"] is False
    e = r["backends"]["eager"]
    assert e["compile_warm_s"] is None and e["decode_tok_s"]["median"] > 0 and e["tokens_match_eager"] is True


def test_shared_cache_points_every_backend_at_one_cache_dir(monkeypatch):
    """With shared_cache every row's compile uses the same Inductor cache dir (without it, one per row)."""
    seen = {True: [], False: []}
    for shared in (True, False):
        monkeypatch.setattr(bench, "_use_cache_dir", lambda path, s=shared: seen[s].append(os.path.basename(path)))
        monkeypatch.setattr(bench, "make_runner", lambda model, name, options, regional=False: model)
        r = bench.run_benchmark("tiny", 'eager,dsv41[pdl=false;disable=["moe"]]', prompt_len=8, new_tokens=2,
                                repeats=1, device="cpu", warm_compile=False, shared_cache=shared)
        assert r["shared_cache"] is shared
        assert r["backends"]['dsv41[pdl=false;disable=["moe"]]']["options"] == {"pdl": False, "disable": ["moe"]}
    assert seen[True] == ["shared", "shared"]
    # One directory per row, named so that a shell command holding the path survives it (Inductor's C++ compile
    # line on CPU broke on `[`, `;` and `"` in a row's name).
    assert seen[False][0] == "eager" and len(set(seen[False])) == 2
    assert re.fullmatch(r"[A-Za-z0-9_.+-]+", seen[False][1]) and seen[False][1].startswith("dsv41_pdl_false")


def test_compile_phase_totals_grow_with_a_compile():
    """`compile_phases_s` is a delta of these totals: a fresh compile must add to the backend-compile phase."""
    torch.compiler.reset()  # clears the totals: take `before` after it
    before = bench._compile_phase_totals()
    fn = torch.compile(lambda x: (x.sin() + 1.5).cos(), backend="aot_eager")
    fn(torch.randn(7))
    after = bench._compile_phase_totals()
    assert set(after) <= set(bench._COMPILE_PHASES)
    key = "OutputGraph.call_user_compiler"
    assert after[key] > before.get(key, 0.0)
    assert after["bytecode_tracing"] > before.get("bytecode_tracing", 0.0)


def test_compile_phases_row_is_the_delta_over_the_cold_run(monkeypatch):
    """Each row's compile_phases_s is what its cold run added to the totals; phases that did not grow are left out."""
    totals = iter([{"bytecode_tracing": 1.0, "compile_fx_inner": 5.0},
                   {"bytecode_tracing": 3.5, "compile_fx_inner": 5.0}])
    monkeypatch.setattr(bench, "_compile_phase_totals", lambda: next(totals))
    r = bench.run_benchmark("tiny", "eager", prompt_len=8, new_tokens=2, repeats=1, device="cpu", warm_compile=False)
    assert r["backends"]["eager"]["compile_phases_s"] == {"bytecode_tracing": 2.5}
    assert bench._phase_deltas({"a": 1.0}, {"a": 1.0, "b": 0.25}) == {"b": 0.25}


def test_identical_rows_names_rows_with_the_same_tokens_and_bit_identical_logits():
    """Hand-made rows: `a` and `b` agree on every run, `c` differs in one token of its second run; digests of
    equal tensors match, of a tensor one ulp off do not."""
    t = torch.tensor([[5, 6, 7]])
    u = torch.tensor([[5, 6, 8]])
    x = torch.linspace(-1, 1, 11)
    y = x.clone()
    y[3] = torch.nextafter(y[3], torch.tensor(2.0))
    assert bench.tensor_digest(x) == bench.tensor_digest(x.clone()) != bench.tensor_digest(y)
    assert bench.tensor_digest(x) != bench.tensor_digest(x.view(1, 11))  # shape is part of it
    same = bench.identical_rows({"a": [t, t], "b": [t.clone()], "c": [t, u], "d": []},
                                {"a": bench.tensor_digest(x), "b": bench.tensor_digest(x.clone()),
                                 "c": bench.tensor_digest(y), "d": None})
    assert same["a"] == {"same_tokens_as": ["b"], "same_logits_as": ["b"]}
    assert same["b"] == {"same_tokens_as": ["a"], "same_logits_as": ["a"]}
    assert same["c"] == {"same_tokens_as": [], "same_logits_as": []}
    assert same["d"] == {"same_tokens_as": None, "same_logits_as": None}


def test_a_run_reports_which_rows_computed_the_same(monkeypatch):
    """In a real CPU run, a row whose runner is the eager model is named as identical to eager; one whose runner
    nudges the logits by one part in 1e6 is not (its tokens may still agree)."""
    class Nudged(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, *a, **k):
            return self._orig_mod(*a, **k) * (1 + 1e-6)

    monkeypatch.setattr(bench, "make_runner", lambda model, name, options, regional=False:
                        model if name in ("eager", "dsv41[pdl=false]") else Nudged(model))
    r = bench.run_benchmark("tiny", "eager,dsv41[pdl=false],dsv41[streams=false]", prompt_len=8, new_tokens=3,
                            repeats=1, device="cpu", warm_compile=False)
    rows = r["backends"]
    assert rows["eager"]["same_logits_as"] == ["dsv41[pdl=false]"]
    assert rows["dsv41[pdl=false]"]["same_tokens_as"][0] == "eager"
    assert rows["dsv41[streams=false]"]["same_logits_as"] == []
    assert rows["dsv41[streams=false]"]["max_rel_logit_err"] > 0


def test_dspark_rows_are_a_backend_row_with_a_suffix():
    fams = ("mhc", "moe")
    got = bench.expand_backends("eager,eager+dspark,dsv41+dspark,dsv41[pdl=false]+dspark,dsv41-no-moe+dspark", fams)
    assert got == ["eager", "eager+dspark", "dsv41+dspark", "dsv41[pdl=false]+dspark", "dsv41-no-moe+dspark"]
    for bad in ("all+dspark", "toggles+dspark", "nope+dspark", "torch_tensorrt+dspark", "dsv41-no-x+dspark",
                "+dspark", "dsv41 +dspark", "eager+dspark+dspark"):
        with pytest.raises(ValueError, match="unknown"):
            bench.expand_backends(bad, fams)
    assert bench.base_backend("dsv41[pdl=false]+dspark") == "dsv41[pdl=false]"
    assert bench.row_options("dsv41-no-moe+dspark", {"pdl": True}) == {"pdl": True, "disable": ["moe"]}
    assert bench.row_options("eager+dspark", None) is None


def test_row_speculation_puts_dspark_off_and_on_side_by_side():
    names = ["eager", "eager+dspark", "dsv41", "dsv41+dspark"]
    assert bench.row_speculation(names, None) == {"eager": None, "eager+dspark": 5.5, "dsv41": None,
                                                  "dsv41+dspark": 5.5}
    at3 = bench.row_speculation(names, 3.0)
    assert at3["dsv41+dspark"] == 3.0 and at3["dsv41"] is None
    assert bench.row_speculation(["eager", "dsv41"], 4.0) == {"eager": 4.0, "dsv41": 4.0}  # --speculative alone
    assert bench.row_speculation(["eager", "dsv41"], None) == {"eager": None, "dsv41": None}


def test_a_run_with_dspark_rows_measures_plain_and_speculative_rows_together():
    """`eager` decodes plainly (tokens equal the reference), `eager+dspark` speculatively at a simulated 3.0 (tiny
    drafts blocks of 3: at most 4 tokens a round) with the measured acceptance reported, tokens not compared
    (simulated rounds keep drafts the target did not pick)."""
    r = bench.run_benchmark("tiny", "eager,eager+dspark", prompt_len=8, new_tokens=24, repeats=1, device="cpu",
                            warm_compile=False, speculative=3.0)
    plain, spec = r["backends"]["eager"], r["backends"]["eager+dspark"]
    assert r["speculative"]["rows"] == ["eager+dspark"] and r["speculative"]["simulated_acceptance"] == 3.0
    assert plain["tokens_match_eager"] is True and "mean_acceptance" not in plain
    assert spec["tokens_match_eager"] is None and 2.0 < spec["mean_acceptance"] <= 4.0
    assert spec["decode_tok_s"]["median"] > 0 and "simulated acceptance 3.0" in spec["note"]
    ph = spec["speculative_round_ms"]  # an extra untimed run; 24 tokens at ~3 a round: 7-12 rounds
    assert 7 <= ph["rounds"] <= 12 and min(ph[k] for k in ("save", "verify", "accept_rollback", "sync", "draft")) >= 0
    assert ph["verify"] > 0 and ph["round"] >= ph["verify"] and "speculative_round_ms" not in plain
    with pytest.raises(ValueError, match="positive"):
        bench.run_benchmark("tiny", "eager+dspark", prompt_len=8, new_tokens=4, device="cpu", speculative=0)


def test_every_row_runs_on_one_cache_allocation_sized_for_the_longest_run(monkeypatch):
    """Cache sizes are static shapes of every compiled step, so a row must see the allocation its precompile
    worker saw: one allocation for the whole run, with room for a verify block when a row speculates (before,
    a plain row after a `+dspark` row inherited the bigger one and missed its worker's cache)."""
    seen = []
    real = bench.timed_run

    def timed(runner, prompt, new_tokens, cuda, speculative=None, compiled_prefill=False):
        seen.append((speculative, base_model(runner).max_seq_len))
        return real(runner, prompt, new_tokens, cuda, speculative, compiled_prefill)

    monkeypatch.setattr(bench, "timed_run", timed)
    r = bench.run_benchmark("tiny", "eager,eager+dspark", prompt_len=8, new_tokens=6, repeats=1, device="cpu",
                            warm_compile=False, speculative=2.0)
    block = 3 + 1  # tiny: dspark_block_size 3, verify block + 1 rows
    assert {s for s, _ in seen} == {None, 2.0}
    assert {m for _, m in seen} == {8 + 6 + block} == {r["cache_max_seq_len"]}
    model, _ = bench.bench_model("tiny", "cpu", "checkpoint", None, 8, 6)
    assert model.max_seq_len == 8 + 6  # plain runs: prompt + new tokens, as generate would allocate
    with pytest.raises(ValueError, match="max_position_embeddings"):
        bench.bench_model("tiny", "cpu", "checkpoint", None, 4090, 3, model=model, speculative=True)  # 4097 > 4096


class _Wrapped(torch.nn.Module):
    """A stand-in compiled wrapper: calls the model (optionally scaling its logits), exposes it as `_orig_mod`."""

    def __init__(self, model, scale: float = 1.0):
        super().__init__()
        self._orig_mod, self.scale = model, scale

    def forward(self, *a, **k):
        return self._orig_mod(*a, **k) * self.scale


def test_eager_new_tokens_shorten_eager_and_compare_the_others_over_that_prefix(monkeypatch):
    """Eager `h200` cannot decode 1,024 tokens in a call: with eager_new_tokens R the reference and the eager row
    decode R tokens, the other rows their full length, compared with eager over the first R."""
    lengths = {}
    real = bench.timed_run

    def timed(runner, prompt, new_tokens, cuda, speculative=None, compiled_prefill=False):
        out = real(runner, prompt, new_tokens, cuda, speculative, compiled_prefill)
        lengths.setdefault(type(runner).__name__, set()).add(out["out"].tokens.shape[1])
        return out

    monkeypatch.setattr(bench, "timed_run", timed)
    monkeypatch.setattr(bench, "make_runner", lambda model, name, options, regional=False:
                        model if name == "eager" else _Wrapped(model))
    r = bench.run_benchmark("tiny", "eager,dsv41[pdl=false]", prompt_len=8, new_tokens=7, repeats=1, device="cpu",
                            warm_compile=False, eager_new_tokens=3)
    assert r["eager_new_tokens"] == 3 and len(r["reference_tokens"][0]) == 3
    assert lengths == {"DeepseekV41Flash": {3}, "_Wrapped": {7}}
    other = r["backends"]["dsv41[pdl=false]"]
    assert other["tokens_match_eager"] is True and other["matching_prefix_tokens"] == 3
    assert "eager runs 3 new tokens, not 7" in r["backends"]["eager"]["note"]
    for bad in (1, 8):
        with pytest.raises(ValueError, match="eager_new_tokens"):
            bench.run_benchmark("tiny", "eager", prompt_len=8, new_tokens=7, device="cpu", eager_new_tokens=bad)


def test_row_new_tokens_shorten_one_row_and_compare_it_over_its_own_length(monkeypatch):
    """A host-bound row (Inductor without CUDA graphs on `h200`) decodes R tokens in every run, the others their
    full length; its tokens are compared with eager's over its R, and a wrong token in that prefix is caught."""
    lengths, forced = {}, {}
    real, real_tf = bench.timed_run, bench.teacher_forced_logits

    def timed(runner, prompt, new_tokens, cuda, speculative=None, compiled_prefill=False):
        out = real(runner, prompt, new_tokens, cuda, speculative, compiled_prefill)
        lengths.setdefault(getattr(runner, "tag", "eager"), []).append(out["out"].tokens.shape[1])
        return out

    def tf(runner, prompt, tokens):
        forced[getattr(runner, "tag", "eager")] = tokens.shape[1]
        return real_tf(runner, prompt, tokens)

    def make(model, name, options, regional=False):
        if name == "eager":
            return model
        w = _Wrapped(model)
        w.tag = name
        return w

    monkeypatch.setattr(bench, "timed_run", timed)
    monkeypatch.setattr(bench, "teacher_forced_logits", tf)
    monkeypatch.setattr(bench, "make_runner", make)
    r = bench.run_benchmark("tiny", "eager,dsv41[pdl=false],dsv41[streams=false],dsv41[debug=true]", prompt_len=8,
                            new_tokens=7, repeats=2, device="cpu", warm_compile=False,
                            row_new_tokens={"dsv41[pdl=false]": 3, "dsv41[debug=true]": 7})
    assert r["row_new_tokens"] == {"dsv41[pdl=false]": 3, "dsv41[debug=true]": 7}
    assert len(r["reference_tokens"][0]) == 7
    # cold run, warm-up run and two measured runs each
    assert lengths == {"eager": [7, 7, 7], "dsv41[pdl=false]": [3] * 4, "dsv41[streams=false]": [7] * 4,
                       "dsv41[debug=true]": [7] * 4}
    # teacher-forced over the row's own length, not all of eager's tokens (a host-bound row would pay for them)
    assert forced == {"dsv41[pdl=false]": 3, "dsv41[streams=false]": 7, "dsv41[debug=true]": 7}
    short, full = r["backends"]["dsv41[pdl=false]"], r["backends"]["dsv41[streams=false]"]
    assert (short["new_tokens"], full["new_tokens"], r["backends"]["eager"]["new_tokens"]) == (3, 7, 7)
    assert short["tokens_match_eager"] is True and short["matching_prefix_tokens"] == 3
    assert "runs 3 new tokens, not 7 (row_new_tokens)" in short["note"]
    assert "row_new_tokens" not in (full["note"] or "")
    assert "row_new_tokens" not in (r["backends"]["dsv41[debug=true]"]["note"] or "")  # R == new_tokens: no note
    assert short["max_rel_logit_err"] is not None and "teacher-forced over eager's first 3 tokens" in short["note"]

    # The short row must still be checked: a wrong first token is a mismatch, not a vacuous pass.
    ref = torch.tensor(r["reference_tokens"])
    wrong = ref[:, :3].clone()
    wrong[0, 1] += 1
    run = types.SimpleNamespace(tokens=wrong, decode_tok_s=1.0, prefill_tok_s=1.0, prefill_s=1.0)
    row = bench.summarize_runs([run], ref, None)
    assert row["tokens_match_eager"] is False and row["matching_prefix_tokens"] == 1
    # nor can a run with nothing to compare, or one of another length than asked, pass
    empty = types.SimpleNamespace(tokens=ref[:, :0], decode_tok_s=1.0, prefill_tok_s=1.0, prefill_s=1.0)
    assert bench.summarize_runs([empty], ref, None)["tokens_match_eager"] is False
    right = types.SimpleNamespace(tokens=ref[:, :3].clone(), decode_tok_s=1.0, prefill_tok_s=1.0, prefill_s=1.0)
    assert bench.summarize_runs([right], ref, None, expected_tokens=3)["tokens_match_eager"] is True
    assert bench.summarize_runs([right], ref, None, expected_tokens=5)["tokens_match_eager"] is False

    row = "dsv41[pdl=false]"
    for bad_map, msg in (({"inductor": 3}, "not in this run"), ({row: 1}, r"\[2, new_tokens=7\]"),
                         ({row: 8}, r"\[2, new_tokens=7\]"), ({row: True}, "must be an int"),
                         ({"eager": 3}, "eager_new_tokens")):
        with pytest.raises(ValueError, match=msg):
            bench.run_benchmark("tiny", f"eager,{row}", prompt_len=8, new_tokens=7, device="cpu",
                                row_new_tokens=bad_map)


def test_parse_row_new_tokens():
    assert bench.parse_row_new_tokens(["inductor=128", " dsv41[pdl=false] =3"]) == {"inductor": 128,
                                                                                    "dsv41[pdl=false]": 3}
    for bad, msg in ((["inductor"], "ROW=R"), (["=3"], "ROW=R"), (["inductor=x"], "ROW=R"),
                     (["dsv41[pdl=false]"], "ROW=R"), (["inductor=+3"], "ROW=R"), (["inductor=1_000"], "ROW=R"),
                     (["inductor=3", "inductor=4"], "twice")):
        with pytest.raises(ValueError, match=msg):
            bench.parse_row_new_tokens(bad)


def test_eager_rows_run_no_warm_up_and_no_second_teacher_forcing(monkeypatch):
    """Eager compiles nothing: its first run is its warm-up, and its decode step is the reference's, whose logits
    the greedy run kept. A compiled row (here a stand-in wrapper) still gets both."""
    runs, forced = [], []
    real_run, real_tf = bench.timed_run, bench.teacher_forced_logits
    monkeypatch.setattr(bench, "timed_run", lambda runner, *a, **k: runs.append(runner) or real_run(runner, *a, **k))
    monkeypatch.setattr(bench, "teacher_forced_logits", lambda runner, *a: forced.append(runner) or real_tf(runner, *a))

    class Wrapped(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, *a, **k):
            return self._orig_mod(*a, **k)

    monkeypatch.setattr(bench, "make_runner", lambda model, name, options, regional=False:
                        model if name == "eager" else Wrapped(model))
    r = bench.run_benchmark("tiny", "eager,dsv41[pdl=false]", prompt_len=8, new_tokens=3, repeats=2, device="cpu",
                            warm_compile=False)
    kinds = ["eager" if not isinstance(x, Wrapped) else "wrapped" for x in runs]
    assert kinds.count("eager") == 1 + 2 and kinds.count("wrapped") == 1 + 1 + 2  # cold (+ warm-up) + measured
    assert len(forced) == 1 and isinstance(forced[0], Wrapped)
    e = r["backends"]["eager"]
    assert e["max_rel_logit_err"] == 0.0 and "the eager reference's own" in e["note"]
    assert "no separate warm-up run" in e["note"]
    assert r["backends"]["dsv41[pdl=false]"]["same_logits_as"] == ["eager"]


def test_kernel_launches_by_name_keeps_every_launch_of_kernels_with_a_shared_prefix():
    """Inductor kernel names share long prefixes; the per-name launches must still add up to the step's kernels."""
    stem = ("triton_per_fused___lshift_____rshift____to_copy_abs_add_amax_bitwise_and_clamp_div_mul_ne_silu_"
            "unsqueeze_view_")
    names = {stem + "a_5": 30, stem + "b_8": 4, "_quant_gemv_kernel": 290, "nvjet_sm90": 4}
    got = bench.launches_by_name(names)
    assert sum(got.values()) == 328 and got == names
    assert list(got) == ["_quant_gemv_kernel", stem + "a_5", "nvjet_sm90", stem + "b_8"]
