"""The API as a daemon service: HTTP server on ``--api``, tunnel handler on the transport, peer directory.

``ApiService(...)`` takes already-built parts so that the daemon, the test nodes and the bench wire it
the same way. ``await start(daemon=None)`` binds and registers ``StreamType.HTTP_TUNNEL`` on the
transport; ``stop()`` undoes it; ``status()`` is merged into ``meshd status --json``.

Model SPECs handled here: ``openai:URL`` and ``NAME=openai:URL`` (external servers). Engine models
(``PATH``, ``tiny``) come from the engine adapter (``meshd.api.engine_backend``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import structlog

from meshd.api.backends import Backend, OpenAIBackend
from meshd.api.directory import TunnelDirectory
from meshd.api.server import ApiConfig, ApiServer, ensure_safe_bind, load_api_keys
from meshd.api.tunnel import TunnelClient, TunnelConfig, TunnelServer
from meshd.errors import UsageError
from transport import limits

log = structlog.get_logger(__name__)


def split_spec(spec: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` -> (NAME, SPEC); a bare SPEC -> (None, SPEC). A Windows-less world: '=' before any '/'."""
    name, sep, rest = spec.partition("=")
    if sep and name and "/" not in name and ":" not in name:
        return name, rest
    return None, spec


def openai_backend_from_spec(spec: str) -> OpenAIBackend | None:
    """An ``OpenAIBackend`` for ``[NAME=]openai:URL``; None for other SPECs. Raises ``UsageError``."""
    name, rest = split_spec(spec)
    if not rest.startswith("openai:"):
        return None
    url = rest[len("openai:"):]
    if not url.startswith(("http://", "https://")) or len(url) < 10:
        raise UsageError(f"bad model SPEC '{spec}': expected openai:http://HOST:PORT/v1")
    return OpenAIBackend(url, alias=name)


def parse_host_port(text: str, default_port: int) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; raises ``UsageError``."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise UsageError(f"bad address '{text}': expected HOST:PORT") from None
    if not host or not 0 <= p <= 65535:
        raise UsageError(f"bad address '{text}': expected HOST:PORT")
    return host, p


