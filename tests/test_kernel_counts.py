"""Kernel launches per decoder layer and per layer role (dsv41/compiler/kernel_counts.py), issues 4 and 7.

References are independent of the code under test: the launch lines of a wrapper are counted here with a plain
line regex (the module parses the wrapper's AST), and which layer a launch belongs to is read from a marker op
whose layer index is a literal argument of its call in the generated code.
"""

import os
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from dsv41.compiler import kernel_counts as kc


# ------------------------------------------------------------------------------------------------ paths, roles
@pytest.mark.parametrize("path, layer", [
    ("L['self'].layers.3.attn.wq", 3),
    ("L['self']._modules['layers']._modules['5'].ffn", 5),
    ("L['self'].layers.2.ffn.experts.7.w1", 2),  # a numbered module inside a layer keeps the layer
    ("L__self___layers_4_attn", 4),
    ("L['m'].stack.0", 0),
    ("L['self'].embed", None),
    ("L['self'].head", None),
])
def test_layer_of_path_takes_the_outermost_numbered_submodule(path, layer):
    assert kc.layer_of_path(path) == layer


def test_kernels_by_role_sums_layers_of_each_role_and_keeps_other():
    by_layer = {"0": 3, "1": 4, "2": 10, "3": 7, "other": 5}
    roles = ["swa", "swa", "full", "reuse"]
    got = kc.kernels_by_role(by_layer, roles)
    assert got == {"swa": 7, "full": 10, "reuse": 7, "other": 5}
    assert sum(got.values()) == sum(by_layer.values())
    per = kc.per_layer_by_role(by_layer, roles)
    assert per["swa"] == {"layers": 2, "min": 3, "max": 4, "mean": 3.5}
    assert per["reuse"] == {"layers": 1, "min": 7, "max": 7, "mean": 7.0}


def test_a_layer_beyond_the_roles_counts_as_other():
    assert kc.kernels_by_role({"0": 1, "9": 2, "other": 0}, ["swa"]) == {"swa": 1, "other": 2}


def test_counts_round_trip_through_json():
    c = kc.LayerKernelCounts(9, ((0, 3), (2, 4)), 2, 1, (("cpp", 6), ("extern", 3)), note="x",
                             detail=((0, (("cpp", 3),)), (2, (("cpp", 3), ("extern_kernels.mm", 1))),
                                     ("other", (("extern_kernels.mm", 2),))))
    assert kc.LayerKernelCounts.from_dict(c.to_dict()) == c
    assert c.layer_dict() == {"0": 3, "2": 4, "other": 2}


# ------------------------------------------------------------------------------------------------ parsing
_WRAPPER = '''
from torch._inductor.async_compile import AsyncCompile
async_compile = AsyncCompile()
cpp_fused_add_0 = async_compile.cpp_pybinding(['float*'], r\'\'\'
extern "C" void kernel(float* p) { extern_kernels.mm(x); }
\'\'\')
triton_poi_fused_mul_1 = async_compile.triton('triton_poi_fused_mul_1', \'\'\'
def triton_poi_fused_mul_1(in_ptr0): pass
\'\'\', device_str='cuda')
async_compile.wait(globals())

class Runner:
    def partition_0(self, args):
        buf0, = args
        # [Provenance debug handles] triton_poi_fused_mul_1:2
        stream0 = get_raw_stream(0)
        triton_poi_fused_mul_1.run(buf0, 16, stream=stream0)
        return (buf0, )

    def call(self, args):
        arg0_1, arg1_1 = args
        buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [x, linear], Original ATen: [aten.mm]
        # [Provenance debug handles] extern_kernels.mm:1
        extern_kernels.mm(arg0_1, arg1_1, out=buf0)
        buf1 = torch.ops.inductor._alloc_from_pool(buf0, 0, torch.float32, (4, ), (1, ))
        # [Provenance debug handles] cpp_fused_add_0:3
        cpp_fused_add_0(buf0, buf1)
        # Topologically Sorted Source Nodes: [cumsum], Original ATen: [aten.cumsum]
        buf2 = torch.ops.aten.cumsum.default(buf1, -1)
        # [Provenance debug handles] torch.ops.aten._local_scalar_dense.default:4
        u0 = buf2.item()
        buf3 = torch.ops.dsv41.mhc_mixes.default(buf2, arg0_1)
        torch.ops._c10d_functional.wait_tensor.default(buf3)
        arg1_1.copy_(buf3)
        reinterpret_tensor(buf0, (2, 2), (2, 1), 0).zero_()
        (buf4, ) = self.partition_0([buf0])
        return (buf4, )

def get_args():
    return [rand_strided((4, ), (1, ), device='cpu', dtype=torch.float32)]

def benchmark_compiled_module(args, times=10, repeat=10):
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat, device='cpu')
'''
_PROVENANCE = {"cppCodeToPost": {"extern_kernels.mm:1": ["mm"], "triton_poi_fused_mul_1:2": ["mul"],
                                 "cpp_fused_add_0:3": ["add", "view"]},
               "postToPre": {"mm": ["linear"], "mul": ["mul"], "add": ["x"], "view": ["linear"]}}


