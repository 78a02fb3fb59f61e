"""The `dsv41` backend: registration by entry point, option validation, pass uuid, config isolation.

Compiles here are tiny (one Linear) and CPU-only; the fresh-interpreter test runs `python -c` in a subprocess
that never imports dsv41 before `torch.compile(..., backend="dsv41")`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsv41.compiler.options import OPTION_KEYS, parse_options
from dsv41.passes import FAMILY_ORDER, PassManager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_backend_resolves_by_name_in_a_fresh_interpreter_and_matches_eager():
    script = textwrap.dedent("""
        import sys, torch
        assert "dsv41" not in sys.modules
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                g = torch.Generator().manual_seed(0)
                self.w = torch.nn.Parameter(torch.randn(16, 32, generator=g), requires_grad=False)
            def forward(self, x):
                return torch.relu(x @ self.w.t()) * 2 - x.sum(-1, keepdim=True)
        m = M()
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            y = torch.compile(m, backend="dsv41")(x)
            ref = m(x).double()
        print("MAXERR", float((y.double() - ref).abs().max() / ref.abs().max()))
        import dsv41
        print("GRAPHS", len(dsv41.last_report().graphs))
    """)
    env = dict(os.environ, DSV41_REPORT="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("MAXERR", "GRAPHS")))
    assert float(lines["MAXERR"]) <= 1e-6
    assert lines["GRAPHS"].strip() == "1"
    assert "dsv41 fusion report" in proc.stdout  # DSV41_REPORT=1 printed the report


def test_tiny_in_a_fresh_interpreter_decodes_like_eager_over_32_steps(tiny_dsv41):
    # tests/fresh_tiny_dsv41.py: `tiny` (float32, checkpoint weights) compiled with fullgraph=True in a process
    # that never imported dsv41's compiler before torch.compile found the backend through its entry point.
    r = tiny_dsv41
    assert r["compiler_imported_before_compile"] is False and r["compiler_imported_after_compile"] is True
    assert len(r["eager_tokens"][0]) == 32
    assert r["compiled_tokens"] == r["eager_tokens"]
    assert r["teacher_forced_argmax_equal"]
    # Stated tolerance: 1e-4 of the largest |logit| per step (measured 3.6e-7: FP32 rounding through 8 layers).
    assert r["max_rel_logit_error"] < 1e-4
    # One graph for 32 decode positions + the teacher-forced pass: no graph break, no recompile.
    assert r["unique_graphs"] == 1 and len(r["report"]["graphs"]) == 1


def test_unknown_option_is_rejected_naming_it_and_the_valid_keys():
    with pytest.raises(ValueError) as e:
        parse_options({"report": True, "reportt": True})
    msg = str(e.value)
    assert "'reportt'" in msg
    for key in OPTION_KEYS:
        assert key in msg


def test_unknown_option_through_torch_compile_surfaces_the_value_error():
    def f(x):
        return x * 2

    with pytest.raises(Exception) as e:
        torch.compile(f, backend="dsv41", options={"cuda_graph": True})(torch.ones(3))
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, ValueError) and "'cuda_graph'" in str(inner)


def test_option_values_are_type_checked_by_key():
    with pytest.raises(TypeError, match="count_kernels"):
        parse_options({"count_kernels": "yes"})
    with pytest.raises(TypeError, match="disable"):
        parse_options({"disable": "dispatch"})
    with pytest.raises(ValueError, match="dispatchh") as e:
        parse_options({"disable": ["dispatchh"]})
    assert all(f in str(e.value) for f in FAMILY_ORDER)
    with pytest.raises(TypeError, match="report"):
        parse_options({"report": 3})
    with pytest.raises(TypeError, match="dict"):
        parse_options([("report", True)])


def test_report_option_and_environment_variable():
    assert parse_options(None, environ={}).print_report is False
    assert parse_options({"report": True}, environ={}).print_report is True
    assert parse_options({}, environ={"DSV41_REPORT": "1"}).print_report is True
    assert parse_options({}, environ={"DSV41_REPORT": "0"}).print_report is False
    opts = parse_options({}, environ={"DSV41_REPORT": "/tmp/r.json"})
    assert opts.report_path == "/tmp/r.json" and not opts.print_report
    assert parse_options({"report": "a.json", "disable": ["dispatch"]}, environ={}).disable == frozenset({"dispatch"})


class _NamedPass:
    def __init__(self, uuid):
        self._uuid = uuid

    def __call__(self, graph):
        pass

    def uuid(self):
        return self._uuid


def test_pass_uuid_covers_options_and_chained_passes():
    base = PassManager().uuid()
    assert base == PassManager().uuid() and len(base) == 64
    others = {PassManager(disabled=["dispatch"]).uuid(), PassManager(disabled=["rope_fp4"]).uuid(),
              PassManager(debug=True).uuid(), PassManager(chained=_NamedPass("a")).uuid(),
              PassManager(chained=_NamedPass("b")).uuid()}
    assert base not in others and len(others) == 5
    assert PassManager(chained=_NamedPass(None)).uuid() is None  # unknown chained pass: no caching
    with pytest.raises(ValueError, match="nope"):
        PassManager(disabled=["nope"])


class _FP8Linear(nn.Module):
    """A dequantise -> matmul chain written by hand (block-FP8 codes, UE8M0 exponents)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 64, generator=g) / 8
        self.codes = nn.Parameter(w.to(torch.float8_e4m3fn).view(torch.uint8), requires_grad=False)
        self.exps = nn.Parameter(torch.full((1, 2), 127, dtype=torch.uint8), requires_grad=False)

    def forward(self, x):
        s = torch.exp2(self.exps.float() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)
        return F.linear(x, self.codes.view(torch.float8_e4m3fn).float() * s)


