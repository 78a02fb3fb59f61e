"""The "where the step goes" table (dsv41/compiler/breakdown.py) and its place in the benchmark rows, on CPU.

The GPU side is fed here with timelines laid out by `Lane` (a kernel per `then(...)` call, gaps and overlaps
explicit), so every expected figure below is read off the layout, not recomputed by the code under test. One check
reads the kernel names an H200 really recorded (bench/results/2026-12-03_h200_s25) and holds them to the counts
the issue quotes (851 Inductor glue, 922 dsv41, 80 cuBLAS / ATen).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from dsv41.compiler import breakdown as bd
from dsv41.compiler.breakdown import KernelEvent

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_RUN = os.path.join(REPO, "bench", "results", "2026-12-03_h200_s25", "final_h200.json")

#: A stand-in for `kernel_ops()`: which dsv41 ops launch which kernel (the shape of the real map).
KNOWN = {"_frag_x_kernel": frozenset({"linear_fp8_block", "grouped_linear_fp4"}),
         "_frag_gemv_kernel": frozenset({"linear_fp8_block", "linear_fp4"}),
         "_grouped_frag_kernel": frozenset({"grouped_linear_fp4_pair"}),
         "_mhc_mixes_kernel": frozenset({"mhc_mixes"})}


class Lane:
    """A GPU timeline written in order: `then(name, dur, after=gap)` starts a kernel `gap` µs after the previous
    one ended (negative: it overlaps it, as a side-stream or PDL launch does)."""

    def __init__(self, t0: float = 100.0):
        self.events: list = []
        self.t = t0

    def then(self, name: str, dur: float, after: float = 0.0) -> "Lane":
        start = self.t + after
        self.events.append(KernelEvent(name, start, start + dur))
        self.t = start + dur
        return self


def one_step(scale: float = 1.0) -> list:
    """Eight activities; durations times `scale`, gaps fixed.

        _frag_x_kernel 3 | gap 1 | _frag_gemv_kernel 10 | gap .5 | triton_poi (copy) 2 | gap .5 | triton_red 4 |
        gap 1 | cublas gemm 6 | mhc_mixes 5 starting 2 before the gemm ends | gap 2 | memcpy 1 | grouped 8
    """
    s = scale
    return (Lane().then("_frag_x_kernel", 3 * s).then("_frag_gemv_kernel", 10 * s, after=1)
            .then("triton_poi_fused__to_copy_view_0", 2 * s, after=0.5)
            .then("triton_red_fused__to_copy_mean_pow_rsqrt_1", 4 * s, after=0.5)
            .then("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_execute_kernel__5x_cublas", 6 * s, after=1)
            .then("_mhc_mixes_kernel", 5 * s, after=-2).then("Memcpy DtoD (Device -> Device)", 1 * s, after=2)
            .then("_grouped_frag_kernel", 8 * s).events)


# ------------------------------------------------------------------------------------------------ GPU timeline
class TestOneProfiledStep:
    table = bd.step_breakdown([one_step()], None, None, known=KNOWN)

    def test_each_kernel_lands_in_its_class(self):
        c = self.table["classes"]
        assert set(c) == {"_frag_x_kernel", "linear_fp8_block", "inductor", "blas", "mhc_mixes", "copies",
                          "grouped_linear_fp4"}
        assert c["_frag_x_kernel"]["kind"] == "dsv41 shared"
        assert c["_frag_x_kernel"]["ops"] == ["grouped_linear_fp4", "linear_fp8_block"]
        assert (c["linear_fp8_block"]["kind"], c["linear_fp8_block"]["time_us"]) == ("dsv41", 10.0)
        assert c["grouped_linear_fp4"]["ops"] == ["grouped_linear_fp4", "grouped_linear_fp4_pair"]
        assert c["inductor"]["by_kind"] == {"copy/cast": {"launches": 1, "time_us": 2.0},
                                            "reduction": {"launches": 1, "time_us": 4.0}}
        assert [c[k]["launches"] for k in ("blas", "copies", "mhc_mixes")] == [1, 1, 1]

    def test_costliest_class_comes_first(self):
        times = [e["time_us"] for e in self.table["classes"].values()]
        assert times == sorted(times, reverse=True) and list(self.table["classes"])[0] == "linear_fp8_block"

    def test_total_and_timeline_by_hand(self):
        # durations 3+10+2+4+6+5+1+8 = 39; first start 100, last end 100+3+1+10+.5+2+.5+4+1+6-2+5+2+1+8 = 142
        # busy = span minus the idle gaps 1 + .5 + .5 + 1 + 2 = 5 -> 37; the 2 us overlap is counted once
        t = self.table
        assert t["total"] == {"launches": 8, "time_us": 39.0, "floor_us": None, "bytes": None}
        assert (t["span_us"], t["busy_us"], t["overlap_us"]) == (42.0, 37.0, 2.0)
        assert t["gap_per_boundary_us"] == pytest.approx(5 / 7)
        assert t["steps_profiled"] == 1 and "torch.profiler" in t["source"]

    def test_without_bandwidth_or_report_no_floor_is_made_up(self):
        assert all(e["floor_us"] is None and e["bytes"] is None for e in self.table["classes"].values())
        assert "no fusion report" in self.table["source"]


def test_several_steps_average_time_and_keep_launches_per_step():
    slow = one_step(scale=2.0)
    t = bd.step_breakdown([one_step(), slow], None, None, known=KNOWN)
    assert t["classes"]["linear_fp8_block"]["time_us"] == 15.0  # (10 + 20) / 2
    assert t["total"]["launches"] == 8 and t["total"]["time_us"] == pytest.approx(58.5)
    # per-step gaps: 5/7 both times (scaled durations, same gaps), so the median is 5/7
    assert t["gap_per_boundary_us"] == pytest.approx(5 / 7) and t["note"] == ""
    short = one_step()[:-1]
    t = bd.step_breakdown([one_step(), short, short], None, None, known=KNOWN)
    assert t["classes"]["grouped_linear_fp4"]["launches"] == 0  # median_low of 1, 0, 0
    assert "[8, 7, 7]" in t["note"]
    with pytest.raises(ValueError, match="empty"):
        bd.step_breakdown([], None, None, known=KNOWN)


def test_gap_of_a_lone_kernel_is_undefined_and_an_empty_step_has_no_timeline():
    lone = bd.step_timeline([KernelEvent("k", 0.0, 4.0)])
    assert lone["gap_per_boundary_us"] is None and lone["span_us"] == lone["busy_us"] == 4.0
    assert bd.step_timeline([])["span_us"] is None


@pytest.mark.parametrize("name, cls, kind", [
    ("triton_poi_fused__to_copy_1", "inductor", "inductor"),
    ("triton_per_fused__softmax_amax_3", "inductor", "inductor"),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "blas", "library"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_tn_align1>(x::Params)", "blas", "library"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>(int)", "blas", "library"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 8>(int)", "aten", "aten"),
    ("Memset (Device)", "copies", "copy"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl", "library"),
    ("_some_new_dsv41_kernel", "_some_new_dsv41_kernel", "dsv41 unattributed"),
    ("mystery", "other", "other"),
])
def test_names_outside_the_dsv41_map(name, cls, kind):
    assert bd.classify_kernel(name, KNOWN) == (cls, kind)


@pytest.mark.parametrize("name, kind", [
    ("triton_poi_fused__to_copy_view_11", "copy/cast"), ("triton_poi_fused_copy__17", "copy/cast"),
    ("triton_poi_fused__to_copy_add_cos_mul_select_sin_slice_stack_sub_unsqueeze_view_9", "pointwise"),
    ("triton_poi_fused_15", "pointwise"), ("triton_red_fused__to_copy__unsafe_view_mean_pow_7", "reduction"),
    ("triton_tem_fused_mm_0", "template"), ("triton_for_fused_3", "other"),
])
def test_inductor_kind_from_the_fused_op_words(name, kind):
    assert bd.inductor_kind(name) == kind


# ------------------------------------------------------------------------------------------------ profiler events
def test_profiler_events_split_into_steps_by_their_host_ranges():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, a, b, dev=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=a, end=b),
                               is_user_annotation=annotation)
    events = [ev("dsv41 decode step 0", 0, 50, cpu), ev("dsv41 decode step 1", 60, 120, cpu),
              ev("dsv41 decode step 0", 5, 40, cuda, True),  # Kineto's GPU-side copy of the range
              ev("cudaGraphLaunch", 1, 3, cpu), ev("k_a", 10, 20), ev("k_b", 21, 30), ev("k_a", 70, 80),
              ev("k_b", 119.5, 121)]  # ends a little after its range (clock skew): still step 1
    kernels = bd.kernel_events(events)
    assert [k.name for k in kernels] == ["k_a", "k_b", "k_a", "k_b"]
    windows = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == cpu and e.name.startswith(bd.STEP_MARK)]
    steps = bd.split_steps(kernels, windows, 2)
    assert [[k.start_us for k in s] for s in steps] == [[10, 21], [70, 119.5]]
    # no ranges: the widest idle gap (30 -> 70) separates the two steps
    assert [len(s) for s in bd.split_steps(kernels, [], 2)] == [2, 2]
    with pytest.raises(ValueError):
        bd.split_steps(kernels, [], 0)


# ------------------------------------------------------------------------------------------------ real names
def test_the_real_kernel_map_classes():
    pytest.importorskip("triton")
    known = bd.kernel_ops()
    assert bd.classify_kernel("_frag_gemv_kernel", known) == ("linear_fp8_block", "dsv41")
    assert bd.classify_kernel("_quant_gemv_kernel", known) == ("linear_fp8_block", "dsv41")
    assert bd.classify_kernel("_grouped_frag_kernel", known) == ("grouped_linear_fp4", "dsv41")
    assert bd.classify_kernel("_sparse_attention_combine_kernel", known) == ("sparse_fp4_attention", "dsv41")
    assert bd.classify_kernel("_topk_select_kernel", known) == ("indexer_topk", "dsv41")
    assert bd.classify_kernel("_frag_x_kernel", known) == ("_frag_x_kernel", "dsv41 shared")
    assert bd.classify_kernel("_mhc_mixes_kernel", known) == ("mhc_mixes", "dsv41")


def test_an_h200_profile_falls_into_the_issues_counts():
    pytest.importorskip("triton")
    with open(H200_RUN) as f:
        row = json.load(f)["backends"]["dsv41"]
    per_kind: dict = {}
    for name, n in row["kernel_launches_by_name"].items():
        cls, kind = bd.classify_kernel(name)
        per_kind[kind] = per_kind.get(kind, 0) + n
    assert per_kind.pop("inductor") == 851
    assert per_kind.pop("dsv41") + per_kind.pop("dsv41 shared") == 922
    assert per_kind.pop("library") + per_kind.pop("aten") == 80
    assert per_kind == {}  # nothing unattributed or unknown


# ------------------------------------------------------------------------------------------------ report side
def _report(regional_steps=None):
    """Three graphs: graph 0 (layer 0) launches 2 linear_fp8_block calls, 3 Inductor kernels and one extern mm;
    graph 1 (a layer graph) one mhc_mixes, one rope_fp4_quant_store and a buffer copy; graph 2 the head's mm."""
    from dsv41.compiler.kernel_counts import LayerKernelCounts
    from dsv41.compiler.report import FusionReport, GraphReport
    from dsv41.passes.records import MatchRecord, PassRecord

    def site(op, after, fam="dispatch"):
        return MatchRecord(fam, op, f"dsv41::{op}", None, (), (), "0", after, (("B", 1), ("L", 1)))
    g0 = LayerKernelCounts(6, ((0, 6),), detail=((0, (("torch.ops.dsv41.linear_fp8_block.default", 2),
                                                      ("triton", 3), ("extern_kernels.mm", 1))),))
    g1 = LayerKernelCounts(3, ((1, 3),), detail=((1, (("torch.ops.dsv41.mhc_mixes.default", 1),
                                                      ("torch.ops.dsv41.rope_fp4_quant_store.default", 1),
                                                      ("copy_", 1))),))
    g2 = LayerKernelCounts(1, (), 1, detail=(("other", (("extern_kernels.mm", 1),)),))
    rep = FusionReport()
    rep.add_graph(GraphReport(0, "0/0", (PassRecord("dispatch", True, (site("linear_fp8_block", "3000000"),
                                                                        site("linear_fp4", "1000000*B"))),),
                              layer_kernels=g0))
    rep.add_graph(GraphReport(1, "1/0", (PassRecord("mhc", True, (site("mhc_mixes", "250000", "mhc"),)),
                                         PassRecord("normalize", True, (site("mhc_mixes", "999", "normalize"),))),
                              layer_kernels=g1))
    rep.add_graph(GraphReport(2, "2/0", (), layer_kernels=g2))
    rep.regional_step_graphs = regional_steps
    return rep


