"""Tensor parallelism (dsv41/model/tp.py) and its launcher (dsv41/launch.py) on CPU: gloo, 2 and 4 spawned ranks.

The reference is the UNSHARDED tiny model (float32, checkpoint weights, seed 0) run in this process; every
rank builds the same seeded model and `apply_tp` keeps its slice. Spawning is expensive (each rank imports
torch), so one spawn per world size runs every variant and returns plain tensors; the tests then compare.

Tolerances. Sharded results differ from the unsharded ones only by the order of float32 additions (partial
GEMMs summed by the all-reduce instead of one K-loop): ~5e-6 on logits. Every FP8/FP4 quantisation point
sees the same 32-blocks as in the unsharded model (splits are block aligned), so the bound is 1e-4; a
rounding flip of a fake-quantised value (MODEL.md §4.1 "modulo quant rounding") would show as a jump of
1e-2 or more and fail it. Greedy tokens must be identical. Padding adds exact zeros, so padded and
unpadded sharded runs must agree bit for bit.
"""

import argparse
import copy
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from dsv41.launch import init_distributed, run_tp, spawn
from dsv41.model import DeepseekV41Flash, ModelConfig, benchmark_prompt, generate
from dsv41.model.tp import DEFAULT_PAD_TO, UNIT_SCALE, apply_tp, tp_plan

PROMPT_LEN = 24          # > window 16; 12 ratio-2 rows and 24 ratio-1 rows > top-k 8; > candidate pool 16
DECODE_STEPS = 8
CACHE_LEN = PROMPT_LEN + DECODE_STEPS + 1   # what `generate` allocates (top-k tie-breaks depend on it)
PAD_ON, PAD_OFF = 128, 32                    # 128: every rank of tiny (inter 64) has padding; 32: none needed
RUN_TP_TOKENS = 3                            # `run_tp` generates twice (warm-up + measured): keep it short
W2_RUNS = [("tp", PAD_ON, True), ("tp", PAD_OFF, True), ("ep", PAD_ON, True), ("ep", PAD_OFF, True)]
W4_RUNS = [("tp", PAD_ON, True), ("ep", PAD_OFF, True), ("tp", PAD_OFF, False)]


# ---------------------------------------------------------------------------------------- shared helpers
def _tiny_model(weight_mode="checkpoint"):
    return DeepseekV41Flash(ModelConfig.preset("tiny"), weight_mode, torch.float32).init_random(0).eval()


def _one_layer_config():
    """A 1-layer tiny (a ratio-1 kv + index + candidate source: compressor, indexer, bank, window) with
    o_groups=1, so that on 2 ranks the heads of one wo_a group are split (the pre-`wo_b` all-reduce path).
    Dynamo traces the 8-layer tiny in ~30 s of CPU per rank; one layer holds every TP hook."""
    return dataclasses.replace(ModelConfig.preset("tiny"), name="tiny-1l", num_hidden_layers=1,
                               compress_ratios=[1, 0, 0], kv_source_layer_ids=[0], index_source_layer_ids=[0],
                               candidate_source_layer_id=0, engram_layer_ids=[], o_groups=1,
                               dspark_target_layer_ids=[0])


@torch.no_grad()
def _greedy(model, steps):
    """Prefill logits [1, P, V] and greedy tokens [1 + steps] (first from the prefill)."""
    ids = benchmark_prompt(model.config, PROMPT_LEN)
    model.setup_cache(1, CACHE_LEN)
    prefill = model(ids, torch.arange(PROMPT_LEN)[None])
    tok = prefill[:, -1:].argmax(-1)
    toks = [tok]
    for i in range(steps):
        tok = model(tok, torch.full((1, 1), PROMPT_LEN + i))[:, -1:].argmax(-1)
        toks.append(tok)
    return {"prefill": prefill, "tokens": torch.cat(toks, 1)[0]}


_SHARDED_TENSORS = {
    "experts.w1": "ffn.experts.w1", "experts.w1_scale": "ffn.experts.w1_scale",
    "experts.w2": "ffn.experts.w2", "experts.w2_scale": "ffn.experts.w2_scale",
    "shared.w1": "ffn.shared_experts.w1.weight", "shared.w1_scale": "ffn.shared_experts.w1.scale",
    "shared.w2": "ffn.shared_experts.w2.weight", "shared.w2_scale": "ffn.shared_experts.w2.scale",
    "wq_b": "attn.wq_b.weight", "wq_b_scale": "attn.wq_b.scale", "attn_sink": "attn.attn_sink",
    "wo_a": "attn.wo_a.weight", "wo_b": "attn.wo_b.weight", "wo_b_scale": "attn.wo_b.scale",
}


