"""User errors of the `dsv41` commands: one line, exit status 2, before any model is built.

Every check a command can make from its arguments alone runs here, before the model is built: a bad value found
after the eager reference (26-44 s on a 2-core CPU) or inside Dynamo (wrapped in `BackendCompilerFailed` with
PyTorch's bug-report hint) is what the first-contact issue reported. Each message names the flag or option key and
what is allowed, in argparse's own form: `dsv41 run: error: argument --prompt-len: ...`.

Public names: `UsageError`, `OneLineParser`, `int_at_least`, `positive_float`, `resolve_device`, `check_lengths`,
`check_options`, `usage_error`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Callable, Sequence

__all__ = ["backend_options", "UsageError", "OneLineParser", "int_at_least", "positive_float", "resolve_device", "check_lengths",
           "check_options", "usage_error"]


class UsageError(ValueError):
    """A bad input from the user (a flag, an option key or value, a size): the message names it and says what is
    allowed. A `ValueError`, so the Python API's callers that catch ValueError keep working."""


class OneLineParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line, `<prog>: error: <message>`, with exit status 2.

    argparse's default prints the usage block first; in a log the error then sits below a dozen lines of flags.
    `--help` still prints the usage. Subparsers made with `add_subparsers().add_parser` are of this class too.
    """

    def error(self, message: str):
        """Print `<prog>: error: <message>` to stderr and exit with status 2 (argparse calls this; never returns)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def usage_error(prog: str, err: BaseException | str) -> int:
    """Print `<prog>: error: <err>` (its first line) to stderr; returns the exit status 2."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    return 2


def int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An argparse `type=` that accepts a decimal integer >= `low`; otherwise argparse reports
    `argument --flag: must be an integer >= low<why>, got 'x'`."""

    def parse(text: str) -> int:
        """The integer in `text` (argparse.ArgumentTypeError when it is not one, or is below `low`)."""
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{why}, got {text!r}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


def positive_float(text: str) -> float:
    """An argparse `type=` for a number > 0 (argparse.ArgumentTypeError otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def resolve_device(device: str | None, flag: str = "--device") -> str:
    """The device a command runs on: `device` checked against this machine, or the default (cuda when a GPU is
    visible, else cpu).

    Returns "cpu", "cuda" or "cuda:N". Raises: UsageError naming `flag` for a device that is not cpu / cuda[:N],
    for cuda on a torch built without CUDA or on a machine with no visible GPU, and for an index past the GPUs.
    """
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    m = _DEVICE.fullmatch(device.strip().lower())
    if m is None or (m.group(1) == "cpu" and m.group(2) not in (None, "0")):
        raise UsageError(f"argument {flag}: unknown device {device!r}; allowed: cpu, cuda, cuda:N")
    if m.group(1) == "cpu":
        return "cpu"
    if torch.version.cuda is None:
        raise UsageError(f"argument {flag}: {device!r} needs a CUDA build of torch, and this torch "
                         f"{torch.__version__} has none; allowed here: cpu")
    if not torch.cuda.is_available():
        raise UsageError(f"argument {flag}: {device!r}: no CUDA GPU is visible (torch.cuda.is_available() is "
                         "False); allowed here: cpu")
    n = torch.cuda.device_count()
    if m.group(2) is not None and int(m.group(2)) >= n:
        raise UsageError(f"argument {flag}: {device!r}: this machine has {n} GPU(s); allowed: cpu, cuda, "
                         f"cuda:0..cuda:{n - 1}")
    return m.group(0)


def check_lengths(preset: str, prompt_len: int, new_tokens: int, extra: int = 0, what: str = "") -> None:
    """Check that a prompt of `prompt_len` plus `new_tokens` (plus `extra` cache positions, e.g. a speculative
    verify block, described by `what`) fits the preset's `max_position_embeddings`.

    Raises: UsageError naming --prompt-len / --new-tokens and the limit; ValueError for an unknown preset.
    """
    from .model.config import ModelConfig

    limit = ModelConfig.preset(preset).max_position_embeddings
    need = prompt_len + new_tokens + extra
    if need > limit:
        raise UsageError(f"argument --prompt-len/--new-tokens: prompt {prompt_len} + {new_tokens} new tokens"
                         + (f" + {extra} ({what})" if extra else "")
                         + f" = {need} positions, beyond the {preset} preset's max_position_embeddings {limit}; "
                         f"allowed: at most {limit - extra - new_tokens} prompt tokens with --new-tokens {new_tokens}")


def check_options(items: Sequence[str], backend: str = "dsv41", flag: str = "--option") -> dict:
    """Parse `--option KEY=VALUE` items (`backend_options`) and validate them as the dsv41 backend will
    (`dsv41.compiler.options.parse_options`), so a bad key or value fails before any work.

    Returns the options dict ({} for no items). Raises: UsageError naming the flag and item: an item without `=`,
    options with a backend other than dsv41, an unknown key (the valid keys listed) or a bad value.
    """
    from .compiler.options import parse_options

    if not items:
        return {}
    if backend != "dsv41":
        raise UsageError(f"argument {flag}: backend options apply to --backend dsv41 only, not {backend!r} "
                         f"(got {' '.join(items)})")
    opts = backend_options(items)
    try:
        parse_options(opts, environ={})
    except (TypeError, ValueError) as e:
        raise UsageError(f"argument {flag}: {e}") from None
    return opts


def backend_options(pairs) -> dict:
    """`--option KEY=VALUE` strings -> the dsv41 `options` dict; VALUE is read as JSON (true, 3, ["moe"]) where it
    parses, else kept as a string. Raises UsageError (a ValueError) for an item without `=` (the backend validates
    the keys: `dsv41.usage.check_options` does both)."""
    out = {}
    for item in pairs or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"argument --option: {item!r}: expected KEY=VALUE, e.g. --option streams=false")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out