def test_parse_finds_every_launch_in_program_order_and_nothing_else():
    got = [(x.kernel, x.kind) for x in kc.parse_launches(_WRAPPER, _PROVENANCE)]
    assert got == [("triton_poi_fused_mul_1", "triton"),  # partition_0 is defined first
                   ("extern_kernels.mm", "extern"), ("cpp_fused_add_0", "cpp"),
                   ("torch.ops.aten.cumsum.default", "op"), ("torch.ops.dsv41.mhc_mixes.default", "op"),
                   ("copy_", "buffer"), ("zero_", "buffer")]


_STREAM_WRAPPER = '''
def call(args):
    arg0_1, = args
    buf0 = torch.ops.dsv41.stream_fork.default([arg0_1], 0)
    buf1 = torch.ops.dsv41.mhc_expand.default(arg0_1)
    # [Provenance debug handles] torch.ops.dsv41.stream_launch.default:7
    buf2 = torch.ops.dsv41.stream_launch.default(buf0, [arg0_1], '{"steps": [{"op": "dsv41::mhc_mixes.default", "args": [], "kwargs": {}}, {"op": "aten::view.default", "args": [], "kwargs": {}}, {"op": "aten::mm.default", "args": [], "kwargs": {}}], "outputs": [[0, -1]]}', 0)
    buf3 = torch.ops.dsv41.stream_join.default(buf2, [arg0_1], '{"steps": [], "outputs": []}', 0)
    return (buf1, buf3)
'''


def test_side_stream_ops_count_the_kernels_their_program_launches():
    """Fork and join launch nothing; a launch launches each op of its program except views: the static count of a
    graph with side streams equals that of the same kernels on one stream (2026-11-30, h200: the report counted
    Reuse layers at 49 launches with streams and 41 without, the profiler 1,815 per step either way)."""
    got = [(x.kernel, x.handle) for x in kc.parse_launches(_STREAM_WRAPPER, None)]
    launch = "torch.ops.dsv41.stream_launch.default"
    assert got == [("torch.ops.dsv41.mhc_expand.default", None), (launch, f"{launch}:7"), (launch, f"{launch}:7")]


def test_parse_reads_provenance_handles_and_source_node_comments():
    by_kernel = {x.kernel: x for x in kc.parse_launches(_WRAPPER, _PROVENANCE)}
    assert by_kernel["triton_poi_fused_mul_1"].handle == "triton_poi_fused_mul_1:2"  # across the stream line
    mm = by_kernel["extern_kernels.mm"]
    assert mm.handle == "extern_kernels.mm:1" and mm.sources == ("mm",) and mm.sources_are_post_grad
    cs = by_kernel["torch.ops.aten.cumsum.default"]
    assert cs.handle is None and cs.sources == ("cumsum",) and not cs.sources_are_post_grad
    assert by_kernel["torch.ops.dsv41.mhc_mixes.default"].sources == ()
    assert by_kernel["torch.ops.dsv41.mhc_mixes.default"].handle is None  # the handle above names another call


