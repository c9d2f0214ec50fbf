"""What a new user and a careless host hit, with real ``meshd`` processes: taken ports (exit 1, one line,
nothing created), join tokens kept out of ``ps``, secret files other users can read, unsafe state dirs,
and ``meshd generate | head``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import meshd_cmd, meshd_env
from daemon_testlib import start_node

from meshd.state import StateDir
from transport import PROTOCOL_MAX, PROTOCOL_MIN
from transport.credentials import MeshCredentials, create_mesh

NOBODY = 65534


def _meshd(*args: str, stdin: str | None = None, timeout: float = 60,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(meshd_cmd(*args), env=env or meshd_env(), input=stdin, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _serve_args(state: Path, *extra: str) -> list[str]:
    args = ["serve", "--state-dir", str(state), "--no-mdns", "--log-format", "json", *extra]
    if "--listen" not in extra:
        args += ["--listen", "127.0.0.1:0"]
    if "--api" not in extra:
        args += ["--api", "127.0.0.1:0"]
    return args


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("meshd: ")]


def _no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-2000:]


# -- taken ports: exit 1, one readable line, nothing created, nothing loaded ---------------------------

def test_taken_api_port_exits_1_and_creates_nothing(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        state = tmp_path / "s"
        res = _meshd(*_serve_args(state, "--api", f"127.0.0.1:{port}", "--model", "tiny"))
    assert res.returncode == 1, res.stderr
    lines = _error_lines(res.stderr)
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], res.stderr
    _no_traceback(res.stderr)
    assert not state.exists() or list(state.iterdir()) == [], list(state.iterdir())
    assert "model_loaded" not in res.stderr and "identity_created" not in res.stderr


def test_taken_quic_port_exits_1_and_creates_nothing(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        state = tmp_path / "s"
        res = _meshd(*_serve_args(state, "--listen", f"127.0.0.1:{port}"))
    assert res.returncode == 1, res.stderr
    lines = _error_lines(res.stderr)
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "UDP" in lines[0], res.stderr
    assert not state.exists() or list(state.iterdir()) == []


def test_generate_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    gen = subprocess.Popen(meshd_cmd("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "400",
                                     "--ignore-eos"),
                           env=meshd_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert gen.stdout is not None and gen.stderr is not None
    gen.stdout.read(20)  # `| head -c 20`
    gen.stdout.close()
    err = gen.stderr.read().decode()
    code = gen.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]
    assert code == 0


# -- join tokens out of ps ------------------------------------------------------------------------------

def _invite(state: Path) -> str:
    return _meshd("invite", "--state-dir", str(state), timeout=20).stdout.strip()


def test_join_token_from_stdin_is_not_in_cmdline(tmp_path: Path) -> None:
    a = start_node(tmp_path / "a")
    b = None
    try:
        token = _invite(tmp_path / "a")
        assert token.startswith("meshd1")
        (tmp_path / "b").mkdir(mode=0o700)
        with open(tmp_path / "b.stderr", "wb") as err:
            b = subprocess.Popen(meshd_cmd(*_serve_args(tmp_path / "b", "--join", "-")), env=meshd_env(),
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        assert b.stdin is not None
        b.stdin.write(token.encode() + b"\n")
        b.stdin.close()
        deadline = time.monotonic() + 30
        mesh = None
        while time.monotonic() < deadline and mesh != a.run["mesh_id"]:
            assert b.poll() is None, (tmp_path / "b.stderr").read_text()[-2000:]
            st = _meshd("status", "--json", "--state-dir", str(tmp_path / "b"), timeout=20)
            mesh = json.loads(st.stdout)["mesh_id"] if st.returncode == 0 else None
            time.sleep(0.3)
        assert mesh == a.run["mesh_id"]
        cmdline = Path(f"/proc/{b.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline and b"--join\0-" in cmdline
        assert "join_token_on_command_line" not in (tmp_path / "b.stderr").read_text()
    finally:
        if b is not None:
            b.terminate()
            b.wait(timeout=15)
        a.stop()


def test_meshd_join_reads_stdin_and_warns_about_argv(tmp_path: Path) -> None:
    a = start_node(tmp_path / "a")
    b = start_node(tmp_path / "b")  # a solo node, then `meshd join -` moves it into a's mesh
    try:
        token = _invite(tmp_path / "a")
        res = _meshd("join", "--state-dir", str(tmp_path / "b"), "-", stdin=token + "\n")
        assert res.returncode == 0, res.stderr
        assert a.run["mesh_id"] in res.stdout and "visible" not in res.stderr
        res = _meshd("join", "--state-dir", str(tmp_path / "b"), _invite(tmp_path / "a"))
        assert "visible to every local user" in res.stderr and "meshd join -" in res.stderr
    finally:
        b.stop()
        a.stop()


def test_token_on_command_line_logs_a_warning(tmp_path: Path) -> None:
    a = start_node(tmp_path / "a")
    try:
        token = _invite(tmp_path / "a")
        b = start_node(tmp_path / "b", "--join", token)
        b.stop()
        warn = [json.loads(ln) for ln in b.stderr().splitlines() if "join_token_on_command_line" in ln]
        assert warn and warn[0]["level"] == "warning"
        assert "--join -" in warn[0]["hint"] and "--join-file" in warn[0]["hint"] and token not in b.stderr()
    finally:
        a.stop()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_group_readable_join_file_is_refused(tmp_path: Path, how: str) -> None:
    tok = tmp_path / "join.token"
    tok.write_text("meshd1whatever\n")
    tok.chmod(0o640)
    state = tmp_path / "s"
    if how == "flag":
        res = _meshd(*_serve_args(state, "--join-file", str(tok)))
    else:
        res = _meshd(*_serve_args(state), env=meshd_env(MESHD_JOIN_FILE=str(tok)))
    assert res.returncode == 2, res.stderr
    lines = _error_lines(res.stderr)
    assert len(lines) == 1 and "readable by group or others" in lines[0] and "chmod 600" in lines[0]
    assert not (state / "identity.key").exists()


def test_world_readable_api_key_file_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-1\n")
    keys.chmod(0o644)
    state = tmp_path / "s"
    res = _meshd(*_serve_args(state, "--api-key-file", str(keys)))
    assert res.returncode == 2, res.stderr
    lines = _error_lines(res.stderr)
    assert len(lines) == 1 and "readable by group or others" in lines[0] and str(keys) in lines[0]
    assert not (state / "identity.key").exists()


def test_units_hide_processes() -> None:
    root = Path(__file__).resolve().parent.parent / "systemd"
    for unit in ("meshd.service", "meshd-client.service"):
        assert "\nProtectProc=invisible\n" in (root / unit).read_text(), unit


# -- the state dir ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o755, 0o777])
def test_open_state_dir_is_made_0700(tmp_path: Path, mode: int) -> None:
    state = tmp_path / "s"
    state.mkdir()
    state.chmod(mode)
    node = start_node(state)
    try:
        assert state.stat().st_mode & 0o777 == 0o700
        assert "state_dir_permissions_fixed" in node.stderr()
    finally:
        node.stop()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@needs_root
def test_state_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    res = _meshd(*_serve_args(state))
    assert res.returncode == 1, res.stderr
    lines = _error_lines(res.stderr)
    assert len(lines) == 1 and "owned by uid 65534" in lines[0], res.stderr
    assert list(state.iterdir()) == []


@needs_root
def test_identity_key_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "s"
    StateDir(state).load_or_create_identity()
    os.chown(state / "identity.key", NOBODY, NOBODY)
    res = _meshd(*_serve_args(state))
    assert res.returncode == 1, res.stderr
    assert "owned by uid 65534" in _error_lines(res.stderr)[0]
    assert sorted(p.name for p in state.iterdir()) == ["identity.key"]


def test_credentials_without_identity_key_write_nothing(tmp_path: Path) -> None:
    state = tmp_path / "s"
    sd = StateDir(state)
    ident, _ = sd.load_or_create_identity()
    creds = create_mesh(ident, "m", int(time.time()), PROTOCOL_MIN, PROTOCOL_MAX)
    sd.store_credentials(MeshCredentials(genesis=creds.genesis, cert=creds.cert))
    (state / "identity.key").unlink()
    before = sorted(p.name for p in state.iterdir())
    res = _meshd(*_serve_args(state))
    assert res.returncode == 1, res.stderr
    lines = _error_lines(res.stderr)
    assert len(lines) == 1 and "identity.key is missing" in lines[0] and "genesis.json" in lines[0]
    assert sorted(p.name for p in state.iterdir()) == before  # no new key written
