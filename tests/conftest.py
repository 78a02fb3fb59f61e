"""Shared fixtures: one eager `tiny` model per session (float32, checkpoint weights)."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model():
    """`tiny` preset, checkpoint weight mode, float32 activations, seeded random weights (seed 0)."""
    from dsv41.model import DeepseekV41Flash, ModelConfig
    return DeepseekV41Flash(ModelConfig.preset("tiny"), "checkpoint", torch.float32).init_random(0).eval()


@pytest.fixture(scope="session")
def tiny_prompt():
    """BENCHMARK.md workload prompt for `tiny`: 40 ids (longer than the window 16 and top-k 8)."""
    from dsv41.model import ModelConfig, benchmark_prompt
    return benchmark_prompt(ModelConfig.preset("tiny"), 40)
