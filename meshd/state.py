"""The state directory: where it is, and the files in it (keys, credentials, run.json, control.sock).

Resolution (SPEC): ``--state-dir`` (or the config file's ``state-dir``), else ``$MESHD_STATE_DIR``, else
``$STATE_DIRECTORY`` (set by systemd's ``StateDirectory=``; the first entry if it lists several), else
``~/.local/state/meshd``.

Every secret or credential file is written atomically (temporary file in the same directory, fsync,
rename, fsync of the directory) with mode 0600, so a crash leaves either the old or the new file, never
half of one. Files holding private keys are refused if group or others can read them.

File formats (documented for operators in docs/daemon.md):

- ``identity.key``: the node's Ed25519 private key, PKCS#8 PEM, unencrypted.
- ``admin.key``: the mesh admin Ed25519 private key (only on the node that created the mesh), PKCS#8 PEM.
- ``genesis.json``: the mesh's genesis record, ``transport.credentials`` signed-document format.
- ``member-cert.json``: this node's member certificate, same format.
- ``run.json``: ``{"node_id", "mesh_id", "quic", "api", "pid"}`` while the daemon runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshd.errors import RuntimeFailure, UsageError
from transport.credentials import CredentialError, Genesis, MemberCert, MeshCredentials
from transport.identity import NodeIdentity

IDENTITY_FILE = "identity.key"
ADMIN_KEY_FILE = "admin.key"
GENESIS_FILE = "genesis.json"
MEMBER_CERT_FILE = "member-cert.json"
RUN_FILE = "run.json"
CONTROL_SOCKET = "control.sock"
LOCK_FILE = "daemon.lock"

log = structlog.get_logger(__name__)

MAX_KEY_FILE_BYTES = 4096
"""A PEM Ed25519 key is 119 bytes; anything far larger is not a key file."""


class StateError(RuntimeFailure):
    """A state file is unreadable, corrupt, or unsafe. Exit 1 with the reason (the user can fix it)."""


def resolve_state_dir(flag: str | None, env: Mapping[str, str]) -> Path:
    """Return the state directory per SPEC's order. ``flag`` is ``--state-dir`` or the config value.

    Raises ``UsageError`` if none applies and there is no home directory.
    """
    if flag:
        return Path(flag).expanduser()
    if env.get("MESHD_STATE_DIR"):
        return Path(env["MESHD_STATE_DIR"]).expanduser()
    if env.get("STATE_DIRECTORY"):
        # systemd joins several StateDirectory= entries with ':'; ours is the first.
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    home = env.get("HOME")
    if not home:
        raise UsageError("no state directory: pass --state-dir or set MESHD_STATE_DIR (HOME is not set)")
    return Path(home) / ".local" / "state" / "meshd"


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically; the file has ``mode`` from its first byte on."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_new(tmp, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes, mode: int = 0o600) -> bool:
    """Create ``path`` with ``data`` only if it does not exist (atomically, complete or absent).

    Returns False if another writer created it first.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_new(tmp, data, mode)
    try:
        os.link(tmp, path)  # fails with EEXIST instead of replacing
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    _fsync_dir(path.parent)
    return True


