"""Logging: one JSON object per line, levels filter, secrets redacted."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from meshd.log import setup_logging


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def test_json_lines_levels_and_redaction() -> None:
    out = io.StringIO()
    setup_logging("json", "info", stream=out)
    log = structlog.get_logger("t")
    log.debug("hidden")
    log.info("peer_connected", peer="abc", rtt_ms=1.5)
    log.info("joining", token="meshd1secret", api_key="sk-1")
    logging.getLogger("aioquic").warning("library says %s", "hi")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in lines] == ["peer_connected", "joining", "library says hi"]
    assert lines[0]["level"] == "info" and lines[0]["rtt_ms"] == 1.5 and "timestamp" in lines[0]
    assert lines[1]["token"] == "<redacted>" and lines[1]["api_key"] == "<redacted>"
    assert "meshd1secret" not in out.getvalue()
    assert lines[2]["level"] == "warning" and lines[2]["logger"] == "aioquic"


def test_pretty_format_is_one_line_per_event() -> None:
    out = io.StringIO()
    setup_logging("pretty", "debug", stream=out)
    structlog.get_logger("t").debug("shown", a=1)
    assert out.getvalue().count("\n") == 1 and "shown" in out.getvalue()
