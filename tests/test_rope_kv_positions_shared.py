"""The step's positions reach every layer's fused RoPE + cache-write op as the graph's own position input.

Eager code indexes each layer's cache with the same `input_pos`; `index_put` wraps a negative position to pos + T.
The family used to insert that wrap (`where(pos < 0, pos + T, pos)`) in front of the op, and even when every layer
read one such node, Inductor recomputed it in front of each layer's extern op: 16 launches of about 2.3 µs in a
Llama-1B step on an H100 (bench/results/2026-12-08_h100_s37). The ops now wrap positions themselves, so the graph
has no position arithmetic at all. Checked on a gpt-fast-style model of four layers compiled with backend="dsv41":
the fused ops read the position placeholder directly, and logits and caches equal eager's (gpt-fast writes with
`index_copy_`, which rejects a negative position; the kernels' tests check the wrap `index_put` does).
"""
from __future__ import annotations

import torch

import dsv41  # noqa: F401  registers the backend
from dsv41.passes.testing import capture_graphs
from zoo import llama_gptfast as gf


def _fused_rope_ops(gm):
    out = []
    for n in gm.graph.nodes:
        if n.target is torch.ops.higher_order.auto_functionalized and "rope" in str(n.args[0]):
            out.append(n)
    return out


def test_every_layer_reads_the_position_input_and_logits_equal_eager():
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
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (pos, (got - want).abs().max())
    ops = [op for gm in graphs for op in _fused_rope_ops(gm)]
    assert len(ops) == 4, f"expected one fused RoPE op per layer, found {len(ops)}"
    sources = {op.kwargs["pos"] for op in ops}
    assert len(sources) == 1 and next(iter(sources)).op == "placeholder", [s.format_node() for s in sources]
    # every layer's cache rows 0-2 were written as eager wrote them
    for a, b in zip(model.layers, twin.layers):
        assert torch.allclose(a.attention.kv_cache.k_cache[:, :, :3], b.attention.kv_cache.k_cache[:, :, :3],
                              rtol=1e-4, atol=1e-5)
        assert torch.allclose(a.attention.kv_cache.v_cache[:, :, :3], b.attention.kv_cache.v_cache[:, :, :3],
                              rtol=1e-4, atol=1e-5)
