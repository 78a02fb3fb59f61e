"""Speculative verify + rollback leaves every cache exactly as a run that only saw the accepted rows (MODEL.md §2.11).

For each cache kind of dsv41/model (window rings, kv-source banks, index keys, the ratio-2 compressor's pending
state, the Engram id history, the DSpark rings) the state after "verify M rows, keep the first `keep`, roll back"
is compared bit for bit with the state after a fresh forward over only the `keep` accepted rows from the same
starting point (the FP32 compressor state to float32 rounding: the two runs' GEMMs have different row counts).
Not compared: a bank's trash row (the write-only sink of tokens that complete no group; never read, unspecified
in plain runs too) and the compressor's `kv_trail`/`score_trail` scratch rows.
Each comparison is also shown able to fail: without the rollback the state differs for every kind.
"""

import pytest
import torch

from dsv41.model.speculative import CacheJournal

KINDS = ("window_ring", "bank", "index_keys", "compressor_state", "engram_history", "dspark_ring")


def _state(m, kind: str) -> dict:
    out = {}
    if kind == "dspark_ring":
        for s, st in enumerate(m.mtp):
            out[f"mtp.{s}.codes"], out[f"mtp.{s}.scales"] = st.attn.ring_codes, st.attn.ring_scales
    elif kind == "engram_history":
        out["history"] = m.engram_history
    for i, layer in enumerate(m.layers):
        a = layer.attn
        if kind == "window_ring":
            out[f"{i}.codes"], out[f"{i}.scales"] = a.ring_codes, a.ring_scales
        elif kind == "bank" and a.role == "full":
            out[f"{i}.codes"], out[f"{i}.scales"] = a.bank_codes[:, :-1], a.bank_scales[:, :-1]
        elif kind == "index_keys" and a.role == "full":
            out[f"{i}.codes"], out[f"{i}.scales"] = a.key_codes[:, :-1], a.key_scales[:, :-1]
        elif kind == "compressor_state" and a.compressor is not None and a.compressor.kv_state is not None:
            out[f"{i}.kv"], out[f"{i}.score"] = a.compressor.kv_state, a.compressor.score_state
    assert out, kind
    return {k: v.clone() for k, v in out.items()}


def _all(m) -> dict:
    return {kind: _state(m, kind) for kind in KINDS}


_CASES = {}
_PREFILLED = {}


