"""Batch-size buckets (dsv41/compiler/buckets.py): bucket choice, padding / slicing, and a compiled toy decoder
that pads a batch to its bucket, equals the unpadded eager decoder, and never recompiles when only the
position, the cache contents or the batch within one bucket change (Dynamo compile counter).

The toy (`ToyLM`) is a one-layer attention decoder with static KV caches written at tensor positions, in the
gpt-fast manner of dsv41/model (setup_cache / reset_cache / batch_size / max_seq_len / embed), so that
`dsv41.model.generate` drives it exactly as it drives the real model; it is far smaller than `tiny`, so the CPU
compile takes seconds.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dsv41.compiler.buckets import (DEFAULT_BUCKETS, BucketedModel, choose_bucket, normalize_buckets, pad_rows,
                                    slice_rows)
from dsv41.model import generate


# ------------------------------------------------------------------------------------------- pure logic
def test_default_buckets_are_powers_of_two_and_the_verify_width():
    assert DEFAULT_BUCKETS == (1, 2, 4, 6, 8)


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 6), (6, 6), (7, 8), (8, 8), (9, None),
                                          (100, None)])
def test_choose_bucket(batch, bucket):
    assert choose_bucket(batch) == bucket


def test_choose_bucket_custom_and_errors():
    assert choose_bucket(3, [8, 2, 2]) == 8
    assert choose_bucket(2, (8, 2)) == 2
    with pytest.raises(ValueError, match=">= 1"):
        choose_bucket(0)
    with pytest.raises(ValueError, match="at least one"):
        normalize_buckets([])
    with pytest.raises(ValueError, match=">= 1"):
        normalize_buckets([0, 2])
    with pytest.raises(TypeError, match="ints"):
        normalize_buckets([True])
    with pytest.raises(TypeError, match="ints"):
        normalize_buckets([2.0])


def test_pad_rows_repeats_the_last_row_and_slice_rows_undoes_it():
    t = torch.arange(6).reshape(3, 2)
    p = pad_rows(t, 4)
    assert p.shape == (4, 2) and torch.equal(p[:3], t) and torch.equal(p[3], t[2])
    assert pad_rows(t, 3) is t
    with pytest.raises(ValueError, match="cannot pad 3 rows down to 2"):
        pad_rows(t, 2)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_rows(torch.tensor(1.0), 2)
    out = slice_rows((p, [p * 2], {"a": p}, 7, torch.tensor(3.0)), 3)
    assert torch.equal(out[0], t) and torch.equal(out[1][0], t * 2) and torch.equal(out[2]["a"], t)
    assert out[3] == 7 and out[4].item() == 3.0


# ------------------------------------------------------------------------------------------- toy decoder
class ToyLM(nn.Module):
    """One attention layer over static KV caches [B, S, D] written at `positions`; logits [B, T, V] fp32."""

    V, D = 48, 16

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = nn.Embedding(self.V, self.D)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(self.V, self.D, generator=g))
        for name, shape in (("wq", (self.D, self.D)), ("wk", (self.D, self.D)), ("wv", (self.D, self.D)),
                            ("wo", (self.D, self.D)), ("head", (self.D, self.V))):
            self.register_buffer(name, torch.randn(*shape, generator=g) / math.sqrt(shape[0]))
        self.batch_size = 0
        self.max_seq_len = 0

    def setup_cache(self, batch_size, max_seq_len):
        self.register_buffer("k_cache", torch.zeros(batch_size, max_seq_len, self.D))
        self.register_buffer("v_cache", torch.zeros(batch_size, max_seq_len, self.D))
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    def reset_cache(self):
        self.k_cache.zero_()
        self.v_cache.zero_()

    def forward(self, input_ids, positions, last_only=False):
        x = self.embed(input_ids)
        b = input_ids.shape[0]
        rows = torch.arange(b, device=x.device)[:, None].expand_as(positions)
        self.k_cache.index_put_((rows, positions), x @ self.wk)
        self.v_cache.index_put_((rows, positions), x @ self.wv)
        k, v = self.k_cache[:b], self.v_cache[:b]
        s = (x @ self.wq) @ k.transpose(1, 2) / math.sqrt(self.D)
        seen = torch.arange(self.max_seq_len, device=x.device)[None, None, :] <= positions[..., None]
        o = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1) @ v
        logits = ((x + o @ self.wo) @ self.head).float()
        return logits[:, -1:] if last_only else logits


@pytest.fixture(scope="module")
def compiled_toy():
    """(eager ToyLM, compile counter, BucketedModel over torch.compile(ToyLM, backend=dsv41 via the counter))."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = ToyLM().eval()
    cnt = CompileCounterWithBackend("dsv41")
    compiled = torch.compile(model, backend=cnt, fullgraph=True, dynamic=False)
    return model, cnt, BucketedModel(compiled)