def test_count_resolves_post_grad_names_through_the_dynamo_graph_without_the_post_grad_graph():
    dynamo = {"x": 0, "linear": 1, "mul": 1, "cumsum": 2}
    c = kc.count_launches(_WRAPPER, _PROVENANCE, None, dynamo)
    # mm -> linear (1); mul -> 1; cpp add/view -> x (0) and linear (1): the last one wins; cumsum -> 2 by its
    # Source Nodes comment; the dsv41 op, the copy and the fill carry no provenance -> other.
    assert c.total == 7 and c.layer_dict() == {"1": 3, "2": 1, "other": 3}
    assert c.no_provenance == 3 and dict(c.by_kind) == {"buffer": 2, "cpp": 1, "extern": 1, "op": 2, "triton": 1}
    assert c.to_dict()["detail"] == {"1": {"cpp": 1, "extern_kernels.mm": 1, "triton": 1},
                                     "2": {"torch.ops.aten.cumsum.default": 1},
                                     "other": {"copy_": 1, "torch.ops.dsv41.mhc_mixes.default": 1, "zero_": 1}}


def test_count_without_source_or_of_a_cpp_wrapper_is_zero_with_a_note():
    assert kc.count_launches(None).total == 0 and "no generated wrapper" in kc.count_launches(None).note
    assert "not Python" in kc.count_launches("void f() { }").note


def test_kept_counts_serve_a_compile_that_inductor_answered_from_its_cache(tmp_path):
    c = kc.LayerKernelCounts(5, ((0, 2), (1, 2)), 1)
    assert kc.graph_counts(kc.WrapperCapture(), True, str(tmp_path), "k") is None  # nothing compiled, nothing kept
    kc.save_counts(str(tmp_path), "k", c)
    assert kc.graph_counts(kc.WrapperCapture(), False, str(tmp_path), "k") == c
    assert kc.load_counts(str(tmp_path), "other-key") is None