def _case(m, prompt, prompt_len: int, keep: int):
    """(state after verify + rollback, state of the accepted-only run, state after verify without rollback)."""
    key = (prompt_len, keep)
    if key in _CASES:
        return _CASES[key]
    c = m.config
    mrows = c.dspark_block_size + 1
    gen = torch.Generator().manual_seed(1000 + prompt_len)
    rows = torch.randint(3, c.vocab_size - 20, (1, mrows), generator=gen)
    pos = torch.arange(prompt_len, prompt_len + mrows)[None]
    valid = torch.arange(mrows)[None] < keep
    m.setup_cache(1, 64)
    with torch.no_grad():
        if prompt_len not in _PREFILLED:
            _, feats = m(prompt[:, :prompt_len], torch.arange(prompt_len)[None], return_features=True)
            m.mtp.commit(feats, torch.arange(prompt_len)[None], torch.ones(1, prompt_len, dtype=torch.bool))
            _PREFILLED[prompt_len] = {n: b.clone() for n, b in m.named_buffers() if b is not None}
        start = _PREFILLED[prompt_len]
        for n, b in m.named_buffers():
            if b is not None:
                b.copy_(start[n])

        journal = CacheJournal(m, pos)
        _, vfeats = m(rows, pos, return_features=True)
        m.mtp.commit(vfeats, pos, torch.ones_like(valid))
        unrolled = _all(m)
        for n, b in m.named_buffers():
            if b is not None and n.startswith("mtp."):
                b.copy_(start[n])
        journal.rollback(torch.tensor([keep]))
        m.mtp.commit(vfeats, pos, valid)
        got = _all(m)

        for n, b in m.named_buffers():
            if b is not None:
                b.copy_(start[n])
        m(rows[:, :keep], pos[:, :keep])
        # The same feature rows, so the DSpark comparison isolates the masked commit.
        m.mtp.commit(vfeats[:, :keep], pos[:, :keep], torch.ones(1, keep, dtype=torch.bool))
        want = _all(m)
    _CASES[key] = (got, want, unrolled)
    return _CASES[key]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("keep", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt_len", [39, 40])  # verify starts on an even / odd position (pair opened / completed)
def test_rollback_equals_a_run_that_saw_only_the_accepted_rows(tiny_model, tiny_prompt, kind, keep, prompt_len):
    got, want, unrolled = _case(tiny_model, tiny_prompt, prompt_len, keep)
    for name in want[kind]:
        if kind == "compressor_state":
            # FP32 projections of a row: the verify's [M, d] GEMM and the reference's [keep, d] GEMM round
            # differently in the last bits (as prefill vs decode in test_model.py); a wrong row is off by O(1).
            torch.testing.assert_close(got[kind][name], want[kind][name], rtol=1e-5, atol=1e-6,
                                       msg=f"{kind} {name} after rollback (keep={keep})")
        else:
            assert torch.equal(got[kind][name], want[kind][name]), f"{kind} {name} after rollback (keep={keep})"
    if keep < tiny_model.config.dspark_block_size + 1:
        changed = [n for n in want[kind] if not torch.equal(unrolled[kind][n], want[kind][n])]
        if kind == "bank" or kind == "index_keys":
            # Ratio-1 sources write a row for every token, so a rejected row always leaves a trace.
            assert changed, f"{kind}: the comparison cannot fail (no rejected row wrote anything)"
        else:
            assert changed, f"{kind}: verify without rollback matched the accepted-only state"


def test_bank_rows_of_rejected_pairs_are_restored_to_their_old_bytes(tiny_model, tiny_prompt):
    """Ratio-2 source: a verify starting at odd 39 completes pair 19 (row 19, kept) and pair 20 at 41 (rejected)."""
    got, want, unrolled = _case(tiny_model, tiny_prompt, 39, 2)
    src = [i for i, layer in enumerate(tiny_model.layers) if layer.attn.role == "full" and layer.attn.ratio == 2][0]
    name = f"{src}.codes"
    assert not torch.equal(unrolled["bank"][name][:, 20], want["bank"][name][:, 20])
    assert torch.equal(got["bank"][name][:, 20], want["bank"][name][:, 20])
    assert not want["bank"][name][:, 20].any()  # never written by the accepted-only run
    assert torch.equal(got["bank"][name][:, 19], unrolled["bank"][name][:, 19])


def test_journal_rejects_verify_widths_that_wrap_the_ring(tiny_model):
    tiny_model.setup_cache(1, 64)
    w = tiny_model.config.sliding_window
    with pytest.raises(ValueError, match="sliding_window"):
        CacheJournal(tiny_model, torch.arange(w + 1)[None])
    with pytest.raises(ValueError, match="2 <= M"):
        CacheJournal(tiny_model, torch.arange(1)[None])


def _round_journal_matches_fresh_journals(m, prompt, device: str, graphs: bool):
    """Four verify rounds; each round's rollback through one reused `RoundJournal` (CUDA graphs when `graphs`)
    must leave every buffer bit-identical to a fresh eager `CacheJournal` of that round, from the same state after
    the same forward. Returns the round journal."""
    from dsv41.model.speculative import RoundJournal

    c = m.config
    width = c.dspark_block_size + 1
    m.setup_cache(1, 96)
    p = 21
    with torch.no_grad():
        m(prompt[:, :p].to(device), torch.arange(p, device=device)[None])
        rj = RoundJournal(m, 1, width, device, graphs=graphs)
        gen = torch.Generator().manual_seed(7)
        for r in range(4):
            pos = torch.arange(p, p + width, device=device)[None]
            rows = torch.randint(3, c.vocab_size - 20, (1, width), generator=gen).to(device)
            fresh = CacheJournal(m, pos.clone())
            rj.save(pos)
            m(rows, pos)
            after_forward = {n: b.clone() for n, b in m.named_buffers() if b is not None}
            keep = 1 + r % (width - 1)
            fresh.rollback(torch.tensor([keep], device=device))
            want = {n: b.clone() for n, b in m.named_buffers() if b is not None}
            for n, b in m.named_buffers():
                if b is not None:
                    b.copy_(after_forward[n])
            rj.rollback(torch.tensor([keep], device=device))
            for n, b in m.named_buffers():
                if b is not None:
                    assert torch.equal(b, want[n]), f"round {r} (keep {keep}): {n} differs from a fresh journal's"
            assert any(not torch.equal(want[n], after_forward[n]) for n in want), "the rollback restored nothing"
            p += keep
    return rj


def test_a_reused_round_journal_rolls_back_as_a_fresh_journal_per_round(tiny_model, tiny_prompt):
    """`generate_speculative` keeps one journal per generation (positions read at each `save`); on the CPU it runs
    uncaptured and must equal building a new `CacheJournal` every round."""
    rj = _round_journal_matches_fresh_journals(tiny_model, tiny_prompt, "cpu", graphs=False)
    assert rj.captures == 0 and rj.replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_round_journal_cuda_graphs_roll_back_as_a_fresh_journal_per_round(tiny_prompt):
    """The same on CUDA with the save and rollback captured on the second round and replayed after."""
    from dsv41.model import DeepseekV41Flash, ModelConfig

    m = DeepseekV41Flash(ModelConfig.preset("tiny"), "checkpoint", torch.float32).init_random(0).eval().cuda()
    rj = _round_journal_matches_fresh_journals(m, tiny_prompt, "cuda", graphs=True)
    assert rj.captures == 2 and rj.replays == 6  # round 1 uncaptured; rounds 2-4 replay both graphs


def test_generations_share_one_round_journal_per_cache_allocation(tiny_model, tiny_prompt):
    """`journal_for` hands every generation over the same caches the same journal (so CUDA graphs captured in a
    warm-up run replay in the measured runs), and a new one after `setup_cache` moved the caches."""
    from dsv41.model import generate
    from dsv41.model.speculative import journal_for

    width = tiny_model.config.dspark_block_size + 1
    prompt = tiny_prompt.reshape(1, -1)[:, :20]
    tiny_model.setup_cache(1, 96)
    generate(tiny_model, prompt, 6, speculative=True, simulate_acceptance=2.0)
    first = journal_for(tiny_model, 1, width)
    saves = first._calls["save"]
    assert saves >= 2  # at 2 tokens per round, 6 tokens take 3 rounds: the journal was this one
    generate(tiny_model, prompt, 6, speculative=True, simulate_acceptance=2.0)
    assert journal_for(tiny_model, 1, width) is first and first._calls["save"] == 2 * saves
    tiny_model.setup_cache(1, 200)
    moved = journal_for(tiny_model, 1, width)
    assert moved is not first and moved.journal.rows[0][0] is tiny_model.layers[0].attn.ring_codes


def test_round_phases_cover_each_round_of_a_speculative_generation(tiny_model, tiny_prompt):
    """`round_phases=True` times every verify round's phases; together they cover the round as the token clock
    sees it (only loop bookkeeping lies between), and they are refused for a plain generation."""
    from dsv41.model import generate
    from dsv41.model.speculative import ROUND_PHASES

    prompt = tiny_prompt.reshape(1, -1)[:, :20]
    out = generate(tiny_model, prompt, 10, speculative=True, simulate_acceptance=2.0, round_phases=True)
    assert len(out.round_phases_ms) == len(out.acceptance) >= 4
    assert all(tuple(r) == ROUND_PHASES and min(r.values()) >= 0 for r in out.round_phases_ms)
    # the tokens of round i carry its end time (timestamps[0]: the prefill); span i = end i - end i-1, i >= 1
    ends = sorted(set(out.timestamps))
    spans = [1e3 * (b - a) for a, b in zip(ends, ends[1:])]
    for ph, span in zip(out.round_phases_ms[1:], spans[1:]):
        assert 0.8 * span <= sum(ph.values()) <= span + 1e-6, (ph, span)
    assert generate(tiny_model, prompt, 4, speculative=True).round_phases_ms == []
    with pytest.raises(ValueError, match="round_phases"):
        generate(tiny_model, prompt, 4, round_phases=True)


def _fresh_tiny():
    from dsv41.model import DeepseekV41Flash, ModelConfig
    return DeepseekV41Flash(ModelConfig.preset("tiny"), "checkpoint", torch.float32).init_random(0).eval()


def test_setup_cache_frees_the_caches_a_speculative_generation_journaled():
    """The kept round journal must not keep an old cache allocation alive: not after a plain `setup_cache`, and not
    while `generate_speculative` grows the caches (old and new at once would not fit a GPU sized for one)."""
    import gc
    import weakref

    from dsv41.model import generate

    m = _fresh_tiny()
    prompt = torch.arange(3, 23)[None]
    generate(m, prompt, 6, speculative=True)
    old = weakref.ref(m.layers[0].attn.ring_codes)
    m.setup_cache(1, 30)
    gc.collect()
    assert old() is None, "setup_cache left the old caches alive"

    generate(m, prompt, 6, speculative=True)
    old = weakref.ref(m.layers[0].attn.ring_codes)
    real, alive = m.setup_cache, []

    def spy(b, n):
        real(b, n)
        gc.collect()
        alive.append(old() is not None)

    m.setup_cache = spy
    generate(m, prompt, 12, speculative=True)  # 20 + 12 + a verify width > the 30 positions allocated
    assert alive == [False], "old and new caches were alive together"


def test_a_journal_made_under_inference_mode_serves_generations_outside_it():
    from dsv41.model import generate

    m = _fresh_tiny()
    prompt = torch.arange(3, 23)[None]
    m.setup_cache(1, 64)
    with torch.inference_mode():
        a = generate(m, prompt, 6, speculative=True)
    b = generate(m, prompt, 6, speculative=True)
    assert torch.equal(a.tokens, b.tokens)
