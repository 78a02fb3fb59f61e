"""The HTML report leads with its point (issue [first-contact] item 6).

The page of a real `tiny` CPU compile (`tests/data/tiny_cpu_report.json.gz`: `dsv41 run`'s report, graph records
dropped; its page was 17,305 px tall and 1,794 px wide at a 1280 px window before) must read: summary first, then a
plot of ops and bytes per family before / after (inline SVG, drawn without a benchmark), then the fused sites,
heaviest first; zero-byte rewrites and the side-stream schedule folded, the schedule left out when it was not
applied. Headless Chromium renders it and measures the height and every element's right edge.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv41.compiler.html import render_html

DATA = Path(__file__).parent / "data" / "tiny_cpu_report.json.gz"


def _tiny() -> dict:
    with gzip.open(DATA, "rt") as f:
        return json.load(f)


def _sections(page: str) -> list[str]:
    """Top-level h2 titles in page order."""
    return [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<h2>(.*?)</h2>", page)]


def test_summary_then_plot_then_families_then_sites_heaviest_first():
    d = _tiny()
    page = render_html(d)
    assert _sections(page)[:3] == ["Summary", "Per family", "Fused sites"]
    summary = page[page.index("<h2>Summary</h2>"):page.index("<h2>Per family</h2>")]
    assert "6,810 &rarr; 231" in summary and "12.51 MB &rarr; 2.37 MB" in summary
    assert "rewrites (canonical forms, no bytes moved): normalize 123" in summary
    assert "<svg" in summary and 'class="plot"' in summary  # the plot, with no benchmark given
    assert "<img" not in page and "<script" not in page
    sites = page[page.index("<h2>Fused sites</h2>"):page.index("<h2>Near-misses")]
    first_table = sites[:sites.index("</table>")]
    saved = []
    for row in re.findall(r"<tr>(.*?)</tr>", first_table)[1:]:
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        n = int(cells[4])
        b, a = re.findall(r"([\d.]+) (B|kB|MB)", re.sub(r"<[^>]+>", "", cells[5]))
        scale = {"B": 1, "kB": 1e3, "MB": 1e6}
        saved.append(n * (float(b[0]) * scale[b[1]] - float(a[0]) * scale[a[1]]))
    # heaviest first (within the 2-decimal rounding of the page's numbers); the rest folded
    assert len(saved) == 15 and all(a >= 0.99 * b for a, b in zip(saved, saved[1:])), saved
    folded = re.findall(r"<details><summary>(.*?)</summary>", sites)
    assert any("lighter sites" in s for s in folded)
    assert any("move no bytes" in s and "normalize" in s for s in folded)
    assert "normalize" not in first_table


def test_the_schedule_is_left_out_when_not_applied_and_folded_when_applied():
    d = _tiny()
    assert d["schedule"]["applied"] is False
    assert "Schedule" not in _sections(render_html(d))
    d["schedule"]["applied"] = True
    page = render_html(d)
    i = page.index("<h2>Schedule</h2>")
    assert page.rfind("<details><summary>", 0, i) > page.rfind("</details>", 0, i)  # inside a closed <details>
    assert f"{len(d['schedule']['regions'])} region(s)" in page


def test_the_plot_reads_names_as_text_not_mathtext_or_markup():
    from dsv41.compiler.report_plot import family_svg

    d = _tiny()
    d["families"]["<b>$x$ & y</b>"] = dict(d["families"]["moe"])
    svg = family_svg(d)
    assert "&lt;b&gt;$x$ &amp; y&lt;/b&gt;" in svg and "<b>" not in svg


def _chromium():
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    return None


_PROBE = """<script>window.addEventListener('load', () => {
  const w = window.innerWidth, wide = [];
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > w + 1) wide.push(el.tagName + ':' + Math.round(r.right));
  }
  const pre = document.createElement('pre');
  pre.id = 'metrics';
  pre.textContent = JSON.stringify({height: document.documentElement.scrollHeight,
                                    scrollWidth: document.documentElement.scrollWidth, width: w, wide: wide});
  document.body.appendChild(pre);
});</script>"""


def _measure(tmp_path, page: str, width: int) -> dict:
    """Load `page` with a probe script appended (the report itself has none) at a window `width` px wide; returns
    {height, scrollWidth, width, wide: elements whose right edge passes the window}."""
    f = tmp_path / f"page{width}.html"
    f.write_text(page.replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},900", "--virtual-time-budget=5000",
           "--dump-dom", f.resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=180).stdout
    m = re.search(r'<pre id="metrics">(.*?)</pre>', dom)
    assert m, dom[-2000:]
    return json.loads(m.group(1))


@pytest.mark.skipif(_chromium() is None, reason="no chromium / chromium-browser on PATH (apt-get install -y chromium;"
                                                " .ci/run installs it where apt-get can)")
def test_the_page_fits_the_window_and_is_short_in_headless_chromium(tmp_path):
    page = render_html(_tiny())
    m = _measure(tmp_path, page, 1280)
    assert m["width"] == 1280 and m["scrollWidth"] <= 1280 and not m["wide"], m
    assert m["height"] < 6000, m  # was 17,305 px
    narrow = _measure(tmp_path, page, 800)
    assert narrow["scrollWidth"] <= 800 and not narrow["wide"], narrow


@pytest.mark.skipif(_chromium() is None, reason="no chromium / chromium-browser on PATH (apt-get install -y chromium;"
                                                " .ci/run installs it where apt-get can)")
def test_an_applied_schedule_and_long_names_still_fit_the_window(tmp_path):
    d = _tiny()
    d["schedule"]["applied"] = True  # its table of 43 regions was 1,794 px wide
    long = "a_family_name_without_any_break_" * 4
    d["families"][long] = dict(d["families"]["moe"], note="x" * 300)
    m = _measure(tmp_path, render_html(d).replace("<details>", "<details open>"), 1000)
    assert m["scrollWidth"] <= 1000 and not m["wide"], m
