"""Logging setup: structlog to stderr, one event per line, JSON (for journald) or pretty (for terminals).

Library code does ``log = structlog.get_logger(__name__)`` and ``log.info("peer_connected", peer=...)``.
Records from the standard ``logging`` module (aioquic, aiohttp, zeroconf) go through the same renderer.

Secrets never belong in a log call. As a second line of defence, ``redact_secrets`` replaces the value of
any field whose name says it holds one (``token``, ``secret``, ``private_key``...) with ``"<redacted>"``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

SECRET_FIELDS = frozenset(
    {
        "token",
        "join_token",
        "invite",
        "secret",
        "password",
        "private_key",
        "admin_key",
        "api_key",
        "key",
        "authorization",
    }
)

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def redact_secrets(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: blank out fields whose names mark secrets."""
    for name in event_dict.keys() & SECRET_FIELDS:
        event_dict[name] = "<redacted>"
    return event_dict


def setup_logging(fmt: str = "json", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog and stdlib logging. ``fmt`` is ``json`` or ``pretty``; ``level`` a name."""
    out = stream if stream is not None else sys.stderr
    numeric = _LEVELS.get(level, logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
    ]
    renderer: Any
    if fmt == "pretty":
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    else:
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    # Foreign (stdlib) records: same fields and renderer, and one level floor a notch above ours for
    # chatty libraries unless we are debugging.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                redact_secrets,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
