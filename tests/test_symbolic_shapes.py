"""Sizes known only at run time are ordinary input for the backend (issue [robust] item 2).

The model below is written the way a quick research port is: a flat dict of tensors, one function per decode step,
einsum everywhere, and caches that grow by `torch.cat` each step, so Dynamo's automatic dynamic shapes make the cache
length symbolic from the second distinct length on. Its indexer picks `min(4, length)` past positions with a top-k
whose k is computed in the graph (what crashed the compile before), its MoE routes with a DeepSeek-style
sqrt-softplus biased top-k (which dsv41 fuses: its sizes are static even in the dynamic graph).

The suite runs strict (conftest): a family that raises on any of these graphs fails the test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dsv41

WIDTH, HEADS, VOCAB, EXPERTS, ROUTED, PICK = 32, 4, 64, 8, 2, 4


def _weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (VOCAB, WIDTH), "wq": (WIDTH, WIDTH), "wk": (WIDTH, WIDTH), "wv": (WIDTH, WIDTH),
              "wo": (WIDTH, WIDTH), "iq": (WIDTH, 8), "ik": (WIDTH, 8), "router": (EXPERTS, WIDTH),
              "bias": (EXPERTS,), "up": (EXPERTS, 2 * WIDTH, WIDTH), "down": (EXPERTS, WIDTH, WIDTH),
              "lm": (VOCAB, WIDTH), "g1": (WIDTH,), "g2": (WIDTH,)}
    return {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}


def _norm(t, g):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + g)


def make_step(p: dict):
    """One decode step over caches that grow by one row: (token [1], k/v caches [L, H, dh], index keys [L, 8]) ->
    (logits [1, V], the three caches one row longer)."""
    dh = WIDTH // HEADS

    def step(tok, kc, vc, ic):
        x = p["emb"][tok]
        h = _norm(x, p["g1"])
        q = (h @ p["wq"]).view(1, HEADS, dh)
        kc = torch.cat([kc, (h @ p["wk"]).view(1, HEADS, dh)], 0)
        vc = torch.cat([vc, (h @ p["wv"]).view(1, HEADS, dh)], 0)
        ic = torch.cat([ic, h @ p["ik"]], 0)
        pick = ((h @ p["iq"]) @ ic.T).topk(min(PICK, ic.shape[0]), dim=-1).indices[0]
        att = torch.einsum("qhd,khd->hqk", q, kc[pick]) / math.sqrt(dh)
        x = x + torch.einsum("hqk,khd->qhd", att.softmax(-1), vc[pick]).reshape(1, WIDTH) @ p["wo"]
        h = _norm(x, p["g2"])
        score = F.softplus(h.float() @ p["router"].T).sqrt()
        ids = (score + p["bias"]).topk(ROUTED, dim=-1).indices
        w = score.gather(-1, ids)
        w = w / w.sum(-1, keepdim=True) * 1.5
        a, b = torch.einsum("td,kfd->kf", h, p["up"][ids[0]]).chunk(2, -1)
        y = torch.einsum("kf,kdf->kd", F.silu(a) * b, p["down"][ids[0]])
        x = x + (w[0, :, None] * y).sum(0, keepdim=True)
        return x @ p["lm"].T, kc, vc, ic

    return step


def decode(fn, steps: int = 8) -> torch.Tensor:
    """Greedy decode from token 3 with empty caches; the logits of every step [steps, V]."""
    dh = WIDTH // HEADS
    kc, vc, ic = torch.zeros(0, HEADS, dh), torch.zeros(0, HEADS, dh), torch.zeros(0, 8)
    tok, out = torch.tensor([3]), []
    for _ in range(steps):
        logits, kc, vc, ic = fn(tok, kc, vc, ic)
        out.append(logits)
        tok = logits.argmax(-1)
    return torch.cat(out)


def _compiled_decode(backend: str):
    """(logits, graphs compiled) of the decode loop under `torch.compile(step, backend=backend)`, defaults."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    logits = decode(torch.compile(make_step(_weights()), backend=backend))
    return logits, counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def growing():
    """The growing-cache loop in eager, Inductor and dsv41 (default settings), with dsv41's report."""
    eager = decode(make_step(_weights()))
    inductor, inductor_graphs = _compiled_decode("inductor")
    got, graphs = _compiled_decode("dsv41")
    return {"eager": eager, "dsv41": got, "graphs": graphs, "inductor_graphs": inductor_graphs,
            "report": dsv41.last_report().to_dict()}


def test_growing_cache_decode_equals_eager(growing):
    assert torch.equal(growing["dsv41"].argmax(-1), growing["eager"].argmax(-1))
    torch.testing.assert_close(growing["dsv41"], growing["eager"], rtol=1e-5, atol=1e-5)


def test_growing_cache_recompiles_no_more_than_inductor(growing):
    assert growing["graphs"] <= growing["inductor_graphs"], (growing["graphs"], growing["inductor_graphs"])


def test_router_in_the_dynamic_graph_is_fused_and_nothing_failed(growing):
    fams = growing["report"]["families"]
    # One router per compiled graph, the graph with the symbolic cache length included.
    assert fams["moe"]["matches"] == growing["graphs"]
    assert not [f for fam in fams.values() for f in fam["findings"] if f["kind"] == "family_failed"]


# Three one-line functions whose top-k k is computed in the graph: the shape of the bug report.
def _first_k(x):
    return torch.topk(x, min(4, x.shape[-1]), dim=-1).indices


def _softmax_k(x):
    return torch.topk(x.softmax(-1), min(3, x.shape[0]), dim=-1).values


def _sigmoid_k(x, w):
    return (x @ w).sigmoid().topk(min(2, x.shape[0]), dim=-1).values


@pytest.mark.parametrize("fn, shapes", [(_first_k, [(7, 9), (5, 11)]), (_softmax_k, [(5, 6), (3, 6)]),
                                        (_sigmoid_k, [((3, 16), (16, 8)), ((4, 16), (16, 8))])],
                         ids=["first_k", "softmax_k", "sigmoid_k"])
def test_symbolic_k_topk_compiles_and_equals_eager(fn, shapes):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="dsv41", dynamic=True)
    g = torch.Generator().manual_seed(1)
    for shape in shapes:
        args = [torch.randn(s, generator=g) for s in (shape if isinstance(shape[0], tuple) else [shape])]
        torch.testing.assert_close(compiled(*args), fn(*args))


def test_router_whose_k_is_computed_in_the_graph_is_a_static_k_near_miss():
    """A DeepSeek router whose k depends on a run-time length: the moe family names `static_k` and leaves it."""
    p = _weights(2)

    def route(h, seen):
        score = F.softplus(h @ p["router"].T).sqrt()
        ids = (score + p["bias"]).topk(min(ROUTED, seen.shape[0]), dim=-1).indices
        w = score.gather(-1, ids)
        return w / w.sum(-1, keepdim=True), ids

    torch._dynamo.reset()
    compiled = torch.compile(route, backend="dsv41", dynamic=True)
    h = torch.randn(1, WIDTH)
    for n in (5, 7):
        seen = torch.zeros(n)
        torch.testing.assert_close(compiled(h, seen), route(h, seen), rtol=0, atol=0)
    moe = dsv41.last_report().to_dict()["families"]["moe"]
    assert moe["matches"] == 0
    assert [m["check"] for m in moe["near_misses"]] == ["static_k"]
    assert "known only at run time" in moe["near_misses"][0]["reason"]
