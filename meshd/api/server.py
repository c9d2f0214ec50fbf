"""The OpenAI-compatible HTTP API of a node (aiohttp), and the same dispatch for tunnelled requests.

``ApiServer.dispatch(method, path, body, local_only)`` is the one place requests are answered: the HTTP
handler calls it for clients (after the API key check), the tunnel server calls it with
``local_only=True`` for peers (the mesh already authenticated them; a tunnelled request is never
forwarded again). It returns a ``Reply`` or raises ``ApiError``.

Order of checks for a generation request: key (401) -> body size (413) -> JSON and fields (400) ->
model known anywhere (404, listing what is served) -> targets (503 if none can serve now) -> first target
that answers (retrying the next on 429/5xx/unreachable before the first byte; the last error otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog
from aiohttp import web

from meshd.api import limits as http_limits
from meshd.api.backends import Backend
from meshd.api.errors import ApiError
from meshd.api.http import ConnectionGuard, bind_tcp, protocol_factory
from meshd.api.metrics import CONTENT_TYPE, ApiMetrics
from meshd.api.reply import Reply
from meshd.api.router import NodeInfo, PeerStats, RouteTable, Target, choose_auto, plan, routable_models
from meshd.api.schema import GenRequest, parse_request
from meshd.api.tunnel import TunnelClient
from meshd.api.view import MeshView, StaticView
from meshd.config import is_loopback, refuse_shared_file
from meshd.errors import RuntimeFailure, UsageError
from transport import limits

log = structlog.get_logger(__name__)

_RETRYABLE = {429, 500, 502, 503, 504}
CLIENT_DISCONNECTED = 499
_WRITE_SLICE_BYTES = 256 * 1024  # a non-streamed answer is written in slices, each under the write deadline
"""The ``code`` label of a request whose client hung up before its answer was complete (nginx's 499)."""


def load_api_keys(path: str | Path) -> list[bytes]:
    """Read bearer keys, one per line (blank lines and ``#`` comments ignored). Raises ``UsageError``."""
    p = Path(path)
    try:
        st = p.stat()
        refuse_shared_file(st.st_mode, p, "API key file")
        if st.st_size > limits.API_MAX_KEY_FILE_BYTES:
            raise UsageError(f"API key file {p} is larger than {limits.API_MAX_KEY_FILE_BYTES} bytes")
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read API key file {p}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"API key file {p} is not UTF-8 text") from None
    keys = [ln.strip().encode() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise UsageError(f"API key file {p} holds no keys")
    if len(keys) > limits.API_MAX_KEYS:
        raise UsageError(f"API key file {p} holds more than {limits.API_MAX_KEYS} keys")
    return keys


def key_matches(presented: bytes, keys: Sequence[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit on a match)."""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented, k)
    return ok


@dataclass
class ApiConfig:
    node_id: str
    role: str = "serve"  # "client" serves nothing and is never routed to
    api_keys: list[bytes] = field(default_factory=list)
    max_body_bytes: int = limits.API_MAX_BODY_BYTES
    head_timeout_s: float = http_limits.API_HEAD_TIMEOUT_S
    body_timeout_s: float = http_limits.API_BODY_TIMEOUT_S
    extra_fields: frozenset[str] = frozenset()  # request fields accepted besides the API's (test backends)


class ApiServer:
    def __init__(self, config: ApiConfig, backends: Sequence[Backend], *, mesh: MeshView | None = None,
                 tunnel: TunnelClient | None = None, metrics: ApiMetrics | None = None) -> None:
        self.config = config
        self.backends = list(backends) if config.role != "client" else []
        self.mesh: MeshView = mesh or StaticView()
        self.tunnel = tunnel
        self.metrics = metrics or ApiMetrics(self.mesh.peer_states)
        self.routes = RouteTable()
        self._runner: web.AppRunner | None = None
        self._listeners: list[asyncio.AbstractServer] = []
        self.guard = ConnectionGuard()
        self.address: tuple[str, int] | None = None
        self.in_flight = 0
        self._seen: dict[str, float] = {}  # model -> when it was last routable (503 instead of 404 for a while)
        self.key_from_request: Any = None  # (request) -> key or None: where else a key may come from
        self.on_request: list[Any] = []  # callbacks(entry: dict) once a generation request is answered
        self.on_tokens: list[Any] = []  # callbacks(n) for tokens generated here (recent tokens/s)
        self.app = self._make_app()

    # -- lifecycle ---------------------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        return app

    async def start(self, host: str, port: int, *, socks: Sequence[socket.socket] | None = None) -> tuple[str, int]:
        """Start backends and listen on ``host:port``, or on ``socks`` already bound (``bind_api``);
        returns the bound address. Raises ``RuntimeFailure`` if the address cannot be bound."""
        if socks is None:
            socks = bind_api(host, port)
        for b in self.backends:
            await b.start()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        assert self._runner.server is not None
        factory = protocol_factory(self._runner.server, self.guard, self._connection_closed,
                                   head_timeout_s=self.config.head_timeout_s)
        loop = asyncio.get_running_loop()
        for sock in socks:
            self._listeners.append(await loop.create_server(factory, sock=sock))
        bound = socks[0].getsockname()[:2]
        self.address = (str(bound[0]), int(bound[1]))
        log.info("api_listening", host=self.address[0], port=self.address[1], role=self.config.role,
                 keys=len(self.config.api_keys) > 0)
        return self.address

    async def stop(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for b in self.backends:
            with contextlib.suppress(Exception):
                await b.stop()

    # -- views of load and models ------------------------------------------------------------------
    def local_models(self) -> dict[str, Backend]:
        out: dict[str, Backend] = {}
        for b in self.backends:
            for m in b.models():
                out.setdefault(m, b)
        return out

    def local_info(self) -> NodeInfo:
        return NodeInfo(self.config.node_id, self.config.role, tuple(sorted(self.local_models())),
                        sum(b.in_flight() for b in self.backends), max(1, sum(b.capacity() for b in self.backends)))

    def status(self) -> dict[str, Any]:
        models = [m for b in self.backends for m in b.status()]
        return {"models": models, "in_flight": self.in_flight, "backend_in_flight": self.local_info().in_flight}

    # -- middleware and plain endpoints ------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if not self.config.api_keys:
                self._check_browser(request)
            elif request.path != "/health":
                self._check_key(request)
            return await handler(request)
        except ApiError as e:
            return self._error_response(e, request.path)
        except web.HTTPException as e:
            status = e.status
            msg = {404: f"no route {request.path}", 405: f"{request.method} is not allowed on {request.path}",
                   413: f"request body is larger than {self.config.max_body_bytes} bytes"}.get(status, e.reason)
            code = {404: "unknown_url", 405: "method_not_allowed"}.get(status)
            return self._error_response(ApiError(status, msg, code=code), request.path)
        except Exception as e:  # noqa: BLE001 - a bug must still answer in OpenAI's shape, not a traceback page
            log.warning("api_internal_error", path=request.path, error=repr(e))
            return self._error_response(ApiError(500, "internal error"), request.path)

    def _check_browser(self, request: web.Request) -> None:
        """Without an API key, a loopback bind is the only protection, and a web page can get past it: by DNS
        rebinding (its own name resolves to 127.0.0.1, the browser lets it read the answers; its requests
        carry ``Host: its.name``) or by a cross-site request that needs no CORS preflight (a ``text/plain``
        POST runs a generation; it carries the page's ``Origin``). So a request whose Host is not a loopback
        name or address, or whose Origin is not a loopback one, is a 403. With a key, the key decides (and a
        reverse proxy may rewrite Host)."""
        if self.address is None or not is_loopback(self.address[0]):
            return
        host = request.headers.get("Host", "")
        if host and not is_loopback(_hostname(host)):
            raise ApiError(403, f"Host {host[:100]!r} is not a loopback name: this API without a key answers "
                           "only local clients (see docs/api.md)", code="forbidden_host")
        origin = request.headers.get("Origin")
        if origin is not None and not is_loopback(_hostname(origin, True)):
            raise ApiError(403, f"Origin {origin[:100]!r} is not a loopback page: this API without a key does not "
                           "answer other sites' pages (see docs/api.md)", code="forbidden_origin")

    def _check_key(self, request: web.Request) -> None:
        """Runs as soon as the head is parsed, before any body byte is read; a 401 closes the connection."""
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth and self.key_from_request is not None:  # e.g. the console's cookie
            scheme, token = "bearer", self.key_from_request(request) or ""
        try:
            presented = token.strip().encode("ascii")  # keys are ASCII; other bytes cannot match
        except UnicodeEncodeError:
            presented = b""
        if scheme.lower() != "bearer" or not presented or not key_matches(presented, self.config.api_keys):
            raise ApiError(401, "missing or invalid API key (use 'Authorization: Bearer KEY')")

    def _connection_closed(self, reason: str) -> None:
        self.metrics.connections_closed.labels(reason).inc()

    def _error_response(self, e: ApiError, path: str) -> web.Response:
        self.metrics.errors.labels(str(e.status), e.code).inc()
        headers = e.headers()
        headers["x-meshd-node"] = self.config.node_id
        headers["x-meshd-route"] = "none"
        resp = web.Response(status=e.status, body=e.body(), headers=headers)
        if e.status in (401, 408, 413):  # the rest of the body is not worth reading (or waiting for)
            resp.force_close()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "node_id": self.config.node_id, "role": self.config.role,
                                  "models": sorted(self.local_models()), "in_flight": self.in_flight,
                                  "backend_in_flight": self.local_info().in_flight})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def models_payload(self, local_only: bool) -> dict[str, Any]:
        peers = [] if local_only else self.mesh.nodes()
        served = routable_models(self.local_info(), peers)
        mono = time.monotonic()
        for m in served:
            self._seen[m] = mono
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "meshd",
                 "meshd": {"nodes": len(nodes), "local": self.config.node_id in nodes}}
                for m, nodes in sorted(served.items())]
        return {"object": "list", "data": data}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(self.models_payload(False))

    def model_payload(self, model_id: str, local_only: bool) -> dict[str, Any]:
        """One entry of ``/v1/models`` (the OpenAI SDK's ``models.retrieve``); 404 if nothing serves it."""
        data = self.models_payload(local_only)["data"]
        for m in data:
            if m["id"] == model_id:
                return m  # type: ignore[no-any-return]
        listing = ", ".join(m["id"] for m in data) or "none"
        raise ApiError(404, f"model '{model_id}' does not exist in this mesh; served models: {listing}",
                       code="model_not_found", param="model")

    async def _model(self, request: web.Request) -> web.Response:
        return web.json_response(self.model_payload(request.match_info["model_id"], False))

    # -- generation --------------------------------------------------------------------------------
    async def _read_body(self, request: web.Request) -> bytes:
        """The body, within ``max_body_bytes`` (413) and ``body_timeout_s`` from the end of the head (408)."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes")
        buf = bytearray()
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                async for chunk in request.content.iter_any():
                    buf += chunk
                    if len(buf) > limit:
                        raise ApiError(413, f"request body is larger than {limit} bytes")
        except TimeoutError:
            self._connection_closed("body_timeout")
            raise ApiError(408, f"request body not received within {self.config.body_timeout_s:g} s",
                           code="request_timeout", type_="invalid_request_error") from None
        return bytes(buf)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        endpoint = "chat" if request.path.endswith("chat/completions") else "completions"
        t0 = time.monotonic()
        route = "none"
        code = 500
        reply: Reply | None = None
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            body = await self._read_body(request)
            reply = await self.dispatch("POST", request.path, body, local_only=False)
            route = reply.route
            self.metrics.ttfb.labels(route).observe(time.monotonic() - t0)
            resp, code = await self._write(request, reply)
            return resp
        except ApiError as e:
            code = e.status
            raise
        except asyncio.CancelledError:  # aiohttp cancels the handler when the client hangs up
            code = CLIENT_DISCONNECTED
            log.info("client_disconnected", path=request.path, route=route)
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint, route, str(code)).inc()
            self.metrics.latency.labels(endpoint, route).observe(time.monotonic() - t0)
            if self.on_request:
                self._log_request(endpoint, route, code, reply, time.monotonic() - t0)

    def _log_request(self, endpoint: str, route: str, code: int, reply: Reply | None, seconds: float) -> None:
        usage = reply.usage if reply is not None else {}
        entry = {"time": time.time(), "endpoint": endpoint, "model": reply.model if reply is not None else None,
                 "route": route, "node": reply.node_id if reply is not None else None,
                 "tokens": usage.get("completion_tokens", reply.events if reply is not None else 0),
                 "latency_ms": round(seconds * 1000.0, 1), "status": code}
        for cb in list(self.on_request):
            with contextlib.suppress(Exception):
                cb(entry)

    def _reply_headers(self, reply: Reply) -> dict[str, str]:
        h = {k: v for k, v in reply.headers.items() if k.lower() in ("content-type", "retry-after")}
        h["x-meshd-node"] = reply.node_id or self.config.node_id
        h["x-meshd-route"] = reply.route
        if reply.stream:
            h["Cache-Control"] = "no-cache"
        return h

    async def _write(self, request: web.Request, reply: Reply) -> tuple[web.StreamResponse, int]:
        headers = self._reply_headers(reply)
        if not reply.stream:
            try:
                buf = bytearray()
                async for chunk in reply.body:
                    buf += chunk
                    if len(buf) > limits.TUNNEL_MAX_RESPONSE_BYTES:
                        raise ApiError(502, "response too large")
            except Exception as e:  # noqa: BLE001 - nothing was sent yet: answer with the error
                err = e if isinstance(e, ApiError) else ApiError(502, f"generation failed ({type(e).__name__})")
                resp = self._error_response(err, request.path)
                resp.headers["x-meshd-route"] = reply.route
                return resp, err.status
            finally:
                await reply.aclose()
            # Written here, in slices under the write deadline, rather than handed to aiohttp as a
            # web.Response, whose write no deadline covers (a client that never reads held it for ever).
            resp = web.StreamResponse(status=reply.status, headers=headers)
            resp.content_length = len(buf)
            try:
                await resp.prepare(request)
                view = memoryview(buf)
                for at in range(0, len(buf), _WRITE_SLICE_BYTES):
                    await self._send(request, resp, view[at:at + _WRITE_SLICE_BYTES])
                await self._send(request, resp, None)
            except (ConnectionResetError, ConnectionError):
                log.info("client_disconnected", path=request.path, route=reply.route)
                return resp, CLIENT_DISCONNECTED
            return resp, reply.status
        resp = web.StreamResponse(status=reply.status, headers=headers)
        status = reply.status
        try:
            await resp.prepare(request)
            try:
                async for chunk in reply.body:
                    await self._send(request, resp, chunk)
            except (ConnectionResetError, ConnectionError):
                raise
            except Exception as e:  # noqa: BLE001 - any failure after the head becomes an error event
                err = e if isinstance(e, ApiError) else ApiError(502, f"generation failed ({type(e).__name__})")
                status = err.status
                self.metrics.errors.labels(str(err.status), err.code).inc()
                log.warning("stream_failed", node=reply.node_id, route=reply.route, reason=err.message)
                await self._send(request, resp, err.sse_event())
            await self._send(request, resp, None)
        except (ConnectionResetError, ConnectionError):
            log.info("client_disconnected", path=request.path, route=reply.route)
            status = CLIENT_DISCONNECTED
        finally:
            await reply.aclose()  # cancels the generation (locally or on the serving node) if unfinished
        return resp, status

    async def _send(self, request: web.Request, resp: web.StreamResponse, data: bytes | memoryview | None
                    ) -> None:
        """Write ``data`` (None: the end of the body) to a streamed answer; a client that reads nothing for
        ``API_WRITE_STALL_S`` has its connection aborted (ConnectionResetError, as if it had hung up)."""
        try:
            async with asyncio.timeout(http_limits.API_WRITE_STALL_S):
                if data is None:
                    await resp.write_eof()
                else:
                    await resp.write(data)
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            self._connection_closed("write_stalled")
            raise ConnectionResetError("the client stopped reading") from None

    async def _counting(self, inner: AsyncIterator[bytes], reply: Reply) -> AsyncIterator[bytes]:
        """Count tokens generated here once the body is done (for HTTP clients and tunnel peers alike)."""
        try:
            async for chunk in inner:
                yield chunk
            self._count_usage(reply)
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()

    def _count_usage(self, reply: Reply) -> None:
        if reply.usage:
            self.metrics.tokens.labels("prompt").inc(reply.usage.get("prompt_tokens", 0))
            self.metrics.tokens.labels("completion").inc(reply.usage.get("completion_tokens", 0))
            for cb in list(self.on_tokens):
                with contextlib.suppress(Exception):
                    cb(reply.usage.get("completion_tokens", 0))

    def _resolve(self, req: GenRequest, local_only: bool) -> tuple[str, list[Target]]:
        local = self.local_info()
        peers = [] if local_only else self.mesh.nodes()
        model = req.model
        if model == "auto":
            chosen = choose_auto(local, peers)
            if chosen is None:
                raise ApiError(503, "no model is served anywhere in the mesh right now", code="no_models")
            model = chosen
        now = time.monotonic()
        served_now = routable_models(local, peers)
        for m in served_now:
            self._seen[m] = now
        targets = plan(model, local, peers, self.routes.stats, now)
        if not targets:
            listing = ", ".join(sorted(served_now)) if served_now else "none"
            if local_only:
                raise ApiError(503, f"model '{model}' is not served on this node")
            seen = self._seen.get(model)
            if seen is not None and now - seen < limits.API_RECENT_MODEL_S:
                raise ApiError(503, f"model '{model}' has no node that can serve it right now "
                               f"(last served {now - seen:.0f} s ago); served models: {listing}",
                               retry_after_s=5)
            raise ApiError(404, f"model '{model}' does not exist in this mesh; served models: {listing}")
        return model, targets

    async def dispatch(self, method: str, path: str, body: bytes, *, local_only: bool) -> Reply:
        """Answer one request (see module docstring)."""
        if method == "GET" and path == "/v1/models":
            return _json_reply(self.models_payload(local_only), self.config.node_id)
        if method == "GET" and path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
            return _json_reply(self.model_payload(path[len("/v1/models/"):], local_only), self.config.node_id)
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            raise ApiError(404, f"no route {method} {path}", code="unknown_url")
        if len(body) > self.config.max_body_bytes:
            raise ApiError(413, f"request body is larger than {self.config.max_body_bytes} bytes")
        req = parse_request("chat" if path == "/v1/chat/completions" else "completion", body,
                            self.config.extra_fields)
        model, targets = self._resolve(req, local_only)
        if model != req.model:
            req.raw = dict(req.raw, model=model)
            req.model = model
            body = json.dumps(req.raw, separators=(",", ":")).encode()
        last: ApiError | None = None
        for i, t in enumerate(targets):
            if i:
                self.metrics.retries.inc()
            try:
                reply = await self._open(t, req, model, path, body)
            except ApiError as e:
                if e.status not in _RETRYABLE:
                    raise
                log.info("route_failed", model=model, node=t.node_id, local=t.local, status=e.status,
                         reason=e.message)
                last = e
                continue
            self.metrics.routes.labels("local" if t.local else "tunnel").inc()
            reply.model = model
            return reply
        self.metrics.routes.labels("none").inc()
        assert last is not None  # targets was non-empty
        if last.status == 429:
            raise last
        if len(targets) > 1:
            raise ApiError(502, f"every node serving '{model}' failed; last: {last.message}")
        raise last

    async def _open(self, t: Target, req: GenRequest, model: str, path: str, body: bytes) -> Reply:
        if t.local:
            backend = self.local_models().get(model)
            if backend is None:
                raise ApiError(503, f"model '{model}' is no longer served on this node")
            reply = await backend.open(req, model)
            reply.node_id = self.config.node_id
            reply.route = "local"
            reply.body = self._counting(reply.body, reply)
            return reply
        peer = self.mesh.handle(t.node_id)
        if peer is None or self.tunnel is None:
            raise ApiError(502, f"node {t.node_id[:12]} is not connected")
        t0 = time.monotonic()
        bump = getattr(self.mesh, "update_load", None)
        hold = getattr(self.mesh, "hold", None)
        held = hold(t.node_id) if hold is not None else contextlib.nullcontext()
        held.__enter__()  # the link stays open (not closed for room) until the reply is closed
        if bump is not None:
            bump(t.node_id, +1)
        try:
            try:
                reply = await self.tunnel.request(peer, "POST", path, body)
            except ApiError as e:
                # the connection was closed under the stream before any answer (replaced by a duplicate
                # dial, or closed as idle just then): the node is fine, so ask it once more
                if e.status != 502 or "connection closed" not in e.message:
                    raise
                log.info("route_retry_same_node", node=t.node_id, reason=e.message)
                reply = await self.tunnel.request(peer, "POST", path, body)
        except ApiError as e:
            if e.status >= 500:
                self.routes.peer(t.node_id).mark_failed(time.monotonic())
            if bump is not None:
                bump(t.node_id, -1)
            held.__exit__(None, None, None)
            raise
        except BaseException:
            if bump is not None:
                bump(t.node_id, -1)
            held.__exit__(None, None, None)
            raise
        st = self.routes.peer(t.node_id)
        st.observe_ttfb((time.monotonic() - t0) * 1000.0)
        st.failed_at = None
        reply.body = _watch_body(reply.body, st, reply)
        inner = reply.on_close

        async def on_close() -> None:
            if bump is not None:
                bump(t.node_id, -1)
            held.__exit__(None, None, None)
            if inner is not None:
                await inner()

        reply.on_close = on_close
        reply.route = "tunnel"
        return reply


async def _watch_body(body: AsyncIterator[bytes], st: PeerStats, reply: Reply) -> AsyncIterator[bytes]:
    """Pass a tunnelled body through: count its SSE events (about tokens) and record their rate, and mark
    the serving node failed for routing when it fails mid-response (killed, silent, reset), so the next
    request goes elsewhere at once instead of waiting for the dead node to time out again. A stream goes
    out in whole SSE events only: if the serving node fails mid-event, the client gets the error event after
    the last whole one, not glued to half a chunk (which the SDK reported as a JSONDecodeError)."""
    events = 0
    t0 = time.monotonic()
    buf = bytearray()
    partial = b""
    try:
        async for chunk in body:
            if reply.stream:
                events += chunk.count(b"data: ")
                reply.events = max(0, events - 1)  # the last event is [DONE]
                partial += chunk
                cut = partial.rfind(b"\n\n") + 2
                if cut >= 2:
                    whole, partial = partial[:cut], partial[cut:]
                    yield whole
                continue
            if len(buf) < _USAGE_SCAN_BYTES:
                buf += chunk
            yield chunk
        if partial:
            yield partial
        if buf:
            reply.events = _completion_tokens(bytes(buf))
    except ApiError as e:
        if e.status >= 500:
            st.mark_failed(time.monotonic())
            log.info("route_failed_mid_response", node=reply.node_id, reason=e.message)
        raise
    dt = time.monotonic() - t0
    if events >= 8 and dt > 0:
        st.observe_rate(events / dt)


_USAGE_SCAN_BYTES = 1024 * 1024  # a non-streamed answer from a peer is read this far for its token count


def _completion_tokens(data: bytes) -> int:
    """``usage.completion_tokens`` of an OpenAI JSON answer, 0 if absent (for the request log)."""
    try:
        usage = json.loads(data).get("usage") or {}
        n = usage.get("completion_tokens", 0)
        return n if isinstance(n, int) else 0
    except (ValueError, AttributeError):
        return 0


def _json_reply(payload: dict[str, Any], node_id: str) -> Reply:
    data = json.dumps(payload, separators=(",", ":")).encode()

    async def body() -> Any:
        yield data

    return Reply(200, {"Content-Type": "application/json"}, body(), stream=False, node_id=node_id)


def bind_api(host: str, port: int) -> list[socket.socket]:
    """Bind the API's listening sockets (before anything else starts, so that a taken port creates
    nothing). Raises ``RuntimeFailure`` (exit 1) with one readable line."""
    try:
        return bind_tcp(host, port)
    except OSError as e:
        reason = e.strerror or str(e)
        raise RuntimeFailure(f"cannot listen on API address {host}:{port} (TCP): {reason}") from None


def _hostname(value: str, is_origin: bool = False) -> str:
    """The host name of a Host header (``name[:port]``, ``[v6][:port]``) or an Origin (``scheme://host[:port]``,
    or ``null``); "" when it has none or does not parse."""
    try:
        return urlsplit(value if is_origin else "//" + value).hostname or ""
    except ValueError:
        return ""


def ensure_safe_bind(host: str, has_keys: bool) -> None:
    """Refuse a non-loopback API address without API keys (SPEC). Raises ``UsageError``."""
    if not is_loopback(host) and not has_keys:
        raise UsageError(f"refusing to serve the API on non-loopback address {host} without --api-key-file")


__all__ = ["ApiConfig", "ApiServer", "ensure_safe_bind", "key_matches", "load_api_keys"]
