"""DeepSeek-V4.1 Flash in plain eager PyTorch (MODEL.md): the compiler's input.

Public names: `ModelConfig`, `DeepseekV41Flash`, `Block`, `budget` (the parameter / byte / KV accounting of a
config, `budget.py`) and its result `Budget`, `generate`, `GenerateResult`, `benchmark_prompt`.
`dsv41.model.budget` is the function; its module is `dsv41.model.budget` in `sys.modules` (import it as
`from dsv41.model.budget import ...` for the other helpers there).
"""

from .budget import Budget, budget
from .config import ModelConfig
from .generate import GenerateResult, benchmark_prompt, generate
from .model import Block, DeepseekV41Flash

__all__ = ["ModelConfig", "DeepseekV41Flash", "Block", "generate", "GenerateResult", "benchmark_prompt", "budget",
           "Budget"]
