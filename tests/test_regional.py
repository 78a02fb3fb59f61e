"""Regional compilation (`dsv41.compiler.regional`): `tiny` compiled region by region with dsv41.

The reference is the eager model's greedy output. The compiled model must produce the same tokens (FP32), compile
fewer graphs than it has regions (layers of one variant share a graph), not recompile on a second generation, and
put every region's graph into one fusion report, with launches per layer taken from the graphs each layer's region
ran in the first decode step.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def regional_run():
    from torch._dynamo.utils import counters

    from dsv41.cli import build_model
    from dsv41.compiler.regional import compile_regional
    from dsv41.model import benchmark_prompt, generate

    model = build_model("tiny", "cpu")
    prompt = benchmark_prompt(model.config, 40)
    ref = generate(model, prompt, 10)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    rm = compile_regional(model, "dsv41")
    first = generate(rm, prompt, 10)
    graphs = counters["stats"]["unique_graphs"] - before
    second = generate(rm, prompt, 10)
    return dict(model=model, rm=rm, ref=ref, first=first, second=second, graphs=graphs,
                graphs_after=counters["stats"]["unique_graphs"] - before)


def test_regional_tokens_equal_eager(regional_run):
    r = regional_run
    assert torch.equal(r["first"].tokens, r["ref"].tokens)
    assert torch.equal(r["second"].tokens, r["ref"].tokens)


def test_layers_share_graphs_and_nothing_recompiles(regional_run):
    r = regional_run
    n_regions = len(r["model"].layers) + 2  # embedding, layers, head
    assert 3 <= r["graphs"] < n_regions, r["graphs"]
    assert r["graphs_after"] == r["graphs"]  # the second generation hit every cached graph
    assert len(r["rm"].report.graphs) == r["graphs"]


def test_one_report_for_all_regions(regional_run):
    import dsv41

    rep = regional_run["rm"].report
    assert dsv41.last_report() is rep
    d = rep.to_dict()
    assert "regional" in d
    fams = d["families"]
    for fam in ("mhc", "moe", "dispatch", "sparse_attention"):
        assert fams[fam]["matches"] > 0, fam


def test_regional_rejects_bad_requests():
    from dsv41.cli import build_model, compile_model
    from dsv41.compiler.regional import compile_regional

    model = build_model("tiny", "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        compile_regional(model, "eager")
    with pytest.raises(ValueError, match="dsv41 backend only"):
        compile_regional(model, "inductor", {"debug": True})
    with pytest.raises(TypeError, match="DeepseekV41Flash"):
        compile_regional(torch.nn.Linear(2, 2), "dsv41")
    with pytest.raises(ValueError, match="unknown option|valid"):
        compile_regional(model, "dsv41", {"no_such_key": 1})
    assert compile_model(model, "eager", regional=True) is model  # eager never compiles
    assert type(compile_model(model, "dsv41", regional=True)).__name__ == "RegionalModel"


def test_regional_compiles_regions_without_inductor_graphs_and_captures_the_step_itself():
    """CUDA-graph trees would see each region call as a new generation (module docstring): the regions compile
    with cuda_graphs off, and the wrapper captures; PDL and side streams follow the wrapper's capture on CUDA as
    they follow Inductor's CUDA graphs; cuda_graphs=False turns the capture, and with it both, off."""
    from dsv41.cli import build_model
    from dsv41.compiler.regional import compile_regional

    model = build_model("tiny", "cpu")
    rm = compile_regional(model, "dsv41")
    opts = rm.report.options
    assert rm.cuda_graphs is True
    assert opts.cuda_graphs is False and opts.step_captured is True and not opts.use_cuda_graphs(True)
    assert opts.use_pdl(True) and not opts.use_pdl(False)
    on, why = opts.use_streams(True)
    assert on and "regional wrapper" in why
    assert opts.use_streams(False)[0] is False  # CPU: the wrapper never captures there
    off = compile_regional(model, "dsv41", {"cuda_graphs": False})
    assert off.cuda_graphs is False and off.report.options.step_captured is False
    assert not off.report.options.use_pdl(True) and off.report.options.use_streams(True)[0] is False
    # an explicit option still wins over the capture
    explicit = compile_regional(model, "dsv41", {"streams": False, "pdl": False}).report.options
    assert explicit.use_streams(True)[0] is False and not explicit.use_pdl(True)
    assert compile_regional(model, "inductor-cudagraphs").cuda_graphs is True
    assert compile_regional(model, "inductor").cuda_graphs is False


def test_launches_per_layer_come_from_the_graphs_each_region_ran(regional_run):
    """Every layer ran compiled graphs in the first decode step and gets their static launches; layers of one role
    and Engram presence (one shared graph) get equal counts; embedding + head count as `other`; per-role sums add
    up to the total once the roles are known."""
    r = regional_run
    rep, model = r["rm"].report, r["model"]
    steps = rep.regional_step_graphs
    n = len(model.layers)
    assert set(steps) == set(range(n)) | {"other"}
    assert all(steps[i] for i in range(n)) and steps["other"]
    kl = rep.to_dict()["kernels_by_layer"]
    assert list(kl["by_layer"]) == [str(i) for i in range(n)] + ["other"]
    assert all(kl["by_layer"][str(i)] > 0 for i in range(n)) and kl["by_layer"]["other"] > 0
    assert kl["total"] == sum(kl["by_layer"].values()) and kl["note"] == ""
    for i in range(n):
        for j in range(n):
            if steps[i] == steps[j]:
                assert kl["by_layer"][str(i)] == kl["by_layer"][str(j)]
    # The counts are the graphs' own static totals, attributed by which region called them.
    for i in range(n):
        assert kl["by_layer"][str(i)] == sum(rep.graphs[g].layer_kernels.total for g in steps[i])
    rep.set_layer_roles(model.config.roles)
    by_role = rep.to_dict()["kernels_by_role"]
    assert sum(v for k, v in by_role.items() if k != "per_layer") == kl["total"]
    assert set(by_role["per_layer"]) == set(model.config.roles)


def test_speculative_decoding_drafts_through_the_compiled_dspark_region(regional_run):
    """`generate(..., speculative=True)` on the regional wrapper verifies through the compiled regions and drafts
    through its compiled DSpark region (`RegionalModel.draft`), and greedy speculative output equals plain greedy
    output (eager's)."""
    from dsv41.model import benchmark_prompt, generate

    r = regional_run
    rm, model = r["rm"], r["model"]
    prompt = benchmark_prompt(model.config, 40)
    ref = generate(model, prompt, 24)
    calls = []
    real = rm._draft

    def counted(*a):
        calls.append(a[0].shape)
        return real(*a)

    rm._draft = counted
    try:
        out = generate(rm, prompt, 24, speculative=True)
    finally:
        rm._draft = real
    assert torch.equal(out.tokens, ref.tokens)
    assert len(calls) == len(out.acceptance) >= 2  # one draft per verify round (the first after the prefill)
    with pytest.raises(ValueError, match="no DSpark stages"):
        from dsv41.compiler.regional import RegionalModel
        bare = RegionalModel(model, lambda fn: fn, "eager")
        bare._draft = None
        bare.draft(*([torch.zeros(1)] * 7))
