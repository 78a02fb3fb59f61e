"""Regional compilation on CUDA: the wrapper's whole-step CUDA graph (`RegionalModel`, dsv41.compiler.regional).

The reference is the eager model's greedy output on the same GPU in FP32. Each backend must give the same tokens
over 24 steps, capture exactly one graph for the decode signature and replay it for every later step, keep
giving the same tokens after `reset_cache` (no re-capture), and re-capture after `setup_cache` moved the caches.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N = 24


@pytest.fixture(scope="module")
def tiny_cuda():
    from gpu_harness import tiny_cuda_reference
    return tiny_cuda_reference(N)


@pytest.mark.parametrize("backend", ["dsv41", "inductor-cudagraphs"])
def test_regional_cuda_graph_replays_the_eager_tokens(tiny_cuda, backend):
    from dsv41.compiler.regional import compile_regional
    from dsv41.model import generate

    model, prompt, ref = tiny_cuda
    torch._dynamo.reset()
    rm = compile_regional(model, backend)
    out = generate(rm, prompt, N)
    assert torch.equal(out.tokens, ref)
    assert rm.captures == 1 and rm.replays == N - 2  # decode calls: 1 uncaptured, 1 capture + replay, N - 3 replays
    again = generate(rm, prompt, N)  # reset_cache in place: same addresses, no new capture
    assert torch.equal(again.tokens, ref) and rm.captures == 1
    model.setup_cache(1, 2 * (40 + N))  # moved caches: the old graph must not replay
    moved = generate(rm, prompt, N)
    assert torch.equal(moved.tokens, ref) and rm.captures == 2


def test_regional_without_cuda_graphs_never_captures(tiny_cuda):
    from dsv41.compiler.regional import compile_regional
    from dsv41.model import generate

    model, prompt, ref = tiny_cuda
    torch._dynamo.reset()
    rm = compile_regional(model, "dsv41", {"cuda_graphs": False})
    out = generate(rm, prompt, 6)
    assert torch.equal(out.tokens, ref[:, :6]) and rm.captures == 0 and rm.replays == 0


def test_regional_speculative_decoding_replays_the_verify_and_draft_graphs(tiny_cuda):
    """DSpark speculative decoding through the regional wrapper: verify rows (block + 1) and the compiled DSpark
    region each get one CUDA graph, captured on their second call and replayed after; greedy speculative output
    equals eager plain greedy output."""
    from dsv41.compiler.regional import compile_regional
    from dsv41.model import generate

    model, prompt, ref = tiny_cuda
    torch._dynamo.reset()
    rm = compile_regional(model, "dsv41")
    out = generate(rm, prompt, N, speculative=True)
    assert torch.equal(out.tokens, ref)
    captured = sorted(k[0][0] for k, v in rm._graphs.items() if v)
    assert captured == ["draft", "step"] and rm.captures == 2
    rounds = len(out.acceptance)
    assert rm.replays == 2 * rounds - 2  # each kind: 1 uncaptured call, then capture + replay, then replays
    from dsv41.model.speculative import journal_for
    journal = journal_for(model, 1, model.config.dspark_block_size + 1)
    assert journal.graphs and journal.captures == 2  # the rollback bookkeeping replays too (save, rollback)