def test_static_launches_and_floors_from_the_report():
    t = bd.step_breakdown(None, _report(), copy_bandwidth_tb_s=2.0)
    c = t["classes"]
    assert {k: e["launches"] for k, e in c.items()} == {"linear_fp8_block": 2, "inductor": 3, "blas": 2,
                                                         "mhc_mixes": 1, "rope_fp4": 1, "copies": 1}
    assert all(e["time_us"] is None for e in c.values()) and t["total"]["time_us"] is None
    # 4 MB at 2 TB/s = 2 us; 0.25 MB = 0.125 us; the normalize record moves nothing of its own
    assert (c["linear_fp8_block"]["bytes"], c["linear_fp8_block"]["floor_us"]) == (4_000_000, 2.0)
    assert c["linear_fp8_block"]["ops"] == ["linear_fp4", "linear_fp8_block"]
    assert (c["mhc_mixes"]["bytes"], c["mhc_mixes"]["floor_us"]) == (250_000, 0.125)
    assert c["rope_fp4"]["bytes"] is None and c["inductor"]["floor_us"] is None
    assert t["total"] == {"launches": 10, "time_us": None, "floor_us": 2.125, "bytes": 4_250_000}
    assert t["gap_per_boundary_us"] is None and "static" in t["source"]


def test_regional_steps_count_a_shared_layer_graph_once_per_layer():
    # layers 0..2: graph 0 once, graph 1 for layers 1 and 2; the head's graph 2 under "other"
    t = bd.step_breakdown(None, _report({0: [0], 1: [1], 2: [1], "other": [2]}), copy_bandwidth_tb_s=None)
    c = t["classes"]
    assert c["mhc_mixes"]["launches"] == 2 and c["mhc_mixes"]["bytes"] == 500_000
    assert c["mhc_mixes"]["floor_us"] is None  # no bandwidth: no floor, bytes still known
    assert t["total"]["launches"] == 6 + 2 * 3 + 1
    assert "regional" in t["source"] and "no copy bandwidth" in t["source"]
    # a graph the step runs without a launch count: no total is invented from the others
    rep = _report({0: [0], 1: [1], "other": [2]})
    rep.graphs[2] = rep.graphs[2].__class__(2, "2/0", ())
    t = bd.step_breakdown(None, rep, copy_bandwidth_tb_s=None)
    assert t["total"]["launches"] is None and t["classes"]["mhc_mixes"]["bytes"] == 250_000