class _Recorder:
    """A user's own post-grad pass (installed by the test, as a user would). Its uuid is new in every process so
    no cache from an earlier test run can skip it."""

    def __init__(self):
        import uuid
        self.calls = 0
        self.token = uuid.uuid4().hex

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return f"user-pass-{self.token}"


def test_dsv41_compile_leaves_global_config_and_plain_compile_untouched():
    import dsv41
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    keys = ("post_grad_custom_post_pass", "post_grad_custom_pre_pass", "cpp.enable_kernel_profile", "fx_graph_cache")
    before = {k: config.get_config_copy()[k] for k in keys}
    m = _FP8Linear()
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.compile(m, backend="dsv41", options={"count_kernels": True})(x)
    assert dsv41.last_report().to_dict()["families"]["dispatch"]["matches"] == 1
    assert {k: config.get_config_copy()[k] for k in keys} == before

    torch._dynamo.reset()
    with torch.no_grad():
        y, codes = run_and_get_code(torch.compile(m, backend="inductor"), x)
        ref = m(x)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert not any("dsv41" in c for c in codes)


def test_a_users_post_grad_pass_still_runs_inside_a_dsv41_compile():
    import dsv41
    from torch._inductor import config

    user = _Recorder()
    torch._dynamo.reset()
    with config.patch(post_grad_custom_post_pass=user), torch.no_grad():
        torch.compile(_FP8Linear(), backend="dsv41")(torch.randn(3, 64))
        assert config.post_grad_custom_post_pass is user
    assert user.calls == 1
    assert dsv41.last_report().to_dict()["families"]["dispatch"]["matches"] == 1


def _detours(x8, xb, xf):
    a = x8.view(torch.uint8).view(torch.float8_e4m3fn).float()  # dtype_view_roundtrip
    b = x8.view(torch.uint8).reshape(4, 8).view(torch.float8_e4m3fn).float()  # dtype_view_reshape
    c = xb.float().to(torch.bfloat16)  # exact_cast_roundtrip (bf16 -> fp32 is exact)
    d = xf.reshape(4, 8).reshape(32)  # reshape_chain
    e = (xf + 1).clone()  # contiguous_clone
    g = xf.to(torch.bfloat16).float()  # fp32 -> bf16 rounds: NOT a no-op, must stay
    return a.sum() + b.sum() + c.float().sum() + d.sum() + e.sum() + g.sum()


