"""State dir: resolution order, atomic 0600 files, identity.key safety checks, credential storage."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import meshd_cmd, meshd_env

from meshd.errors import UsageError
from meshd.state import StateDir, StateError, create_exclusive, resolve_state_dir, write_atomic
from transport.credentials import create_mesh
from transport.identity import NodeIdentity


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize(
    "flag, env, expected",
    [
        ("/flag", {"MESHD_STATE_DIR": "/m", "STATE_DIRECTORY": "/s", "HOME": "/h"}, "/flag"),
        (None, {"MESHD_STATE_DIR": "/m", "STATE_DIRECTORY": "/s", "HOME": "/h"}, "/m"),
        (None, {"STATE_DIRECTORY": "/s", "HOME": "/h"}, "/s"),
        (None, {"STATE_DIRECTORY": "/s1:/s2", "HOME": "/h"}, "/s1"),
        (None, {"HOME": "/h"}, "/h/.local/state/meshd"),
        (None, {"MESHD_STATE_DIR": "", "HOME": "/h"}, "/h/.local/state/meshd"),
    ],
)
def test_resolve_state_dir_order(flag: str | None, env: dict[str, str], expected: str) -> None:
    assert resolve_state_dir(flag, env) == Path(expected)


def test_resolve_state_dir_without_home_is_usage_error() -> None:
    with pytest.raises(UsageError):
        resolve_state_dir(None, {})


def test_identity_command_follows_env_order(tmp_path: Path) -> None:
    """Real processes: $MESHD_STATE_DIR beats $STATE_DIRECTORY beats $HOME."""
    m, s, h = tmp_path / "m", tmp_path / "s", tmp_path / "h"

    def ident(**env: str) -> str:
        out = subprocess.run(
            meshd_cmd("identity"),
            env=meshd_env(**env),
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    env_all = {"MESHD_STATE_DIR": str(m), "STATE_DIRECTORY": str(s), "HOME": str(h)}
    a = ident(**env_all)
    assert (m / "identity.key").exists() and not s.exists() and not h.exists()
    b = ident(STATE_DIRECTORY=str(s), HOME=str(h))
    assert (s / "identity.key").exists() and not h.exists()
    c = ident(HOME=str(h))
    assert (h / ".local/state/meshd/identity.key").exists()
    assert len({a, b, c}) == 3
    assert ident(**env_all) == a  # stable


def test_identity_key_created_0600_and_reloaded(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "st")
    ident, created = state.load_or_create_identity()
    assert created and _mode(state.identity_path) == 0o600 and _mode(state.path) == 0o700
    again, created2 = state.load_or_create_identity()
    assert not created2 and again.node_id == ident.node_id
    assert state.identity_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert [p.name for p in state.path.iterdir()] == ["identity.key"]  # no temp files left


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_identity_key_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    state = StateDir(tmp_path / "st")
    state.load_or_create_identity()
    os.chmod(state.identity_path, mode)
    with pytest.raises(StateError, match="chmod 600"):
        state.load_or_create_identity()
    out = subprocess.run(
        meshd_cmd("identity", "--state-dir", str(state.path)),
        env=meshd_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "readable by group or others" in out.stderr


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", b"x" * 10000],
)
def test_corrupt_identity_key_is_refused(tmp_path: Path, content: bytes) -> None:
    state = StateDir(tmp_path / "st")
    state.ensure()
    fd = os.open(state.identity_path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(StateError, match="corrupt"):
        state.load_or_create_identity()
    for cmd in (["identity"], ["serve", "--no-mdns", "--listen", "127.0.0.1:0", "--api", "127.0.0.1:0"]):
        out = subprocess.run(
            meshd_cmd(*cmd, "--state-dir", str(state.path)),
            env=meshd_env(),
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 1
        assert len(out.stderr.splitlines()) == 1 and "corrupt" in out.stderr
    assert state.identity_path.read_bytes() == content  # never overwritten


def test_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    state = StateDir(tmp_path / "st")
    state.ensure()
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_atomic(state.identity_path, pem)
    with pytest.raises(StateError, match="not an Ed25519 key"):
        state.load_identity()


def test_write_atomic_and_create_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, b"one")
    assert path.read_bytes() == b"one" and _mode(path) == 0o600
    write_atomic(path, b"two", mode=0o644)
    assert path.read_bytes() == b"two" and _mode(path) == 0o644
    assert not create_exclusive(path, b"three")
    assert path.read_bytes() == b"two"
    assert create_exclusive(tmp_path / "g", b"new") and (tmp_path / "g").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "g"]


def test_credentials_roundtrip_0600(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "st")
    ident, _ = state.load_or_create_identity()
    assert state.load_credentials(ident) is None
    creds = create_mesh(ident, "home", 1_700_000_000, 1, 1)
    state.store_credentials(creds)
    for name in ("genesis.json", "member-cert.json", "admin.key", "identity.key"):
        assert _mode(state.path / name) == 0o600, name
    back = state.load_credentials(ident)
    assert back is not None and back.mesh_id == creds.mesh_id and back.genesis.name == "home"
    assert back.cert.encoded == creds.cert.encoded
    assert back.admin is not None and back.admin.public_key == creds.admin.public_key  # type: ignore[union-attr]


def test_credentials_for_another_key_or_tampered_are_refused(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "st")
    ident, _ = state.load_or_create_identity()
    creds = create_mesh(ident, "home", 1_700_000_000, 1, 1)
    state.store_credentials(creds)
    with pytest.raises(StateError, match="not this node"):
        state.load_credentials(NodeIdentity.generate())
    os.chmod(state.path / "admin.key", 0o644)
    with pytest.raises(StateError, match="admin key .* readable by group or others"):
        state.load_credentials(ident)
    os.chmod(state.path / "admin.key", 0o600)
    other = create_mesh(ident, "other", 1_700_000_000, 1, 1)
    write_atomic(state.path / "admin.key", (state.path / "admin.key").read_bytes())  # still fine
    write_atomic(state.path / "member-cert.json", other.cert.encoded)
    with pytest.raises(StateError, match="another mesh"):
        state.load_credentials(ident)
    (state.path / "member-cert.json").unlink()
    with pytest.raises(StateError, match="missing"):
        state.load_credentials(ident)
    write_atomic(state.path / "genesis.json", creds.genesis.encoded.replace(b"home", b"hack"))
    with pytest.raises(StateError, match="genesis .* invalid"):
        state.load_credentials(ident)


def test_first_serve_creates_mesh_files_0600(tmp_path: Path) -> None:
    from daemon_testlib import start_node

    node = start_node(tmp_path / "a", "--mesh-name", "lab")
    try:
        assert node.status()["mesh_name"] == "lab"
    finally:
        node.stop()
    for name in ("identity.key", "genesis.json", "member-cert.json", "admin.key"):
        assert _mode(tmp_path / "a" / name) == 0o600, name
    state = StateDir(tmp_path / "a")
    ident = state.load_identity()
    assert ident is not None
    creds = state.load_credentials(ident)
    assert creds is not None and creds.is_admin and creds.mesh_id == node.run["mesh_id"]
