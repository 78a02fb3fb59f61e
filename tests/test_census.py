"""Tests of the launch census (dsv41/kernels/census.py) and its use in the static launch count
(dsv41/compiler/kernel_counts.py `count_launches(op_census=...)`).

References, never the census itself:
- the H200 profiler (bench/results/2026-11-30_h200_s13/toggles_h200.json, `h200` decode, one step): 38 calls of
  `_sparse_fp4_attention_kernel` and 38 of `_sparse_attention_combine_kernel`, so one attention call at the h200
  decode shapes launches two kernels;
- real runs of the same host code under the Triton interpreter, whose launches are counted by wrapping
  `InterpretedFunction.run` and whose ATen kernels are counted by a dispatch mode written here;
- hand-derived plans (`attention_plan`'s documented heuristic: a split only while rows x head blocks < 256).
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from interp_harness import InterpreterHarness

import dsv41.kernels  # noqa: F401  (registers the ops)
from dsv41.kernels import _common
from dsv41.kernels.census import CensusError, census, meta_like, op_launches, program_launches

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _attention_args(b, t, h, d, s, n, k, r=64, q_transposed=False, dtype=torch.bfloat16, gen=None):
    """Valid `sparse_fp4_attention` arguments (random codes, indices in [-1, n))."""
    g = gen or torch.Generator().manual_seed(0)
    if q_transposed:
        q = torch.randn(b, t, d, h, generator=g).to(dtype).transpose(-1, -2)
    else:
        q = torch.randn(b, t, h, d, generator=g).to(dtype)
    u8 = lambda *shape: torch.randint(0, 120, shape, dtype=torch.uint8, generator=g)  # noqa: E731
    return [q, u8(b, s, d), torch.full((b, s, d // 32), 120, dtype=torch.uint8), torch.rand(b, t, s, generator=g) > 0.3,
            u8(b, n, d // 2), torch.full((b, n, d // 16), 56, dtype=torch.uint8),
            torch.randint(-1, n, (b, t, k), generator=g), torch.randn(h, generator=g),
            torch.randn(b, t, r // 2, generator=g), torch.randn(b, t, r // 2, generator=g), d ** -0.5]


# ------------------------------------------------------------------------------------------------ census
def test_attention_at_h200_decode_shapes_launches_the_kernel_and_its_combine():
    # h200 decode: 64 heads of 512, a 129-row window, top-512 of the bank. Profiler: 38 + 38 launches for 38 calls.
    args = _attention_args(1, 1, 64, 512, 129, 1024, 512)
    assert op_launches("dsv41::sparse_fp4_attention", args) == 2
    assert op_launches(torch.ops.dsv41.sparse_fp4_attention.default, args) == 2


def test_attention_with_enough_rows_to_fill_the_gpu_launches_no_combine():
    # 256 query rows x 4 head blocks >= 256 programs: no split, so no combine kernel.
    assert op_launches("dsv41::sparse_fp4_attention", _attention_args(1, 256, 64, 512, 384, 1024, 512)) == 1


def test_a_query_without_a_unit_last_stride_costs_one_layout_copy():
    args = _attention_args(1, 1, 64, 512, 129, 1024, 512, q_transposed=True)
    assert op_launches("dsv41::sparse_fp4_attention", args) == 3


def test_indexer_topk_over_long_rows_selects_in_two_launches():
    # One row of 64k scores is cut into chunks (topk_plan: at least 8,192 each) and a second launch merges them.
    short = torch.empty(1, 1, 4096)
    long = torch.empty(1, 1, 65536)
    assert op_launches("dsv41::indexer_topk", [short, 512, None, 1, 0]) == 1
    assert op_launches("dsv41::indexer_topk", [long, 512, None, 1, 0]) == 2


def test_split_k_gemv_is_one_launch_and_its_counters_are_not_a_fill():
    # Split-K GEMVs merge through persistent arrival counters: no zeroing kernel per call.
    from dsv41.kernels.quant_gemv import gemv_plan
    x = torch.empty(1, 5120, dtype=torch.bfloat16)
    w = torch.empty(1280, 5120, dtype=torch.uint8)
    s = torch.empty(40, 160, dtype=torch.uint8)
    assert gemv_plan(1, 1280, 5120, False)["grid"][1] > 1  # the shape does split K
    assert op_launches("dsv41::linear_fp8_block", [x, w, s, True]) == 1


def test_grouped_fp4_gemv_counts_its_activation_preparation_launch():
    # The default grouped expert GEMV on bf16 x at the h200 shapes (dsv41/kernels/grouped_words.py): FP8
    # quantisation of x first (one launch), then the GEMV; without act_quant the GEMV alone; fp16 x takes the tile
    # kernel (one launch).
    x = torch.empty(1, 5120, dtype=torch.bfloat16)
    w = torch.empty(96, 2304, 2560, dtype=torch.uint8)
    s = torch.empty(96, 2304, 160, dtype=torch.uint8)
    idx = torch.empty(1, 6, dtype=torch.int64)
    assert op_launches("dsv41::grouped_linear_fp4", [x, w, s, idx, True]) == 2
    assert op_launches("dsv41::grouped_linear_fp4", [x, w, s, idx, False]) == 1
    assert op_launches("dsv41::grouped_linear_fp4", [x.half(), w, s, idx, True]) == 1
    # The `small` preset's w1 (4 of 32 experts, [512, 1024]): below WORDS_MIN_CODES_ACT_QUANT, the tile kernel.
    xs, ws, ss = torch.empty(1, 1024, dtype=torch.bfloat16), torch.empty(32, 512, 512, dtype=torch.uint8), \
        torch.empty(32, 512, 32, dtype=torch.uint8)
    assert op_launches("dsv41::grouped_linear_fp4", [xs, ws, ss, idx[:, :4], True]) == 1
    # The w1 / w3 pair (grouped_pair): one quantisation and one fragment launch for both GEMVs at h200
    # (grouped_gemv.PAIR_ONE_LAUNCH); two tile launches at `small`.
    assert op_launches("dsv41::grouped_linear_fp4_pair", [x, w, s, w, s, idx, True]) == 2
    assert op_launches("dsv41::grouped_linear_fp4_pair", [xs, ws, ss, ws, ss, idx[:, :4], True]) == 2


def test_sibling_gemvs_are_one_gemv_launch_at_one_x_row():
    # dsv41::linear_fp8_block_multi (sibling_gemv): the h200 wq_a + wkv and shared w1 + w3 as one activation launch
    # and one fragment GEMV launch at decode (gemv_multi.frag_launch_applies); without act_quant one tile launch;
    # with several x rows the separate GEMVs (each its own launch).
    for widths in ((1280, 512), (2304, 2304)):
        ws = [torch.empty(n, 5120, dtype=torch.uint8) for n in widths]
        ss = [torch.empty(n // 32, 160, dtype=torch.uint8) for n in widths]
        x = torch.empty(1, 5120, dtype=torch.bfloat16)
        assert op_launches("dsv41::linear_fp8_block_multi", [x, ws, ss, True]) == 2
        assert op_launches("dsv41::linear_fp8_block_multi", [x, ws, ss, False]) == 1
        assert op_launches("dsv41::linear_fp8_block_multi", [torch.empty(3, 5120, dtype=torch.bfloat16), ws, ss,
                                                             True]) == 2


def test_census_reads_shapes_only_and_launches_nothing():
    from triton.runtime import jit
    before = jit.KernelInterface.__dict__["__getitem__"]
    args = _attention_args(1, 1, 16, 64, 40, 64, 16)
    assert op_launches("dsv41::sparse_fp4_attention", args) == 2
    assert jit.KernelInterface.__dict__["__getitem__"] is before
    assert not _common.census_active()


def test_the_launch_proxy_is_restored_when_the_host_code_raises():
    from triton.runtime import jit
    before = jit.KernelInterface.__dict__["__getitem__"]
    bad = _attention_args(1, 1, 16, 64, 40, 64, 16)
    bad[7] = torch.randn(15)  # sink of the wrong length: the host check raises ValueError
    with pytest.raises(ValueError, match="sink"):
        op_launches("dsv41::sparse_fp4_attention", bad)
    assert jit.KernelInterface.__dict__["__getitem__"] is before
    assert not _common.census_active()


def test_host_code_that_reads_tensor_data_is_a_census_error():
    def reads_data(x):
        return int(x.sum().item())
    with pytest.raises(CensusError, match="reads tensor data"):
        census(reads_data, torch.ones(3))


def test_aten_kernels_count_but_views_and_allocations_do_not():
    def host(x):
        y = x.view(4, 2).t()                     # views: nothing
        z = torch.empty(3, device=x.device)      # allocation: nothing
        w = y.contiguous()                       # a copy kernel
        torch.zeros(5, device=x.device)          # a fill kernel
        torch.zeros(0, device=x.device)          # empty: nothing
        v = x.view(2, 4)
        v.unsqueeze_(0)                          # in-place metadata: nothing
        x.view(2, 4).t_()
        return w, z
    assert census(host, torch.ones(8)) == 2


def test_meta_like_keeps_shape_strides_offset_and_dtype():
    base = torch.arange(40, dtype=torch.int16).view(5, 8)
    t = base[1:, 2:].t()
    m = meta_like(t)
    assert (m.device.type, m.dtype, m.shape, m.stride(), m.storage_offset()) == \
        ("meta", torch.int16, t.shape, t.stride(), t.storage_offset())


def test_every_dsv41_kernel_op_has_a_cuda_host_for_the_census():
    names = set()
    for path in glob.glob(os.path.join(_REPO, "dsv41", "kernels", "*.py")):
        names |= set(re.findall(r'custom_op\("(dsv41::\w+)"', open(path).read()))
    kernel_ops = {n for n in names if not n.startswith("dsv41::stream_")}
    assert kernel_ops and kernel_ops == set(_common.CUDA_HOSTS)


def test_a_side_stream_program_counts_each_step_and_its_restride_copies():
    import json
    args = _attention_args(1, 1, 64, 512, 129, 1024, 512)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    step = {"op": "dsv41::sparse_fp4_attention.default", "args": [{"t": i} for i in range(len(tensors))]
            + [args[-1]], "kwargs": {}}
    program = json.dumps({"steps": [step, step], "outputs": [[1, -1]]})
    assert program_launches(tensors, program) == 4
    # A traced stride the tensor does not have: the program copies q into it first (one kernel), and that layout
    # (head dim not innermost) makes the attention host copy q again (one more).
    q = tensors[0]
    program = json.dumps({"steps": [step], "outputs": [[0, -1]], "stride": {"0": [q.stride(0), q.stride(1), 1, 64]}})
    assert program_launches(tensors, program) == 4
    assert op_launches("dsv41::stream_launch", [None, tensors, program, 0]) == 4
    assert op_launches("dsv41::stream_fork", [tensors, 0]) == 0


def test_a_layout_copy_inside_a_side_stream_program_is_counted():
    # Below the autograd key `contiguous` reaches the counting mode whole; its copy must still count.
    import json
    args = _attention_args(1, 1, 64, 512, 129, 1024, 512, q_transposed=True)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    step = {"op": "dsv41::sparse_fp4_attention.default", "args": [{"t": i} for i in range(len(tensors))]
            + [args[-1]], "kwargs": {}}
    program = json.dumps({"steps": [step], "outputs": [[0, -1]]})
    assert program_launches(tensors, program) == 3
    assert census(torch.ops.dsv41.sparse_fp4_attention.default, *args) == 3
    assert op_launches("dsv41::stream_launch", [], {"token": None, "tensors": tensors, "program": program,
                                                    "slot": 0}) == 3


def test_a_symbolic_size_is_a_census_error_and_adds_no_guard():
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        n = env.create_symintnode(env.create_symbol(5, ConstantSource("s0"), dynamic_dim=DimDynamic.DYNAMIC),
                                  hint=5)
        x = torch.empty(n, 32)
    with pytest.raises(CensusError, match="symbolic"):
        meta_like(x)
    with pytest.raises(CensusError, match="symbolic"):
        census(lambda a: a.contiguous(), x)
    assert not env.guards and not env.replacements  # the graph stays dynamic


def test_a_census_inside_a_census_neither_deadlocks_nor_leaks():
    from triton.runtime import jit
    before = jit.KernelInterface.__dict__["__getitem__"]
    args = _attention_args(1, 1, 64, 512, 129, 1024, 512)
    inner = []
    outer = census(lambda *a: inner.append(op_launches("dsv41::sparse_fp4_attention", a)), *args)
    assert inner == [2] and outer == 0  # the inner census launched nothing real
    assert jit.KernelInterface.__dict__["__getitem__"] is before and not _common.census_active()


def test_register_cuda_refuses_a_name_of_another_op():
    from dsv41.kernels import sparse_attention
    with pytest.raises(ValueError, match="another op"):
        _common.register_cuda(sparse_attention.sparse_fp4_attention, "dsv41::linear_fp4")
    with pytest.raises(ValueError, match="not a registered"):
        _common.register_cuda(sparse_attention.sparse_fp4_attention, "dsv41::no_such_op")


# ------------------------------------------------------------------------------------------------ real runs
class _RealKernels(TorchDispatchMode):
    """ATen ops of a real CPU run that would run a CUDA kernel: neither a view nor an allocation."""

    _FREE = {"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::detach",
             "aten::_unsafe_view", "aten::alias", "aten::empty_like", "aten::lift_fresh"}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func._schema.name not in self._FREE:
            if any(isinstance(o, torch.Tensor) and o.numel() for o in (out if isinstance(out, (list, tuple))
                                                                       else (out,))):
                self.n += 1
        return out


def _real_launches(monkeypatch, name, args):
    """(Triton launches, ATen kernels) of the op's CUDA host code run for real under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction
    runs = []
    real_run = InterpretedFunction.run

    def counting_run(self, *a, **kw):
        runs.append(self)
        with _disable_current_modes():  # the interpreter's own tensor traffic is not the host code's
            return real_run(self, *a, **kw)
    monkeypatch.setattr(InterpretedFunction, "run", counting_run)
    with _RealKernels() as mode:
        _common.CUDA_HOSTS[name](*args)
    return len(runs), mode.n


