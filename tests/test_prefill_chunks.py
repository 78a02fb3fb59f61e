"""Chunked prefill (dsv41/model/prefill.py, issue [prefill] item 2).

- the chunk plan covers every length with the fixed sizes, and bad sizes are refused by name;
- the eager model prefilled in chunks gives the whole-prompt prefill's logits (fp32, independent reference: one
  call over the whole prompt) and the same greedy continuation, for chunk sets that do and do not line up with the
  window (16), the compressor's pairs (odd chunk starts) and the top-k (8);
- under `torch.compile` with default settings (automatic dynamic shapes), prompts of several lengths compile one
  graph per chunk size and nothing more (Dynamo's frame counter, no Inductor: `CompileCounter`), and none of them
  has a symbolic length.
The dsv41-compiled chunked prefill against eager is checked in the shared fixture (tests/fresh_tiny_dsv41.py,
`chunked_*` keys; test_backend.py).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dsv41.model import PREFILL_CHUNKS, benchmark_prompt, chunk_plan, generate
from dsv41.model.prefill import check_chunk_sizes, prefill

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 63, 64, 65, 511, 512, 513, 4096, 5000])
def test_plan_covers_the_length_with_the_fixed_sizes(length):
    plan = chunk_plan(length)
    assert sum(plan) == length
    assert set(plan) <= set(PREFILL_CHUNKS)
    assert plan == sorted(plan, reverse=True)
    # greedy: fewer than (next size / size) chunks of every size but the largest
    sizes = sorted(PREFILL_CHUNKS, reverse=True)
    for big, small in zip(sizes, sizes[1:]):
        assert plan.count(small) < big // small


@pytest.mark.parametrize("bad, word", [((8, 4), "include 1"), ((8, 0, 1), "positive"), ((4, 4, 1), "distinct"),
                                       ((2.0, 1), "positive"), (None, "sequence"), ((True, 1), "positive")])
def test_bad_chunk_sizes_are_refused_by_name(bad, word):
    with pytest.raises(ValueError, match=word):
        check_chunk_sizes(bad)


def test_bad_lengths_are_refused():
    for n in (0, -3, 2.5):
        with pytest.raises(ValueError, match="prompt length"):
            chunk_plan(n, (4, 1))


def _whole(model, ids):
    p = ids.shape[1]
    model.reset_cache()
    return model(ids, torch.arange(p)[None], last_only=True)[:, -1].double()


@pytest.mark.parametrize("sizes", [(16, 1), (5, 3, 1), (32, 4, 1), (1,)])
def test_eager_chunks_equal_the_whole_prompt(tiny_model, sizes):
    ids = benchmark_prompt(tiny_model.config, 37)
    with torch.no_grad():
        tiny_model.setup_cache(1, 64)
        want = _whole(tiny_model, ids)
        tiny_model.reset_cache()
        got = prefill(tiny_model, ids, torch.arange(37)[None], sizes)[:, -1].double()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_eager_chunks_decode_the_same_tokens(tiny_model):
    ids = benchmark_prompt(tiny_model.config, 29)
    with torch.no_grad():
        whole = generate(tiny_model, ids, 10)
        chunked = generate(tiny_model, ids, 10, compiled_prefill=True, prefill_chunks=(8, 3, 1))
    assert whole.tokens.tolist() == chunked.tokens.tolist()


def test_prefill_wants_matching_shapes(tiny_model):
    with pytest.raises(ValueError, match="one shape"):
        prefill(tiny_model, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))


def test_default_compile_gives_one_static_graph_per_chunk_size(tiny_model):
    """Prompts of 1, 6, 21 and 40 tokens, chunks (16, 4, 1), default torch.compile settings: three graphs (16 and 4
    with `last_only`, 1 shared with the decode steps), all with static shapes."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(tiny_model, backend=counter)
    with torch.no_grad():
        tiny_model.setup_cache(1, 48)  # big enough for every prompt below: the caches are reset in place
        outs = {}
        for p in (40, 1, 6, 21):
            ids = benchmark_prompt(tiny_model.config, p)
            outs[p] = generate(compiled, ids, 3, compiled_prefill=True, prefill_chunks=(16, 4, 1)).tokens
            assert outs[p].tolist() == generate(tiny_model, ids, 3).tokens.tolist()
    assert counter.frame_count == 3, counter.frame_count
    for gm in counter.graphs:
        shapes = [n.meta["example_value"].shape for n in gm.graph.nodes
                  if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)]
        assert all(isinstance(d, int) for s in shapes for d in s), shapes
    torch._dynamo.reset()


def test_dsv41_compiled_chunked_prefill_equals_eager(tiny_dsv41):
    """fp32 `tiny` through `backend="dsv41"` (the shared fixture): the chunked compiled prefill's last logits within
    1e-4 of one eager call over the prompt, the greedy tokens after it equal to eager's, one new graph (16 tokens)."""
    assert tiny_dsv41["chunked_prefill_max_rel_logit_error"] < 1e-4
    assert tiny_dsv41["chunked_compiled_tokens"] == tiny_dsv41["eager_tokens"]
    assert tiny_dsv41["chunked_new_graphs"] == 1


def test_speculative_decoding_after_a_chunked_prefill(tiny_model):
    """DSpark commits the prompt's features to its drafter ring: chunk by chunk it must leave the ring as one commit
    of the whole prompt does, so the speculative tokens (greedy: equal to plain greedy) and the natural acceptance
    agree with an eager whole-prompt prefill."""
    ids = benchmark_prompt(tiny_model.config, 27)
    with torch.no_grad():
        plain = generate(tiny_model, ids, 9)
        whole = generate(tiny_model, ids, 9, speculative=True)
        chunked = generate(tiny_model, ids, 9, speculative=True, compiled_prefill=True, prefill_chunks=(8, 3, 1))
    assert chunked.tokens.tolist() == whole.tokens.tolist() == plain.tokens.tolist()
    assert chunked.natural_acceptance == whole.natural_acceptance

    def rings(**kw):
        """Every DSpark stage's context ring right after the prompt's commit (one new token: no round ran)."""
        with torch.no_grad():
            generate(tiny_model, ids, 1, speculative=True, **kw)
        return [t.clone() for st in tiny_model.mtp for t in (st.attn.ring_codes, st.attn.ring_scales)]

    want, got = rings(), rings(compiled_prefill=True, prefill_chunks=(8, 3, 1))
    assert len(want) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(want, got))
