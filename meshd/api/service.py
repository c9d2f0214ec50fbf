"""The API as a daemon service: HTTP server on ``--api``, tunnel handler on the transport, console.

What the router knows about other nodes comes from membership's ``MeshView`` (signed records); this
service advertises this node's models, load and API address in its own record.

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
from meshd.api.server import ApiConfig, ApiServer, ensure_safe_bind, load_api_keys
from meshd.api.tunnel import TunnelClient, TunnelConfig, TunnelServer
from meshd.api.view import StaticView
from meshd.errors import UsageError

log = structlog.get_logger(__name__)

PUBLISH_CHECK_S = 0.5  # how often this node's models and load are compared with its record (no network)


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
    ) -> None:
        self.config = config
        self.tunnel_config = tunnel_config or TunnelConfig()
        self.address: tuple[str, int] | None = None
        self.daemon: Any = None
        self.membership: Any = None
        self._own: list[Backend] | None = None
        self._publisher: asyncio.Task[None] | None = None
        self.server: ApiServer | None = None
        self.view: Any = StaticView()
        self.console: Any = None
        self._parts: tuple[Any, ...] | None = None
        if node_id is not None:  # built at start(), once the daemon's membership view is known
            ensure_safe_bind(host, bool(api_keys))
            self._parts = (node_id, host, port, role, list(api_keys), list(backends), transport)

    def _build(self, node_id: str, host: str, port: int, role: str, keys: list[bytes], backends: list[Backend],
               transport: Any) -> None:
        from meshd.mesh.console import Console

        ensure_safe_bind(host, bool(keys))
        self.host, self.port = host, port
        self.transport = transport
        self.tunnel_client = TunnelClient(_http_tunnel_type(), self.tunnel_config)
        self.server = ApiServer(ApiConfig(node_id, role=role, api_keys=keys), backends,
                                mesh=self.view, tunnel=self.tunnel_client)
        self.console = Console(self.server, self.view)
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

    async def _dispatch_local(self, method: str, path: str, body: bytes) -> Any:
        assert self.server is not None
        return await self.server.dispatch(method, path, body, local_only=True)

    async def start(self, daemon: Any = None) -> None:
        self.membership = _membership_of(daemon) if daemon is not None else None
        view = getattr(self.membership, "view", None)
        if view is not None:
            self.view = view
        if self.server is None:
            if self._parts is not None:
                parts = list(self._parts)
                if parts[6] is None and daemon is not None:
                    parts[6] = daemon.transport
                self._build(*parts)
            elif daemon is None:
                raise RuntimeError("ApiService needs node_id=... or a daemon")
            else:
                await self._build_from_daemon(daemon)
        assert self.server is not None and self.console is not None
        self.daemon = daemon
        if self.transport is not None:
            self.transport.on_stream(_http_tunnel_type(), self.tunnel_server.handle)
        if daemon is not None:
            register_collectors(daemon, self.server.metrics.registry)
        self.console.install(self.server.app)
        # serve.run binds the API before it creates anything (a taken port must leave no mesh behind)
        socks = getattr(daemon, "api_sockets", None) if daemon is not None else None
        self.address = await self.server.start(self.host, self.port, socks=socks)
        await self.console.start()
        if daemon is not None:
            daemon.set_api_address(*self.address)
            daemon.control.register("api_connect", self._cmd_connect)
            if self.membership is not None:
                self.membership.set_api(self._advertised_api())
                if any(getattr(b, "kind", None) == "engine" for b in self.server.backends):
                    from engine import numerics  # light: reads the environment and versions, imports no numba

                    # the serving node's tag, beside its models, as stages and workers gossip theirs: the
                    # console and status show with what numerics every node computes (engine/numerics.py)
                    self.membership.set_local_field("numerics", await asyncio.to_thread(numerics.tag))
                self._publisher = asyncio.create_task(self._publish_loop())

    def _advertised_api(self) -> str | None:
        """This node's API address for its record: as bound, or with the QUIC host when bound to any."""
        if self.address is None:
            return None
        from meshd.config import format_hostport

        host, port = self.address
        if host in ("0.0.0.0", "::", ""):
            addrs = list(getattr(getattr(self.membership, "_info", None), "addrs", ()) or ())
            host = addrs[0].rpartition(":")[0].strip("[]") if addrs else "127.0.0.1"
        return format_hostport(host, port)

    async def _publish_loop(self) -> None:
        """Advertise this node's served models and load in its membership record. Local reads only: the
        membership service decides when a change is worth re-signing (``meshd.membership.load``)."""
        last: tuple[tuple[str, str, str, int], ...] | None = None
        while True:
            try:
                assert self.server is not None and self.console is not None
                models = tuple(sorted((m["name"], m["kind"], m["fingerprint"], _context_of(b))
                                      for b in self.server.backends if b.models() for m in b.status()))
                if models != last:
                    self.membership.set_local_models([_model_info(*m) for m in models])
                    last = models
                info = self.server.local_info()
                self.membership.set_load(info.in_flight, queue=max(0, info.in_flight - info.capacity),
                                         tok_s=self.console.tok_rate(), slots=info.capacity)
            except Exception as e:  # noqa: BLE001 - advertising must never take the API down
                log.debug("api_publish_failed", error=type(e).__name__)
            await asyncio.sleep(PUBLISH_CHECK_S)

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
        if self.console is not None:
            await self.console.stop()
        await self.server.stop()

    def status(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        st = self.server.status()
        own = self._own if self._own is not None else self.server.backends
        st["models"] = [m for b in own for m in b.status()]
        st["role"] = self.server.config.role
        st["tunnels_active"] = self.tunnel_server.active
        st["tunnel_streams"] = {"served": self.tunnel_server.served, "opened": self.tunnel_client.opened}
        st["peers_serving"] = {n.node_id: list(n.models) for n in self.view.nodes()}
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
