"""How the graphs of one `torch.compile` call find their FusionReport (dsv41/compiler/backend.py).

`dsv41.Backend()` keeps its report on the object; the string form `backend="dsv41"` keys it on torch.compile's
per-call wrapper, found by `_torch_compile_call`, the one function that reads the call stack. The fast tests pin
what that function relies on in torch (the wrapper class, its `compiler_fn`, and that it calls the backend from its
own `__call__`) with the compile itself stubbed out, so a torch that changes them fails here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsv41
from dsv41.compiler import backend as backend_mod
from dsv41.compiler.report import FusionReport


@pytest.fixture
def stub_compile(monkeypatch):
    """Replace the pipeline's compile by a stub; returns the list of reports it was handed, one per graph."""
    from dsv41.compiler import pipeline

    seen = []

    def fake(gm, example_inputs, opts, report, mode=None):
        seen.append(report)
        return gm

    monkeypatch.setattr(pipeline, "compile_graph", fake)
    return seen


def _gm():
    return torch.fx.symbolic_trace(nn.ReLU())


def test_torch_compiles_wrapper_is_the_key_of_the_string_form(stub_compile):
    """torch.compile(backend="dsv41") builds one `_TorchCompileWrapper` per call and compiles each graph through
    it: every graph of one wrapper gets one report, another wrapper another."""
    first = torch._TorchCompileWrapper("dsv41", None, {"debug": False}, None)
    assert first.compiler_fn is backend_mod.dsv41_backend
    first(_gm(), [])
    first(_gm(), [])
    second = torch._TorchCompileWrapper("dsv41", None, None, None)
    second(_gm(), [])
    a, b, c = stub_compile
    assert a is b and isinstance(a, FusionReport) and c is not a
    assert getattr(first, backend_mod._REPORT_ATTR) is a


def test_without_torch_compiles_wrapper_each_graph_gets_its_own_report(stub_compile):
    backend_mod.dsv41_backend(_gm(), [])
    backend_mod.dsv41_backend(_gm(), [])
    assert stub_compile[0] is not stub_compile[1]


def test_a_backend_object_keeps_one_report_for_its_graphs(stub_compile):
    be = dsv41.Backend({"debug": False})
    assert be.report is None
    torch._TorchCompileWrapper(be, None, None, None)(_gm(), [])
    torch._TorchCompileWrapper(be, None, {"debug": True}, None)(_gm(), [])
    assert stub_compile == [be.report, be.report]
    assert be.report.options.debug is False  # the options of its first graph


def test_a_backend_object_rejects_bad_options_by_name():
    with pytest.raises(ValueError, match="nope"):
        dsv41.Backend({"nope": 1})(_gm(), [])


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return h * 2


def test_a_backend_object_reports_every_graph_of_its_compile():
    torch._dynamo.reset()
    be = dsv41.Backend()
    m = _Broken().eval()
    with torch.no_grad():
        fn = torch.compile(m, backend=be, dynamic=False)
        x = torch.randn(2, 8)
        assert torch.allclose(fn(x), m(x))
    assert len(be.report.graphs) == 2
    assert dsv41.last_report() is be.report
