"""A one-line progress bar for a terminal's stderr (checkpoint loading).

``ProgressBar(total, label, stream)`` renders ``label [#####.....]  45%  1.2/2.6 GB  3.1s`` with ``\\r`` and
redraws at most every ``min_interval_s``; ``update(done)`` takes the bytes done so far, ``close()`` ends
the line. ``render()`` is a pure function so tests can check the text without a terminal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 30


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def render(label: str, done: int, total: int, elapsed_s: float, width: int = BAR_WIDTH) -> str:
    """One bar line, without the leading carriage return."""
    frac = 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
    filled = int(round(frac * width))
    bar = "#" * filled + "." * (width - filled)
    total_s = _size(total)
    done_s = _size(done).split()[0] if total_s.split()[-1] == _size(done).split()[-1] else _size(done)
    return f"{label} [{bar}] {frac * 100:3.0f}%  {done_s}/{total_s}  {elapsed_s:.1f}s"


class ProgressBar:
    """Draws ``render(...)`` to ``stream``; callable as ``bar(done, total)``."""

    def __init__(self, label: str, stream: TextIO, total: int = 0, min_interval_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.stream = stream
        self.total = total
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._start = clock()
        self._last = -1e9
        self._done = 0
        self._drawn = False

    def __call__(self, done: int, total: int | None = None) -> None:
        self.update(done, total)

    def update(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        self._done = done
        now = self._clock()
        if now - self._last >= self.min_interval_s or (self.total and done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        line = render(self.label, self._done, self.total, now - self._start)
        self.stream.write("\r" + line)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self._draw(self._clock())
            self.stream.write("\n")
            self.stream.flush()
