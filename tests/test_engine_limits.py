"""engine/limits.py holds the engine's limits: engine/ takes no constant from transport/."""

from __future__ import annotations

import ast
from pathlib import Path

from engine import limits as engine_limits
from transport import limits as transport_limits

ROOT = Path(__file__).resolve().parent.parent


def test_engine_imports_no_transport_limits() -> None:
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "transport.limits":
                offenders.append(str(path.relative_to(ROOT)))
            elif isinstance(node, ast.ImportFrom) and node.module == "transport" and any(
                    a.name == "limits" for a in node.names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_limits_live_in_one_package_each() -> None:
    engine_names = {n for n in dir(engine_limits) if n.isupper()}
    transport_names = {n for n in dir(transport_limits) if n.isupper()}
    assert engine_names & transport_names == set()
    assert {"ATTENTION_QUERY_BLOCK", "EXPERT_MAX_MESSAGE_BYTES", "PREFILL_CHUNK_TOKENS"} <= engine_names


def test_expert_window_stays_half_the_stream_queue() -> None:
    # A worker busy computing must not have its stream reset by requests already in flight.
    assert engine_limits.EXPERT_WINDOW_BYTES * 2 <= transport_limits.STREAM_RECV_QUEUE_BYTES
