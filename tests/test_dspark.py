"""DSpark drafts and speculative decoding on `tiny` (MODEL.md §2.11, §2.13; BENCHMARK.md simulated acceptance).

Eager tests use the session `tiny_model`. The compiled (`backend="dsv41"`) speculative run compiles `tiny` ONCE, in
a fresh interpreter (tests/fresh_tiny_dspark.py, module-scoped fixture): only the verify forward (block + 1 rows)
is compiled there.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from dsv41.model import DeepseekV41Flash, ModelConfig, generate
from dsv41.model.dspark import DSparkAttention, markov_decode
from dsv41.model.speculative import MatchExpected, greedy_acceptance

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dspark_helpers import OracleDrafter  # noqa: E402

N_TOKENS = 64


@pytest.fixture(scope="module")
def plain(tiny_model, tiny_prompt):
    """Plain greedy eager decode of 64 tokens: the reference every speculative run must reproduce."""
    with torch.no_grad():
        return generate(tiny_model, tiny_prompt, N_TOKENS)


# ------------------------------------------------------------------------------------ greedy equality (eager)
def test_greedy_speculative_equals_plain_greedy_over_64_tokens(tiny_model, tiny_prompt, plain):
    spec = generate(tiny_model, tiny_prompt, N_TOKENS, speculative=True)
    assert torch.equal(spec.tokens, plain.tokens)
    assert len(spec.timestamps) == N_TOKENS
    k = tiny_model.config.dspark_block_size
    assert all(1 <= r[0] <= k + 1 for r in spec.acceptance)
    # Every token after the first came from a verify round: the rounds emitted at least N - 1 tokens.
    assert sum(r[0] for r in spec.acceptance) >= N_TOKENS - 1
    assert spec.mean_acceptance == pytest.approx(sum(r[0] for r in spec.acceptance) / len(spec.acceptance))
    assert spec.acceptance == spec.natural_acceptance and spec.simulated_acceptance is None


def test_every_acceptance_length_reproduces_plain_greedy(tiny_model, tiny_prompt, plain):
    """Drafts that agree for exactly 0..K positions (an oracle drafter): accept that many plus the bonus token."""
    k = tiny_model.config.dspark_block_size
    ref = torch.cat((tiny_prompt, plain.tokens), dim=1)
    oracle = OracleDrafter(ref, k, [0, 1, 2, 3, 3, 1, 2, 0, 3], tiny_model.config.vocab_size)
    spec = generate(tiny_model, tiny_prompt, N_TOKENS, speculative=True, drafter=oracle)
    assert torch.equal(spec.tokens, plain.tokens)
    got = [r[0] for r in spec.acceptance]
    assert got == oracle.expected[:len(got)]
    assert set(got) == set(range(1, k + 2))


def test_batch_of_two_sequences_rolls_back_per_sequence(tiny_model, tiny_prompt, plain):
    """The same prompt twice, accepting different numbers of drafts per sequence (positions drift apart): both
    sequences must still produce the plain greedy tokens."""
    cfg = tiny_model.config
    prompts = tiny_prompt.expand(2, -1).contiguous()
    ref = torch.cat((prompts, plain.tokens.expand(2, -1)), dim=1)

    class PerSequence(OracleDrafter):
        def __call__(self, features, fpos, fvalid, last_token, start, ew, hw):
            drafts, conf = super().__call__(features, fpos, fvalid, last_token, start, ew, hw)
            if self.calls % 2:  # sequence 1 accepts everything on odd rounds, sequence 0 follows the schedule
                drafts[1] = self.truth(start)[1].to(drafts.device)
            return drafts, conf

    oracle = PerSequence(ref, cfg.dspark_block_size, [0, 2, 1], cfg.vocab_size)
    spec = generate(tiny_model, prompts, 24, speculative=True, drafter=oracle)
    assert any(r[0] != r[1] for r in spec.acceptance)
    assert torch.equal(spec.tokens[0], spec.tokens[1])
    assert torch.equal(spec.tokens, plain.tokens[:, :24].expand(2, -1))


def test_verify_rows_do_not_see_later_rows(tiny_model, tiny_prompt):
    """Row i of a verify forward depends on rows <= i only (bitwise), whatever the later drafts are."""
    m = tiny_model
    m.setup_cache(1, 64)
    with torch.no_grad():
        m(tiny_prompt[:, :35], torch.arange(35)[None])
        snap = {n: b.clone() for n, b in m.named_buffers() if b is not None}
        pos = torch.arange(35, 39)[None]
        outs = []
        for tail in ([500, 500], [7, 9], [300, 12]):
            for n, b in m.named_buffers():
                if b is not None:
                    b.copy_(snap[n])
            rows = torch.cat((tiny_prompt[:, 35:37], torch.tensor([tail])), dim=1)
            outs.append(m(rows, pos))
    for o in outs[1:]:
        assert torch.equal(o[:, :2], outs[0][:, :2])
        assert not torch.equal(o[:, 3], outs[0][:, 3])


# ------------------------------------------------------------------------------------ heads vs float64
def _last_stage(m):
    return m.mtp[len(m.mtp) - 1]


def test_markov_head_applied_sequentially_matches_float64_reference(tiny_model):
    st = _last_stage(tiny_model)
    v, d = tiny_model.config.vocab_size, tiny_model.config.hidden_size
    k = tiny_model.config.dspark_block_size
    g = torch.Generator().manual_seed(3)
    U = torch.randn(2, k, v, generator=g) * 2
    hidden = torch.randn(2, k, d, generator=g)
    y = torch.tensor([7, 300])
    with torch.no_grad():
        drafts, logits, _ = markov_decode(U, hidden, y, st.markov_head, st.confidence_head)
    W1 = st.markov_head.embed.weight.double()
    W2 = st.markov_head.head.weight.double()
    for b in range(2):
        prev = int(y[b])
        for i in range(k):
            ref = U[b, i].double() + W2 @ W1[prev]
            torch.testing.assert_close(logits[b, i].double(), ref, rtol=1e-5, atol=1e-5)
            prev = int(torch.argmax(ref))
            assert int(drafts[b, i]) == prev, (b, i)


def test_confidence_head_matches_float64_reference(tiny_model):
    st = _last_stage(tiny_model)
    v, d = tiny_model.config.vocab_size, tiny_model.config.hidden_size
    k = tiny_model.config.dspark_block_size
    g = torch.Generator().manual_seed(4)
    U = torch.randn(1, k, v, generator=g)
    hidden = torch.randn(1, k, d, generator=g)
    y = torch.tensor([42])
    with torch.no_grad():
        drafts, _, conf = markov_decode(U, hidden, y, st.markov_head, st.confidence_head)
    W1 = st.markov_head.embed.weight.double()
    P = st.confidence_head.proj.weight.double()[0]
    prevs = [42] + drafts[0, :-1].tolist()
    for i in range(k):
        ref = P[:d] @ hidden[0, i].double() + P[d:] @ W1[prevs[i]]  # the previous token of draft i
        assert float(conf[0, i]) == pytest.approx(float(ref), rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------------------------ drafter structure
def test_target_features_are_stream_means_of_the_target_layers_inputs(tiny_model, tiny_prompt):
    m = tiny_model
    seen = {}
    hooks = [m.layers[i].register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].clone()))
             for i in m.config.dspark_target_layer_ids]
    try:
        m.setup_cache(1, 64)
        with torch.no_grad():
            _, feats = m(tiny_prompt[:, :10], torch.arange(10)[None], return_features=True)
    finally:
        for h in hooks:
            h.remove()
    ref = torch.cat([seen[i].double().mean(dim=2) for i in m.config.dspark_target_layer_ids], dim=-1)
    torch.testing.assert_close(feats.double(), ref, rtol=1e-6, atol=1e-6)


def test_draft_attention_is_bidirectional_inside_the_block_and_never_stores_it(tiny_model):
    att = tiny_model.mtp[0].attn
    assert isinstance(att, DSparkAttention) and att.rotary.kind == "main"
    cfg = tiny_model.config
    tiny_model.setup_cache(1, 64)
    g = torch.Generator().manual_seed(5)
    ctx = torch.randn(1, 6, cfg.hidden_size, generator=g)
    att.commit(ctx, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
    ring = att.ring_codes.clone()
    x = torch.randn(1, 3, cfg.hidden_size, generator=g)
    pos = torch.arange(6, 9)[None]
    with torch.no_grad():
        a = att(x, pos)
        x2 = x.clone()
        x2[:, -1] += 1.0
        b = att(x2, pos)
    assert torch.equal(att.ring_codes, ring)                  # block rows are not written
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-4             # row 0 sees the last block row
    with torch.no_grad():
        att.reset_cache()
        c = att(x, pos)
    assert (a - c).abs().max() > 1e-4                         # and the committed context


def test_commit_writes_only_valid_rows(tiny_model):
    att = tiny_model.mtp[1].attn
    tiny_model.setup_cache(1, 64)
    x = torch.randn(1, 4, tiny_model.config.hidden_size)
    att.commit(x, torch.arange(20, 24)[None], torch.tensor([[True, True, False, False]]))
    w = tiny_model.config.sliding_window
    written = att.ring_codes[0].any(-1)
    assert written.nonzero().flatten().tolist() == [20 % w, 21 % w]


def test_dspark_checkpoint_names_follow_the_v41_module_tree(tiny_model):
    names = set(tiny_model.state_dict())
    last = tiny_model.config.num_dspark_stages - 1
    for key in ("mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", "mtp.0.attn.wkv.weight",
                "mtp.0.hc_attn_fn", "mtp.0.ffn.gate.bias", f"mtp.{last}.norm.weight",
                f"mtp.{last}.markov_head.embed.weight", f"mtp.{last}.markov_head.head.weight",
                f"mtp.{last}.confidence_head.proj.weight"):
        assert key in names, key
    cfg = tiny_model.config
    assert tuple(tiny_model.mtp[0].ffn.experts.w1.shape[:1]) == (cfg.dspark_n_routed_experts,)
    assert tiny_model.mtp[last].markov_head.embed.weight.shape == (cfg.vocab_size, cfg.dspark_markov_rank)
    assert tiny_model.mtp[last].confidence_head.proj.weight.shape == (1, cfg.hidden_size + cfg.dspark_markov_rank)
    assert not any(k.startswith("mtp.") and ".markov_head." in k for k in names if not k.startswith(f"mtp.{last}."))


# ------------------------------------------------------------------------------------ acceptance
def test_greedy_acceptance_is_the_longest_agreeing_prefix():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 6, 7], [5, 9, 7]])
    target = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 0], [5, 6, 7, 0], [5, 6, 7, 0]])
    assert greedy_acceptance(drafts, target).tolist() == [3, 2, 0, 1]


def test_match_expected_draws_the_two_neighbouring_lengths_with_the_expected_mean():
    sim = MatchExpected(5.5, 6, seed=0)
    draws = torch.cat([sim.draw(1) for _ in range(4000)])
    assert set(draws.tolist()) == {5, 6}
    assert draws.double().mean().item() == pytest.approx(5.5, abs=0.05)
    assert set(MatchExpected(4.0, 6).draw(50).tolist()) == {4}
    with pytest.raises(ValueError, match="block size"):
        MatchExpected(5.5, 4)


def test_simulated_acceptance_forces_the_round_lengths_and_reports_both_means(tiny_model, tiny_prompt):
    k = tiny_model.config.dspark_block_size
    spec = generate(tiny_model, tiny_prompt, 24, speculative=True, simulate_acceptance=k + 0.5)
    lengths = [r[0] for r in spec.acceptance]
    assert set(lengths) <= {k, k + 1} and spec.tokens.shape == (1, 24)
    assert spec.simulated_acceptance == k + 0.5
    assert abs(spec.mean_acceptance - (k + 0.5)) <= 0.5
    assert 1 <= spec.mean_natural_acceptance <= k + 1
    with pytest.raises(ValueError, match="speculative"):
        generate(tiny_model, tiny_prompt, 4, simulate_acceptance=5.5)
    with pytest.raises(ValueError, match="block size"):
        generate(tiny_model, tiny_prompt, 4, speculative=True, simulate_acceptance=k + 1.5)


def test_model_without_dspark_stages_refuses_speculation():
    import dataclasses
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), num_dspark_stages=0, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1])
    m = DeepseekV41Flash(cfg, "bf16", torch.float32)
    assert m.mtp is None
    with pytest.raises(ValueError, match="DSpark"):
        generate(m, torch.tensor([[5, 6]]), 2, speculative=True)


def test_cli_run_speculative_reports_the_mean_acceptance(tmp_path, monkeypatch):
    import dsv41.cli as cli
    import dsv41.harness as harness
    monkeypatch.setattr(harness, "compile_model", lambda model, backend, options=None, **kw: model)
    out = tmp_path / "run.json"
    with torch.no_grad():
        rc = cli.main(["run", "--device", "cpu", "--prompt-len", "8", "--new-tokens", "6", "--speculative",
                       "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["speculative"] is True and r["tokens_match_eager"] is True and r["mean_acceptance"] >= 1


# ------------------------------------------------------------------------------------ compiled (dsv41)
@pytest.fixture(scope="module")
def dspark_dsv41(tmp_path_factory):
    """tests/fresh_tiny_dspark.py in a fresh interpreter: ONE dsv41 compile of tiny's verify forward."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("dspark_dsv41") / "result.json"
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DSV41_REPORT", None)
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "fresh_tiny_dspark.py"), str(out),
                           str(N_TOKENS)], cwd=repo, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def test_compiled_speculative_equals_plain_greedy(dspark_dsv41):
    r = dspark_dsv41
    assert r["spec_tokens"] == r["plain_tokens"]
    assert all(1 <= a[0] <= 4 for a in r["acceptance"]) and r["mean_acceptance"] >= 1


