"""Side-stream overlap on CUDA (dsv41/compiler/streams.py): the rewrite must not change what the model computes.

The reference is the eager model's greedy output on the same GPU in FP32 (`tiny`, checkpoint weights). The dsv41
compile with default options, where side streams are on (auto: a second stream, fork/join events, inside the decode
step's CUDA graph), must give the same tokens over 24 steps as eager and as the same compile with streams=False,
with logits equal to the streams=False compile (the same kernels on the same inputs; only their stream placement
differs), and its report must say the schedule was applied with two streams. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N = 24


@pytest.fixture(scope="module")
def tiny_cuda():
    from gpu_harness import tiny_cuda_reference
    model, prompt, ref = tiny_cuda_reference(N)
    assert torch.equal(_greedy(model, model, prompt)[0], ref)  # the loop below decodes as generate does
    return model, prompt, ref


def _greedy(step, model, prompt):
    """(tokens [1, N], decode logits [1, N - 1, vocab]): eager prefill, then N - 1 decode steps through `step`
    (as dsv41.model.generate does), each step's logits copied out of the CUDA graph's output buffer."""
    model.reset_cache()
    ids = prompt[None] if prompt.dim() == 1 else prompt
    b, p = ids.shape
    pos = torch.arange(p, device=ids.device)[None].expand(b, p).contiguous()
    tok = model(ids, pos, last_only=True)[:, -1].argmax(-1)
    toks, logits = [tok], []
    pos = torch.full((b, 1), p, dtype=torch.int64, device=ids.device)
    for _ in range(1, N):
        lg = step(tok[:, None], pos)[:, -1].clone()
        tok = lg.argmax(-1)
        toks.append(tok)
        logits.append(lg)
        pos += 1
    return torch.stack(toks, 1).cpu(), torch.stack(logits, 1)


def _compiled_run(model, prompt, options: dict):
    import dsv41
    from dsv41.cli import compile_model

    torch._dynamo.reset()
    compiled = compile_model(model, "dsv41", options)
    out = _greedy(compiled, model, prompt)
    return out, dsv41.last_report().to_dict()


def test_side_streams_keep_the_eager_tokens_and_the_single_stream_logits(tiny_cuda):
    model, prompt, ref = tiny_cuda
    (tok_on, lg_on), rep_on = _compiled_run(model, prompt, {})  # the default: streams auto, on here
    (tok_off, lg_off), rep_off = _compiled_run(model, prompt, {"streams": False})
    assert rep_on["schedule"]["applied"] is True and rep_on["schedule"]["streams"] == 2
    assert rep_on["schedule"]["reason"] == "on: auto (CUDA graph on CUDA)"
    assert rep_on["schedule"]["moved"] > 0
    assert rep_off["schedule"]["applied"] is False
    assert torch.equal(tok_on, ref) and torch.equal(tok_off, ref)
    # Same kernels, same inputs: placement on a second stream must not change a bit of the logits.
    assert torch.equal(lg_on, lg_off)


def test_regional_side_streams_follow_the_wrappers_capture(tiny_cuda):
    """Regional compilation: the regions compile without Inductor's CUDA graphs and the wrapper captures the step;
    side streams follow that capture (`Options.step_captured`). Tokens equal eager's and logits equal those of
    the same regions without side streams, bit for bit."""
    from dsv41.compiler.regional import compile_regional

    model, prompt, ref = tiny_cuda
    runs = {}
    for name, options in (("on", None), ("off", {"streams": False})):
        torch._dynamo.reset()
        rm = compile_regional(model, "dsv41", options)
        runs[name] = (_greedy(rm, model, prompt), rm.report.to_dict(), rm.captures)
    (tok_on, lg_on), rep_on, cap_on = runs["on"]
    (tok_off, lg_off), rep_off, cap_off = runs["off"]
    assert cap_on == 1 and cap_off == 1
    assert rep_on["schedule"]["applied"] is True and rep_on["schedule"]["streams"] == 2
    assert "regional wrapper" in rep_on["schedule"]["reason"] and rep_on["schedule"]["moved"] > 0
    assert rep_off["schedule"]["applied"] is False
    assert torch.equal(tok_on, ref) and torch.equal(tok_off, ref)
    assert torch.equal(lg_on, lg_off)
