"""Control socket protocol, and the Daemon's service lifecycle, in-process with real Unix sockets."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from meshd.cli import build_parser
from meshd.config import HostPort, load_config
from meshd.control import ControlError, ControlServer, NoDaemon, request
from meshd.daemon import Daemon
from meshd.errors import RuntimeFailure
from meshd.sdnotify import SdNotifier
from meshd.state import StateDir
from transport.credentials import create_mesh


async def _raw(path: Path, payload: bytes) -> list[dict[str, Any]]:
    reader, writer = await asyncio.open_unix_connection(str(path), limit=4 << 20)
    writer.write(payload)
    await writer.drain()
    writer.write_eof()
    replies = [json.loads(line) for line in (await reader.read()).splitlines()]
    writer.close()
    return replies


def test_control_protocol(tmp_path: Path) -> None:
    async def main() -> None:
        server = ControlServer(tmp_path / "control.sock")

        async def echo(params: dict[str, Any]) -> dict[str, Any]:
            return {"got": params}

        async def refuse(params: dict[str, Any]) -> dict[str, Any]:
            raise ControlError("not the admin")

        async def broken(params: dict[str, Any]) -> dict[str, Any]:
            raise KeyError("x")

        server.register("echo", echo)
        server.register("refuse", refuse)
        server.register("broken", broken)
        with pytest.raises(ValueError):
            server.register("echo", echo)
        await server.start()
        try:
            assert stat.S_IMODE(os.stat(tmp_path / "control.sock").st_mode) == 0o600
            assert await request(tmp_path / "control.sock", "echo", {"a": 1}) == {"got": {"a": 1}}
            with pytest.raises(RuntimeFailure, match="not the admin"):
                await request(tmp_path / "control.sock", "refuse")
            with pytest.raises(RuntimeFailure, match="internal error in 'broken'"):
                await request(tmp_path / "control.sock", "broken")
            with pytest.raises(RuntimeFailure, match="unknown command 'nope'"):
                await request(tmp_path / "control.sock", "nope")
            replies = await _raw(
                tmp_path / "control.sock",
                b'{"cmd":"echo","n":1}\nnot json\n[1]\n{"cmd":5}\n{"cmd":"echo","n":2}\n',
            )
            assert [r["ok"] for r in replies] == [True, False, False, False, True]
            assert replies[0]["got"] == {"n": 1} and replies[4]["got"] == {"n": 2}
            assert replies[1]["error"] == "request is not JSON"
            big = await _raw(tmp_path / "control.sock", b'{"cmd":"echo","x":"' + b"a" * (2 << 20) + b'"}\n')
            assert big == [{"ok": False, "error": "request too large"}]
            # a second server on the same live socket is refused
            with pytest.raises(RuntimeFailure, match="already running"):
                await ControlServer(tmp_path / "control.sock").start()
        finally:
            await server.close()
        assert not (tmp_path / "control.sock").exists()
        with pytest.raises(NoDaemon, match="no meshd daemon is running"):
            await request(tmp_path / "control.sock", "echo")

    asyncio.run(main())


def test_stale_socket_is_replaced_and_long_paths_work(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "control.sock"
    assert len(str(path)) > 108

    async def main() -> None:
        import socket

        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        os.chdir(deep)
        stale.bind("control.sock")  # a socket file nobody listens on (a crashed daemon's)
        stale.close()
        server = ControlServer(path)

        async def ping(params: dict[str, Any]) -> dict[str, Any]:
            return {"pong": True}

        server.register("ping", ping)
        await server.start()
        try:
            assert await request(path, "ping") == {"pong": True}
        finally:
            await server.close()

    cwd = os.getcwd()
    try:
        asyncio.run(main())
    finally:
        os.chdir(cwd)


class RecordingService:
    """A real (if small) service: records its calls and reports a model and a peer."""

    def __init__(self, name: str, calls: list[str], fail_start: bool = False) -> None:
        self.name = name
        self.calls = calls
        self.fail_start = fail_start

    async def start(self, daemon: Daemon) -> None:
        self.calls.append(f"start {self.name}")
        if self.fail_start:
            raise OSError("port in use")
        if self.name == "api":
            daemon.set_api_address("127.0.0.1", 12345)

    async def stop(self) -> None:
        self.calls.append(f"stop {self.name}")

    def status(self) -> dict[str, Any]:
        return {
            "models": [{"name": f"m-{self.name}", "fingerprint": "f", "kind": "local"}],
            "peers": [],
            "extra": 1,
        }


def _daemon(
    tmp_path: Path, services: list[Any], with_creds: bool = True, argv: tuple[str, ...] = ()
) -> Daemon:
    args = build_parser().parse_args(
        [
            "serve",
            "--state-dir",
            str(tmp_path),
            "--listen",
            "127.0.0.1:0",
            "--api",
            "127.0.0.1:0",
            "--no-mdns",
            *argv,
        ]
    )
    config = load_config(args, {"HOME": str(tmp_path)}, "serve")
    state = StateDir(tmp_path)
    ident, _ = state.load_or_create_identity()
    creds = create_mesh(ident, "t", int(time.time()), 1, 1) if with_creds else None
    return Daemon(config, state, ident, creds, services=services, notifier=SdNotifier({}))


def test_daemon_starts_in_order_stops_in_reverse_and_merges_status(tmp_path: Path) -> None:
    calls: list[str] = []
    daemon = _daemon(tmp_path, [RecordingService("membership", calls), RecordingService("api", calls)])
    seen: dict[str, Any] = {}

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        while not daemon.state.run_path.exists():
            await asyncio.sleep(0.01)
        seen["run"] = json.loads(daemon.state.run_path.read_text())
        seen["status"] = await request(daemon.state.control_path, "status")
        daemon.request_stop("test")
        return await task

    assert asyncio.run(main()) == 0
    assert calls == ["start membership", "start api", "stop api", "stop membership"]
    assert seen["run"]["api"] == "127.0.0.1:12345"
    st = seen["status"]
    assert [m["name"] for m in st["models"]] == ["m-membership", "m-api"]
    assert st["services"]["membership"] == {"extra": 1} and st["services"]["api"] == {"extra": 1}
    assert st["services"]["transport"]["connected_peers"] == 0
    assert not daemon.state.run_path.exists() and not daemon.state.control_path.exists()


def test_service_start_failure_undoes_started_services(tmp_path: Path) -> None:
    calls: list[str] = []
    daemon = _daemon(
        tmp_path,
        [
            RecordingService("a", calls),
            RecordingService("b", calls, fail_start=True),
            RecordingService("c", calls),
        ],
    )
    with pytest.raises(RuntimeFailure, match="b failed to start: port in use"):
        asyncio.run(daemon.run())
    assert calls == ["start a", "start b", "stop a"]
    assert not daemon.state.control_path.exists() and not daemon.state.run_path.exists()


def test_fail_exits_1(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, [])

    async def main() -> int:
        task = asyncio.create_task(daemon.run())
        while daemon.phase != "running":
            await asyncio.sleep(0.01)
        daemon.fail("lost the plot")
        return await task

    assert asyncio.run(main()) == 1


def test_set_credentials_after_join(tmp_path: Path) -> None:
    """The join hook: a daemon started without credentials adopts them later."""
    daemon = _daemon(tmp_path, [], with_creds=False, argv=("--join", "meshd1x"))
    got: list[str] = []
    daemon.on_credentials.append(lambda c: got.append(c.mesh_id))

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        task = asyncio.create_task(daemon.run())
        while not daemon.state.run_path.exists():
            await asyncio.sleep(0.01)
        before = json.loads(daemon.state.run_path.read_text())
        st_before = daemon.status()
        creds = create_mesh(daemon.identity, "joined", int(time.time()), 1, 1)
        daemon.set_credentials(creds)
        after = json.loads(daemon.state.run_path.read_text())
        daemon.request_stop()
        await task
        return before, st_before, after

    before, st_before, after = asyncio.run(main())
    assert before["mesh_id"] is None and st_before["state"] == "joining"
    assert after["mesh_id"] == got[0] and len(after["mesh_id"]) == 32
    state = StateDir(tmp_path)
    creds = state.load_credentials(daemon.identity)
    assert creds is not None and creds.mesh_id == got[0]


def test_admission_checks_first_refusal_wins(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, [])
    assert daemon.credentials is not None
    cert = daemon.credentials.cert
    assert daemon.admit("n", cert) is None
    daemon.admission_checks.append(lambda node_id, c: None)
    daemon.admission_checks.append(lambda node_id, c: "banned")
    daemon.admission_checks.append(lambda node_id, c: "other")
    assert daemon.admit("n", cert) == "banned"

    def boom(node_id: str, c: Any) -> str | None:
        raise RuntimeError

    daemon.admission_checks.insert(0, boom)
    assert daemon.admit("n", cert) == "internal error"  # fails closed
    assert HostPort("::1", 1).__str__() == "[::1]:1"


class HangingService(RecordingService):
    async def stop(self) -> None:
        self.calls.append(f"stop {self.name}")
        await asyncio.sleep(3600)


def test_hanging_stop_is_bounded_by_the_shutdown_budget(tmp_path: Path) -> None:
    import dataclasses

    calls: list[str] = []
    daemon = _daemon(tmp_path, [RecordingService("a", calls), HangingService("stuck", calls)])
    daemon.config = dataclasses.replace(daemon.config, shutdown_timeout_s=0.5)

    async def main() -> tuple[int, float]:
        task = asyncio.create_task(daemon.run())
        while daemon.phase != "running":
            await asyncio.sleep(0.01)
        start = time.monotonic()
        daemon.request_stop()
        return await task, time.monotonic() - start

    code, took = asyncio.run(main())
    assert code == 0 and took < 2.0
    assert calls == ["start a", "start stuck", "stop stuck", "stop a"]  # the others still stopped
    assert not daemon.state.control_path.exists() and not daemon.state.run_path.exists()


def test_human_status_lists_models_and_peers() -> None:
    from meshd.commands.status import format_status

    st = {
        "node_id": "a" * 32,
        "mesh_id": "b" * 32,
        "mesh_name": "home",
        "state": "running",
        "version": "0.1.0",
        "protocol": 1,
        "quic": "0.0.0.0:9336",
        "api": "127.0.0.1:9337",
        "role": "serve",
        "admin": False,
        "models": [{"name": "tiny", "fingerprint": "f00d", "kind": "local"}],
        "peers": [
            {
                "node_id": "c" * 32,
                "addrs": ["10.0.0.2:9336"],
                "state": "alive",
                "rtt_ms": 1.25,
                "models": ["qwen"],
                "experts": [],
                "version": "0.1.0",
                "last_seen_s": 0.4,
                "role": "serve",
            },
            {"node_id": "d" * 32, "addrs": ["10.0.0.3:9336"], "state": "dead", "rtt_ms": None,
             "models": [{"name": "gone"}], "role": "client", "last_seen_s": 12.0},
        ],
        "services": {"membership": {"banned": ["e" * 32]}},
    }
    text = format_status(st)
    assert "mesh      home (" + "b" * 32 + ")" in text
    assert "models    1" in text and "tiny" in text and "f00d" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("c" * 32))
    assert row.split()[1:] == ["serve", "alive", "1.2", "0.4", "10.0.0.2:9336", "qwen", "0.1.0", "-"]
    dead = next(line for line in text.splitlines() if line.strip().startswith("d" * 32))
    # no models when dead; no version or numerics said
    assert dead.split()[1:] == ["client", "dead", "-", "12.0", "10.0.0.3:9336", "-", "-", "-"]
    assert "banned    1" in text and "  " + "e" * 32 in text


def test_human_status_shows_each_peers_version_and_numerics() -> None:
    """Why two nodes' outputs could differ: the peers table names each peer's meshd version and numerics tag
    (engine/numerics.py; ``=`` when it is this node's), and the legend spells out the others and what
    differs."""
    from meshd.commands.status import format_status

    mine = "kernels=numba-0.68.1+int;numpy=2.4.6;blas=scipy-openblas-0.3.31.188.0:SkylakeX"
    other = mine.replace("SkylakeX", "Haswell")
    peer = {"addrs": [], "state": "alive", "rtt_ms": 1.0, "models": [], "role": "serve", "last_seen_s": 0.1}
    st = {
        "node_id": "a" * 32, "state": "running",
        "peers": [
            {**peer, "node_id": "b" * 32, "version": "0.1.0", "numerics": mine},
            {**peer, "node_id": "c" * 32, "version": "0.1.0", "numerics": other},
            {**peer, "node_id": "d" * 32, "version": "0.0.9"},  # an older meshd, or no engine model: no tag
        ],
        "services": {"membership": {"banned": [], "numerics": mine}},
    }
    lines = format_status(st).splitlines()
    head = next(line for line in lines if line.strip().startswith("NODE"))
    assert head.split()[-2:] == ["VERSION", "NUMERICS"]
    rows = {ln.split()[0][0]: ln.split()[-2:] for ln in lines if ln.strip()[:1] in "bcd" and "alive" in ln}
    assert rows == {"b": ["0.1.0", "="], "c": ["0.1.0", "N1"], "d": ["0.0.9", "-"]}
    text = "\n".join(lines)
    assert f"numerics  = {mine} (this node)" in text
    assert f"  N1 {other}" in text
    assert ("differs: blas scipy-openblas-0.3.31.188.0:Haswell there, "
            "scipy-openblas-0.3.31.188.0:SkylakeX here") in text
    st["services"]["membership"]["numerics"] = None  # this node computes no model: the tags are listed as is
    text = format_status(st)
    assert "numerics  (this node computes no model: no tag)" in text and f"  N1 {mine}" in text, text
    assert f"  N2 {other}" in text and "differs" not in text, text


class SlowService(RecordingService):
    async def start(self, daemon: Daemon) -> None:
        await asyncio.sleep(0.5)  # e.g. loading a large model


def test_slow_start_extends_the_systemd_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    import meshd.daemon

    monkeypatch.setattr(meshd.daemon, "STARTUP_EXTEND_EVERY_S", 0.1)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    daemon = _daemon(tmp_path / "st", [SlowService("slow", [])])
    daemon.notifier = SdNotifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})

    async def main() -> None:
        task = asyncio.create_task(daemon.run())
        while daemon.phase != "running":
            await asyncio.sleep(0.01)
        daemon.request_stop()
        await task

    asyncio.run(main())
    msgs = []
    while True:
        try:
            msgs.append(sock.recv(4096).decode())
        except BlockingIOError:
            break
    sock.close()
    ready = next(i for i, m in enumerate(msgs) if "READY=1" in m.split("\n"))
    extends = [i for i, m in enumerate(msgs) if m.startswith("EXTEND_TIMEOUT_USEC=60000000")]
    assert len(extends) >= 2 and max(extends) < ready  # only while starting


@pytest.mark.parametrize("token,message", [("garbage", "not a meshd invite token"),
                                           ("meshd1garbage", "invite token is corrupt or was tampered with")])
def test_join_with_a_malformed_token_is_a_usage_error(tmp_path: Path, token: str, message: str) -> None:
    """Exit 2 and one line, before the daemon is even asked (as `serve --join` does); no daemon needed."""
    import subprocess

    from conftest import meshd_cmd, meshd_env

    res = subprocess.run(meshd_cmd("join", "--state-dir", str(tmp_path / "s"), token), capture_output=True,
                         text=True, env=meshd_env(), timeout=60)
    assert res.returncode == 2, res
    assert res.stderr.startswith(f"meshd: {message}") and res.stderr.count("\n") == 1 and res.stdout == ""