def test_compiled_verify_accepts_every_scheduled_length(dspark_dsv41):
    r = dspark_dsv41
    assert r["spec_oracle_tokens"] == r["plain_tokens"]
    assert r["oracle_acceptance"] == [[e] for e in r["oracle_expected"]]


def test_compiled_verify_round_matches_eager_and_rolls_back_identically(dspark_dsv41):
    r = dspark_dsv41
    assert r["verify_argmax_equal"]
    assert r["verify_max_rel_logit_error"] < 1e-4
    assert r["verify_features_max_abs_error"] < 1e-4
    assert r["caches_differing_after_rollback"] == []


def test_verify_width_is_one_dynamo_graph(dspark_dsv41):
    """Only the verify forward is compiled: one graph, no recompile across rounds, acceptance lengths or drafters
    (nor for the separate verify-round check)."""
    assert dspark_dsv41["unique_graphs_generate"] == 1
    assert dspark_dsv41["unique_graphs"] == 1


def test_every_fusion_family_runs_on_the_verify_graph(dspark_dsv41):
    """The verify graph (block + 1 rows) goes through every family without a failure; the quantised matmuls, mHC
    sites and compressor writes are fused at the verify width too."""
    fams = dspark_dsv41["report"]["families"]
    for name in ("dispatch", "mhc", "c2_compressor", "moe", "engram"):
        assert fams[name]["matches"] > 0, name
    assert not [f for f in fams["dispatch"].get("near_misses") or []]