def _layer0_tensors(model):
    return {k: model.layers[0].get_parameter(v).detach().clone() for k, v in _SHARDED_TENSORS.items()}


# ---------------------------------------------------------------------------------------- rank workers
@torch.no_grad()
def _compile_check():
    """Sharded (ep) 1-layer decode step through torch.compile(fullgraph=True) with an eager-executing backend
    that records the graphs; compared with the eager step from the same cache state."""
    model = DeepseekV41Flash(_one_layer_config(), "checkpoint", torch.float32).init_random(0).eval()
    plan = apply_tp(model, moe_mode="ep")
    first = _greedy(model, 0)["tokens"].view(1, 1)
    pos = torch.full((1, 1), PROMPT_LEN)
    saved = {n: b.clone() for n, b in model.named_buffers()}
    eager = model(first, pos)
    for n, b in model.named_buffers():
        b.copy_(saved[n])
    graphs = []

    def recording_eager_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=recording_eager_backend)(first, pos)
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    out = {"plan": plan, "graphs": len(graphs), "all_reduce": sum("all_reduce" in t for t in targets),
           "max_diff": (compiled - eager).abs().max().item()}
    # The same step through the dsv41 backend: every family on, the functional collectives inside the graph.
    import dsv41
    for n, b in model.named_buffers():
        b.copy_(saved[n])
    torch._dynamo.reset()
    fused = torch.compile(model, fullgraph=True, backend="dsv41")(first, pos)
    rep = dsv41.last_report().to_dict()
    out.update(dsv41_graphs=len(rep["graphs"]),
               dsv41_rel_err=((fused - eager).abs().max() / eager.abs().max()).item(),
               dsv41_patterns={f: sorted(s["pattern"] for s in d["sites"]) for f, d in rep["families"].items()
                               if f != "normalize"})
    return out


def _tp_worker(runs, shard_runs, extras, json_path=None):
    """One rank: every (moe_mode, pad_to, decode?) run on a fresh copy of the seeded tiny model."""
    full = _tiny_model()
    out = {"rank": dist.get_rank(), "runs": {}, "shards": {}}
    for mode, pad, decode in runs:
        model = copy.deepcopy(full)
        plan = apply_tp(model, moe_mode=mode, pad_to=pad)
        out["runs"][(mode, pad)] = {"plan": plan, **_greedy(model, DECODE_STEPS if decode else 0)}
        if (mode, pad) in shard_runs:
            out["shards"][(mode, pad)] = _layer0_tensors(model)
        del model
    if "subgroup3" in extras:
        g3 = dist.new_group([0, 1, 2])
        out["subgroup3"] = None
        if dist.get_rank() < 3:
            try:
                apply_tp(copy.deepcopy(full), group=g3)
            except ValueError as e:
                out["subgroup3"] = str(e)
    if "bf16" in extras:   # dense weights: the unquantised slicing paths (expert stacks without scales)
        model = _tiny_model("bf16")
        apply_tp(model, moe_mode="tp", pad_to=PAD_ON)
        out["bf16"] = _greedy(model, 0)["prefill"]
    if "compile" in extras:
        out["compile"] = _compile_check()
    if "run_tp" in extras:
        args = argparse.Namespace(preset="tiny", prompt_len=PROMPT_LEN, new_tokens=RUN_TP_TOKENS, backend="eager",
                                  device="cpu", weight_mode="checkpoint", dtype="fp32", seed=0, check=True,
                                  json=json_path, tp=dist.get_world_size(), tp_moe="tp", tp_pad_to=None)
        out["run_tp"] = run_tp(args)
    return out


