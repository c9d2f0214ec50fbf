"""meshd: the daemon, CLI, config, membership, API and wiring."""

from __future__ import annotations

import engine  # noqa: F401 - first, so OpenBLAS gets its thread timeout before anything loads numpy (engine/__init__.py)

__version__ = "0.1.0"
