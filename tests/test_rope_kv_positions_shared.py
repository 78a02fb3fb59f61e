"""The step's positions reach every layer's `rope_kv_store` as ONE tensor.

Each layer's cache write in eager code indexes the cache with the same `input_pos`. The op takes positions in
[0, T), so the family wraps negative ones the way `index_put` does (`where(pos < 0, pos + T, pos)`). That value is
the same for every layer. Computed once per layer, it cost Inductor one launch per layer: 16 launches of 2.3 µs in a
Llama-1B step on an H100 (bench/results/2026-12-07_h100_s36). Here a gpt-fast-style model of four layers is compiled
with backend="dsv41". The test checks that the fused ops share one wrapped-position node, and that the logits and the
caches still equal eager's.
"""
from __future__ import annotations

import torch

import dsv41  # noqa: F401  registers the backend
from dsv41.passes.testing import capture_graphs
from zoo import llama_gptfast as gf


def _rope_ops(gm):
    out = []
    for n in gm.graph.nodes:
        if n.target is torch.ops.higher_order.auto_functionalized and "rope_kv_store" in str(n.args[0]):
            out.append(n)
    return out


def test_every_layer_reads_one_wrapped_position_and_logits_equal_eager():
    args = gf.ModelArgs(vocab_size=96, n_layer=4, n_head=4, n_local_heads=2, dim=64,
                        intermediate_size=128)
    model = gf.build(args, dtype=torch.float32, seed=3, max_batch_size=1, max_seq_length=24)
    twin = gf.build(args, dtype=torch.float32, seed=3, max_batch_size=1, max_seq_length=24)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dsv41", dynamic=False)
    tok = torch.tensor([[5]])
    with torch.no_grad(), capture_graphs() as graphs:
        for pos in (torch.tensor([0]), torch.tensor([1]), torch.tensor([2])):
            got = compiled(tok, pos)
            want = twin(tok, pos)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    ops = [op for gm in graphs for op in _rope_ops(gm)]
    assert len(ops) == 4, f"expected one rope_kv_store per layer, found {len(ops)}"
    sources = {op.kwargs["pos"] for op in ops}
    assert len(sources) == 1, [s.format_node() for s in sources]
    wrap = next(iter(sources))
    assert wrap.target is torch.ops.aten.where.self, wrap.format_node()
    # every layer's cache rows 0-2 were written as eager wrote them
    for a, b in zip(model.layers, twin.layers):
        assert torch.allclose(a.attention.kv_cache.k_cache[:, :, :3], b.attention.kv_cache.k_cache[:, :, :3],
                              rtol=1e-4, atol=1e-5)
