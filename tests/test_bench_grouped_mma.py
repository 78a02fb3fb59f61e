"""CPU tests of the benchmark side of the word-decode grouped GEMV (dsv41/kernels/grouped_mma.py): the sweep
entries of `bench/kernels.py` and the plan choice of `bench/grouped_e2e.py`."""

from __future__ import annotations

import pytest

from gpu_harness import load_bench

from dsv41.kernels import grouped_mma as gm

_KERNELS = load_bench("kernels")
_E2E = load_bench("grouped_e2e")


def test_every_mma_words_sweep_entry_is_a_valid_plan_with_a_label_that_round_trips():
    entries = [c for c in _KERNELS.GROUPED_SWEEP if isinstance(c, dict) and c.get("mma_words")]
    assert len(entries) >= 4
    for cfg in entries:
        over, label = _KERNELS.sweep_overrides(cfg, True)
        assert over["mma_words"] is True and label.startswith("sweep mma_words")
        grid = _KERNELS._plan_grid(over, 1, 2304, 5120, True, pairs=6)
        plan_args = {k: v for k, v in cfg.items() if k != "mma_words"}
        assert grid == list(gm.grouped_mma_plan(6, 2304, 5120, **plan_args)["grid"])
        # grouped_e2e reads the plan back from the row label
        rows = [dict(kernel="grouped_linear_fp4", shape=s, variant=label, time_us=1.0)
                for s in ("grouped_w1w3", "grouped_w2")]
        assert _E2E.best_config(rows) == (plan_args, {"grouped_w1w3": 1.0, "grouped_w2": 1.0})


def _row(variant, shape, us, kernel="grouped_linear_fp4"):
    return dict(kernel=kernel, shape=shape, variant=variant, time_us=us)


def test_best_config_takes_the_least_summed_time_over_both_shapes():
    a = "sweep mma_words block_n=64 block_k=256 stages=3 programs_per_sm=4"
    b = "sweep mma_words block_n=128 block_k=256 stages=3 programs_per_sm=2 num_warps=8"
    c = "sweep mma_words block_n=64 block_k=512 stages=2 programs_per_sm=3"
    rows = [_row(a, "grouped_w1w3", 50.0), _row(a, "grouped_w2", 60.0),
            _row(b, "grouped_w1w3", 70.0), _row(b, "grouped_w2", 30.0),   # sum 100 < 110: b wins
            _row(c, "grouped_w1w3", 1.0),                                  # one shape only: not a candidate
            _row("sweep fma bn=128 bk=128 w=4 st=1", "grouped_w1w3", 0.5),
            _row("sweep fma bn=128 bk=128 w=4 st=1", "grouped_w2", 0.5),
            _row(a, "wq_b", 0.1, kernel="linear_fp8_block")]
    cfg, times = _E2E.best_config(rows)
    assert cfg == dict(block_n=128, block_k=256, stages=3, programs_per_sm=2, num_warps=8)
    assert times == {"grouped_w1w3": 70.0, "grouped_w2": 30.0}
    assert _E2E.best_config([_row(c, "grouped_w1w3", 1.0)]) == ({}, {})


def test_grouped_e2e_refuses_a_sweep_without_mma_words_rows(tmp_path):
    p = tmp_path / "sweep.json"
    p.write_text('{"rows": [{"kernel": "grouped_linear_fp4", "shape": "grouped_w2", "variant": "triton (graph)", '
                 '"time_us": 37.0}]}')
    assert _E2E.main([str(p), "--", "--preset", "tiny"]) == 3


def test_the_default_stays_the_cuda_core_kernel_and_cpu_never_picks_the_mma_kernel():
    import torch

    from dsv41.kernels import grouped_gemv as gg

    assert gg.MMA_WORDS_DEFAULT is False
    assert not gm.mma_words_supported(torch.device("cpu"))
    assert not gm.mma_words_supported(torch.device("meta"))
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 8, 32, dtype=torch.uint8)
    assert gm.mma_words_eligible(x, w, True)
    assert not gm.mma_words_eligible(x, w, False)
    assert not gm.mma_words_eligible(x.half(), w, True)
    assert not gm.mma_words_eligible(x, w[:, :, 1:29], True)  # 28-byte rows at a 1-byte offset: no int32 words
