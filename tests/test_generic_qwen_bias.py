"""[generic]: transformers' Qwen2 (q / k / v projections with a bias, `F.linear(x, W, b)` -> addmm) compiled in bf16
with a StaticCache: the biased q / k / v go through one `dsv41::linear_half_multi` with its biases, RoPE and the
cache writes through `rope_kv_store`, and the logits stay within bf16 of eager's. Also the op itself against
`F.linear` with a bias in float64."""

from __future__ import annotations

import inspect

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs

import test_generic_llama_families as generic  # its decode-and-count harness (`_run`, `_close`)

from dsv41.kernels import half_gemv as hg

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


def _close64(y, want):
    assert torch.allclose(y.double(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item()), \
        (y.double() - want).abs().max()


def test_linear_half_multi_with_biases_matches_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    ws = [(torch.randn(n, 64, generator=g) * 0.1).to(torch.bfloat16) for n in (32, 16, 16)]
    bs = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (32, 16, 16)]
    got = torch.ops.dsv41.linear_half_multi(x, ws, None, 0.0, 0, bs)
    for y, w, b in zip(got, ws, bs):
        _close64(y, x.double() @ w.double().t() + b.double())
    with pytest.raises(ValueError, match="biases"):
        torch.ops.dsv41.linear_half_multi(x, ws, None, 0.0, 0, bs[:2])


@interpreted
@pytest.mark.parametrize("k_iters", [None, 1])  # 1: K split over several programs, the bias added once
def test_kernel_adds_each_bias_once(monkeypatch, k_iters):
    poison_outputs(monkeypatch, hg)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    ws = [(torch.randn(n, 256, generator=g) * 0.1).to(torch.bfloat16) for n in (48, 16, 16)]
    bs = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (48, 16, 16)]
    over = {} if k_iters is None else {"k_iters": k_iters, "block_k": 64}
    for y, w, b in zip(hg.triton_linear_half_multi(x, ws, biases=bs, **over), ws, bs):
        _close64(y, x.double() @ w.double().t() + b.double())
    r = torch.randn(2, 48, generator=g).to(torch.bfloat16)
    y = hg.triton_linear_half(x, ws[0], r, bias=bs[0], **over)
    _close64(y, x.double() @ ws[0].double().t() + bs[0].double() + r.double())


def test_qwen2_biased_projections_fuse_in_bf16():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # random biases: a dropped or misplaced bias must show in the logits
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 1.0)
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def call(m, ids, pos):
        return m(ids, position_ids=pos[None], cache_position=pos, use_cache=True, **{key: cache}).logits[:, -1]

    want, got, ops = generic._run(model, call)
    assert ops["aten.addmm"] == 0 and ops["aten.mm"] == 0, ops
    # RoPE + cache writes ride in the attention's launch (rope_gqa), as for Llama
    assert ops["dsv41.linear_half_multi"] == 2 and ops["dsv41.rope_gqa_decode_attention"] == 2, ops
    assert generic._close(got, want) < 0.05
