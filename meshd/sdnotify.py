"""The systemd notification protocol (sd_notify(3)), spoken directly: one datagram per message.

``NOTIFY_SOCKET`` names an AF_UNIX datagram socket; a leading ``@`` means the Linux abstract namespace
(the ``@`` becomes a NUL byte). A message is newline-separated ``KEY=VALUE`` assignments, e.g.
``READY=1\\nSTATUS=serving``. Without ``NOTIFY_SOCKET`` every call is a no-op. Sending never raises:
systemd being away must not take the daemon down.

Watchdog: when ``WATCHDOG_USEC`` is set (and ``WATCHDOG_PID``, if set, is our pid), systemd expects
``WATCHDOG=1`` at least that often; ``watchdog_interval_s()`` returns half of it, the recommended period.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)


def _address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock and other schemes: not supported, so notifications are disabled


class SdNotifier:
    """Sends sd_notify messages to ``NOTIFY_SOCKET`` (from ``env``, default ``os.environ``)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self._address = _address(raw) if raw else None
        if raw and self._address is None:
            log.warning("notify_socket_unsupported", notify_socket=raw)
        self._sock: socket.socket | None = None
        self._watchdog_usec = 0
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self._watchdog_usec = int(usec)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def watchdog_interval_s(self) -> float | None:
        """Half of ``WATCHDOG_USEC`` in seconds, or None if systemd expects no watchdog pings."""
        if not self._watchdog_usec or not self.enabled:
            return None
        return self._watchdog_usec / 2e6

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines (``notify(READY=1, STATUS="serving")``). True if sent."""
        if self._address is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value).replace("\n", " ")  # a newline would start a new assignment
            lines.append(f"{key}={text}")
        return self.send("\n".join(lines))

    def send(self, message: str) -> bool:
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(message.encode(), self._address)
        except OSError as e:
            log.debug("sd_notify_failed", error=e.strerror or str(e))
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