# ---------------------------------------------------------------------------------------- fixtures
class _Threads:
    """Run the reference single-threaded, like each CPU rank (and quicker on a shared 2-core box)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


@pytest.fixture(scope="module")
def reference():
    with _Threads():
        model = _tiny_model()
        ref = {**_greedy(model, DECODE_STEPS), "layer0": _layer0_tensors(model)}
        ref["bf16"] = _greedy(_tiny_model("bf16"), 0)["prefill"]
        ref["generate"] = generate(model, benchmark_prompt(model.config, PROMPT_LEN), RUN_TP_TOKENS).tokens[0]
        return ref


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp") / "run_tp.json")
    res = spawn(_tp_worker, 2, W2_RUNS, [("tp", PAD_ON), ("ep", PAD_OFF)], ["bf16", "compile", "run_tp"], path,
                device="cpu")
    return res, path


@pytest.fixture(scope="module")
def tp4():
    return spawn(_tp_worker, 4, W4_RUNS, [], ["subgroup3"], device="cpu")


def _results(request, world):
    res = request.getfixturevalue("tp2" if world == 2 else "tp4")
    return res[0] if world == 2 else res


FULL_RUNS = [(2, m, p) for m, p, d in W2_RUNS if d] + [(4, m, p) for m, p, d in W4_RUNS if d]


# ---------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("world,mode,pad", FULL_RUNS)
def test_sharded_prefill_logits_match_unsharded(request, reference, world, mode, pad):
    res = _results(request, world)
    assert [r["rank"] for r in res] == list(range(world))     # spawn returns results in rank order
    got = res[0]["runs"][(mode, pad)]["prefill"]
    assert got.shape == reference["prefill"].shape and torch.isfinite(got).all()
    assert (got - reference["prefill"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("world,mode,pad", FULL_RUNS)
def test_sharded_greedy_tokens_match_unsharded_over_8_decode_steps(request, reference, world, mode, pad):
    got = _results(request, world)[0]["runs"][(mode, pad)]["tokens"]
    assert got.shape == (DECODE_STEPS + 1,)
    assert torch.equal(got, reference["tokens"])


def test_sharded_bf16_weight_mode_prefill_matches_unsharded(tp2, reference):
    for r in tp2[0]:
        assert (r["bf16"] - reference["bf16"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_computes_bitwise_identical_logits(request, world):
    # The head is replicated and every all-reduce hands all ranks the same sum.
    res = _results(request, world)
    for key, run in res[0]["runs"].items():
        for other in res[1:]:
            assert torch.equal(other["runs"][key]["prefill"], run["prefill"]), (key, other["rank"])
            assert torch.equal(other["runs"][key]["tokens"], run["tokens"]), (key, other["rank"])


@pytest.mark.parametrize("world,mode", [(2, "tp"), (2, "ep"), (4, "tp")])
def test_padding_changes_nothing(request, world, mode):
    res = _results(request, world)
    on, off = res[0]["runs"][(mode, PAD_ON)], res[0]["runs"][(mode, PAD_OFF)]
    assert on["plan"].inter == PAD_ON and off["plan"].inter == PAD_OFF
    assert torch.equal(on["prefill"], off["prefill"])
    if "tokens" in on and on["tokens"].numel() == off["tokens"].numel():
        assert torch.equal(on["tokens"], off["tokens"])


# ---------------------------------------------------------------------------------------- shard layout
def _split_check(full, shards, dim, real, padded, fill):
    """Rank r's shard = full[r*real:(r+1)*real] along dim, then (padded - real) entries equal to fill."""
    for r, s in enumerate(shards):
        assert s.shape[dim] == padded
        assert torch.equal(s.narrow(dim, 0, real), full.narrow(dim, r * real, real)), (r, dim)
        assert (s.narrow(dim, real, padded - real) == fill).all(), r