def test_the_profile_keeps_the_report_bytes_beside_the_measured_time():
    t = bd.step_breakdown([one_step()], _report(), copy_bandwidth_tb_s=2.0, known=KNOWN)
    c = t["classes"]
    assert (c["linear_fp8_block"]["time_us"], c["linear_fp8_block"]["floor_us"]) == (10.0, 2.0)
    assert c["inductor"]["launches"] == 2  # the profile's count, not the static 3
    assert "rope_fp4" not in c  # in the static count only: a profile shows what it saw
    # a map that misses the mixes kernel: the report's class is shown as launching nothing, the kernel apart
    blind = {k: v for k, v in KNOWN.items() if k != "_mhc_mixes_kernel"}
    c = bd.step_breakdown([one_step()], _report(), copy_bandwidth_tb_s=2.0, known=blind)["classes"]
    assert (c["mhc_mixes"]["launches"], c["mhc_mixes"]["time_us"], c["mhc_mixes"]["floor_us"]) == (0, 0.0, 0.125)
    assert c["_mhc_mixes_kernel"]["kind"] == "dsv41 unattributed" and c["_mhc_mixes_kernel"]["time_us"] == 5.0


def test_the_reports_show_the_table_only_when_it_is_there():
    from dsv41.compiler.html import render_html
    rep = _report()
    assert "where the step goes" not in str(rep) and "Where the step goes" not in render_html(rep.to_dict())
    rep.step_breakdown = bd.set_step_time(bd.step_breakdown([one_step()], rep, 2.0, known=KNOWN), 20_000.0)
    text = str(rep)
    assert "where the step goes" in text and "_frag_x_kernel (shared)" in text
    assert rep.to_dict()["step_breakdown"]["step_us"] == 50.0
    headers, rows, foot = bd.table_rows(rep.step_breakdown)
    total = rows[-1]
    assert total == ["total", "8", "39.0", "2.12", "-", "78.0"]  # 39 us of a 50 us step; floor 2 + 0.125 us
    assert "step 50.0 us" in foot and "over 7 boundaries" in foot
    page = render_html(rep.to_dict())
    assert "Where the step goes" in page and "mhc_mixes" in page
    # a report without the table borrows the benchmark's dsv41 row
    bench = {"backends": {"dsv41": {"step_breakdown": rep.step_breakdown}}}
    assert "Where the step goes" in render_html(_report().to_dict(), bench={**bench, "backends": bench["backends"]})


