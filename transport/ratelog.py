"""Rate-limited debug logging for events a stranger can trigger at will (garbage, refusals)."""

from __future__ import annotations

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

    def debug(self, now: float, event: str, **fields: Any) -> bool:
        """Log ``event`` at debug unless one was logged within the interval. Returns True if logged."""
        if now < self._next.get(event, float("-inf")):
            self._suppressed[event] = self._suppressed.get(event, 0) + 1
            return False
        suppressed = self._suppressed.pop(event, 0)
        if suppressed:
            fields["suppressed"] = suppressed
        self._next[event] = now + self._interval_s
        self._log.debug(event, **fields)
        return True
