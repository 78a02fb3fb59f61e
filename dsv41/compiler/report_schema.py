"""The version of the fusion report's JSON form, and reading a report back (docs/USAGE.md "The report JSON").

`FusionReport.to_dict()` / `to_json()` write `schema_version` (an int) as the first key. It goes up by one when a
field is removed, renamed or changes meaning; adding a field keeps it. A reader (`read_report`, the text and HTML
renderers) takes any version up to `SCHEMA_VERSION`, and a report written before the key existed as version 1
(the same fields); a newer one is refused with one line that says so, rather than failing on a missing key deep in
a renderer.

Public names: `SCHEMA_VERSION`, `ReportSchemaError`, `check_schema`, `read_report`.
"""

from __future__ import annotations

import json
import os

__all__ = ["SCHEMA_VERSION", "ReportSchemaError", "check_schema", "read_report"]

#: The schema version this dsv41 writes and the newest it reads.
SCHEMA_VERSION = 1


class ReportSchemaError(ValueError):
    """A report dict or JSON file this dsv41 cannot read: of a newer `schema_version`, a version that is not a
    positive int, or not a JSON object. The message is one line naming the version (and file)."""


def check_schema(report: dict, source: str = "report") -> dict:
    """`report` (a `FusionReport.to_dict()`, maybe read from JSON) when this dsv41 can read it.

    Args: report: the dict; source: what to call it in the error (e.g. the file name).
    Returns: `report` itself.
    Raises: ReportSchemaError when it is not a dict, or its `schema_version` is not an int >= 1 or is newer than
    `SCHEMA_VERSION`. A dict without the key (written before it existed) is version 1.
    """
    if not isinstance(report, dict):
        raise ReportSchemaError(f"{source} is not a fusion report (a JSON object), got {type(report).__name__}")
    version = report.get("schema_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ReportSchemaError(f"{source} has schema_version {version!r}; expected an integer >= 1")
    if version > SCHEMA_VERSION:
        raise ReportSchemaError(f"{source} has schema_version {version}, newer than this dsv41 reads "
                                f"({SCHEMA_VERSION}); read it with a newer dsv41")
    return report


def read_report(path: str | os.PathLike) -> dict:
    """The report dict of a JSON file written by `FusionReport.to_json` (or the `report` option).

    Raises: OSError when the file cannot be read; ReportSchemaError when it is not JSON, not an object, or of a
    newer schema version (the message names the file).
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ReportSchemaError(f"{path} is not JSON: {e}") from None
    return check_schema(data, source=path)
