"""[generic]: the bf16 decode step of three Llama spellings (the zoo's gpt-fast and transformers-style models, and
transformers' own LlamaForCausalLM with a StaticCache) goes through the `half_gemv` family, and its logits stay
within bf16 of eager's.

The count of fused ops per decoder layer is what the family declares for a Llama block: the q/k/v projections as
one op (one `linear_half_multi`, or one `linear_half` where the model has a fused wqkv), o_proj and down_proj with
their residual adds, gate/up with the SwiGLU, and both RMSNorms in the prologues; no aten.mm is left. The
comparison: eager bf16 vs compiled bf16 logits over 3 decode steps, relative to the logits' scale, against 0.05
(a few bf16 roundings carried through 2 layers; a gate/up swap or a lost norm gives errors of order 1).
"""

from __future__ import annotations

import pytest
import torch

from dsv41.passes.testing import capture_graphs, ops_after

from zoo import llama_gptfast as gf
from zoo import llama_hf_style as hfs

STEPS, PROMPT = 3, 6


def _fused(graphs) -> dict:
    """Op counts of the graphs the decode steps compiled, by `namespace.op` (overloads summed)."""
    out: dict = {}
    for gm in graphs:
        counts = ops_after(gm)
        for name in ("dsv41.linear_half", "dsv41.linear_half_multi", "dsv41.linear_half_silu_mul", "aten.mm",
                     "dsv41.gqa_decode_attention", "aten.clone", "dsv41.rope_kv_store", "aten.view_as_complex",
                     "dsv41.rope_gqa_decode_attention",
                     "aten.cat", "aten.addmm"):
            out[name] = out.get(name, 0) + counts[name]
    return out


def _run(model, call, options=None):
    """(eager logits, compiled logits, fused op counts) over STEPS decode steps after an eager prefill."""
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dsv41", dynamic=False, options=options)
    with torch.no_grad():
        call(model, ids, torch.arange(PROMPT))
        tok = torch.tensor([[7]])
        want, got = [], []
        with capture_graphs() as graphs:
            for t in range(PROMPT, PROMPT + STEPS):
                pos = torch.tensor([t])
                want.append(call(model, tok, pos).float())
                got.append(call(compiled, tok, pos).float())
    return torch.stack(want), torch.stack(got), _fused(graphs)


def _close(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _zoo_call(m, ids, pos):
    return m(ids, pos)[:, -1]


@pytest.mark.parametrize("spelling", ["gpt-fast", "hf-style"])
def test_zoo_llamas_fuse_every_projection_in_bf16(spelling):
    if spelling == "gpt-fast":
        model = gf.build("llama-tiny", dtype=torch.bfloat16, max_seq_length=32)
    else:
        model = hfs.build(hfs.LlamaConfig(), dtype=torch.bfloat16, max_seq_length=32)
    # The eager model writes its KV cache in both calls; the compiled call repeats eager's writes at each position.
    want, got, ops = _run(model, _zoo_call)
    layers = 2
    assert ops["aten.mm"] == 0, ops
    assert ops["dsv41.linear_half_silu_mul"] == layers, ops
    q_ops = ops["dsv41.linear_half_multi"]
    assert q_ops in (0, layers), ops
    # o_proj + down_proj per layer (residual), the head, and q/k/v where the model fuses them into one wqkv
    assert ops["dsv41.linear_half"] == 2 * layers + 1 + (layers if q_ops == 0 else 0), ops
    # The attention reads the cache's KV heads once (gqa_attention): no repeated copy of the cache is made, whether
    # the model calls SDPA (gpt-fast) or writes the attention out with matmul and softmax (the transformers-style zoo)
    # (the one clone left in the transformers-style zoo is its rotary embedding's [1, S, D/2] angle table)
    assert ops["aten.clone"] == (0 if spelling == "gpt-fast" else 1), ops
    # RoPE of q and k, both cache writes and the attention: one op per layer (complex multiply in gpt-fast,
    # rotate_half in bf16 in the transformers-style zoo); neither half is left on its own
    assert ops["dsv41.rope_gqa_decode_attention"] == layers, ops
    assert ops["dsv41.rope_kv_store"] == 0 and ops["dsv41.gqa_decode_attention"] == 0, ops
    # q's RoPE rides in the same op: no complex multiply (gpt-fast) and no rotate_half cat (transformers) is left
    assert ops["aten.view_as_complex"] == 0 and ops["aten.cat"] == 0, ops
    assert _close(got, want) < 0.05


def test_transformers_llama_fuses_in_bf16():
    """transformers' model compiled in bf16 differs from its eager run by 0.148 of the logits' scale with or
    without these families (Inductor's own fp32 fusions of the rest): the bar is that they add nothing to it."""
    transformers = pytest.importorskip("transformers")
    import inspect

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def call(m, ids, pos):
        return m(ids, position_ids=pos[None], cache_position=pos, use_cache=True, **{key: cache}).logits[:, -1]

    state = {k: v.clone() for k, v in model.state_dict().items()}
    want, got, ops = _run(model, call)
    assert ops["aten.mm"] == 0, ops
    assert ops["dsv41.linear_half_silu_mul"] == 2 and ops["dsv41.linear_half_multi"] == 2, ops
    assert ops["dsv41.rope_gqa_decode_attention"] == 2 and ops["dsv41.rope_kv_store"] == 0, ops
    model.load_state_dict(state)
    cache.reset()
    want_off, got_off, ops_off = _run(model, call, {"disable": ["half_gemv", "gqa_attention", "rope_kv", "rope_gqa"]})
    assert ops_off["dsv41.linear_half"] == 0 and torch.equal(want, want_off)
    assert _close(got, want) <= _close(got_off, want) + 0.01
