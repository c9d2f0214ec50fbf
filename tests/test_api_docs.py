"""The API's documented error statuses are the ones the code answers with: every ``ApiError(STATUS`` in
meshd/ has a row in docs/api.md's Errors table and is in README.md's list, and so is every error code."""

from __future__ import annotations

import re
from pathlib import Path

from meshd.api.errors import _DEFAULTS

ROOT = Path(__file__).resolve().parent.parent


def _raised() -> dict[int, set[str]]:
    """status -> the ``code`` values raised with it anywhere in meshd/ (given, or the status's default)."""
    out: dict[int, set[str]] = {}
    for f in (ROOT / "meshd").rglob("*.py"):
        text = f.read_text("utf-8")
        for m in re.finditer(r"ApiError\(\s*(\d{3})\b", text):
            call = text[m.start(): m.start() + 600]
            depth, end = 0, len(call)
            for i, ch in enumerate(call):  # the call's own parentheses
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0 and ch == ")":
                    end = i
                    break
            status = int(m.group(1))
            codes = set(re.findall(r"\bcode=\"([a-z_]+)\"", call[:end])) or {_DEFAULTS[status][1]}
            out.setdefault(status, set()).update(codes)
    return out


def _table(doc: str) -> str:
    return doc.split("## Errors", 1)[1].split("\n## ", 1)[0]


def _missing(raised: dict[int, set[str]], table: str, readme_list: str) -> list[str]:
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2:5].isdigit()]
    missing = []
    for status, codes in sorted(raised.items()):
        if not any(re.search(rf"\b{status}\b", row.split("|")[1]) for row in rows):
            missing.append(f"{status} has no row in docs/api.md's Errors table")
        for code in sorted(codes):
            if f"`{code}`" not in table:
                missing.append(f"{status} {code} is not named in docs/api.md's Errors table")
        if not re.search(rf"\b{status}\b", readme_list):
            missing.append(f"{status} is not in README.md's list of errors")
    return missing


def _readme_list() -> str:
    readme = (ROOT / "README.md").read_text("utf-8")
    m = re.search(r"errors have OpenAI's shape \(([^)]*)\)", readme)
    assert m, "README.md lost its list of error statuses"
    return m.group(1)


def test_every_status_the_api_answers_is_documented() -> None:
    raised = _raised()
    assert {400, 401, 403, 404, 429, 502, 503} <= set(raised), raised  # the scan finds the calls
    assert {"forbidden_host", "forbidden_origin"} <= raised[403]
    doc = (ROOT / "docs" / "api.md").read_text("utf-8")
    assert _missing(raised, _table(doc), _readme_list()) == []


def test_the_check_can_fail() -> None:
    doc = (ROOT / "docs" / "api.md").read_text("utf-8")
    table = "\n".join(line for line in _table(doc).splitlines() if not line.startswith("| 403"))
    got = _missing({403: {"forbidden_host"}, 418: set()}, table, "400, 403")
    assert got == ["403 has no row in docs/api.md's Errors table",
                   "403 forbidden_host is not named in docs/api.md's Errors table",
                   "418 has no row in docs/api.md's Errors table", "418 is not in README.md's list of errors"]