def test_normalize_removes_value_preserving_detours_only():
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsv41.passes.normalize import NormalizeFamily
    from dsv41.passes.testing import ops_after

    x8 = torch.randn(32).to(torch.float8_e4m3fn)
    xb = torch.randn(32, dtype=torch.bfloat16)
    xf = torch.randn(32)
    gm = make_fx(_detours, decomposition_table=select_decomp_table(), tracing_mode="fake")(x8, xb, xf)
    rec = NormalizeFamily().run(gm)
    gm.recompile()
    rewrites = [m.pattern for m in rec.matches if m.pattern != "alias"]  # make_fx adds aliases around views
    assert sorted(rewrites) == ["contiguous_clone", "dtype_view_reshape", "dtype_view_roundtrip",
                                "exact_cast_roundtrip", "reshape_chain"]
    ops = ops_after(gm)
    assert ops["aten.view.dtype"] == 0 and ops["aten.clone"] == 0
    # the lossy fp32 -> bf16 -> fp32 round trip is kept: the only cast to bf16 left
    casts = [n.args[1] for n in gm.graph.nodes if n.target == torch.ops.prims.convert_element_type.default]
    assert casts.count(torch.bfloat16) == 1, gm.code
    assert torch.equal(gm(x8, xb, xf), _detours(x8, xb, xf))


def test_families_run_in_the_documented_order():
    import dsv41

    assert FAMILY_ORDER == ("normalize", "c2_compressor", "rope_fp4", "mhc", "engram", "mhc_fold", "moe", "sparse_attention", "indexer", "small_ops", "upcast_linear", "dispatch", "grouped_pair", "sibling_gemv", "half_gemv", "rope_kv", "gqa_attention", "rope_gqa", "row_argmax")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_FP8Linear(), backend="dsv41")(torch.randn(1, 64))
    assert [r.family for r in dsv41.last_report().graphs[0].records] == list(FAMILY_ORDER)


def test_cuda_graph_and_pdl_options_default_to_on_for_cuda_only():
    o = parse_options({})
    assert (o.use_cuda_graphs(True), o.use_pdl(True)) == (True, True)
    assert (o.use_cuda_graphs(False), o.use_pdl(False)) == (False, False)
    o = parse_options({"cuda_graphs": False})
    assert (o.use_cuda_graphs(True), o.use_pdl(True)) == (False, False)
    o = parse_options({"cuda_graphs": False, "pdl": True})
    assert (o.use_cuda_graphs(True), o.use_pdl(True), o.use_pdl(False)) == (False, True, False)
    assert o.to_dict()["cuda_graphs"] is False and o.to_dict()["pdl"] is True
    with pytest.raises(TypeError, match="'cuda_graphs'"):
        parse_options({"cuda_graphs": "yes"})


def test_cpu_compile_ignores_cuda_graphs_and_leaves_pdl_off():
    import dsv41
    from dsv41.kernels import pdl_enabled

    torch._dynamo.reset()
    x = torch.randn(3, 8)
    with torch.no_grad():
        y = torch.compile(lambda t: torch.relu(t) * 2, backend="dsv41", options={"cuda_graphs": True, "pdl": True})(x)
    assert torch.equal(y, torch.relu(x) * 2)
    assert dsv41.last_report().options.to_dict()["cuda_graphs"] is True
    assert not pdl_enabled()


def test_pdl_switch_is_set_per_compiled_graph_call_and_restored():
    """Each compiled CUDA graph runs with its own compile's PDL setting (a `dsv41[pdl=false]` benchmark row next
    to a PDL one must not inherit it); the process setting is restored after the call, also when it raises, and
    Inductor's calling-convention attributes survive the wrapper."""
    from dsv41.compiler.pipeline import _graph_call, record_graph_calls
    from dsv41.kernels import pdl_enabled, set_pdl

    seen = []

    def graph(args):
        seen.append(pdl_enabled())
        if args == "boom":
            raise RuntimeError("boom")
        return args

    graph._boxed_call = True
    on, off, cpu = _graph_call(graph, "rep", 3, True), _graph_call(graph, "rep", 4, False), _graph_call(graph, "rep", 5, None)
    assert on._boxed_call is True
    set_pdl(False)
    with record_graph_calls() as log:
        assert on([1]) == [1] and seen[-1] is True and not pdl_enabled()
        assert cpu([0]) == [0] and seen[-1] is False  # None: the process setting is left alone
    assert log == [("rep", 3), ("rep", 5)]
    assert on([1]) == [1] and log == [("rep", 3), ("rep", 5)]  # nothing noted outside the block
    set_pdl(True)
    try:
        assert off([2]) == [2] and seen[-1] is False and pdl_enabled()
        with pytest.raises(RuntimeError, match="boom"):
            off("boom")
        assert pdl_enabled()
    finally:
        set_pdl(False)
