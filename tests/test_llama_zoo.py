"""The third-party Llama spellings of `tests/zoo/` (issue [generic] #42): gpt-fast's and HF transformers', checked
against each other and against a float64 reference written out step by step, then compiled with dsv41.

Table-driven: every case is a row of `SHAPES` (sizes that exercise MHA, GQA and one KV head) or `CALLS` (prefill and
decode lengths); the references are the other spelling, a float64 loop, or eager, never dsv41's own code.
"""

from __future__ import annotations

import math

import pytest
import torch

from zoo import llama_gptfast as gf
from zoo import llama_hf_style as hf

#: (name, ModelArgs overrides): head layouts the two spellings must agree on.
SHAPES = [
    ("tiny-gqa", {}),
    ("mha", dict(n_head=4, n_local_heads=4)),
    ("one-kv-head", dict(n_head=8, n_local_heads=1, dim=64)),
    ("wide-head", dict(n_head=2, n_local_heads=1, dim=64, rope_base=10000.0)),
]


def _pair(overrides: dict, seed: int = 0, max_seq: int = 32):
    """A gpt-fast model and an HF-style model holding the same weights (fp32, CPU)."""
    args = gf.ModelArgs(**overrides)
    a = gf.build(args, seed=seed, max_seq_length=max_seq)
    b = hf.build(hf.config_from_gptfast(args), max_seq_length=max_seq)
    hf.load_gptfast_state(b, a.state_dict())
    return a, b


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _prefill_then_decode(model, prompt: torch.Tensor, steps: int, call=None) -> torch.Tensor:
    """Logits of the prompt's last position and of `steps` greedy decode steps, [steps + 1, B, vocab]."""
    call = model if call is None else call
    p = prompt.shape[1]
    out = [call(prompt, torch.arange(p))[:, -1]]
    for t in range(p, p + steps):
        out.append(call(out[-1].argmax(-1, keepdim=True), torch.tensor([t]))[:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("name, overrides", SHAPES, ids=[s[0] for s in SHAPES])
@torch.no_grad()
def test_gptfast_and_hf_spellings_give_the_same_logits(name, overrides):
    a, b = _pair(overrides)
    prompt = torch.randint(0, a.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    a.setup_caches(2, 32)
    b.setup_caches(2, 32)
    want = _prefill_then_decode(a, prompt, 4)
    got = _prefill_then_decode(b, prompt, 4)
    assert _rel(got, want) < 1e-5


@torch.no_grad()
def test_the_weight_map_is_not_the_identity_on_q_and_k():
    """The spellings pair RoPE channels differently, so copying wqkv rows as they are must break the agreement
    (guards the cross-check against passing with RoPE switched off or the permutation applied twice)."""
    a, b = _pair({})
    c = b.config
    kv = c.num_key_value_heads * c.head_dim
    for i, layer in enumerate(b.model.layers):
        q, k, _ = a.state_dict()[f"layers.{i}.attention.wqkv.weight"].split([c.hidden_size, kv, kv])
        layer.self_attn.q_proj.weight.copy_(q)
        layer.self_attn.k_proj.weight.copy_(k)
    prompt = torch.arange(9)[None] * 5
    assert _rel(_prefill_then_decode(b, prompt, 0), _prefill_then_decode(a, prompt, 0)) > 1e-3


def _attention_f64(x: torch.Tensor, wq, wk, wv, wo, n_head: int, n_kv: int, base: float) -> torch.Tensor:
    """One causal self-attention layer in float64, position by position, from the Llama paper's definitions:
    RoPE turns channel pair (2j, 2j + 1) of q and k at position t by t * base^(-2j / D); query head h reads KV
    head h // (n_head / n_kv); softmax over the positions up to t. x [S, E] -> [S, E]."""
    s, e = x.shape
    d = e // n_head
    x, wq, wk, wv, wo = (t.double() for t in (x, wq, wk, wv, wo))
    q = (x @ wq.T).view(s, n_head, d)
    k = (x @ wk.T).view(s, n_kv, d)
    v = (x @ wv.T).view(s, n_kv, d)

    def turn(u, t):
        out = u.clone()
        for j in range(d // 2):
            ang = t * base ** (-2 * j / d)
            c, sn = math.cos(ang), math.sin(ang)
            out[..., 2 * j] = u[..., 2 * j] * c - u[..., 2 * j + 1] * sn
            out[..., 2 * j + 1] = u[..., 2 * j] * sn + u[..., 2 * j + 1] * c
        return out
    q = torch.stack([turn(q[t], t) for t in range(s)])
    k = torch.stack([turn(k[t], t) for t in range(s)])
    y = torch.zeros(s, n_head, d, dtype=torch.float64)
    for t in range(s):
        for h in range(n_head):
            g = h // (n_head // n_kv)
            scores = torch.stack([q[t, h] @ k[u, g] for u in range(t + 1)]) / math.sqrt(d)
            w = torch.softmax(scores, 0)
            y[t, h] = sum(w[u] * v[u, g] for u in range(t + 1))
    return y.reshape(s, e) @ wo.T


@pytest.mark.parametrize("name, overrides", SHAPES[:3], ids=[s[0] for s in SHAPES[:3]])
@torch.no_grad()
def test_one_gptfast_attention_layer_equals_a_float64_reference(name, overrides):
    a, _ = _pair(overrides)
    args = a.config
    attn = a.layers[0].attention
    kv = args.n_local_heads * args.head_dim
    wq, wk, wv = attn.wqkv.weight.split([args.dim, kv, kv])
    x = torch.randn(1, 6, args.dim, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(6)
    got = attn(x, a.freqs_cis[pos], a.causal_mask[None, None, pos], pos)[0]
    want = _attention_f64(x[0], wq, wk, wv, attn.wo.weight, args.n_head, args.n_local_heads, args.rope_base)
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("spelling", ["gptfast", "hf_style"])
def test_dsv41_compiles_each_spelling_to_eager_logits(spelling):
    """Compiled with backend="dsv41" (static shapes: one graph for the prompt, one for decode), prefill + 3 decode
    steps give eager's logits to 1e-5 relative in fp32; the compiled copy has its own caches."""
    if spelling == "hf_style":
        _, eager = _pair({})
        twin = hf.build(eager.config, max_seq_length=32)
        twin.load_state_dict(eager.state_dict())
    else:
        eager = gf.build("llama-tiny", max_seq_length=32)
        twin = gf.build("llama-tiny", max_seq_length=32)  # same seed: the same weights
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="dsv41", dynamic=False)
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _prefill_then_decode(eager, prompt, 3)
        got = _prefill_then_decode(twin, prompt, 3, call=compiled)
    assert _rel(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
