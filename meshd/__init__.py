"""meshd: the daemon, CLI, config, membership, API and wiring."""

from __future__ import annotations

__version__ = "0.1.0"