# ------------------------------------------------------------------------------------------------ benchmark
def test_a_cpu_benchmark_row_carries_static_launches_and_no_time(monkeypatch):
    import dsv41
    from dsv41 import bench
    rep = _report()
    monkeypatch.setattr(dsv41, "last_report", lambda: rep)
    monkeypatch.setattr(bench, "make_runner", lambda model, name, options, regional=False: model)
    r = json.loads(json.dumps(bench.run_benchmark("tiny", "eager,dsv41", prompt_len=8, new_tokens=2, repeats=1,
                                                  device="cpu", warm_compile=False)))
    assert {"step_breakdown", "gap_per_boundary_us"} <= set(r["definitions"])
    row = r["backends"]["dsv41"]
    t = row["step_breakdown"]
    assert row["gap_per_boundary_us"] is None and t["steps_profiled"] == 0
    assert t["total"]["launches"] == row["kernels_per_step_static"] == 10
    assert t["classes"]["linear_fp8_block"]["launches"] == 2
    assert all(e["time_us"] is None and e["floor_us"] is None for e in t["classes"].values())
    assert t["step_us"] == pytest.approx(1e6 / row["decode_tok_s"]["median"])
    assert row["report"]["step_breakdown"] == t
    eager = r["backends"]["eager"]["step_breakdown"]
    assert eager["classes"] == {} and eager["total"]["launches"] is None and "null" in eager["source"]


