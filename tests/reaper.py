"""The test session's reaper: no process a test started (daemons, workers, stages) outlives the pytest run.

How: the session's first process (the serial run, or xdist's controller) puts a fresh marker in its environment,
``PYTEST_MESHD_RUN=<uuid>``, which every process started after it inherits (xdist's workers, the daemons they
start, their children; ``conftest.meshd_env`` keeps it: it drops only ``MESHD_*``). When the session ends, every
process of this user whose environment holds the marker is stopped (SIGTERM, then SIGKILL after
``GRACE_S``), whatever started it and whoever its parent is now (an xdist worker that crashed left its daemons
to init). A sidecar process, started detached with the session, does the same if the session's process dies
without ending the session (SIGKILL, a crash): it polls that process and reaps once it is gone.

Linux only (``/proc``); elsewhere nothing is done. Run as a plugin (``-p reaper``) or from conftest.py's hooks
(``start`` / ``finish``); ``python reaper.py PID MARKER`` is the sidecar.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

VAR = "PYTEST_MESHD_RUN"
GRACE_S = 3.0  # a daemon's SIGTERM shutdown (closing connections, its state dir) gets this long before SIGKILL
POLL_S = 0.5  # the sidecar checks that the session's process is alive this often

_sidecar: subprocess.Popen[bytes] | None = None


def marked(marker: str, exclude: set[int]) -> list[int]:
    """Pids of this user's processes whose (initial) environment holds ``VAR=marker``, but ``exclude``."""
    want = f"{VAR}={marker}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in exclude:
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if want in env.split(b"\0"):
            out.append(int(d))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def reap(marker: str, exclude: set[int]) -> list[str]:
    """Stop every marked process (see ``marked``): SIGTERM, SIGKILL for those left after ``GRACE_S``. Returns
    ``"pid cmdline"`` of each process that was found."""
    pids = marked(marker, exclude)
    found = [f"{pid} {_cmdline(pid)}" for pid in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + GRACE_S
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for p in pids if _alive(p)]
        if not pids:
            break
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone (its parent has not waited)
    except OSError:
        return False


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def start(config: Any) -> None:
    """At the session's start in its first process (not in an xdist worker): the marker and the sidecar."""
    global _sidecar
    if hasattr(config, "workerinput") or not Path("/proc/self/environ").exists():
        return
    marker = uuid.uuid4().hex
    os.environ[VAR] = marker  # a nested pytest run (a test running pytest) gets its own marker
    env = {k: v for k, v in os.environ.items() if k != VAR}
    _sidecar = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(os.getpid()), marker],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)


def finish(config: Any) -> None:
    """At the session's end in its first process: stop what the tests left, say so, and stop the sidecar."""
    global _sidecar
    marker = os.environ.get(VAR)
    if hasattr(config, "workerinput") or _sidecar is None or marker is None:
        return
    left = reap(marker, _ancestors() | {_sidecar.pid})
    _sidecar.terminate()
    _sidecar.wait(10)
    _sidecar = None
    if left:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        text = f"reaper: stopped {len(left)} process(es) the tests left running: " + "; ".join(left)
        if tr is not None:
            tr.write_line(text, yellow=True)
        else:
            print(text, file=sys.stderr)


def pytest_configure(config: Any) -> None:  # as a plugin (-p reaper); conftest.py calls start itself
    start(config)


def pytest_unconfigure(config: Any) -> None:
    finish(config)


def _sidecar_main(pid: int, marker: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the session ended normally and reaped itself
    while _alive(pid):
        time.sleep(POLL_S)
    reap(marker, {os.getpid()})


if __name__ == "__main__":
    _sidecar_main(int(sys.argv[1]), sys.argv[2])