@interpreted
@pytest.mark.parametrize("case", ["split", "no_split", "q_transposed"])
def test_census_equals_the_launches_of_a_real_attention_run(monkeypatch, case):
    shapes = {"split": (1, 1, 16, 64, 40, 64, 16), "no_split": (1, 16, 256, 32, 8, 16, 8),
              "q_transposed": (1, 1, 16, 64, 40, 64, 16)}[case]
    args = _attention_args(*shapes, r=32, q_transposed=case == "q_transposed", dtype=torch.float32)
    predicted = op_launches("dsv41::sparse_fp4_attention", args)
    triton_runs, aten = _real_launches(monkeypatch, "dsv41::sparse_fp4_attention", args)
    assert predicted == triton_runs + aten
    assert triton_runs == (1 if case == "no_split" else 2)


@interpreted
def test_a_census_in_another_thread_leaves_real_launches_alone():
    # Counting is per thread: a real launch made meanwhile by another thread must run (and give the right numbers).
    import threading

    from dsv41.kernels.moe import reference_moe_combine, triton_moe_combine
    y, sh = torch.randn(4, 6, 32), torch.randn(4, 32)
    w = torch.rand(4, 6)
    stop, results = threading.Event(), []

    def take_censuses():
        while not stop.is_set():
            results.append(op_launches("dsv41::moe_combine", [y, sh, w, torch.float32]))
    t = threading.Thread(target=take_censuses)
    t.start()
    try:
        ref = reference_moe_combine(y, sh, w, torch.float32)
        for _ in range(40):
            torch.testing.assert_close(triton_moe_combine(y, sh, w, torch.float32), ref)
    finally:
        stop.set()
        t.join()
    assert results and set(results) == {1}