def test_dsv41_report_on_cpu_leaves_the_table_out_with_one_line(tiny_model, tiny_prompt, capsys):
    from dsv41.harness import profile_breakdown
    rep = _report()
    assert profile_breakdown(tiny_model, tiny_prompt[:8], 3, rep) is None
    assert rep.step_breakdown is None
    assert "step breakdown left out: RuntimeError" in capsys.readouterr().err


def test_a_profiled_row_gets_the_table_its_gap_and_a_progress_line():
    """The CUDA branch of the benchmark, fed a hand-laid profile: what `_set_breakdown` writes into a dsv41 row."""
    from dsv41 import bench
    rep = _report()
    row, lines, notes = {"report": rep.to_dict(), "note": None}, [], []
    bench._REPORTS[id(row)] = rep
    try:
        bench._set_breakdown(row, [one_step(), one_step()], 2.0, lines.append, "dsv41", notes)
    finally:
        bench._REPORTS.pop(id(row))
    assert row["gap_per_boundary_us"] == pytest.approx(5 / 7) and notes == []
    assert row["report"]["step_breakdown"] is row["step_breakdown"] is rep.step_breakdown
    assert row["step_breakdown"]["classes"]["mhc_mixes"]["floor_us"] == 0.125
    assert row["step_breakdown"]["roofline_step_us"] is None  # no decode bytes given
    bench._set_breakdown(row, [one_step()], 2.0, lines.append, "dsv41", notes, decode_bytes=5e6)
    assert row["step_breakdown"]["roofline_step_us"] == 2.5  # 5 MB at 2 TB/s
    assert "roofline step 2.5 us" in bd.table_rows(row["step_breakdown"])[2]
    lines.pop()
    assert lines == [lines[0]] and "2 steps" in lines[0] and "gap per boundary 0.714 us" in lines[0]
    broken = {"note": None}
    bench._set_breakdown(broken, [], 2.0, lines.append, "x", notes)  # an empty profile: a note, no table
    assert "step_breakdown" not in broken and notes and "empty" in notes[0]


