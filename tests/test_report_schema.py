"""The fusion report as data (issue [house] #38 item 2): `to_dict()` carries `schema_version`, the text and HTML
renderers read that dict (so a report read back from JSON renders as the live one), and a report of a newer
schema is refused with one line wherever a report is read back. Fast: a hand-built report, no compile."""

from __future__ import annotations

import json

import pytest

from dsv41.compiler import report_text
from dsv41.compiler.html import render_html
from dsv41.compiler.report_schema import SCHEMA_VERSION, ReportSchemaError, check_schema, read_report
from report_fixture import hand_built_report


def test_the_json_form_starts_with_its_schema_version(tmp_path):
    d = hand_built_report().to_dict()
    assert SCHEMA_VERSION == 1
    assert next(iter(d)) == "schema_version" and d["schema_version"] == SCHEMA_VERSION
    hand_built_report().to_json(tmp_path / "r.json")
    assert read_report(tmp_path / "r.json")["schema_version"] == SCHEMA_VERSION


def test_a_report_read_back_renders_as_the_live_one(tmp_path):
    rep = hand_built_report()
    rep.to_json(tmp_path / "r.json")
    d = read_report(tmp_path / "r.json")
    assert report_text.render(d) == str(rep)
    assert report_text.summary(d) == rep.summary()
    assert render_html(d) == render_html(rep.to_dict())


def test_a_report_without_the_key_is_version_1():
    d = hand_built_report().to_dict()
    with_key = report_text.render(d)
    del d["schema_version"]
    assert check_schema(d) is d and report_text.render(d) == with_key


def _newer(tmp_path):
    d = hand_built_report().to_dict()
    d["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(d, default=str))
    return d, path


def test_a_newer_schema_is_refused_with_one_line_where_a_report_is_read(tmp_path):
    d, path = _newer(tmp_path)
    with pytest.raises(ReportSchemaError) as e:
        read_report(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    assert f"schema_version {SCHEMA_VERSION + 1}, newer than this dsv41 reads ({SCHEMA_VERSION})" in msg
    for render in (report_text.render, report_text.summary, render_html):
        with pytest.raises(ReportSchemaError, match="newer than this dsv41 reads"):
            render(d)


@pytest.mark.parametrize("bad, words", [(0, "expected an integer >= 1"), ("1", "expected an integer >= 1"),
                                        (True, "expected an integer >= 1"), ([], "not a fusion report")])
def test_a_malformed_version_or_report_is_refused(bad, words):
    report = bad if isinstance(bad, list) else {"schema_version": bad}
    with pytest.raises(ReportSchemaError, match=words):
        check_schema(report)


def test_a_file_that_is_not_json_is_refused_by_name(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ReportSchemaError, match="broken.json is not JSON"):
        read_report(path)
