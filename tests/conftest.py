"""Shared test helpers. Tests run the daemon as real processes: ``python -m meshd`` from this checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def meshd_cmd(*args: str) -> list[str]:
    """argv for running this checkout's meshd in a subprocess."""
    return [sys.executable, "-m", "meshd", *args]


def meshd_env(**extra: str) -> dict[str, str]:
    """Environment for a meshd subprocess: this checkout first on the path, no inherited join token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHD_", "NOTIFY_SOCKET"))}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


# CI runs the property tests derandomized (reproducible runs; a failure found locally is kept in the
# example database), and no test is failed for a slow example on a loaded 2-core machine.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    _hyp_settings.register_profile("dev", deadline=None)
    _hyp_settings.load_profile("ci" if os.environ.get("CI") else "dev")
except ImportError:  # the test extra is not installed: the property tests are skipped by their imports
    pass
