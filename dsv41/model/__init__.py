"""DeepSeek-V4.1 Flash in plain eager PyTorch (MODEL.md): the compiler's input.

Public names: `ModelConfig`, `DeepseekV41Flash`, `budget`, `generate`, `benchmark_prompt`.
"""

from .config import ModelConfig
from .generate import GenerateResult, benchmark_prompt, generate
from .model import Block, DeepseekV41Flash

__all__ = ["ModelConfig", "DeepseekV41Flash", "Block", "generate", "GenerateResult", "benchmark_prompt", "budget"]


def __getattr__(name):
    if name in ("budget", "Budget"):
        from . import budget as _b
        return getattr(_b, name)
    raise AttributeError(name)
