"""The control socket: ``control.sock`` (mode 0600) in the state dir, newline-delimited JSON.

Protocol: the client sends one JSON object per line, ``{"cmd": NAME, ...params}``; the daemon answers each
with one line, ``{"ok": true, ...result}`` or ``{"ok": false, "error": "one readable line"}``. A
connection may carry several requests, answered in order.

Server side: ``ControlServer.register(name, handler)`` with ``async handler(params: dict) -> dict``;
raise ``ControlError(message)`` to refuse with that message. Any other exception answers
``"internal error"`` and is logged.

Client side: ``call(socket_path, cmd, **params)`` (blocking) or ``await request(...)``; both raise
``NoDaemon`` when nothing listens and ``RuntimeFailure`` when the daemon refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import structlog

from meshd.errors import RuntimeFailure
from transport.limits import MAX_CONTROL_CONNECTIONS, MAX_CONTROL_LINE_BYTES

log = structlog.get_logger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

_MAX_SUN_PATH = 100  # sockaddr_un holds 108 bytes; longer paths go through /proc/self/fd


class ControlError(Exception):
    """Raised by a handler to answer ``{"ok": false, "error": str(e)}``."""


class NoDaemon(RuntimeFailure):
    """No daemon listens on the control socket. ``reason`` is the why alone (e.g. "no control socket in DIR")."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"no meshd daemon is running ({reason})")
        self.reason = reason


@contextlib.contextmanager
def _sun_path(path: Path) -> Iterator[str]:
    """A path usable in ``sockaddr_un`` for ``path``, even when it is longer than 108 bytes."""
    text = str(path)
    if len(text.encode()) < _MAX_SUN_PATH:
        yield text
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _socket_alive(path: Path) -> bool:
    with _sun_path(path) as sun, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(sun)
        except OSError:
            return False
    return True


class ControlServer:
    """Serves the control protocol on a Unix socket. ``register`` handlers, then ``start``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handlers: dict[str, Handler] = {}
        self._server: asyncio.AbstractServer | None = None
        self._clients: set[asyncio.Task[None]] = set()

    def register(self, name: str, handler: Handler) -> None:
        """Add command ``name``. Raises ``ValueError`` if it is already registered."""
        if name in self._handlers:
            raise ValueError(f"control command {name!r} is already registered")
        self._handlers[name] = handler

    def commands(self) -> list[str]:
        return sorted(self._handlers)

    async def start(self) -> None:
        """Listen. Raises ``RuntimeFailure`` if another daemon already serves this state dir."""
        if self.path.exists() or self.path.is_symlink():
            if _socket_alive(self.path):
                raise RuntimeFailure(f"another meshd is already running with state dir {self.path.parent}")
            self.path.unlink()  # stale socket from a daemon that died
        old_umask = os.umask(0o177)  # the socket is 0600 from the moment it exists
        try:
            with _sun_path(self.path) as sun:
                self._server = await asyncio.start_unix_server(
                    self._serve_client, path=sun, limit=MAX_CONTROL_LINE_BYTES
                )
        except OSError as e:
            raise RuntimeFailure(f"cannot create control socket {self.path}: {e.strerror}") from e
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        """Stop listening, drop clients, remove the socket file."""
        if self._server is not None:
            self._server.close()
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # always inside a task here (asyncio contract, not input)
        if len(self._clients) >= MAX_CONTROL_CONNECTIONS:
            writer.write(_encode({"ok": False, "error": "too many control connections"}))
            with contextlib.suppress(Exception):
                await writer.drain()
            writer.close()
            return
        self._clients.add(task)
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as e:
                    line = e.partial  # a last request without its newline, or b"" at EOF
                    if not line:
                        break
                except asyncio.LimitOverrunError:
                    # Longer than the limit: skip the rest of that line, answer, and carry on.
                    if not await _skip_line(reader):
                        break
                    writer.write(_encode({"ok": False, "error": "request too large"}))
                    await writer.drain()
                    continue
                reply = await self.dispatch(line)
                writer.write(_encode(reply))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def dispatch(self, line: bytes) -> dict[str, Any]:
        """Answer one request line. Never raises (except cancellation)."""
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return {"ok": False, "error": "request is not JSON"}
        if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
            return {"ok": False, "error": "request must be an object with a string 'cmd'"}
        name = request.pop("cmd")
        handler = self._handlers.get(name)
        if handler is None:
            return {"ok": False, "error": f"unknown command {name!r}"}
        try:
            result = await handler(request)
        except ControlError as e:
            return {"ok": False, "error": str(e) or "refused"}
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("control_command_failed", cmd=name)
            return {"ok": False, "error": f"internal error in {name!r} (see the daemon's log)"}
        return {"ok": True, **result}


async def _skip_line(reader: asyncio.StreamReader) -> bool:
    """Discard input up to and including the next newline. False if the stream ended first."""
    while True:
        try:
            await reader.readuntil(b"\n")
            return True
        except asyncio.LimitOverrunError as e:
            await reader.readexactly(max(1, e.consumed))
        except asyncio.IncompleteReadError:
            return False


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def request(
    path: Path, cmd: str, params: dict[str, Any] | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Send one command and return the reply's fields (without ``ok``).

    Raises ``NoDaemon`` if no daemon listens on ``path``; ``RuntimeFailure`` if it refuses or does not
    answer within ``timeout_s``.
    """
    state_dir = path.parent
    try:
        with _sun_path(path) as sun:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(sun, limit=MAX_CONTROL_LINE_BYTES), timeout_s
            )
    except (FileNotFoundError, ConnectionRefusedError):
        raise NoDaemon(f"no control socket in {state_dir}") from None
    except PermissionError:
        raise RuntimeFailure(f"permission denied on {path} (run as the daemon's user)") from None
    except (TimeoutError, OSError) as e:
        raise RuntimeFailure(f"cannot reach the daemon at {path}: {e}") from None
    try:
        writer.write(_encode({**(params or {}), "cmd": cmd}))
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except TimeoutError:
        raise RuntimeFailure(f"the daemon did not answer {cmd!r} within {timeout_s:g} s") from None
    except (OSError, ValueError) as e:
        raise RuntimeFailure(f"control socket error: {e}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    if not line:
        raise RuntimeFailure("the daemon closed the control connection without answering")
    try:
        reply = json.loads(line)
    except ValueError:
        raise RuntimeFailure("the daemon sent a malformed reply") from None
    if not isinstance(reply, dict):
        raise RuntimeFailure("the daemon sent a malformed reply")
    if not reply.pop("ok", False):
        raise RuntimeFailure(str(reply.get("error", "the daemon refused")))
    return reply


def call(path: Path, cmd: str, timeout_s: float = 10.0, **params: Any) -> dict[str, Any]:
    """Blocking ``request`` for CLI commands."""
    return asyncio.run(request(path, cmd, params, timeout_s))