@interpreted
@pytest.mark.parametrize("n", [1000, 20000])
def test_census_equals_the_launches_of_a_real_topk_run(monkeypatch, n):
    scores = torch.randn(1, 1, n)
    args = [scores, 64, None, 1, 0]
    predicted = op_launches("dsv41::indexer_topk", args)
    triton_runs, aten = _real_launches(monkeypatch, "dsv41::indexer_topk", args)
    assert predicted == triton_runs + aten == (1 if n <= 8192 else 2)


# ------------------------------------------------------------------------------------------------ static count
@pytest.fixture(scope="module")
def compiled_attention():
    """A CPU graph calling the attention op at split shapes (two kernels on CUDA) next to Inductor's own kernel:
    (wrapper source, provenance, post-grad graph, Dynamo layers)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from dsv41.compiler.kernel_counts import WrapperCapture, provenance_config

    cap = WrapperCapture()

    def backend(gm, example_inputs):
        cap.remember_dynamo_graph(gm)
        # Caches off: a cache hit would skip the inner compile that records the post-grad graph.
        with inductor_config.patch({**provenance_config(), "fx_graph_cache": False}), \
                functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=cap.inner_compile)

    args = _attention_args(1, 1, 16, 64, 40, 64, 16, dtype=torch.float32)

    def fn(*a):
        return torch.ops.dsv41.sparse_fp4_attention(*a) * 2.0

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return cap.sources[-1], cap.provenance[-1], cap.graphs[-1].graph, cap.dynamo_layers


def test_static_count_takes_the_census_of_each_dsv41_op_call(compiled_attention):
    from dsv41.compiler.kernel_counts import count_launches
    src, prov, graph, layers = compiled_attention
    listed = count_launches(src, prov, graph, layers, op_census=False)
    as_cuda = count_launches(src, prov, graph, layers, op_census=True)
    assert as_cuda.total == listed.total + 1  # the combine kernel
    assert dict(as_cuda.by_kind)["op"] == 2 and dict(listed.by_kind)["op"] == 1
    what = dict(dict(as_cuda.detail)["other"])
    assert what["torch.ops.dsv41.sparse_fp4_attention.default"] == 2
    assert as_cuda.note == ""


def test_static_count_of_a_cpu_graph_counts_each_op_call_once_by_default(compiled_attention):
    # On CPU the op runs its reference, not the CUDA host code: the census applies to CUDA calls only.
    from dsv41.compiler.kernel_counts import count_launches
    src, prov, graph, layers = compiled_attention
    assert count_launches(src, prov, graph, layers).total == count_launches(src, prov, graph, layers,
                                                                            op_census=False).total


def test_an_op_call_the_census_cannot_run_counts_once_with_a_note(compiled_attention, monkeypatch):
    from dsv41.compiler import kernel_counts
    from dsv41.kernels import census as census_mod
    src, prov, graph, layers = compiled_attention

    def fail(*a, **k):
        raise CensusError("no")
    monkeypatch.setattr(census_mod, "op_launches", fail)
    counts = kernel_counts.count_launches(src, prov, graph, layers, op_census=True)
    assert counts.total == kernel_counts.count_launches(src, prov, graph, layers, op_census=False).total
    assert "could not be censused" in counts.note


def test_static_count_of_a_cuda_graph_takes_the_census_by_default(compiled_attention):
    # The same graph with its op's arguments as fake CUDA tensors (what a CUDA compile's post-grad graph holds).
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from dsv41.compiler.kernel_counts import count_launches
    src, prov, graph, layers = compiled_attention
    node = next(n for n in graph.nodes if n.target is torch.ops.dsv41.sparse_fp4_attention.default)
    mode = FakeTensorMode()
    saved = {}
    try:
        for a in node.args:
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                v = saved[a] = a.meta["val"]
                meta = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                a.meta["val"] = FakeTensor(mode, meta, torch.device("cuda"))
        on_cuda = count_launches(src, prov, graph, layers)
    finally:
        for a, v in saved.items():
            a.meta["val"] = v
    assert saved
    assert on_cuda.total == count_launches(src, prov, graph, layers, op_census=False).total + 1


def test_an_op_inside_a_cond_branch_is_found_and_a_cpu_graph_gets_no_note():
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from dsv41.compiler.kernel_counts import WrapperCapture, count_launches, provenance_config
    caps = []

    def backend(gm, example_inputs):
        cap = WrapperCapture()
        cap.remember_dynamo_graph(gm)
        with inductor_config.patch({**provenance_config(), "fx_graph_cache": False}), \
                functorch_config.patch(enable_autograd_cache=False):
            out = compile_fx(gm, example_inputs, inner_compile=cap.inner_compile)
        caps.append(cap)
        return out

    def fn(p, w, y, sh):
        return torch.cond(p, lambda w, y, sh: torch.ops.dsv41.moe_combine(y, sh, w, torch.float32) + 1,
                          lambda w, y, sh: sh * 2, (w, y, sh))

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(torch.tensor(True), torch.rand(2, 6), torch.randn(2, 6, 32),
                                                       torch.randn(2, 32))
    cap = caps[-1]
    src, prov, graph = cap.sources[-1], cap.provenance[-1], cap.graphs[-1].graph
    listed = count_launches(src, prov, graph, cap.dynamo_layers, op_census=False)
    default = count_launches(src, prov, graph, cap.dynamo_layers)
    forced = count_launches(src, prov, graph, cap.dynamo_layers, op_census=True)
    assert default.total == listed.total == forced.total  # moe_combine: one kernel
    assert default.note == "" and forced.note == ""


def test_a_cache_hit_without_a_post_grad_graph_says_its_op_calls_count_once(compiled_attention):
    from dsv41.compiler.kernel_counts import count_launches
    src, prov, graph, layers = compiled_attention
    hit = count_launches(src, prov, None, layers)
    assert "each dsv41 op call counts once" in hit.note
    assert count_launches(src, prov, None, layers, op_census=False).note == ""
