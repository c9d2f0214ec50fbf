"""tests/reaper.py: a process a test starts and leaves running is stopped when the pytest run ends, also when
the run's process is killed and when an xdist worker crashes (its daemons were left to init before)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

INNER = """
import os, signal, subprocess, sys, time
from pathlib import Path

def test_leaves_a_daemon_behind():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    Path(os.environ["PIDFILE"]).write_text(str(child.pid))
    if os.environ["HOW"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run(tmp_path: Path, how: str, *args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    pidfile = tmp_path / "pid"
    env = {**os.environ, "PIDFILE": str(pidfile), "HOW": how, "PYTHONPATH": str(TESTS)}
    env.pop("PYTEST_XDIST_TESTRUNUID", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "reaper", "-p", "no:cacheprovider",
                          "-p", "no:randomly", "-p", "no:hypothesispytest", *args, "test_inner.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    return out, int(pidfile.read_text())


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, 9)  # do not leave it to the next test
        return False
    return True


pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the reaper reads /proc (Linux)")


def test_a_process_left_running_is_stopped_when_the_run_ends(tmp_path: Path) -> None:
    out, pid = _run(tmp_path, "leave")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reaper: stopped 1 process(es)" in out.stdout and str(pid) in out.stdout, out.stdout
    assert _gone_within(pid, 1.0)


def test_a_process_left_running_is_stopped_when_the_run_is_killed(tmp_path: Path) -> None:
    out, pid = _run(tmp_path, "kill")
    assert out.returncode == -9, out.stdout + out.stderr
    assert _gone_within(pid, 10.0)  # the sidecar's poll, then SIGTERM


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist")
def test_a_crashed_xdist_workers_process_is_stopped_when_the_run_ends(tmp_path: Path) -> None:
    out, pid = _run(tmp_path, "kill", "-n", "1", "--max-worker-restart=0")
    assert "crashed" in out.stdout.lower() or "worker" in out.stdout.lower(), out.stdout
    assert _gone_within(pid, 2.0), out.stdout
