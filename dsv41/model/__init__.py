"""DeepSeek-V4.1 Flash in plain eager PyTorch (MODEL.md): the compiler's input.

Public names: `ModelConfig`, `DeepseekV41Flash`, `Block`, `budget` (the parameter / byte / KV accounting of a
config, `budget.py`) and its result `Budget`, `generate`, `GenerateResult`, `benchmark_prompt`, and the chunked
prefill's `PREFILL_CHUNKS` / `chunk_plan` (`prefill.py`; `generate(..., compiled_prefill=True)` uses them).
`dsv41.model.budget` is the function; its module is `dsv41.model.budget` in `sys.modules` (import it as
`from dsv41.model.budget import ...` for the other helpers there).
"""

from .._package import repair as _repair

_repair()  # `dsv41` imported as a namespace package (a script beside the clone): run its __init__ now

from .budget import Budget, budget  # noqa: E402
from .config import ModelConfig  # noqa: E402
from .generate import GenerateResult, benchmark_prompt, generate  # noqa: E402
from .model import Block, DeepseekV41Flash  # noqa: E402
from .prefill import PREFILL_CHUNKS, chunk_plan  # noqa: E402

__all__ = ["ModelConfig", "DeepseekV41Flash", "Block", "generate", "GenerateResult", "benchmark_prompt", "budget",
           "Budget", "PREFILL_CHUNKS", "chunk_plan"]