def test_tp_shards_hold_the_unsharded_bytes_plus_zero_weights_and_unit_scales(tp2, reference):
    shards = [r["shards"][("tp", PAD_ON)] for r in tp2[0]]
    full = reference["layer0"]
    # Routed experts [E, inter, d/2] / [E, inter, d/32] and [E, d, inter/2] / [E, d, inter/32]: inter 64 -> 32 real
    # per rank, padded to 128 (FP4 packed: 2 elements per byte; scales: 1 per 32 elements).
    _split_check(full["experts.w1"], [s["experts.w1"] for s in shards], 1, 32, 128, 0)
    _split_check(full["experts.w1_scale"], [s["experts.w1_scale"] for s in shards], 1, 32, 128, UNIT_SCALE)
    _split_check(full["experts.w2"], [s["experts.w2"] for s in shards], 2, 16, 64, 0)
    _split_check(full["experts.w2_scale"], [s["experts.w2_scale"] for s in shards], 2, 1, 4, UNIT_SCALE)
    # Shared expert, FP8 32x32 blocks: w1 rows / w2 columns, scale grids by 32-blocks.
    _split_check(full["shared.w1"], [s["shared.w1"] for s in shards], 0, 32, 128, 0)
    _split_check(full["shared.w1_scale"], [s["shared.w1_scale"] for s in shards], 0, 1, 4, UNIT_SCALE)
    _split_check(full["shared.w2"], [s["shared.w2"] for s in shards], 1, 32, 128, 0)
    _split_check(full["shared.w2_scale"], [s["shared.w2_scale"] for s in shards], 1, 1, 4, UNIT_SCALE)
    # Attention (4 heads x 64, o_groups 2 x o_lora 32): 2 heads and 1 whole group per rank.
    _split_check(full["wq_b"], [s["wq_b"] for s in shards], 0, 128, 128, 0)
    _split_check(full["wq_b_scale"], [s["wq_b_scale"] for s in shards], 0, 4, 4, 0)
    _split_check(full["attn_sink"], [s["attn_sink"] for s in shards], 0, 2, 2, 0)
    _split_check(full["wo_a"], [s["wo_a"] for s in shards], 0, 32, 32, 0)
    _split_check(full["wo_b"], [s["wo_b"] for s in shards], 1, 32, 32, 0)
    _split_check(full["wo_b_scale"], [s["wo_b_scale"] for s in shards], 1, 1, 1, 0)


def test_ep_ranks_hold_disjoint_expert_ranges_and_a_split_shared_expert(tp2, reference):
    shards = [r["shards"][("ep", PAD_OFF)] for r in tp2[0]]
    plans = [r["runs"][("ep", PAD_OFF)]["plan"] for r in tp2[0]]
    assert [(p.expert_start, p.experts) for p in plans] == [(0, 4), (4, 4)]
    full = reference["layer0"]
    for name in ("experts.w1", "experts.w1_scale", "experts.w2", "experts.w2_scale"):
        assert torch.equal(torch.cat([s[name] for s in shards], 0), full[name])
    _split_check(full["shared.w1"], [s["shared.w1"] for s in shards], 0, 32, 32, 0)
    _split_check(full["shared.w2"], [s["shared.w2"] for s in shards], 1, 32, 32, 0)


def test_four_ranks_split_each_o_group_between_two_ranks(tp4):
    plans = [r["runs"][("tp", PAD_ON)]["plan"] for r in tp4]
    assert [(p.heads, p.head_start, p.o_groups, p.group_share, p.o_group) for p in plans] == \
        [(1, 0, 1, 2, 0), (1, 1, 1, 2, 0), (1, 2, 1, 2, 1), (1, 3, 1, 2, 1)]
    # inter 64 = two 32-blocks over 4 ranks: ranks 2 and 3 hold padding only.
    assert [(p.inter_start, p.inter_real, p.inter) for p in plans] == \
        [(0, 32, 128), (32, 32, 128), (64, 0, 128), (64, 0, 128)]


# ---------------------------------------------------------------------------------------- compile
def test_compiled_sharded_decode_step_is_one_graph_with_the_all_reduces(tp2):
    for r in tp2[0]:
        c = r["compile"]
        assert c["plan"].group_share == 2 and c["plan"].moe_mode == "ep"
        assert c["graphs"] == 1                              # fullgraph=True raised on any break; one graph
        assert c["all_reduce"] == 2                          # pre-wo_b + MoE output (one layer)
        assert c["max_diff"] == 0.0
        # dsv41 on the sharded model (gloo, 2 ranks): one graph, logits of eager to FP32 rounding, and the MoE
        # tail matched through the all-reduce that follows it (the collective stays a separate graph op).
        assert c["dsv41_graphs"] == 1
        assert c["dsv41_rel_err"] < 1e-5, c["dsv41_rel_err"]
        pats = c["dsv41_patterns"]
        assert pats["moe"] == ["moe_combine -> all_reduce", "moe_router"], pats["moe"]
        assert sum(p.startswith("grouped_linear_fp4") for p in pats["dispatch"]) == 3  # this rank's experts


# ---------------------------------------------------------------------------------------- errors
def test_apply_tp_on_three_ranks_rejects_four_heads(tp4):
    msgs = [r["subgroup3"] for r in tp4]
    assert msgs[3] is None                                   # not a member of the 3-rank group
    for m in msgs[:3]:
        assert "num_attention_heads=4" in m and "world_size=3" in m