def test_insert_node_carries_the_anchor_provenance_to_the_fused_node():
    """dsv41's fused nodes must inherit the module stack and from_node of the chain they replace, so Inductor's
    provenance (and the report) puts their launch in the anchor's layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.traceback import NodeSource

    from dsv41.passes.engine import insert_node

    g = fx.Graph()
    x = g.placeholder("x")
    anchor = g.call_function(torch.ops.aten.relu.default, (x,))
    g.output(anchor)
    with FakeTensorMode() as mode:
        x.meta["val"] = torch.empty(4)
        anchor.meta["val"] = torch.empty(4)
    src = fx.Graph()
    origin = src.call_function(torch.relu, (src.placeholder("y"),))
    anchor.meta.update(nn_module_stack={"k": ("L['self'].layers.6.ffn", nn.Module)}, stack_trace="File ...",
                       from_node=[NodeSource(origin, "test")])
    new = insert_node(g, anchor, torch.ops.aten.neg.default, (x,), like=anchor)
    assert new.meta["from_node"] is anchor.meta["from_node"]
    assert new.meta["nn_module_stack"] == anchor.meta["nn_module_stack"]
    assert kc.node_layers(g)[new.name][0] == 6
    del mode


# ------------------------------------------------------------------------------------------------ a real compile
_LIB = torch.library.Library("kctest", "DEF")
_LIB.define("tag(Tensor x, int layer) -> Tensor")
torch.library.impl(_LIB, "tag", "CompositeExplicitAutograd")(lambda x, layer: x.clone())
torch.library.register_fake("kctest::tag", lib=_LIB)(lambda x, layer: torch.empty_like(x))


class _Gate(nn.Module):
    """Kind A: projection, ReLU, gain, residual."""

    def __init__(self, width: int, index: int):
        super().__init__()
        self.index = index
        self.mix = nn.Linear(width, width, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, h):
        t = torch.ops.kctest.tag(h, self.index)
        return h + torch.relu(self.mix(t)) * self.gain


class _Scan(nn.Module):
    """Kind B: running sum over features, sigmoid gate, then a norm."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, h):
        t = torch.ops.kctest.tag(h, self.index)
        g = torch.sigmoid(torch.cumsum(t, dim=-1))
        return (h * g) / (h.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()


class _TwoKinds(nn.Module):
    def __init__(self, vocab: int = 40, width: int = 16):
        super().__init__()
        self.table = nn.Embedding(vocab, width)
        self.stack = nn.ModuleList([_Gate(width, 0), _Scan(1), _Gate(width, 2), _Scan(3)])
        self.readout = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.table(ids)
        for blk in self.stack:
            h = blk(h)
        return self.readout(h)


_LAUNCH_LINE = re.compile(r"^\s+(?:[\w, ()]+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+)\(")
_TAG_LINE = re.compile(r"torch\.ops\.kctest\.tag\.default\(\w+, (\d+)\)")


@pytest.fixture(scope="module")
def compiled_two_kinds(tmp_path_factory):
    """`_TwoKinds` through backend="dsv41" on CPU, once, with an empty Inductor cache dir of its own (so Inductor
    really compiles); the wrapper and provenance are kept through a recording `WrapperCapture` put in the
    compiler's place. Returns the report, the capture, and a function that compiles the model again."""
    from dsv41.compiler import pipeline

    captures = []

    class Recording(kc.WrapperCapture):
        def __init__(self):
            super().__init__()
            captures.append(self)

    torch.manual_seed(0)
    model = _TwoKinds().eval()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    cache = str(tmp_path_factory.mktemp("inductor_cache"))

    def compile_once():
        import dsv41
        with pytest.MonkeyPatch.context() as mp, torch.no_grad():
            mp.setattr(pipeline, "WrapperCapture", Recording)
            mp.setenv("TORCHINDUCTOR_CACHE_DIR", cache)
            torch._dynamo.reset()
            fast = torch.compile(model, backend="dsv41", fullgraph=True)
            out = fast(ids)
            torch.testing.assert_close(out, model(ids))
        return dsv41.last_report()

    report = compile_once()
    return {"report": report, "capture": captures[-1], "again": compile_once, "cache": cache}


def _launch_lines(source: str) -> list[str]:
    body = source.split("def call(self, args):", 1)[1].split("\ndef ", 1)[0]
    return [ln for ln in body.splitlines() if _LAUNCH_LINE.match(ln)]


def test_per_layer_counts_sum_to_the_launches_in_the_wrapper(compiled_two_kinds):
    cap = compiled_two_kinds["capture"]
    assert len(cap.sources) == 1
    lines = _launch_lines(cap.sources[0])
    k = compiled_two_kinds["report"].to_dict()["kernels_by_layer"]
    assert k["total"] == len(lines) > 0
    assert sum(k["by_layer"].values()) == k["total"]
    assert set(k["by_layer"]) == {"0", "1", "2", "3", "other"}
    assert all(k["by_layer"][str(i)] >= 2 for i in range(4))  # the marker plus at least one kernel of its own
    assert k["by_layer"]["other"] >= 1  # the readout matmul (the embedding gather fuses into layer 0's first kernel)
    assert k["no_provenance"] == 0
    assert {layer: sum(what.values()) for layer, what in k["detail"].items()} == k["by_layer"]
    for i in range(4):
        assert k["detail"][str(i)]["torch.ops.kctest.tag.default"] == 1


def test_each_launch_is_attributed_to_the_layer_that_issued_it(compiled_two_kinds):
    cap = compiled_two_kinds["capture"]
    src, prov, gm = cap.sources[0], cap.provenance[0], cap.graphs[0]
    post = kc.node_layers(gm.graph, cap.dynamo_layers)
    lines = src.splitlines()
    tags = 0
    for launch in kc.parse_launches(src, prov):
        layer = kc._launch_layer(launch, post, cap.dynamo_layers)
        m = _TAG_LINE.search(lines[launch.line - 1])
        if m:
            tags += 1
            assert layer == int(m.group(1)), lines[launch.line - 1]
        if launch.kernel == "torch.ops.aten.cumsum.default":
            assert layer in (1, 3)
        if launch.kernel.startswith("extern_kernels."):
            assert layer in (0, 2, None)  # the Gate projections, or the readout (no layer)
    assert tags == 4


def test_every_generated_kernel_names_its_source_lines_and_ops(compiled_two_kinds):
    """Each cpp kernel of the wrapper has origins: a line of this file's model code and its ATen ops; the
    Scan kernels point at the sigmoid / norm lines, and the origins survive the JSON round trip and reach the
    report's merged `kernel_origins`."""
    cap = compiled_two_kinds["capture"]
    src, prov, gm = cap.sources[0], cap.provenance[0], cap.graphs[0]
    launches = kc.parse_launches(src, prov)
    generated = {x.kernel for x in launches if x.kind == "cpp"}
    origins = dict(kc.kernel_origins(launches, gm.graph))
    assert generated and set(origins) == generated
    for name, found in origins.items():
        assert any(o.startswith("test_kernel_counts.py:") for o in found), (name, found)
        assert found[-1].startswith("ops: ") and "aten." in found[-1], (name, found)
    text = " ".join(o for found in origins.values() for o in found)
    assert "torch.sigmoid(torch.cumsum(t, dim=-1))" in text and "torch.relu(self.mix(t))" in text
    counts = compiled_two_kinds["report"].graphs[0].layer_kernels
    assert kc.LayerKernelCounts.from_dict(counts.to_dict()).origins == counts.origins
    assert compiled_two_kinds["report"].kernel_origins() == {k: list(v) for k, v in counts.origins}


def test_bench_rows_carry_the_origin_of_each_costly_kernel():
    from dsv41 import bench
    top = [{"name": "triton_poi_fused__to_copy_16", "count": 32, "total_us": 1007.2},
           {"name": "_quant_gemv_kernel", "count": 290, "total_us": 3850.1}]
    out = bench._with_origins(top, {"triton_poi_fused__to_copy_16": ["model.py:300 (final_logits): x", "ops: y"]})
    assert out[0]["origin"][0].startswith("model.py:300") and "origin" not in out[1]


def test_a_cache_hit_attributes_launches_the_same_way_through_the_dynamo_graph(compiled_two_kinds):
    cap = compiled_two_kinds["capture"]
    direct = kc.count_captured(cap)
    via_dynamo = kc.count_captured(cap, from_cache=True)
    assert via_dynamo.layer_dict() == direct.layer_dict()


def test_a_recompile_served_from_inductors_caches_keeps_the_launch_counts(compiled_two_kinds):
    # The first compile (an empty cache dir) ran the passes with Inductor's caches on, so it filled them: the next
    # compile is served from them, without post-grad passes or a post-grad graph to read layers from.
    first = compiled_two_kinds["report"]
    assert not first.graphs[0].from_cache
    hit = compiled_two_kinds["again"]()
    assert hit.graphs[0].from_cache
    want, got = first.to_dict()["kernels_by_layer"], hit.to_dict()["kernels_by_layer"]
    assert got["by_layer"] == want["by_layer"] and got["total"] == want["total"] > 0


def test_records_without_a_current_launch_count_are_compiled_again(compiled_two_kinds):
    """A warm cache whose pass records outlive the kept launch count (kernel_counts.py changed since, so the
    count's file name differs) must not be served from Inductor's caches: that hit skips the compile the count is
    read from and the report lost every per-layer count (CI with a warm cache, 2026-11-30)."""
    import glob

    first = compiled_two_kinds["again"]()  # records and count kept (a hit, or a compile if run alone)
    want = first.to_dict()["kernels_by_layer"]
    assert want["total"] > 0
    kept = glob.glob(os.path.join(compiled_two_kinds["cache"], "dsv41_records", "*.kernels.*.json"))
    assert kept
    for path in kept:
        os.remove(path)
    again = compiled_two_kinds["again"]()
    assert not again.graphs[0].from_cache
    got = again.to_dict()["kernels_by_layer"]
    # Same launches and layers; a kernel fusing the embedding gather into layer 0 may go to either side of that
    # boundary in a later compile of the same model (Inductor names its origins differently).
    assert got["total"] == want["total"] and set(got["by_layer"]) == set(want["by_layer"])
    assert sum(got["by_layer"].values()) == got["total"]
    hit = compiled_two_kinds["again"]()
    assert hit.graphs[0].from_cache and hit.to_dict()["kernels_by_layer"]["total"] == want["total"]


def test_a_cache_hit_without_pass_records_compiles_again_for_a_whole_report(compiled_two_kinds):
    """Inductor's caches hold the graph but dsv41's records of it are gone: the hit would leave the report without
    matches or counts, so the graph is compiled again with the caches off (the passes run)."""
    import shutil

    want = compiled_two_kinds["report"].to_dict()
    shutil.rmtree(os.path.join(compiled_two_kinds["cache"], "dsv41_records"))
    again = compiled_two_kinds["again"]()
    assert not again.graphs[0].from_cache
    got = again.to_dict()
    assert got["kernels_by_layer"]["total"] == want["kernels_by_layer"]["total"] > 0
    fams = [{f: (v["enabled"], v["matches"], v["note"]) for f, v in d["families"].items()} for d in (got, want)]
    assert fams[0] == fams[1] and not any("no post-grad graph" in note for _, _, note in fams[0].values())
    assert os.listdir(os.path.join(compiled_two_kinds["cache"], "dsv41_records"))


def test_roles_from_the_caller_give_per_role_counts_in_dict_table_and_html(compiled_two_kinds):
    from dsv41.compiler.html import render_html

    rep = compiled_two_kinds["report"]
    rep.set_layer_roles(["gate", "scan", "gate", "scan"])
    try:
        d = rep.to_dict()
        by_layer, by_role = d["kernels_by_layer"]["by_layer"], d["kernels_by_role"]
        assert by_role["gate"] == by_layer["0"] + by_layer["2"]
        assert by_role["scan"] == by_layer["1"] + by_layer["3"]
        assert sum(v for r, v in by_role.items() if r != "per_layer") == d["kernels_by_layer"]["total"]
        assert by_role["per_layer"]["scan"]["layers"] == 2
        text = str(rep)
        assert "launches per call by layer role" in text and "scan" in text
        page = render_html(d)
        assert "Kernel launches per layer" in page and "By layer role" in page
    finally:
        rep.set_layer_roles(None)


# ------------------------------------------------------------------------------------------------ tiny (fixture)
def test_tiny_every_role_has_launches_and_roles_sum_to_the_total(tiny_dsv41):
    from dsv41.model import ModelConfig

    k = tiny_dsv41["report"]["kernels_by_layer"]
    roles = ModelConfig.preset("tiny").roles
    assert k["total"] and sum(k["by_layer"].values()) == k["total"]
    by_role = kc.kernels_by_role(k["by_layer"], roles)
    assert sum(by_role.values()) == k["total"]
    for role in set(roles):
        assert by_role[role] > 0, (role, by_role)
    assert all(k["by_layer"].get(str(i), 0) > 0 for i in range(len(roles))), k["by_layer"]
    assert k["no_provenance"] == 0, k


# ------------------------------------------------------------------------------------------------ dsv41 run --json
def test_run_json_has_launches_per_step_by_role_of_the_model_config(tmp_path, monkeypatch):
    """`dsv41 run --json`: the report of the compile gets the model's layer roles; the compile itself is replaced
    by eager execution and the report by one with known per-layer counts (tiny has 8 layers)."""
    import json

    import dsv41
    import dsv41.cli as cli
    import dsv41.harness as harness
    from dsv41.compiler.report import FusionReport, GraphReport
    from dsv41.model import ModelConfig
    from dsv41.passes.records import PassRecord

    rep = FusionReport()
    counts = kc.LayerKernelCounts(8 * 10 + 3, tuple((i, 10) for i in range(8)), 3)
    rep.add_graph(GraphReport(0, "0/0", (PassRecord("dispatch", True),), layer_kernels=counts))
    monkeypatch.setattr(harness, "compile_model", lambda model, backend, options=None, **kw: model)
    monkeypatch.setattr(dsv41, "last_report", lambda: rep)
    out = tmp_path / "run.json"
    with torch.no_grad():
        assert cli.main(["run", "--device", "cpu", "--prompt-len", "8", "--new-tokens", "2", "--no-check",
                         "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    roles = ModelConfig.preset("tiny").roles
    want = {role: 10 * roles.count(role) for role in dict.fromkeys(roles)}
    by_role = r["kernels_per_step_by_role"]
    assert {k: v for k, v in by_role.items() if k != "per_layer"} == {**want, "other": 3}
    assert r["report"]["layer_roles"] == roles
