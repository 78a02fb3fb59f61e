"""Every document and repository path the user-facing text cites exists in the repository.

Scanned: README.md, docs/*.md, bench/README.md, bench/probes/README.md, the README of every run folder under
bench/results/, the `--help` of `dsv41`, `dsv41 run`, `dsv41 bench` and `dsv41 report` (argparse only: no model is
built), every docstring, comment and string literal of dsv41/**/*.py (error messages cite documents too), and the
docstrings and comments of tests/*.py.

Checked, each failure named as `citing file:line`:
- a cited `NAME.md` exists: next to the citing file, at the repository root or in docs/ (`MODEL.md` is docs/MODEL.md);
- `MODEL.md §2.3` (also `§2.5-§2.7`, `§2.9, §2.1`): docs/MODEL.md has a heading with that section number;
- `ARCHITECTURE.md "Pipeline stages"`, `BENCHMARK.md 'Metric'`, `MODEL.md §2.9 "Router"`, `row "mHC"`: the quoted
  name occurs in that document;
- a repository path (`bench/...`, `docs/...`, `dsv41/...`, `tests/...`) exists; `*` must match a file, `{a,b}` is
  expanded, and placeholders (`<run>`, `<family>`, `...`) are not paths, nor is `<commit>:path` (a file of another
  commit, as in `git show 1020b14:bench/...`). Files a run wrote on the device machine are cited as `$OUT/...` or by
  bare name in the run READMEs, never as repository paths, so every repository path there must exist too.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import itertools
import os
import re
import sys
import tokenize

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_]*\.md)\b")
_SECTIONS = re.compile(r"MODEL\.md,? (§ ?\d+(?:\.\d+)*(?:\s*(?:(?:-|–)\s*§? ?|(?:,|and|, and)\s*§ ?)\d+(?:\.\d+)*)*)")
_SECTION_NUM = re.compile(r"\d+(?:\.\d+)*")
_NAME = r"(?:\"(?P<dq>[^\"\n]{1,80})\"|'(?P<sq>[^'\n]{1,80})')"
_QUOTED = re.compile(r"\b(?P<doc>ARCHITECTURE|BENCHMARK|MODEL)\.md(?: §\s?[\d.]*\d)?,? \(?" + _NAME)
_ROW = re.compile(r"\b(?P<doc>ARCHITECTURE)\.md[^\n]{0,40}?row " + _NAME)
_IN_COMMIT = re.compile(r"\b[0-9a-f]{7,40}:$")
_PATH = re.compile(r"(?<![\w./<>-])((?:bench|docs|dsv41|tests)/[\w./*{},<>-]*[\w*}>/])")


def _rel(path: str) -> str:
    return os.path.relpath(path, REPO).replace(os.sep, "/")


def _texts_of_python(path: str, strings: bool = True):
    """(line, text) of every comment and string literal of a Python file (docstrings included); with
    `strings=False` only comments and docstrings (tests build made-up paths in their string literals)."""
    with open(path, "rb") as f:
        source = f.read()
    docstrings = set()
    if not strings:
        for node in ast.walk(ast.parse(source)):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                docstrings.add(body[0].value.lineno)
    for tok in tokenize.tokenize(io.BytesIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and (strings or tok.start[0] in docstrings)):
            yield tok.start[0], tok.string


def _texts_of_file(path: str):
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            yield i, line


def _help_texts():
    """(name, text) of the --help output of the console commands (argparse exits before anything is built)."""
    from dsv41 import cli

    out = []
    for argv in ([], ["run"], ["bench"], ["report"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exit_info:
            cli.main([*argv, "--help"])
        assert exit_info.value.code == 0, f"dsv41 {' '.join(argv)} --help exited with {exit_info.value.code}"
        out.append((" ".join(["dsv41", *argv, "--help"]), buf.getvalue()))
    return out


def _sources():
    """(display name, directory relative paths resolve against, [(line, text)])."""
    mds = [os.path.join(REPO, "README.md"), os.path.join(REPO, "bench", "README.md"),
           os.path.join(REPO, "bench", "probes", "README.md")]
    mds += sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    mds += sorted(glob.glob(os.path.join(REPO, "bench", "results", "*", "README.md")))
    for p in mds:
        yield _rel(p), os.path.dirname(p), list(_texts_of_file(p))
    for p in sorted(glob.glob(os.path.join(REPO, "dsv41", "**", "*.py"), recursive=True)):
        yield _rel(p), os.path.dirname(p), list(_texts_of_python(p))
    for p in sorted(glob.glob(os.path.join(REPO, "tests", "*.py"))):
        if os.path.abspath(p) != os.path.abspath(__file__):  # this file cites what does not exist, on purpose
            yield _rel(p), os.path.dirname(p), list(_texts_of_python(p, strings=False))
    for name, text in _help_texts():
        yield name, REPO, list(enumerate(text.splitlines(), 1))


def _doc_file(name: str, here: str) -> str | None:
    for d in (here, REPO, os.path.join(REPO, "docs")):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


_HEADINGS: dict = {}


def _model_sections() -> set:
    if "model" not in _HEADINGS:
        with open(os.path.join(REPO, "docs", "MODEL.md"), encoding="utf-8") as f:
            _HEADINGS["model"] = {m.group(1) for m in re.finditer(r"^#+ (\d+(?:\.\d+)*)\.? ", f.read(), re.M)}
    return _HEADINGS["model"]


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "")).lower()


def _expand_braces(path: str) -> list:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(itertools.chain.from_iterable(
        _expand_braces(path[:m.start()] + alt + path[m.end():]) for alt in m.group(1).split(",")))


def _path_exists(path: str) -> bool:
    for p in _expand_braces(path):
        full = os.path.join(REPO, p)
        if "*" in p:
            if not glob.glob(full):
                return False
        elif not os.path.exists(full):
            return False
    return True


def missing_citations() -> list:
    """'file:line: what' for every citation that does not resolve."""
    bad = []
    for name, here, lines in _sources():
        for line, text in lines:
            where = f"{name}:{line}"
            for m in _DOC.finditer(text):
                if _doc_file(m.group(1), here) is None:
                    bad.append(f"{where}: document {m.group(1)!r} is not in the repository")
            for m in _SECTIONS.finditer(text):
                for num in _SECTION_NUM.findall(m.group(1)):
                    if num not in _model_sections():
                        bad.append(f"{where}: docs/MODEL.md has no section §{num} ({m.group(0)!r})")
            for m in itertools.chain(_QUOTED.finditer(text), _ROW.finditer(text)):
                doc = _doc_file(m.group("doc") + ".md", os.path.join(REPO, "docs"))
                quoted = m.group("dq") or m.group("sq")
                if doc is None:
                    continue  # reported above
                with open(doc, encoding="utf-8") as f:
                    if _normalised(quoted) not in _normalised(f.read()):
                        bad.append(f"{where}: {m.group('doc')}.md has no {quoted!r}")
            for m in _PATH.finditer(text):
                cited = m.group(1).rstrip(".,;:")
                if "<" in cited or "..." in cited or cited.count("{") != cited.count("}") \
                        or _IN_COMMIT.search(text[:m.start()]):
                    continue  # a placeholder, a brace list broken over lines, or `git show <commit>:path`
                if not _path_exists(cited):
                    bad.append(f"{where}: path {cited!r} does not exist")
    return bad


def test_every_cited_document_section_and_path_exists():
    bad = missing_citations()
    assert not bad, f"{len(bad)} citation(s) that do not resolve:\n" + "\n".join(bad)


def test_the_checker_reports_a_missing_path_document_and_section(tmp_path, monkeypatch):
    """The checker itself: a made-up README citing what does not exist is reported, line by line."""
    fake = tmp_path / "README.md"
    fake.write_text("fine: docs/MODEL.md, MODEL.md §2.3, bench/run_gpu.sh, ARCHITECTURE.md \"Pipeline stages\"\n"
                    "gone: bench/no_such_tool.py\n"
                    "gone: NO_SUCH_NOTES.md\n"
                    "gone: MODEL.md §9.9\n"
                    "gone: BENCHMARK.md \"No such section\"\n")
    monkeypatch.setattr(sys.modules[__name__], "_sources", lambda: [("README.md", str(tmp_path),
                                                                    list(_texts_of_file(str(fake))))])
    bad = missing_citations()
    assert [b.split(":")[1] for b in bad] == ["2", "3", "4", "5"], bad