class ApiService:
    """See module docstring. Built either from parts (``node_id=...``: tests, bench) or, in the daemon,
    from ``DaemonConfig`` at ``start(daemon)`` (``ApiService(config)``)."""

    name = "api"

    def __init__(
        self,
        config: Any = None,
        *,
        node_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 9337,
        role: str = "serve",
        api_keys: Sequence[bytes] = (),
        backends: Sequence[Backend] = (),
        transport: Any = None,
        tunnel_config: TunnelConfig | None = None,
        poll_interval_s: float = limits.TUNNEL_POLL_INTERVAL_S,
    ) -> None:
        self.config = config
        self.tunnel_config = tunnel_config or TunnelConfig()
        self.poll_interval_s = poll_interval_s
        self.address: tuple[str, int] | None = None
        self.daemon: Any = None
        self.membership: Any = None
        self._own: list[Backend] | None = None
        self._publisher: asyncio.Task[None] | None = None
        self.server: ApiServer | None = None
        if node_id is not None:
            self._build(node_id, host, port, role, list(api_keys), list(backends), transport)

    def _build(self, node_id: str, host: str, port: int, role: str, keys: list[bytes], backends: list[Backend],
               transport: Any) -> None:
        ensure_safe_bind(host, bool(keys))
        self.host, self.port = host, port
        self.transport = transport
        self.tunnel_client = TunnelClient(_http_tunnel_type(), self.tunnel_config)
        self.directory = TunnelDirectory(self._peers, self.tunnel_client, interval_s=self.poll_interval_s)
        self.server = ApiServer(ApiConfig(node_id, role=role, api_keys=keys), backends,
                                mesh=self.directory, tunnel=self.tunnel_client)
        self.tunnel_client.count = self.server.metrics.count_tunnel
        self.tunnel_server = TunnelServer(self._dispatch_local, self.tunnel_config, self.server.metrics.count_tunnel)

    async def _build_from_daemon(self, daemon: Any) -> None:
        cfg = daemon.config
        keys = load_api_keys(cfg.api_key_file) if cfg.api_key_file is not None else []
        backends: list[Backend] = []
        if cfg.role == "serve":
            provided = engine_backends(daemon)
            for spec in cfg.models:
                b = openai_backend_from_spec(spec)
                if b is not None:
                    backends.append(b)
                elif provided is None:  # no engine service in this daemon: load the model here
                    from meshd.api.engine_backend import engine_backend, load_engine_model
                    from meshd.experts_service import experts_of

                    experts = experts_of(daemon)
                    remote = experts is not None and cfg.remote_experts != "off"
                    pipeline = None
                    if getattr(cfg, "pipeline", "off") != "off":
                        from meshd.pipeline_service import pipeline_of

                        pipeline = pipeline_of(daemon)
                    # in a thread: a big checkpoint must not stall the loop (systemd pings, control)
                    loaded = await asyncio.to_thread(load_engine_model, spec, cfg.state_dir,
                                                     remote or pipeline is not None)
                    executor = None
                    if remote:
                        assert experts is not None
                        executor = await experts.executor_for(loaded.path, loaded.model.expert_weights)
                    if pipeline is not None:  # --pipeline on|prefer: layers over stage nodes
                        backends.append(await pipeline.backend(loaded, executor))
                    else:
                        backends.append(engine_backend(loaded, executor=executor))
            self._own = list(backends)  # reported in status by this service (others report their own)
            backends.extend(provided or [])
        self._build(daemon.node_id, cfg.api.host, cfg.api.port, cfg.role, keys, backends, daemon.transport)

    def _peers(self) -> list[Any]:
        return list(self.transport.peers()) if self.transport is not None else []

    async def _dispatch_local(self, method: str, path: str, body: bytes) -> Any:
        assert self.server is not None
        return await self.server.dispatch(method, path, body, local_only=True)

    def _peer_down(self, peer: Any) -> None:
        self.directory.forget(peer.node_id)

    def _peer_up(self, peer: Any) -> None:
        self.directory.poke()

    async def start(self, daemon: Any = None) -> None:
        if self.server is None:
            if daemon is None:
                raise RuntimeError("ApiService needs node_id=... or a daemon")
            await self._build_from_daemon(daemon)
        assert self.server is not None
        self.daemon = daemon
        if self.transport is not None:
            self.transport.on_stream(_http_tunnel_type(), self.tunnel_server.handle)
            self.transport.on_peer_down.append(self._peer_down)
            self.transport.on_peer_up.append(self._peer_up)
        if daemon is not None:
            register_collectors(daemon, self.server.metrics.registry)
        # serve.run binds the API before it creates anything (a taken port must leave no mesh behind)
        socks = getattr(daemon, "api_sockets", None) if daemon is not None else None
        self.address = await self.server.start(self.host, self.port, socks=socks)
        await self.directory.start()
        if daemon is not None:
            daemon.set_api_address(*self.address)
            daemon.control.register("api_connect", self._cmd_connect)
            self.membership = _membership_of(daemon)
            if self.membership is not None:
                with contextlib.suppress(Exception):
                    self.membership.on_change(lambda event: self.directory.poke())
                self.directory.states_source = self._member_states
                self._publisher = asyncio.create_task(self._publish_loop())

    def _member_states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for v in self.membership.peers():
            counts[str(v.state)] = counts.get(str(v.state), 0) + 1
        return counts

    async def _publish_loop(self) -> None:
        """Advertise this node's served models and load in its membership record (gossip)."""
        last: tuple[tuple[str, str, str, int], ...] | None = None
        while True:
            try:
                assert self.server is not None
                models = tuple(sorted((m["name"], m["kind"], m["fingerprint"], _context_of(b))
                                      for b in self.server.backends if b.models() for m in b.status()))
                if models != last:
                    self.membership.set_local_models([_model_info(*m) for m in models])
                    last = models
                self.membership.set_load(self.server.local_info().in_flight)
            except Exception as e:  # noqa: BLE001 - advertising must never take the API down
                log.debug("api_publish_failed", error=type(e).__name__)
            await asyncio.sleep(self.poll_interval_s)

    async def _cmd_connect(self, params: dict[str, Any]) -> dict[str, Any]:
        """Interim until membership connects peers: keep a connection to ``addr`` pinned to ``node_id``."""
        from meshd.control import ControlError

        addr, node_id = params.get("addr"), params.get("node_id")
        if not isinstance(addr, str) or not isinstance(node_id, str) or self.transport is None:
            raise ControlError("api_connect needs addr (HOST:PORT) and node_id")
        try:
            host, port = parse_host_port(addr, 9336)
        except UsageError as e:
            raise ControlError(str(e)) from None
        self.transport.keep_connected(node_id, [(host, port)])
        return {"connecting": node_id}

    async def stop(self) -> None:
        if self.server is None:
            return
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(BaseException):
                await self._publisher
        await self.directory.stop()
        await self.server.stop()
        if self.transport is not None:
            with contextlib.suppress(ValueError):
                self.transport.on_peer_down.remove(self._peer_down)
            with contextlib.suppress(ValueError):
                self.transport.on_peer_up.remove(self._peer_up)

    def status(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        st = self.server.status()
        own = self._own if self._own is not None else self.server.backends
        st["models"] = [m for b in own for m in b.status()]
        st["role"] = self.server.config.role
        st["tunnels_active"] = self.tunnel_server.active
        st["peers_serving"] = {n.node_id: list(n.models) for n in self.directory.nodes()}
        st["routes"] = {nid: {"ttfb_ms": ps.ttfb_ms, "tok_per_s": ps.tok_per_s, "failures": ps.failures}
                        for nid, ps in self.server.routes.stats.items()}
        return st

    def local_info(self) -> dict[str, Any]:
        """What membership may advertise for this node: served models, role, load, API address."""
        assert self.server is not None
        info = self.server.local_info()
        return {"models": list(info.models), "role": info.role, "in_flight": info.in_flight,
                "capacity": info.capacity,
                "api": f"{self.address[0]}:{self.address[1]}" if self.address else None}


def engine_backends(daemon: Any) -> list[Backend] | None:
    """Backends for engine models (PATH, tiny) from a models service of this daemon, or None if none runs.

    A service exposing ``api_backends() -> list[Backend]`` (e.g. ``EngineBackend`` over its schedulers)
    contributes them; without one, the API service loads ``--model`` engine SPECs itself."""
    out: list[Backend] | None = None
    for svc in getattr(daemon, "services", []):
        fn = getattr(svc, "api_backends", None)
        if callable(fn):
            out = (out or []) + list(fn())
    return out


def register_collectors(daemon: Any, registry: Any) -> None:
    """Put the daemon's other services' Prometheus collectors on this API's /metrics registry: a service
    exposing ``prometheus_collectors() -> [Collector]`` (e.g. the expert workers' ``meshd_experts_*``)."""
    for svc in getattr(daemon, "services", []):
        fn = getattr(svc, "prometheus_collectors", None)
        if callable(fn):
            for collector in fn():
                with contextlib.suppress(ValueError):  # already there (a second start)
                    registry.register(collector)


def _membership_of(daemon: Any) -> Any:
    """The daemon's membership service (anything with ``set_local_models`` and ``set_load``), or None."""
    for svc in getattr(daemon, "services", []):
        if callable(getattr(svc, "set_local_models", None)) and callable(getattr(svc, "set_load", None)):
            return svc
    return None


def _context_of(backend: Any) -> int:
    """The context length an engine backend's model advertises; 0 when unknown (external servers)."""
    model = getattr(getattr(backend, "source", None), "model", None)
    if model is None:
        return 0
    from engine.generate import context_length

    return context_length(model) or 0


def _model_info(name: str, kind: str, fingerprint: str, context_length: int = 0) -> Any:
    from meshd.membership.records import ModelInfo  # type: ignore[import-not-found]

    return ModelInfo(name=name, kind=kind, fingerprint=fingerprint, context_length=context_length)


def _http_tunnel_type() -> Any:
    from transport.streams import StreamType

    return StreamType.HTTP_TUNNEL
