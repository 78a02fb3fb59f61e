"""The HTML fusion report (dsv41/compiler/html.py) and the `dsv41 report` command, on CPU without compiles.

The report is built by hand from records (as the compiler would), the page is parsed back with the standard
library's `html.parser`, and the expected tables and cells are written out here. A headless-Chromium test
renders the page where a `chromium` binary is on PATH.
"""

import base64
import shutil
import struct
import subprocess
from html.parser import HTMLParser

import pytest
import torch

from dsv41.compiler.html import render_html, write_html
from dsv41.compiler.report import FusionReport, GraphReport, KernelCount
from dsv41.passes.records import Finding, MatchRecord, NearMiss, PassRecord, SourceLocation

EVIL_FAMILY = '<script>alert("family")</script>'
EVIL_REASON = "</td><img src=x onerror=alert(1)> & more"


class Page(HTMLParser):
    """Tags, text, and every table as {"headers": [...], "rows": [[cell text, ...], ...]}; img attributes."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags, self.data, self.tables, self.imgs, self.h2 = [], [], [], [], []
        self._cell = None
        self._in_h2 = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "table":
            self.tables.append({"headers": [], "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = [tag, ""]
        elif tag == "img":
            self.imgs.append(dict(attrs))
        elif tag == "h2":
            self._in_h2 = True
            self.h2.append("")

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            kind, text = self._cell
            t = self.tables[-1]
            (t["headers"] if kind == "th" else t["rows"][-1]).append(text.strip())
            self._cell = None
        elif tag == "h2":
            self._in_h2 = False

    def handle_data(self, data):
        self.data.append(data)
        if self._cell is not None:
            self._cell[1] += data
        if self._in_h2:
            self.h2[-1] += data

    def table(self, first_header: str, *more: str) -> dict:
        """The table whose header row starts with these names."""
        want = [first_header, *more]
        for t in self.tables:
            if t["headers"][:len(want)] == want:
                t["rows"] = [r for r in t["rows"] if r]
                return t
        raise AssertionError(f"no table with headers {want}; tables: {[t['headers'] for t in self.tables]}")


def _loc(file, line, fn, code, caller=None):
    stack = ((caller,) if caller else ()) + (f"{file}:{line} ({fn})",)
    return SourceLocation(file, line, fn, code, stack)


def _report(schedule=None) -> FusionReport:
    """Two graphs: dispatch fuses one linear in two layers (same line), rope_fp4 one chain and one near-miss,
    a family with a hostile name that matched once, and kernel counts on both graphs."""
    lin = _loc("/m/linear.py", 96, "forward", "return F.linear(x, w)", "/m/attention.py:118 (forward)")
    rope = _loc("/m/rope.py", 51, "apply_rope", "return torch.cat((nope, rot), -1)")
    d1 = MatchRecord("dispatch", "linear_fp8_block(act_quant=True)", "dsv41::linear_fp8_block", lin,
                     ("mul", "mm"), ("aten.mul.Tensor", "aten.mm.default"), "1000*B*L + 5000", "100*B*L + 600",
                     (("B", 1), ("L", 1)), (("layer", 0),))
    d2 = MatchRecord("dispatch", "linear_fp8_block(act_quant=True)", "dsv41::linear_fp8_block", lin,
                     ("mul_1", "mm_1"), ("aten.mul.Tensor", "aten.mm.default"), "1000*B*L + 5000", "100*B*L + 600",
                     (("B", 1), ("L", 1)), (("layer", 1),))
    r1 = MatchRecord("rope_fp4", "rope_fp4_quant(e4m3_1x16)", "dsv41::rope_fp4_quant", rope, ("a", "b", "c"),
                     ("aten.cat.default",) * 3, "512*B*L + 64", "256*B*L + 64", (("B", 1), ("L", 1)))
    miss = NearMiss("rope_fp4", "rope -> quantise", "fp4_quantiser", EVIL_REASON, rope)
    evil = MatchRecord(EVIL_FAMILY, "<b>pattern</b>", "dsv41::<i>op</i>",
                       _loc("/m/<evil>.py", 1, "f", "<script>x()</script>"), ("n",), ("aten.add",), "8*B", "4*B",
                       (("B", 1),))
    find = Finding("dispatch", "materialised_dequant", "weight 'w' is dequantised to <fp32> every step", lin)
    rep = FusionReport()
    rep.add_graph(GraphReport(0, "0/0", (
        PassRecord("normalize", True), PassRecord("rope_fp4", True, (r1,), (miss,)),
        PassRecord("dispatch", True, (d1,), (), (find,)), PassRecord(EVIL_FAMILY, True, (evil,))),
        KernelCount("cpu", 40, 12, "counted by hand")))
    rep.add_graph(GraphReport(1, "1/0", (
        PassRecord("normalize", True), PassRecord("rope_fp4", False, note="disabled by option"),
        PassRecord("dispatch", True, (d2,))), KernelCount("cpu", 10, 3, "counted by hand"),
        graph_after="def forward(self, x):\n    return x  # <not markup>"))
    d = rep.to_dict()
    if schedule is not None:
        d["schedule"] = schedule
    return rep, d


def _page(**kw) -> Page:
    _, d = _report(kw.pop("schedule", None))
    return Page(render_html(d, **kw))


def test_page_is_a_complete_document_with_inline_css_and_no_scripts():
    _, d = _report()
    text = render_html(d)
    assert text.startswith("<!DOCTYPE html>")
    p = Page(text)
    assert "style" in p.tags and "script" not in p.tags and "link" not in p.tags
    assert p.h2[:3] == ["Summary", "Per family", "Fused sites"]


def test_family_table_has_one_row_per_family_with_counts_by_hand():
    t = _page().table("family", "on", "matches", "nodes replaced", "near-misses", "findings")
    rows = {r[0]: r for r in t["rows"]}
    assert set(rows) == {"normalize", "c2_compressor", "rope_fp4", "mhc", "engram", "mhc_fold", "moe", "sparse_attention", "indexer", "small_ops", "upcast_linear", "dispatch", "grouped_pair", "sibling_gemv", "half_gemv", "rope_kv", "gqa_attention", "rope_gqa", "row_argmax", EVIL_FAMILY}
    # dispatch: 2 matches x 2 nodes, 1 finding; bytes at B=L=1: (1000+5000)*2 = 12 kB -> (100+600)*2 = 1.4 kB
    assert rows["dispatch"][1:6] == ["on", "2", "4", "0", "1"]
    assert rows["dispatch"][6] == "12.00 kB -> 1.40 kB"
    # rope_fp4 was switched off in graph 1, so the aggregate shows it off
    assert rows["rope_fp4"][1:5] == ["OFF", "1", "3", "1"]
    assert rows[EVIL_FAMILY][2] == "1"


def test_sites_table_groups_by_source_line_and_shows_layer_and_caller():
    t = _page().table("family", "pattern", "fused op", "source", "layer", "matches")
    rows = [r for r in t["rows"] if r[0] == "dispatch"]
    assert sorted(r[4] for r in rows) == ["0", "1"]  # one row per layer recorded in the match detail
    assert all(r[5] == "1" for r in rows)
    assert "linear.py:96 (forward)" in rows[0][3] and "called from attention.py:118 (forward)" in rows[0][3]


def test_near_misses_and_findings_tables_carry_checks_and_reasons():
    p = _page()
    miss = p.table("family", "pattern", "failed check", "reason")["rows"]
    assert miss == [["rope_fp4", "rope -> quantise", "fp4_quantiser", EVIL_REASON,
                     miss[0][4], "1"]] and "rope.py:51" in miss[0][4]
    finds = p.table("family", "kind", "message")["rows"]
    assert finds[0][:3] == ["dispatch", "materialised_dequant", "weight 'w' is dequantised to <fp32> every step"]


def test_kernel_table_sums_graphs():
    t = _page().table("graph", "device", "before", "after")
    assert t["rows"][-1][:4] == ["total", "", "50", "15"]


def test_hostile_text_is_escaped_not_interpreted():
    _, d = _report()
    text = render_html(d)
    p = Page(text)
    assert not {"script", "img", "b", "i"} & set(p.tags)  # no markup came from the report's strings
    body = "".join(p.data)
    for s in (EVIL_FAMILY, EVIL_REASON, "<b>pattern</b>", "<script>x()</script>", "# <not markup>"):
        assert s in body
    assert "&lt;script&gt;alert(&quot;family&quot;)&lt;/script&gt;" in text


def test_schedule_section_appears_only_when_the_report_has_one():
    assert "Schedule" not in _page().h2
    sched = {"side_stream": 1, "moved": [{"op": "<mhc_pre>", "layer": 0, "stream": "side"},
                                         {"op": "sinkhorn", "layer": 0, "stream": "side"}]}
    p = _page(schedule=sched)
    assert "Schedule" in p.h2
    t = p.table("op", "layer", "stream")
    assert t["rows"] == [["<mhc_pre>", "0", "side"], ["sinkhorn", "0", "side"]]


def _bench_result():
    """A benchmark result as `dsv41.bench.run_benchmark` returns it (two measured rows, one not installed)."""
    none = {"prefill_tok_s": None, "kernels_per_step": None, "roofline_fraction": None, "compile_s": None,
            "compile_warm_s": None, "peak_mem_gb": None, "tokens_match_eager": None, "max_rel_logit_err": None,
            "note": None}
    return {"preset": "tiny", "prompt_len": 20, "new_tokens": 4, "gpu": "Fake GPU", "torch": "2.x", "triton": "3.x",
            "copy_bandwidth_tb_s": 4.0, "decode_bytes_per_step": 2.5e8, "roofline_tok_s": 16.0,
            "backends": {"eager": {**none, "decode_tok_s": {"median": 10.0, "min": 9.0, "max": 11.0},
                                   "kernels_per_step": 900, "tokens_match_eager": True},
                         "dsv41": {**none, "decode_tok_s": {"median": 14.0, "min": 13.0, "max": 15.0},
                                   "kernels_per_step": 120, "compile_s": 30.0, "tokens_match_eager": True,
                                   "logit_err_vs_fp32": 0.02, "logit_err_vs_fp32_over_eager": 1.25},
                         "torch_tensorrt": {**none, "decode_tok_s": None, "note": "not installed"}}}


def _png_bytes():
    from dsv41.plots import benchmark_png
    return benchmark_png(_bench_result())


def test_png_is_embedded_as_base64(tmp_path):
    png = tmp_path / "plot.png"
    png.write_bytes(_png_bytes())
    p = _page(png_path=str(png))
    srcs = [i["src"] for i in p.imgs]
    assert len(srcs) == 1 and srcs[0].startswith("data:image/png;base64,")
    assert base64.b64decode(srcs[0].split(",", 1)[1]) == png.read_bytes()


def test_bench_section_lists_every_backend_and_draws_the_plot():
    p = _page(bench=_bench_result())
    t = p.table("backend", "decode tok/s median [min, max]", "kernels/step")
    assert [r[0] for r in t["rows"]] == ["eager", "dsv41", "torch_tensorrt"]
    assert t["rows"][0][1:3] == ["10.00 [9.00, 11.00]", "900"]
    assert t["rows"][2][-1] == "not installed"
    col = t["headers"].index("logit err vs fp32")  # issue [robust] 7: each row's error against the FP32 reference
    assert [r[col] for r in t["rows"]] == ["-", "2.00e-02 (1.25x eager)", "-"]
    assert len(p.imgs) == 1 and p.imgs[0]["src"].startswith("data:image/png;base64,iVBORw0KGgo")


def test_bad_inputs_raise_clear_errors(tmp_path):
    _, d = _report()
    with pytest.raises(TypeError, match="report_dict"):
        render_html([d])
    with pytest.raises(TypeError, match="bench"):
        render_html(d, bench="results.json")
    with pytest.raises(FileNotFoundError, match="png_path"):
        render_html(d, png_path=str(tmp_path / "missing.png"))
    (tmp_path / "x.png").write_bytes(b"GIF89a not a png")
    with pytest.raises(ValueError, match="not a PNG"):
        render_html(d, png_path=str(tmp_path / "x.png"))
    with pytest.raises(TypeError, match="FusionReport"):
        write_html(42, tmp_path / "r.html")


def test_write_html_accepts_a_report_or_its_dict(tmp_path):
    rep, d = _report()
    a = write_html(rep, tmp_path / "a" / "r.html")
    b = write_html(d, tmp_path / "b.html")
    ta, tb = open(a, encoding="utf-8").read(), open(b, encoding="utf-8").read()
    assert ta == tb and "<h2>Per family</h2>" in ta


def test_report_command_writes_the_page(tmp_path, monkeypatch, capsys):
    """`dsv41 report` wiring: build tiny, compile (stubbed to eager: no Inductor here), decode, write the page."""
    import dsv41.cli as cli
    import dsv41.harness as harness
    import dsv41.compiler.report as report_mod

    rep, _ = _report()
    calls = []
    monkeypatch.setattr(harness, "compile_model", lambda model, backend, options=None, **kw: calls.append(
        (backend, options)) or model)
    monkeypatch.setattr(report_mod, "last_report", lambda: rep if calls else None)
    out = tmp_path / "page.html"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["report", "--prompt-len", "8", "--out", str(out), "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(n)
    assert calls == [("dsv41", {"count_kernels": True})]
    assert "wrote" in capsys.readouterr().out
    assert Page(out.read_text()).table("family", "on", "matches")["rows"]


def test_report_command_fails_when_no_report_was_produced(tmp_path, monkeypatch):
    import dsv41.cli as cli
    import dsv41.harness as harness
    import dsv41.compiler.report as report_mod
    monkeypatch.setattr(harness, "compile_model", lambda model, backend, options=None, **kw: model)
    monkeypatch.setattr(report_mod, "last_report", lambda: None)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["report", "--prompt-len", "8", "--out", str(tmp_path / "p.html"), "--device", "cpu"]) == 1
    finally:
        torch.set_num_threads(n)
    assert not (tmp_path / "p.html").exists()


def _chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="no chromium / chromium-browser on PATH "
                                                "(apt-get install -y chromium)")
def test_page_renders_in_headless_chromium(tmp_path):
    """A real browser loads the page: the screenshot is a PNG of the window size with content drawn, and the
    browser's DOM holds the hostile family name as text, not as a script element."""
    _, d = _report()
    page = tmp_path / "report.html"
    page.write_text(render_html(d, bench=_bench_result()), encoding="utf-8")
    shot = tmp_path / "shot.png"
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1600"]
    url = page.resolve().as_uri()
    subprocess.run(base + [f"--screenshot={shot}", url], capture_output=True, timeout=180, check=False)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert (w, h) == (1280, 1600)
    import matplotlib.image
    img = matplotlib.image.imread(str(shot))
    assert img[..., :3].std() > 0.05  # text, tables and the plot were drawn, not a blank page
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    assert "<table" in dom and "<script" not in dom
    assert "&lt;script&gt;alert(\"family\")&lt;/script&gt;" in dom
