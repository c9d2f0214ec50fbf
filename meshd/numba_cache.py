"""Where numba keeps a daemon's compiled kernels (the ``fast`` extra).

The engine's kernels are compiled with ``cache=True``: numba writes them beside the sources
(``engine/__pycache__``), else into the user's cache (``$XDG_CACHE_HOME/numba``, ``~/.cache/numba``), and later
processes load them from there (~1 s and ~70 MB) instead of compiling again (tens of seconds and ~100 MB more
at the peak). When neither is writable numba refuses to define a cached function at all (``RuntimeError:
cannot cache function ...: no locator available``), which is what the shipped systemd unit gives it: a read-only
install (``ProtectSystem=strict``), no home (``ProtectHome=yes``, ``DynamicUser=yes``). The daemon then points
``NUMBA_CACHE_DIR`` at ``numba-cache`` in its state directory (writable by construction) before the engine
imports numba. A ``NUMBA_CACHE_DIR`` already set wins; where numba's own places are writable nothing changes, so
the nodes of one install share one cache.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

SUBDIR = "numba-cache"


def writable(path: Path) -> bool:
    """Whether ``path`` exists or can be made, and takes a new file (numba's own test of a cache location)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def numba_locations(env: MutableMapping[str, str]) -> list[Path]:
    """numba's own cache locations for the engine's kernels, in its order: beside the sources, then the
    user-wide cache (Linux: ``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``; macOS ``~/Library/Caches/numba``)."""
    spec = importlib.util.find_spec("engine")
    out = []
    if spec is not None and spec.origin:
        out.append(Path(spec.origin).parent / "__pycache__")
    try:
        home = Path(env.get("HOME") or Path.home())
    except (KeyError, RuntimeError):  # no home directory at all
        return out
    if sys.platform == "darwin":
        out.append(home / "Library" / "Caches" / "numba")
    else:
        out.append(Path(env.get("XDG_CACHE_HOME") or home / ".cache") / "numba")
    return out


def choose(state_dir: Path, locations: list[Path]) -> Path | None:
    """``state_dir / SUBDIR`` when none of ``locations`` is writable, else None (numba's own choice)."""
    if any(writable(p) for p in locations):
        return None
    return state_dir / SUBDIR


def apply(state_dir: Path, env: MutableMapping[str, str] = os.environ) -> Path | None:
    """Set ``NUMBA_CACHE_DIR`` for this process if numba is installed, the variable is unset and numba's own
    locations are not writable; returns the directory set, or None. Call before anything imports numba."""
    if env.get("NUMBA_CACHE_DIR") or importlib.util.find_spec("numba") is None:
        return None
    path = choose(state_dir, numba_locations(env))
    if path is None:
        return None
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    env["NUMBA_CACHE_DIR"] = str(path)
    config = sys.modules.get("numba.core.config")
    if env is os.environ and config is not None:  # numba already imported: it read its environment then
        config.CACHE_DIR = str(path)  # type: ignore[attr-defined]
    return path