def test_profile_decode_step_steps_through_positions_and_splits_its_events(monkeypatch):
    """`bench.profile_decode_step`'s CUDA path with the GPU taken out: a device that calls itself cuda, a stub
    runner, and a profiler that hands back a hand-made timeline of three steps."""
    import contextlib

    import dsv41.compiler.profiling as profiling
    import dsv41.model as model_pkg
    from dsv41 import bench

    class Dev(str):
        type = "cuda"

    calls = []

    class Stub:
        max_seq_len, batch_size = 64, 1
        embed = SimpleNamespace(weight=SimpleNamespace(device=Dev("cpu")))

        def __call__(self, tok, pos):
            calls.append(int(pos))

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, a, b, dev=cuda):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=a, end=b),
                               is_user_annotation=False)
    timeline = [ev(f"{bd.STEP_MARK} {i}", 100 * i, 100 * i + 60, cpu) for i in range(3)]
    for i in range(3):  # per step: two kernels and a memcpy; step 2's gemv is slower
        t = 100 * i + 5
        timeline += [ev("_frag_x_kernel", t, t + 3), ev("Memcpy DtoD (Device -> Device)", t + 4, t + 5),
                     ev("_frag_gemv_kernel", t + 6, t + 16 + 10 * (i == 2))]

    @contextlib.contextmanager
    def fake_profile(activities):
        yield SimpleNamespace(events=lambda: timeline)
    monkeypatch.setattr(profiling, "quiet_profile", fake_profile)
    monkeypatch.setattr(model_pkg, "generate", lambda r, p, n: SimpleNamespace(tokens=torch.tensor([[7, 9]])))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    k = bench.profile_decode_step(Stub(), torch.arange(10), new_tokens=4, steps=5)
    assert calls == [11, 12, 13]  # steps capped at new_tokens - 1; prompt 10 + warm-up step, then one each
    assert (k["kernels"], k["memcpy_memset"], k["span_us"], k["gpu_busy_us"]) == (2, 1, 16.0, 14.0)
    assert k["names"] == {"_frag_x_kernel": 1, "_frag_gemv_kernel": 1}
    assert [len(s) for s in k["step_events"]] == [3, 3, 3]
    t = bd.step_breakdown(k["step_events"], None, None, known=KNOWN)
    assert t["classes"]["linear_fp8_block"]["time_us"] == pytest.approx(40 / 3)  # (10 + 10 + 20) / 3


def test_an_h200_sized_table_fits_a_narrow_window(tmp_path):
    """The H200 profile's kernel names laid end to end (1 us each) as the step of the tiny CPU report's page."""
    import test_html_layout as layout
    if layout._chromium() is None:
        pytest.skip("no chromium / chromium-browser on PATH")
    pytest.importorskip("triton")
    with open(H200_RUN) as f:
        names = json.load(f)["backends"]["dsv41"]["kernel_launches_by_name"]
    lane = Lane()
    for name, n in names.items():
        for _ in range(n):
            lane.then(name, 1.0, after=0.25)
    d = layout._tiny()
    d["step_breakdown"] = bd.set_step_time(bd.step_breakdown([lane.events], None, 4.2), 127.85)
    page = layout.render_html(d)
    assert "Where the step goes" in page and "_frag_x_kernel (shared)" in page
    m = layout._measure(tmp_path, page, 800)
    assert m["scrollWidth"] <= 800 and not m["wide"], m


def test_a_prefill_breakdown_profiles_one_generate_of_one_token(monkeypatch):
    """`prefill_breakdown` with the GPU taken out: the profiled call is `generate(runner, prompt, 1)` with the row's
    prefill mode, its kernels become a step table without byte floors; a failing profile is a note, not a table."""
    from dsv41 import bench_reports, harness
    import dsv41.model as model_pkg
    calls = []

    def fake_generate(runner, prompt, n, compiled_prefill=False):
        calls.append((runner, n, compiled_prefill))

    def fake_profiled_steps(fns):
        for f in fns:
            f()
        return [one_step()]

    monkeypatch.setattr(model_pkg, "generate", fake_generate)
    monkeypatch.setattr(harness, "profiled_steps", fake_profiled_steps)
    row, notes = {}, []
    bench_reports.set_prefill_breakdown(row, "runner", torch.zeros(1, 4), True, notes)
    assert calls == [("runner", 1, True)] and notes == []
    t = row["prefill_breakdown"]
    assert t["steps_profiled"] == 1 and t["total"]["launches"] == 8  # the memcpy counts in `copies`
    assert all(c.get("floor_us") is None for c in t["classes"].values())

    def broken(fns):
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(harness, "profiled_steps", broken)
    row = {}
    bench_reports.set_prefill_breakdown(row, "runner", torch.zeros(1, 4), False, notes)
    assert "prefill_breakdown" not in row and "prefill breakdown" in notes[0] and "no CUDA" in notes[0]
