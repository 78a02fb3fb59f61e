"""Hugging Face transformers' own `LlamaForCausalLM` (when installed) with a `StaticCache`: the zoo's HF-style
spelling reproduces it, and its decode step compiled with backend="dsv41" gives eager's logits in fp32.

Written against transformers 5.25 (`cache=` keyword; 4.x called it `past_key_values=`, both are accepted here).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from zoo import llama_hf_style as hfs  # noqa: E402

PROMPT, STEPS, CACHE = 8, 3, 32


def _config():
    """The `llama-tiny` sizes as a transformers `LlamaConfig` (untied head, SDPA attention)."""
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    attn_implementation="sdpa")


def _model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config()).eval()


def _decode(model, step=None) -> torch.Tensor:
    """Last-position logits of an eager prefill of a seeded prompt and of STEPS greedy decode steps run by `step`
    (default: the model itself), [STEPS + 1, 1, vocab], with a fresh StaticCache of CACHE positions."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step = model if step is None else step

    def call(fn, ids, pos):
        return fn(ids, position_ids=pos[None], cache_position=pos, use_cache=True, **{key: cache}).logits[:, -1]
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = [call(model, ids, torch.arange(PROMPT))]
        for t in range(PROMPT, PROMPT + STEPS):
            out.append(call(step, out[-1].argmax(-1, keepdim=True), torch.tensor([t])))
    return torch.stack(out)


def _rel(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def test_the_zoo_hf_spelling_reproduces_transformers_llama():
    """An independent check of the zoo: the same state dict in tests/zoo/llama_hf_style.py gives the same logits."""
    ref = _model()
    mine = hfs.build(hfs.LlamaConfig(), max_seq_length=CACHE)
    mine.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = [mine(ids, torch.arange(PROMPT))[:, -1]]
        for t in range(PROMPT, PROMPT + STEPS):
            got.append(mine(got[-1].argmax(-1, keepdim=True), torch.tensor([t]))[:, -1])
    assert _rel(torch.stack(got), _decode(ref)) < 1e-5


def test_dsv41_compiles_the_transformers_decode_step_to_eager_logits():
    eager = _model()
    twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="dsv41", dynamic=False)
    want = _decode(eager)
    got = _decode(twin, compiled)
    assert _rel(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
