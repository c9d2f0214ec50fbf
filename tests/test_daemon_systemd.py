"""systemd integration: the unit files verify, and the sd_notify client speaks the datagram protocol."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from meshd.sdnotify import SdNotifier

UNITS = ["meshd.service", "meshd-client.service"]


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("unit", UNITS)
def test_unit_has_required_settings(unit: str) -> None:
    d = _directives((REPO_ROOT / "systemd" / unit).read_text())
    assert d["Type"] == ["notify"] and d["Restart"] == ["on-failure"] and d["StateDirectory"] == ["meshd"]
    assert d["WatchdogSec"] and d["NoNewPrivileges"] == ["yes"] and d["ProtectSystem"] == ["strict"]
    assert d["ProtectHome"] == ["yes"] and d["PrivateTmp"] == ["yes"]
    assert set(d["RestrictAddressFamilies"][0].split()) == {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}
    assert d.get("DynamicUser") == ["yes"] or d.get("User")
    assert "--config /etc/meshd/meshd.toml" in d["ExecStart"][0]
    assert d["EnvironmentFile"] == ["-/etc/meshd/meshd.env"]  # where MESHD_JOIN_FILE is set
    role = "client" if "client" in unit else "serve"
    assert d["ExecStart"][0].split()[:2] == ["/usr/local/bin/meshd", role]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on both units. verify insists that ExecStart's binary exists, so the
    copies verified here run this interpreter (`sys.executable -m meshd ...`) instead of the
    pip-installed /usr/local/bin/meshd; everything else is the unit as shipped."""
    copies = []
    for unit in UNITS:
        text = (REPO_ROOT / "systemd" / unit).read_text()
        assert "ExecStart=/usr/local/bin/meshd " in text
        text = text.replace("ExecStart=/usr/local/bin/meshd ", f"ExecStart={sys.executable} -m meshd ")
        (tmp_path / unit).write_text(text)
        copies.append(str(tmp_path / unit))
    out = subprocess.run(
        ["systemd-analyze", "verify", *copies],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )
    # verify exits 0 even for unknown keys, which it only prints: require silence about our units.
    ours = [line for line in (out.stdout + out.stderr).splitlines() if "meshd" in line]
    assert out.returncode == 0 and not ours, out.stdout + out.stderr


def test_sd_notifier_path_and_abstract(tmp_path: Path) -> None:
    path_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path_sock.bind(str(tmp_path / "n.sock"))
    abstract_name = f"meshd-unit-{os.getpid()}"
    abs_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abs_sock.bind("\0" + abstract_name)
    try:
        for sock, value in ((path_sock, str(tmp_path / "n.sock")), (abs_sock, "@" + abstract_name)):
            n = SdNotifier({"NOTIFY_SOCKET": value})
            assert n.enabled
            assert n.notify(READY=1, STATUS="two\nlines")
            sock.settimeout(2)
            assert sock.recv(1024) == b"READY=1\nSTATUS=two lines"
            n.close()
    finally:
        path_sock.close()
        abs_sock.close()


def test_sd_notifier_disabled_or_unreachable_never_raises(tmp_path: Path) -> None:
    assert not SdNotifier({}).notify(READY=1)
    assert not SdNotifier({"NOTIFY_SOCKET": "vsock:2:1"}).enabled
    assert not SdNotifier({"NOTIFY_SOCKET": str(tmp_path / "absent")}).notify(READY=1)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000"}, 15.0),
        ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # not us
        ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "0"}, None),
        ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "abc"}, None),
        ({"WATCHDOG_USEC": "30000000"}, None),  # nowhere to send pings
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(env: dict[str, str], expected: float | None) -> None:
    assert SdNotifier(env).watchdog_interval_s() == expected


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_sandbox_exposure_is_low(tmp_path: Path) -> None:
    """`systemd-analyze security --offline=true` (systemd >= 252) scores the sandbox 0 (locked down) to 10.
    Ours measured 1.4 on systemd 252; fail if a change loosens it past 2.0."""
    for unit in UNITS:
        text = (REPO_ROOT / "systemd" / unit).read_text()
        text = text.replace("ExecStart=/usr/local/bin/meshd ", f"ExecStart={sys.executable} -m meshd ")
        (tmp_path / unit).write_text(text)
        out = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", "--no-pager", str(tmp_path / unit)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if "--offline" in out.stderr and "unrecognized" in out.stderr:
            pytest.skip("this systemd-analyze has no --offline")
        last = [line for line in out.stdout.splitlines() if "Overall exposure level" in line]
        assert last, out.stdout + out.stderr
        score = float(last[0].split(":")[1].split()[0])
        assert score <= 2.0, last[0]


def _documented_join_dropin() -> str:
    """The drop-in docs/daemon.md tells a joiner's admin to write (its ``printf '...'`` line)."""
    text = (REPO_ROOT / "docs" / "daemon.md").read_text()
    m = re.search(r"printf '(\[Service\][^']*)'", text)
    assert m, "docs/daemon.md no longer shows the join drop-in as a printf line"
    return m.group(1).replace("\\n", "\n").replace("%%", "%")


def test_documented_join_hands_the_token_over_as_a_credential() -> None:
    """Both units run as a DynamicUser, which cannot read a root-owned 0600 token file (and meshd refuses
    one that others can read), so the documented join must pass it with LoadCredential= and point
    MESHD_JOIN_FILE into the credentials directory (%d). Before session 9 the docs pointed
    MESHD_JOIN_FILE at /etc/meshd/join.token itself: "Permission denied" at every start."""
    for unit in UNITS:
        assert _directives((REPO_ROOT / "systemd" / unit).read_text()).get("DynamicUser") == ["yes"]
    d = _directives(_documented_join_dropin())
    name, _, source = d["LoadCredential"][0].partition(":")
    assert source.startswith("/etc/meshd/")
    assert d["Environment"] == [f"MESHD_JOIN_FILE=%d/{name}"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_documented_join_dropin_verifies(tmp_path: Path) -> None:
    """The documented drop-in's lines, added to the unit's [Service] section, pass `systemd-analyze verify`."""
    text = (REPO_ROOT / "systemd" / "meshd.service").read_text()
    text = text.replace("ExecStart=/usr/local/bin/meshd ", f"ExecStart={sys.executable} -m meshd ")
    extra = _documented_join_dropin().replace("[Service]\n", "")
    text = text.replace("\n[Install]", "\n" + extra + "\n[Install]")
    (tmp_path / "meshd.service").write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "meshd.service")], check=False,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})
    ours = [line for line in (out.stdout + out.stderr).splitlines() if "meshd" in line]
    assert out.returncode == 0 and not ours, out.stdout + out.stderr