def _prompt(b, p, seed):
    return torch.randint(0, ToyLM.V, (b, p), generator=torch.Generator().manual_seed(seed))


def _eager_generate(prompt, n):
    ref = ToyLM().eval()
    return generate(ref, prompt, n)


def test_padded_decode_equals_unpadded_eager_and_never_recompiles(compiled_toy):
    model, cnt, bucketed = compiled_toy
    bucketed.setup_cache(3, 32)  # room for every run below: generate then resets the caches in place
    with torch.no_grad():
        got = generate(bucketed, _prompt(3, 5, 0), 6)  # batch 3 -> bucket 4
    assert model.batch_size == 4 and model.max_seq_len == 32  # caches hold the bucket's rows
    assert bucketed._orig_mod.batch_size == 3
    assert torch.equal(got.tokens, _eager_generate(_prompt(3, 5, 0), 6).tokens)
    assert cnt.frame_count == 1, "the first decode step compiles once"
    with torch.no_grad():  # new prompt: other cache contents, other positions (longer prompt)
        again = generate(bucketed, _prompt(3, 9, 1), 5)
        four = generate(bucketed, _prompt(4, 7, 2), 4)  # batch 4: the same bucket
    assert torch.equal(again.tokens, _eager_generate(_prompt(3, 9, 1), 5).tokens)
    assert torch.equal(four.tokens, _eager_generate(_prompt(4, 7, 2), 4).tokens)
    assert cnt.frame_count == 1, "position, cache contents or batch within a bucket must not recompile"
    summary = bucketed.summary()
    assert {r["batch"]: r["bucket"] for r in summary["seen"]} == {3: 4, 4: 4}
    assert "bucket 4 (padded from 3)" in [r["runs_as"] for r in summary["seen"]]


def test_step_logits_of_real_rows_match(compiled_toy):
    model, cnt, bucketed = compiled_toy
    ids, pos = _prompt(3, 1, 5), torch.full((3, 1), 4, dtype=torch.int64)
    ref = ToyLM().eval()
    ref.setup_cache(3, 16)
    bucketed.setup_cache(3, 16)
    with torch.no_grad():
        for p in range(4):  # same cache history in both
            hist = _prompt(3, 1, 10 + p)
            ref(hist, torch.full((3, 1), p, dtype=torch.int64))
            bucketed(hist, torch.full((3, 1), p, dtype=torch.int64))
        want = ref(ids, pos)
        got = bucketed(ids, pos)
    assert got.shape == want.shape == (3, 1, ToyLM.V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1


def test_batch_above_the_largest_bucket_runs_uncaptured_and_is_reported(compiled_toy):
    import dsv41

    model, cnt, bucketed = compiled_toy
    with torch.no_grad():
        got = generate(bucketed, _prompt(9, 4, 3), 3)
    assert torch.equal(got.tokens, _eager_generate(_prompt(9, 4, 3), 3).tokens)
    assert cnt.frame_count == 1, "the uncaptured path is the eager module: no compile"
    assert 9 in bucketed.summary()["uncaptured"]
    rep = dsv41.last_report()
    assert rep is not None and rep.to_dict()["buckets"]["uncaptured"] == [9]
    assert "uncaptured (above the largest bucket 8)" in str(rep)
