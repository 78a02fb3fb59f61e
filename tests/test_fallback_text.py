"""Inductor's implicit-fallback log line stays short inside a dsv41 compile (dsv41/compiler/fallback_text.py)."""

import contextlib
import logging

import pytest
import torch
from torch._inductor import ir
from torch._inductor.exc import OperatorIssue

from dsv41.compiler.fallback_text import bounded_operator_str, bounded_operator_text, brief


def _scale_op(name: str, factor: float):
    """A fresh custom op x -> x * factor (Inductor creates an implicit fallback for it once per process)."""
    @torch.library.custom_op(f"dsv41_fallback_test::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    @op.register_fake
    def _(x):
        return torch.empty_like(x)
    return op


_twice, _thrice, _fwd, _bwd = (_scale_op("twice", 2), _scale_op("thrice", 3), _scale_op("fwd", 2),
                               _scale_op("bwd", 2))
# The backward calls another custom op after a pointwise op, so lowering the backward graph creates a fallback.
_fwd.register_autograd(lambda ctx, g: torch.ops.dsv41_fallback_test.bwd(torch.sin(g) + 1.0))


def test_brief_renders_values_and_names_without_formatting_ir(monkeypatch):
    """Primitives, dtypes and short containers by value; long containers counted; IR nodes and tensors by type,
    name, size, dtype without their __str__."""
    def boom(*a, **k):
        raise AssertionError("IR text was formatted")
    monkeypatch.setattr(ir.IRNode, "str_helper", boom)
    assert brief(3) == "3" and brief(None) == "None" and brief(torch.bfloat16) == "torch.bfloat16"
    assert brief([1, 2.5, "a"]) == "[1, 2.5, 'a']"
    assert brief(tuple(range(20))) == "(0, 1, 2, 3, 4, 5, 6, 7, ... (+12))"
    assert brief([[[[1]]]]) == "[[list(len=1)]]"
    assert brief({"dim": -1}) == "{'dim': -1}"
    assert brief(torch.zeros(2, 3)) == "Tensor(size=[2, 3], dtype=torch.float32, device=cpu)"
    assert brief("x" * 500).endswith("...") and len(brief("x" * 500)) == 120
    assert brief(object()) == "object"


def test_operator_str_is_swapped_only_inside_the_block():
    original = OperatorIssue.__dict__["operator_str"]
    with bounded_operator_text():
        assert OperatorIssue.operator_str is bounded_operator_str
        with pytest.raises(RuntimeError):
            with bounded_operator_text():
                raise RuntimeError("compile failed")
        assert OperatorIssue.operator_str is bounded_operator_str
    assert OperatorIssue.__dict__["operator_str"] is original
    # Blocks of overlapping compiles (two threads) may close in either order: the last one out restores.
    first, second = bounded_operator_text(), bounded_operator_text()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert OperatorIssue.operator_str is bounded_operator_str
    second.__exit__(None, None, None)
    assert OperatorIssue.__dict__["operator_str"] is original
    text = bounded_operator_str("aten.foo", [1, [2, 3]], {"k": torch.float16})
    assert text == "  target: aten.foo\n  args[0]: 1\n  args[1]: [2, 3]\n  kwargs: {'k': torch.float16}"


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def no_compile_caches():
    """Lower for real: a graph served from Inductor's on-disk caches (an earlier test run) logs no fallback."""
    from torch._inductor import config
    with config.patch(force_disable_caches=True):
        yield


@pytest.fixture
def ir_text_calls(monkeypatch):
    """The list of IR nodes whose text (`IRNode.str_helper`) is built while the test runs."""
    calls = []
    real = ir.IRNode.str_helper

    def counted(self, *a, **k):
        calls.append(type(self).__name__)
        return real(self, *a, **k)
    monkeypatch.setattr(ir.IRNode, "str_helper", counted)
    return calls


@contextlib.contextmanager
def _inductor_info_log():
    """Inductor's graph logger at INFO inside the block; yields the handler that keeps its messages."""
    log, keep = logging.getLogger("torch._inductor.graph"), _Keep()
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        yield keep
    finally:
        log.removeHandler(keep)
        log.setLevel(level)


def test_dsv41_compile_logs_the_fallback_without_formatting_ir(monkeypatch, no_compile_caches, ir_text_calls):
    """With Inductor's INFO log on (where torch 2.13 formats the lazy text too), a dsv41 compile that meets an
    op without a lowering logs the fallback naming the op and its input buffer, and no IR node's text is built.
    Outside dsv41's block, the same log line formats the IR (the cost the block removes)."""
    calls = ir_text_calls

    def f(x):
        y = torch.ops.dsv41_fallback_test.twice(torch.sin(x) + 1.0)
        return torch.cos(y)

    x = torch.randn(5, 7, dtype=torch.float64)
    want = torch.cos(2 * (torch.sin(x) + 1.0))
    torch._dynamo.reset()
    with _inductor_info_log() as keep:
        got = torch.compile(f, backend="dsv41", fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    text = "\n".join(m for m in keep.messages if "implicit fallback" in m)
    assert "target: dsv41_fallback_test.twice" in text, keep.messages
    assert "args[0]: TensorBox(of=Pointwise, size=[5, 7], dtype=torch.float64)" in text, text
    assert calls == [], calls

    # Control: the same compile without dsv41's block (another op: a fallback is created once per op) formats
    # the input's IR when the log line is built.
    import dsv41.compiler.fallback_text as fallback_text
    import dsv41.compiler.pipeline as pipeline
    monkeypatch.setattr(pipeline, "bounded_operator_text", contextlib.nullcontext)
    monkeypatch.setattr(fallback_text, "bounded_operator_text", contextlib.nullcontext)

    def g(x):
        return torch.cos(torch.ops.dsv41_fallback_test.thrice(torch.sin(x) + 1.0))
    torch._dynamo.reset()
    with _inductor_info_log():
        torch.compile(g, backend="dsv41", fullgraph=True)(x)
    assert calls, "control: Inductor's own text should have formatted the IR"


def test_backward_compiled_after_the_forward_builds_no_ir_text(no_compile_caches, ir_text_calls):
    """AOT autograd compiles the backward at the first .backward(), after dsv41's compile returned: its fallback
    log line is bounded too (dsv41's inner_compile opens the block), and the gradient is right."""
    calls = ir_text_calls
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    with _inductor_info_log() as keep:
        f = torch.compile(lambda x: torch.ops.dsv41_fallback_test.fwd(torch.sin(x) + 1.0).sum(), backend="dsv41")
        f(x).backward()
    torch.testing.assert_close(x.grad, 2 * (torch.sin(torch.ones_like(x)) + 1.0) * torch.cos(x), rtol=0,
                               atol=1e-12)
    text = "\n".join(m for m in keep.messages if "implicit fallback" in m)
    assert "target: dsv41_fallback_test.bwd" in text and "args[0]: TensorBox(of=" in text, text
    assert calls == [], calls
