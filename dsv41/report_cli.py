"""`dsv41 report`: build a preset, compile it with the dsv41 backend, decode a few tokens and write the HTML fusion
report (rendered by `dsv41.compiler.html`). An app-layer command: it builds and runs a model, which the compiler
package never does (tests/test_layers.py)."""

from __future__ import annotations

import json
import sys

from .compiler.html import read_png, write_html
from .usage import UsageError

__all__ = ["main"]


def _report_args(argv):
    """Parse and check `dsv41 report` arguments before anything is built; returns the namespace with `device`,
    `preset`, `bench_result` (the --bench JSON or None) and `out_path` filled in. Raises: UsageError naming the
    flag (device, lengths beyond the preset's max_position_embeddings, a --bench or --png file that is missing or
    not JSON / PNG); argparse's own errors exit with status 2 after one line."""
    from .outputs import output_path
    from .usage import OneLineParser, check_lengths, int_at_least, resolve_device

    p = OneLineParser(prog="dsv41 report", description="write the dsv41 fusion report as an HTML page")
    p.add_argument("--preset", choices=("tiny", "small", "h200"), default=None,
                   help="default: small on a GPU, tiny on CPU")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--weight-mode", choices=("checkpoint", "bf16"), default="checkpoint")
    p.add_argument("--prompt-len", type=int_at_least(1), default=32)
    p.add_argument("--new-tokens", type=int_at_least(2, " (the report is of a decode step)"), default=3,
                   help="tokens to generate (default 3: two decode steps)")
    p.add_argument("--no-count-kernels", dest="count_kernels", action="store_false",
                   help="skip profiling kernels per step before/after")
    p.add_argument("--bench", default=None, help="a `dsv41 bench --json` result to include")
    p.add_argument("--png", default=None, help="a PNG to embed as the benchmark plot (default: drawn from --bench)")
    p.add_argument("-o", "--out", default=None, metavar="PATH",
                   help="a .html path, or a folder for dsv41_report.html (default out/)")
    a = p.parse_args(argv)
    a.device = resolve_device(a.device)
    a.preset = a.preset or ("small" if a.device.startswith("cuda") else "tiny")
    check_lengths(a.preset, a.prompt_len, a.new_tokens)
    a.bench_result = None
    if a.bench:
        try:
            with open(a.bench) as f:
                a.bench_result = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"argument --bench: cannot read {a.bench!r} as a `dsv41 bench --json` result: {e}") \
                from None
    if a.png:
        try:
            read_png(a.png)
        except (OSError, ValueError) as e:
            raise UsageError(f"argument --png: {e}") from None
    a.out_path = output_path(a.out, "dsv41_report.html", ".html")
    return a


def main(argv=None) -> int:
    """`dsv41 report`: build a preset, compile with backend="dsv41", decode a few tokens, write the HTML report
    (default `out/dsv41_report.html`, `-o` to choose) and print its path. On a GPU the page also gets "where the
    step goes" from profiled decode steps (`harness.profile_breakdown`; left out with a line on stderr if
    profiling fails).

    Returns 0, or 1 when the compile produced no fusion report. Raises: UsageError for a bad argument, before
    anything is built (`dsv41 report` prints it as one line with status 2). Options: see `dsv41 report --help`.
    """
    from . import harness
    from .compiler import report as report_mod
    from .model import benchmark_prompt, generate
    from .outputs import shown
    from .progress import Phases

    a = _report_args(argv)
    phases = Phases("dsv41 report")
    with phases.phase(f"building {a.preset} ({a.weight_mode}) on {a.device}"):
        model = harness.build_model(a.preset, a.device, a.weight_mode)
    before = report_mod.last_report()
    fast = harness.compile_model(model, "dsv41", {"count_kernels": a.count_kernels})
    prompt = benchmark_prompt(model.config, a.prompt_len, device=a.device)
    with phases.phase(f"dsv41: compile + {a.new_tokens} tokens",
                      hint=f"a cold {a.preset} compile takes minutes on a 2-core CPU" if a.device == "cpu" else ""):
        generate(fast, prompt, a.new_tokens)
    rep = report_mod.last_report()
    if rep is None or rep is before:
        print("dsv41 report: the dsv41 backend produced no fusion report (did the compile fall back?)",
              file=sys.stderr)
        return 1
    rep.set_layer_roles(model.config.roles)  # launches per layer role (the backend never sees the config)
    if a.device.startswith("cuda"):  # "where the step goes" needs a GPU profile
        harness.profile_breakdown(fast, prompt, a.new_tokens, rep)
    with phases.phase("writing the page"):
        write_html(rep, a.out_path, bench=a.bench_result, png_path=a.png)
    print(f"wrote {shown(a.out_path)} ({a.preset} on {a.device}, {len(rep.graphs)} graph(s)); open it in a browser")
    return 0
