"""The daemon: one asyncio loop owning the transport, the control socket and the services.

Lifecycle of ``await Daemon.run()`` (returns the exit code):

1. signal handlers (SIGTERM, SIGINT -> clean stop); ``STATUS=starting``;
2. the control socket (refuses to start if another daemon serves this state dir);
3. the transport (``MeshTransport`` listening on ``config.listen``) -- see ``_start_transport``;
4. the services, in order (``await service.start(daemon)``);
5. ``run.json`` written atomically, ``READY=1``, watchdog pings, ``daemon_ready`` logged;
6. wait for a stop request; then ``STOPPING=1``, ``run.json`` removed, services stopped in reverse
   order, the transport closed (connections closed with a reason), the control socket removed,
   all within ``config.shutdown_timeout_s``.

A service is any object with ``name: str``, ``async start(daemon)``, ``async stop()`` and
``status() -> dict``. ``status()`` may return ``"models"`` and ``"peers"`` lists (SPEC's status shapes),
which are concatenated into ``meshd status``; anything else appears under ``"services": {name: ...}``.
A service that fails at run time calls ``daemon.fail(reason)`` (exit 1, so systemd restarts us).

Joining: a daemon may start without credentials when a join token is configured
(``daemon.credentials is None``, state ``joining``). Whoever redeems the token (the membership service,
reading ``daemon.config.read_join_token()``) calls ``daemon.set_credentials(creds)``, which stores them,
hands them to the transport and tells every ``daemon.on_credentials`` callback.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog

from meshd import __version__
from meshd.config import DaemonConfig, HostPort, format_hostport, is_loopback
from meshd.control import ControlServer
from meshd.errors import EXIT_OK, EXIT_RUNTIME, MeshdError, RuntimeFailure
from meshd.sdnotify import SdNotifier
from meshd.state import StateDir
from transport import PROTOCOL_VERSION
from transport.credentials import MemberCert, MeshCredentials
from transport.errors import TransportError
from transport.identity import NodeIdentity
from transport.quic import MeshTransport, TransportConfig

log = structlog.get_logger(__name__)

STATUS_REFRESH_S = 15.0  # how often STATUS= is refreshed for systemctl status
STARTUP_EXTEND_EVERY_S = 20.0  # while services start (a model may load for minutes), ask systemd ...
STARTUP_EXTEND_S = 60.0  # ... for this much more start time: a live loop may start as long as it needs


class Service(Protocol):
    """What the daemon runs. See the module docstring for the contract."""

    name: str

    async def start(self, daemon: Daemon) -> None: ...

    async def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


Admission = Callable[[str, MemberCert], "str | None"]
"""``admission(node_id, cert)`` -> a refusal reason, or None to admit. Checked at every handshake."""


class Daemon:
    """One meshd node. Construct, optionally ``add_service``, then ``await run()``."""

    def __init__(
        self,
        config: DaemonConfig,
        state: StateDir,
        identity: NodeIdentity,
        credentials: MeshCredentials | None,
        *,
        services: Sequence[Service] = (),
        notifier: SdNotifier | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.identity = identity
        self.credentials = credentials
        self.services: list[Service] = list(services)
        self.notifier = notifier if notifier is not None else SdNotifier()
        self.control = ControlServer(state.control_path)
        self.transport: MeshTransport | None = None
        self.quic_address: HostPort | None = None
        self.api_address: HostPort | None = None
        self.admission_checks: list[Admission] = []
        self.on_credentials: list[Callable[[MeshCredentials], None]] = []
        self.phase = "created"
        self.started_at = time.monotonic()
        self._stop: asyncio.Event | None = None
        self._exit_code = EXIT_OK
        self._stop_reason = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._started: list[Service] = []
        self.control.register("status", self._cmd_status)

    # --- identity / mesh -----------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def mesh_id(self) -> str | None:
        return self.credentials.mesh_id if self.credentials else None

    def add_service(self, service: Service) -> None:
        """Append a service (before ``run``); services start in the order added."""
        if self.phase != "created":
            raise RuntimeError("services must be added before the daemon runs")
        self.services.append(service)

    def set_credentials(self, creds: MeshCredentials) -> None:
        """Adopt mesh credentials (after a join): store them 0600, give them to the transport, tell
        ``on_credentials`` callbacks, and rewrite run.json. Raises ``StateError`` if storing fails."""
        if creds.cert.node_pub != self.identity.public_key:
            raise ValueError("credentials are for another node key")
        self.state.store_credentials(creds)
        self.credentials = creds
        if self.transport is not None:
            self.transport.set_credentials(creds)
        log.info(
            "mesh_credentials_set", mesh_id=creds.mesh_id, mesh_name=creds.genesis.name, admin=creds.is_admin
        )
        for callback in list(self.on_credentials):
            try:
                callback(creds)
            except Exception:
                log.exception("credentials_callback_failed")
        if self.phase in ("joining", "running"):
            self.phase = "running"
            self._write_run()
            self._notify_status()

    def set_api_address(self, host: str, port: int) -> None:
        """Called by the API service once it has bound (the address actually bound)."""
        self.api_address = HostPort(host, port)
        if self.phase in ("joining", "running"):
            self._write_run()

    def admit(self, node_id: str, cert: MemberCert) -> str | None:
        """Run ``admission_checks`` in order; the first refusal reason wins. Never raises."""
        for check in self.admission_checks:
            try:
                reason = check(node_id, cert)
            except Exception:
                log.exception("admission_check_failed", peer=node_id)
                return "internal error"
            if reason:
                return reason
        return None

    # --- stopping ------------------------------------------------------------------------------

    def request_stop(self, reason: str = "requested") -> None:
        """Begin a clean stop (exit 0 unless ``fail`` was called). Safe to call more than once."""
        if not self._stop_reason:
            self._stop_reason = reason
        if self._stop is not None:
            self._stop.set()

    def fail(self, reason: str) -> None:
        """Stop because something broke at run time: exit 1 (systemd's Restart=on-failure applies)."""
        log.error("daemon_failed", reason=reason)
        self._exit_code = EXIT_RUNTIME
        self.request_stop(f"failure: {reason}")

    # --- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """SPEC's status object, plus ``role``, ``pid``, ``uptime_s``, ``admin`` and ``services``."""
        models: list[Any] = []
        peers: list[Any] = []
        extra: dict[str, Any] = {}
        for service in self.services:
            try:
                st = dict(service.status())
            except Exception as e:  # a broken status must not break `meshd status`
                log.exception("service_status_failed", service=service.name)
                st = {"error": type(e).__name__}
            models.extend(st.pop("models", []) or [])
            peers.extend(st.pop("peers", []) or [])
            if st:
                extra[service.name] = st
        if self.transport is not None:
            extra["transport"] = {"connected_peers": len(self.transport.peers()), **self.transport.stats}
        creds = self.credentials
        return {
            "node_id": self.node_id,
            "mesh_id": creds.mesh_id if creds else None,
            "mesh_name": creds.genesis.name if creds else None,
            "state": self.phase,
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "quic": str(self.quic_address) if self.quic_address else None,
            "api": str(self.api_address) if self.api_address else None,
            "lane": getattr(self, "lane_address", None),  # set by the lane service (meshd/lane_service.py)
            "models": models,
            "peers": peers,
            "role": self.config.role,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "admin": bool(creds and creds.is_admin),
            "services": extra,
        }

    async def _cmd_status(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    def run_info(self) -> dict[str, Any]:
        """The contents of run.json."""
        return {
            "node_id": self.node_id,
            "mesh_id": self.mesh_id,
            "quic": str(self.quic_address) if self.quic_address else None,
            "api": str(self.api_address) if self.api_address else None,
            "pid": os.getpid(),
        }

    def _write_run(self) -> None:
        try:
            self.state.write_run(self.run_info())
        except OSError as e:
            log.error("run_file_write_failed", path=str(self.state.run_path), error=e.strerror)

    def _status_line(self) -> str:
        if self.credentials is None:
            return "joining a mesh"
        st = self.status()
        return (
            f"running: mesh {st['mesh_name']} ({st['mesh_id']}), {len(st['peers'])} peers, "
            f"{len(st['models'])} models"
        )

    def _notify_status(self) -> None:
        if self.notifier.enabled:
            self.notifier.notify(STATUS=self._status_line())

    # --- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> int:
        """Start everything, serve until SIGTERM/SIGINT or ``request_stop``, stop. Returns the exit
        code. Raises ``MeshdError`` if starting fails (after undoing what had started)."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stop_reason:
            self._stop.set()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        self.phase = "starting"
        self.started_at = time.monotonic()
        self.notifier.notify(STATUS="starting")
        extender = loop.create_task(self._extend_startup())
        try:
            await self._start_all()
        except BaseException:
            extender.cancel()
            await self._stop_all()
            raise
        extender.cancel()
        try:
            if not self._stop.is_set():
                self.phase = "running" if self.credentials else "joining"
                self._write_run()
                self.notifier.notify(READY=1, STATUS=self._status_line())
                log.info(
                    "daemon_ready",
                    node_id=self.node_id,
                    mesh_id=self.mesh_id,
                    role=self.config.role,
                    quic=str(self.quic_address) if self.quic_address else None,
                    api=str(self.api_address) if self.api_address else None,
                    pid=os.getpid(),
                )
                self._spawn(self._watchdog())
                self._spawn(self._status_refresher())
                await self._stop.wait()
        finally:
            log.info("daemon_stopping", reason=self._stop_reason or "cancelled")
            await self._stop_all()
        log.info("daemon_stopped", exit_code=self._exit_code)
        return self._exit_code

    async def _start_all(self) -> None:
        await self.control.start()
        if self._stop_requested():
            return
        await self._start_transport()
        for service in self.services:
            if self._stop_requested():
                return
            try:
                await service.start(self)
            except MeshdError:
                raise
            except OSError as e:  # a port in use, a missing file: the environment, not a bug
                raise RuntimeFailure(f"{service.name} failed to start: {e.strerror or e}") from e
            except Exception as e:
                log.exception("service_start_failed", service=service.name)
                raise RuntimeFailure(f"{service.name} failed to start: {e}") from e
            self._started.append(service)
            log.debug("service_started", service=service.name)

    def _stop_requested(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    async def _start_transport(self) -> None:
        # ---- WIRING POINT (transport): the only place the daemon creates the QUIC transport. ----
        # Loopback-only nodes (tests, benches) use bigger packets: every peer is on the 64 KiB-MTU loopback.
        listen_loopback = is_loopback(self.config.listen.host)
        tconfig = TransportConfig.loopback() if listen_loopback else TransportConfig()
        transport = MeshTransport(self.identity, self.credentials, tconfig, admission=self.admit)
        try:
            host, port = await transport.listen(self.config.listen.host, self.config.listen.port)
        except (OSError, TransportError) as e:
            await transport.close()
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).rsplit(": ", 1)[-1]
            raise RuntimeFailure(f"cannot listen on {self.config.listen} (UDP): {reason}") from e
        self.transport = transport
        self.quic_address = HostPort(host, port)
        log.info("quic_listening", address=format_hostport(host, port))

    async def _stop_all(self) -> None:
        """Undo everything started, newest first, within the shutdown budget. Never raises."""
        self.phase = "stopping"
        self.notifier.notify(STOPPING=1, STATUS="stopping")
        self.state.remove_run()
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        steps: list[tuple[str, Callable[[], Any]]] = [(s.name, s.stop) for s in reversed(self._started)]
        self._started.clear()
        if self.transport is not None:
            steps.append(("transport", self.transport.close))
        steps.append(("control", self.control.close))
        for name, stop in steps:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.wait_for(stop(), remaining)
            except TimeoutError:
                log.warning("stop_timed_out", component=name, budget_s=round(remaining, 2))
            except Exception:
                log.exception("stop_failed", component=name)
        self.transport = None
        self.state.remove_run()
        self.notifier.close()

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def _watchdog(self) -> None:
        interval = self.notifier.watchdog_interval_s()
        if interval is None:
            return
        while True:  # pinged from the loop itself: a stuck loop stops the pings and systemd restarts us
            self.notifier.notify(WATCHDOG=1)
            await asyncio.sleep(interval)

    async def _extend_startup(self) -> None:
        if not self.notifier.enabled:
            return
        while True:
            await asyncio.sleep(STARTUP_EXTEND_EVERY_S)
            self.notifier.notify(EXTEND_TIMEOUT_USEC=int(STARTUP_EXTEND_S * 1e6), STATUS="starting services")

    async def _status_refresher(self) -> None:
        if not self.notifier.enabled:
            return
        while True:
            await asyncio.sleep(STATUS_REFRESH_S)
            self._notify_status()