def _cfg(**kw):
    return dataclasses.replace(ModelConfig.preset("tiny"), name="tiny-mod", **kw)


@pytest.mark.parametrize("cfg,world,mode,pad,needle", [
    (_cfg(), 3, "tp", None, "num_attention_heads=4 is not divisible by world_size=3"),
    (_cfg(), 8, "tp", None, "num_attention_heads=4 is not divisible by world_size=8"),
    (_cfg(num_attention_heads=12, o_groups=4), 6, "tp", None, "o_groups=4 and world_size=6"),
    (_cfg(o_lora_rank=16), 2, "tp", None, "not whole 32-column FP8 blocks"),
    (_cfg(n_routed_experts=6), 4, "ep", None, "n_routed_experts=6 is not divisible by world_size=4"),
    (_cfg(), 2, "tp", 48, "pad_to must be a positive multiple of 32"),
    (_cfg(), 2, "tp", 0, "pad_to must be a positive multiple of 32"),
    (_cfg(), 2, "dp", None, "unknown moe_mode 'dp'"),
])
def test_tp_plan_rejects_unshardable_configs_with_a_clear_error(cfg, world, mode, pad, needle):
    with pytest.raises(ValueError, match=needle):
        tp_plan(cfg, 0, world, mode, pad)


def test_apply_tp_needs_an_initialised_group_and_a_model():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        apply_tp(_tiny_model())
    with pytest.raises(TypeError, match="DeepseekV41Flash"):
        apply_tp(torch.nn.Linear(2, 2))


def test_init_distributed_needs_torchrun_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="RANK is not set"):
        init_distributed("cpu")
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------- plans at scale
def test_default_padding_turns_full_scale_576_rows_per_rank_into_640():
    full = ModelConfig.preset("full")
    plans = [tp_plan(full, r, 4) for r in range(4)]
    assert DEFAULT_PAD_TO == 128
    assert [(p.inter_start, p.inter_real, p.inter) for p in plans] == [(i * 576, 576, 640) for i in range(4)]
    assert [(p.heads, p.o_groups, p.group_share) for p in plans] == [(16, 2, 1)] * 4
    ep = tp_plan(full, 3, 8, "ep")
    assert (ep.experts, ep.expert_start, ep.inter_real, ep.inter) == (48, 144, 288, 384)


# ---------------------------------------------------------------------------------------- dsv41 run --tp
def test_run_tp_rank0_writes_json_with_unsharded_tokens(tp2, reference):
    res, path = tp2
    assert [r["run_tp"] for r in res] == [0, 0]
    with open(path) as f:
        out = json.load(f)
    assert out["tp"]["world_size"] == 2 and out["tp"]["moe_mode"] == "tp" and out["tp"]["ranks_agree"]
    assert out["tp"]["inter_per_rank"] == DEFAULT_PAD_TO
    assert out["tokens"] == reference["generate"].tolist()


# ------------------------------------------------------------------------------------------- barrier gap
def test_barrier_gap_from_kernel_durations_hand_computed():
    from dsv41.launch import barrier_gap_us
    # rank 0 arrives early at collectives 0 and 2 (waits 30 and 10 us), rank 1 at collective 1 (waits 5 us)
    got = barrier_gap_us([[40.0, 12.0, 20.0], [10.0, 17.0, 10.0]])
    assert got == {"collectives": 3, "barrier_gap_us_median": 10.0, "barrier_gap_us_max": 30.0,
                   "allreduce_us_median": 10.0}
    assert barrier_gap_us([[], []])["barrier_gap_us_median"] is None
    with pytest.raises(ValueError, match="different numbers"):
        barrier_gap_us([[1.0], [1.0, 2.0]])


def test_allreduce_kernels_are_picked_from_profiler_events_in_start_order():
    from types import SimpleNamespace as NS

    from dsv41.launch import allreduce_kernel_durations_us

    def ev(name, dev, start, end):  # Kineto event: times in ns
        return NS(name=lambda: name, device_type=lambda: NS(name=dev), start_ns=lambda: start * 1000,
                  duration_ns=lambda: (end - start) * 1000)
    events = [ev("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "CUDA", 50, 58),
              ev("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "CUDA", 10, 30),
              ev("c10d::allreduce_", "CPU", 5, 60),  # the host-side call, not the kernel
              ev("triton_poi_fused_add_0", "CUDA", 31, 33)]
    assert allreduce_kernel_durations_us(events) == [20.0, 8.0]