def _write_new(path: Path, data: bytes, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed or (never) widened it
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode_private_key(identity: NodeIdentity) -> bytes:
    return identity.private_key().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _read_secret(path: Path, what: str) -> bytes:
    """Read a private-key file, refusing it if group/others may read it or it is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except PermissionError as e:
        raise StateError(f"{what} {path}: permission denied") from e
    except OSError as e:
        raise StateError(f"{what} {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{what} {path} is not a regular file")
        _refuse_foreign(st, path, what)
        if st.st_mode & 0o077:
            raise StateError(
                f"{what} {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run: chmod 600 {path}"
            )
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise StateError(f"{what} {path} is corrupt (too large for a key)")
        return os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)


def _refuse_foreign(st: os.stat_result, path: Path, what: str) -> None:
    """Refuse a state file or directory that another user owns: they could replace or read it."""
    me = os.geteuid()
    if st.st_uid != me:
        raise StateError(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {me}); "
                         f"run meshd as its owner, or fix it: chown {me} {path}")


def _decode_private_key(data: bytes, path: Path, what: str) -> NodeIdentity:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise StateError(f"{what} {path} is corrupt (not an unencrypted PEM private key)") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise StateError(f"{what} {path} is not an Ed25519 key")
    return NodeIdentity(key)


class StateDir:
    """The files of one node's state directory. Paths only; nothing is touched until a method runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def identity_path(self) -> Path:
        return self.path / IDENTITY_FILE

    @property
    def run_path(self) -> Path:
        return self.path / RUN_FILE

    @property
    def control_path(self) -> Path:
        return self.path / CONTROL_SOCKET

    def lock(self) -> int:
        """Take the state dir's single-daemon lock (held until the process exits); returns its fd.

        Raises ``StateError`` if another daemon holds it.
        """
        self.ensure()
        path = self.path / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StateError(f"cannot open {path}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateError(f"another meshd is already running with state dir {self.path}") from None
        return fd

    def ensure(self) -> None:
        """Create the directory (mode 0700) if needed, or make an existing one 0700 (logged); see
        ``check``. Raises ``StateError`` if that fails or the directory is unsafe."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise StateError(f"state directory {self.path}: {e.strerror}") from e
        st = self._check_dir()
        if st is not None and stat.S_IMODE(st.st_mode) & 0o077:
            try:
                os.chmod(self.path, 0o700)
            except OSError as e:
                raise StateError(f"state directory {self.path} is open to group or others (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}) and cannot be made 0700: {e.strerror}") from e
            log.warning("state_dir_permissions_fixed", path=str(self.path),
                        old_mode=f"{stat.S_IMODE(st.st_mode):04o}", new_mode="0700")

    def _check_dir(self) -> os.stat_result | None:
        """The directory's stat, None if it does not exist. Raises ``StateError`` if it is not a directory
        or another user owns it."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StateError(f"state directory {self.path}: {e.strerror}") from e
        if not stat.S_ISDIR(st.st_mode):
            raise StateError(f"state directory {self.path} is not a directory")
        _refuse_foreign(st, self.path, "state directory")
        return st

    def check(self) -> None:
        """Refuse an unsafe state dir before anything is written to it: a directory or a state file owned
        by another user, or mesh credentials without the ``identity.key`` they were issued to (a new key
        would not match them). A group/other-readable directory is fixed later by ``ensure``, not refused.
        Raises ``StateError``."""
        if self._check_dir() is None:
            return
        for name in (IDENTITY_FILE, ADMIN_KEY_FILE, GENESIS_FILE, MEMBER_CERT_FILE, RUN_FILE):
            try:
                st = os.lstat(self.path / name)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StateError(f"{self.path / name}: {e.strerror}") from e
            _refuse_foreign(st, self.path / name, "state file")
        self._refuse_orphan_credentials()

    def _refuse_orphan_credentials(self) -> None:
        if self.identity_path.exists() or self.identity_path.is_symlink():
            return
        present = [n for n in (GENESIS_FILE, MEMBER_CERT_FILE, ADMIN_KEY_FILE) if (self.path / n).exists()]
        if present:
            raise StateError(
                f"{self.identity_path} is missing but {', '.join(present)} are present: they belong to the "
                f"lost node key. Restore identity.key from a backup, or move {', '.join(present)} away to "
                "start this node afresh (it will need a new invite)")

    # --- node identity -------------------------------------------------------------------------

    def load_identity(self) -> NodeIdentity | None:
        """The node key, or None if there is none yet. Raises ``StateError`` if unsafe or corrupt."""
        if not self.identity_path.exists() and not self.identity_path.is_symlink():
            return None
        data = _read_secret(self.identity_path, "identity key")
        return _decode_private_key(data, self.identity_path, "identity key")

    def load_or_create_identity(self) -> tuple[NodeIdentity, bool]:
        """Return ``(identity, created)``, creating ``identity.key`` (0600, atomically) if absent."""
        self.ensure()
        existing = self.load_identity()
        if existing is not None:
            return existing, False
        self._refuse_orphan_credentials()
        identity = NodeIdentity.generate()
        try:
            created = create_exclusive(self.identity_path, _encode_private_key(identity))
        except OSError as e:
            raise StateError(f"cannot write {self.identity_path}: {e.strerror}") from e
        if not created:  # another process won the race: use its key
            other = self.load_identity()
            if other is None:
                raise StateError(f"{self.identity_path} vanished while being created; try again")
            return other, False
        return identity, True

    # --- mesh credentials ----------------------------------------------------------------------

    def has_credentials(self) -> bool:
        return (self.path / GENESIS_FILE).exists()

    def load_credentials(self, identity: NodeIdentity) -> MeshCredentials | None:
        """This node's mesh credentials, or None if it has not joined or created a mesh.

        Raises ``StateError`` if they are incomplete, corrupt, or bound to another node key.
        """
        genesis_path = self.path / GENESIS_FILE
        cert_path = self.path / MEMBER_CERT_FILE
        admin_path = self.path / ADMIN_KEY_FILE
        if not genesis_path.exists():
            return None
        try:
            genesis = Genesis.decode(genesis_path.read_bytes())
        except CredentialError as e:
            raise StateError(f"mesh genesis {genesis_path} is invalid: {e}") from e
        except OSError as e:
            raise StateError(f"mesh genesis {genesis_path}: {e.strerror}") from e
        try:
            cert = MemberCert.decode(cert_path.read_bytes(), genesis)
        except FileNotFoundError as e:
            raise StateError(f"member certificate {cert_path} is missing (genesis present)") from e
        except CredentialError as e:
            raise StateError(f"member certificate {cert_path} is invalid: {e}") from e
        except OSError as e:
            raise StateError(f"member certificate {cert_path}: {e.strerror}") from e
        if cert.node_pub != identity.public_key:
            raise StateError(
                f"member certificate {cert_path} is for node {cert.node_id}, not this node "
                f"{identity.node_id} (was identity.key replaced?)"
            )
        admin: NodeIdentity | None = None
        if admin_path.exists():
            admin = _decode_private_key(_read_secret(admin_path, "admin key"), admin_path, "admin key")
            if admin.public_key != genesis.admin_pub:
                raise StateError(f"admin key {admin_path} does not match the mesh genesis")
        return MeshCredentials(genesis=genesis, cert=cert, admin=admin)

    def store_credentials(self, creds: MeshCredentials) -> None:
        """Write credentials (0600). The genesis is written last: its presence marks a complete set."""
        self.ensure()
        try:
            if creds.admin is not None:
                write_atomic(self.path / ADMIN_KEY_FILE, _encode_private_key(creds.admin))
            write_atomic(self.path / MEMBER_CERT_FILE, creds.cert.encoded)
            write_atomic(self.path / GENESIS_FILE, creds.genesis.encoded)
        except OSError as e:
            raise StateError(f"cannot write credentials in {self.path}: {e.strerror}") from e

    # --- run.json ------------------------------------------------------------------------------

    def write_run(self, info: dict[str, Any]) -> None:
        write_atomic(self.run_path, json.dumps(info, sort_keys=True).encode() + b"\n", mode=0o644)

    def read_run(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.run_path.read_bytes())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def remove_run(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.run_path.unlink()
