"""dsv41: a torch.compile backend for batch-1 LLM decode, first model DeepSeek-V4.1 Flash.

`torch.compile(model, backend="dsv41", options={...})` works without importing this package (entry point
`torch_dynamo_backends`); `dsv41.last_report()` returns the FusionReport of the most recent dsv41 compile.
`torch.compile(model, backend=dsv41.Backend())` does the same and keeps that compile's report on the object
(`Backend().report`).
Importing `dsv41` stays light: the compiler is imported on first use. The same names live in submodules, which
work from any working directory (`dsv41._version.__version__`, `dsv41.compiler.report.last_report`).
"""

from ._version import __version__

__all__ = ["__version__", "last_report", "Backend"]


def last_report():
    """The `FusionReport` of the most recent dsv41 compile in this process, or None if there was none.

    See `dsv41.compiler.report.FusionReport` (`to_dict()`, `to_json(path)`, `print()`, `summary()`, `str()`).
    """
    from .compiler.report import last_report as _last
    return _last()


def __getattr__(name):
    """`dsv41.Backend` (`dsv41.compiler.backend.Backend`), imported on first use so `import dsv41` stays light."""
    if name == "Backend":
        from .compiler.backend import Backend
        return Backend
    raise AttributeError(f"module 'dsv41' has no attribute {name!r}")
