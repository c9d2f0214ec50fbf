"""Rate-limited debug logging for events a stranger can trigger at will (garbage, refusals)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """Log each event name at most once per ``interval_s``; later ones are counted and reported.

    ``now`` is passed in so the class stays clock-free and testable.
    """

    def __init__(self, log: Any, interval_s: float = 10.0) -> None:
        self._log = log
        self._interval_s = interval_s
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def debug(self, now: float, event: str, key: str | None = None, **fields: Any) -> bool:
        """Log ``event`` at debug unless one of the same ``key`` (default: the event) was logged within the
        interval. Returns True if logged."""
        k = event if key is None else key
        if now < self._next.get(k, float("-inf")):
            self._suppressed[k] = self._suppressed.get(k, 0) + 1
            return False
        if len(self._next) >= _MAX_KINDS and k not in self._next:
            self._next.clear()  # a bound on kinds; the worst case is one extra line per kind
            self._suppressed.clear()
        suppressed = self._suppressed.pop(k, 0)
        if suppressed:
            fields["suppressed"] = suppressed
        self._next[k] = now + self._interval_s
        self._log.debug(event, **fields)
        return True


_MAX_KINDS = 1024  # distinct keys remembered by one RateLimitedLog
_CID_PREFIX = re.compile(r"^\[[0-9a-fA-F]*\] ")  # aioquic's connection adapter prefixes "[cid] "


class AioquicLogFilter(logging.Filter):
    """Installed on aioquic's ``quic`` logger: every record it makes (about 3 info lines per connection, any
    stranger's included) becomes one rate-limited debug event ``aioquic_log``, at most once per interval
    per kind (the message template without its connection id). The record itself is dropped."""

    def __init__(self, ratelog: RateLimitedLog, clock: Callable[[], float]) -> None:
        super().__init__()
        self._ratelog = ratelog
        self._clock = clock

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            kind = _CID_PREFIX.sub("", str(record.msg))[:80]
            self._ratelog.debug(self._clock(), "aioquic_log", key="aioquic:" + kind, kind=kind,
                                level=record.levelname.lower(), message=record.getMessage()[:200])
        except Exception:  # noqa: BLE001, S110 - logging must never raise into aioquic
            pass
        return False


def route_aioquic_logs(log: Any, interval_s: float, clock: Callable[[], float]) -> None:
    """Route aioquic's ``quic`` logger through ``AioquicLogFilter`` (once per process)."""
    logger = logging.getLogger("quic")
    if not any(isinstance(f, AioquicLogFilter) for f in logger.filters):
        logger.addFilter(AioquicLogFilter(RateLimitedLog(log, interval_s), clock))
