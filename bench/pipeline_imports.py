"""Resident memory of what a stage daemon imports, one package after another (the daemon's order).

    V/bin/python bench/pipeline_imports.py [MODULE ...]

Run it with the interpreter of a venv with meshd installed the README way (``python -m venv V &&
V/bin/pip install .``), from outside the source tree (``cd /tmp``), so the figures are a user's, not the
development environment's (which has rich, pygments, torch, ...). Each line: the module, the RSS it added
(shared dependencies count for the first module that pulls them in), the total, and the modules loaded.
What a running daemon adds beyond its imports (threads, the loop, QUIC state, malloc arenas) is not
here: compare with ``bench/pipeline.py``'s idle daemon.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# bench/ holds transport.py and engine.py: as the script's directory it would shadow those packages
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

# the order a `meshd serve --stage PATH` node imports them in
DAEMON_ORDER = [
    "structlog",
    "meshd.cli",
    "aiohttp.web",
    "prometheus_client",
    "meshd.api.server",
    "aioquic.quic.connection",
    "meshd.daemon",
    "numpy",
    "meshd.pipeline_service",
    "engine.gguf_file",
    "meshd.lane_service",
    "meshd.membership.service",
    "meshd.mesh.console",
    "meshd.pipeline_metrics",
    "engine.model",
]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    names = sys.argv[1:] or DAEMON_ORDER
    if any(n.startswith("-") for n in names):  # no options: -h/--help prints the usage
        print(__doc__.strip())
        return 0 if names[0] in ("-h", "--help") else 2
    prev = rss_mb()
    print(f"{'interpreter':32s} {prev:6.1f} MB")
    for name in names:
        importlib.import_module(name)
        now = rss_mb()
        print(f"{name:32s} +{now - prev:5.1f} = {now:6.1f} MB ({len(sys.modules)} modules)")
        prev = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
