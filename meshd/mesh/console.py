"""The operator console on the API address: a live page of the mesh, its JSON and its event stream.

    GET /                    the page (``meshd/mesh/static/``: plain HTML, JS and CSS, nothing fetched)
    GET /console/{file}      its assets
    GET /meshd/v1/mesh       ``MeshView.snapshot()`` plus this node's recent requests (JSON)
    GET /meshd/v1/events     server-sent events: ``mesh`` (a snapshot, whenever it changed, at most every
                             ``EVENTS_INTERVAL_S``) and ``request`` (each answered API request)

All of it sits behind the API key when one is set (the server's key middleware). A browser cannot send
``Authorization`` when it opens a page, so these paths also take the key as ``?key=KEY`` on ``GET /``,
which answers with an HttpOnly, SameSite=Strict cookie that the page's own requests then carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from importlib import resources
from typing import Any

import structlog
from aiohttp import web

from meshd.mesh.limits import (
    EVENTS_INTERVAL_S,
    EVENTS_KEEPALIVE_S,
    EVENTS_MAX_CLIENTS,
    REQUEST_LOG_SIZE,
    TOK_RATE_WINDOW_S,
)

log = structlog.get_logger(__name__)

KEY_COOKIE = "meshd_key"
ASSETS = {"index.html": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
CONSOLE_PATHS = ("/", "/meshd/v1/mesh", "/meshd/v1/events")


def console_key(request: web.Request) -> str | None:
    """The API key a console request carries besides ``Authorization``: ``?key=`` on the page, else the
    cookie the page set. None for any other path."""
    if request.method != "GET" or not (request.path in CONSOLE_PATHS or request.path.startswith("/console/")):
        return None
    if request.path == "/" and request.query.get("key"):
        return request.query["key"]
    return request.cookies.get(KEY_COOKIE)


class Console:
    """See module docstring. ``server`` is the ``ApiServer``; ``view`` anything with ``snapshot()``."""

    def __init__(self, server: Any, view: Any) -> None:
        self.server = server
        self.view = view
        self.requests: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_SIZE)
        self._tokens: deque[tuple[float, int]] = deque()
        # subscribers, oldest first: the queue of each /meshd/v1/events handler and its request
        self._clients: dict[asyncio.Queue[tuple[str, Any]], web.Request] = {}
        self._task: asyncio.Task[None] | None = None
        server.on_request.append(self._on_request)
        server.on_tokens.append(self._on_tokens)
        if getattr(server, "key_from_request", False) is None:
            server.key_from_request = console_key

    # ----- what the page shows -----------------------------------------------------------------
    def _on_request(self, entry: dict[str, Any]) -> None:
        self.requests.append(entry)
        for q in list(self._clients):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(("request", entry))

    def _on_tokens(self, n: int) -> None:
        now = time.monotonic()
        self._tokens.append((now, int(n)))
        while self._tokens and now - self._tokens[0][0] > TOK_RATE_WINDOW_S:
            self._tokens.popleft()

    def tok_rate(self) -> float:
        """Tokens generated on this node per second, over the last ``TOK_RATE_WINDOW_S``."""
        now = time.monotonic()
        while self._tokens and now - self._tokens[0][0] > TOK_RATE_WINDOW_S:
            self._tokens.popleft()
        return sum(n for _, n in self._tokens) / TOK_RATE_WINDOW_S

    def snapshot(self) -> dict[str, Any]:
        snap = dict(self.view.snapshot())
        snap["requests"] = list(self.requests)[-50:]
        snap["local"] = {"in_flight": self.server.in_flight, "tok_s": round(self.tok_rate(), 1)}
        return snap

    # ----- HTTP --------------------------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        app.router.add_get("/", self._page)
        app.router.add_get("/console/{name}", self._asset)
        app.router.add_get("/meshd/v1/mesh", self._mesh)
        app.router.add_get("/meshd/v1/events", self._events)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._pump())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for q in list(self._clients):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(("end", None))

    def _evict_oldest(self) -> None:
        """End the oldest subscriber's stream to make room (a page's EventSource reconnects by itself), so
        connections that subscribe and then sit there, forgotten tabs or a hostile local client, cannot
        lock the operator out of the console. A subscriber whose queue is full is stuck writing to a
        client that does not read: its connection is aborted."""
        q, request = next(iter(self._clients.items()))
        del self._clients[q]
        stuck = q.full()
        while not q.empty():
            q.get_nowait()
        q.put_nowait(("end", None))
        if stuck and request.transport is not None:
            request.transport.abort()
        log.debug("console_subscriber_evicted", subscribers=len(self._clients) + 1, stuck=stuck)

    async def _page(self, request: web.Request) -> web.Response:
        resp = web.Response(body=_asset_bytes("index.html"), content_type="text/html",
                            headers={"Cache-Control": "no-store"})
        key = request.query.get("key")
        if key:
            resp.set_cookie(KEY_COOKIE, key, httponly=True, samesite="Strict", path="/")
        return resp

    async def _asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise web.HTTPNotFound()
        return web.Response(body=_asset_bytes(name), content_type=ASSETS[name],
                            headers={"Cache-Control": "no-store"})

    async def _mesh(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def _events(self, request: web.Request) -> web.StreamResponse:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=256)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        while len(self._clients) >= EVENTS_MAX_CLIENTS:
            self._evict_oldest()
        self._clients[q] = request
        try:
            await resp.write(_sse("mesh", self.snapshot()))
            while True:
                try:
                    kind, data = await asyncio.wait_for(q.get(), EVENTS_KEEPALIVE_S)
                except TimeoutError:
                    await resp.write(b": keep-alive\n\n")
                    continue
                if kind == "end":
                    break
                await resp.write(_sse(kind, data))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._clients.pop(q, None)
        return resp

    async def _pump(self) -> None:
        """Push a snapshot to subscribers whenever it changed (checked every ``EVENTS_INTERVAL_S``)."""
        last = ""
        while True:
            await asyncio.sleep(EVENTS_INTERVAL_S)
            if not self._clients:
                last = ""
                continue
            try:
                snap = self.view.snapshot()
            except Exception as e:  # noqa: BLE001 - the console must never take the API down
                log.debug("console_snapshot_failed", error=repr(e))
                continue
            key = json.dumps({k: v for k, v in snap.items() if k != "time"}, sort_keys=True, default=str)
            if key == last:
                continue
            last = key
            full = self.snapshot()
            for q in list(self._clients):
                with contextlib.suppress(asyncio.QueueFull):
                    q.put_nowait(("mesh", full))


def _sse(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n".encode()


def _asset_bytes(name: str) -> bytes:
    return resources.files("meshd.mesh").joinpath("static", name).read_bytes()
