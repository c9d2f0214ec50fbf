"""The API's HTTP connection layer: aiohttp's protocol with deadlines, connection caps and JSON errors.

aiohttp parses HTTP/1.1 and runs handlers, but gives an open connection no deadline until its first
request head is complete, none for the body, and answers parser errors with text/plain. ``GuardedHandler``
(one per TCP connection, built by ``protocol_factory``) adds, in this order:

1. admission (``ConnectionGuard``): at most ``API_MAX_CONNECTIONS_PER_ADDRESS`` connections per IP and
   ``API_MAX_CONNECTIONS`` in all. Over a cap, the oldest connection of the pool with no request in
   progress is closed to make room (a stranger's idle sockets cannot lock out a real client from the same
   address); if every one is busy, the new connection gets a 429 and is closed;
2. the head deadline: ``API_HEAD_TIMEOUT_S`` from the connection's opening, or on a kept-alive connection
   from the first byte of the next request, to the end of the head. Missed: 408 and close;
3. idle keep-alive: aiohttp's own ``keepalive_timeout`` (``API_KEEPALIVE_IDLE_S``);
4. parser errors (bad request line, oversize head, Content-Length with Transfer-Encoding) and anything a
   handler let escape: an OpenAI-shaped JSON error, and the connection is closed.

The body deadline is the handler's (``ApiServer._read_body``): only it knows whether a body is read.

This uses four of aiohttp's private attributes of ``RequestHandler`` (``_request_count``, ``_messages``,
``_request_in_progress``, ``transport``); ``tests/test_api_hostile.py`` fails loudly if they go, and
pyproject pins aiohttp to the minor version tested.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from meshd.api import limits
from meshd.api.errors import ApiError
from transport.ratelog import RateLimitedLog

log = structlog.get_logger(__name__)
_ratelog = RateLimitedLog(log, 10.0)

PRIVATE_ATTRIBUTES = ("_request_count", "_messages", "_request_in_progress")
"""aiohttp ``RequestHandler`` internals this module reads (checked by a test)."""

ConnEvent = Callable[[str], None]
"""``on_event(reason)``: a connection closed by this layer (head_timeout, evicted, refused, bad_http)."""


def raw_error(err: ApiError) -> bytes:
    """A complete HTTP/1.1 response carrying ``err`` that closes the connection (written by hand where no
    aiohttp request exists yet: before or instead of a request head)."""
    body = err.body()
    reason = HTTPStatus(err.status).phrase
    head = (f"HTTP/1.1 {err.status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


class ConnectionGuard:
    """Open connections per address and in all, oldest first (see the module docstring, step 1)."""

    def __init__(self, per_address: int = limits.API_MAX_CONNECTIONS_PER_ADDRESS,
                 total: int = limits.API_MAX_CONNECTIONS) -> None:
        self.per_address = per_address
        self.total = total
        self._by_addr: dict[str, dict[GuardedHandler, None]] = {}  # insertion order = age
        self._all: dict[GuardedHandler, None] = {}

    def __len__(self) -> int:
        return len(self._all)

    def admit(self, conn: GuardedHandler, addr: str) -> bool:
        """Register ``conn``; False if it must be refused (every connection in its full pool is busy)."""
        pool = self._by_addr.setdefault(addr, {})
        if len(pool) >= self.per_address and not self._evict(pool):
            if not pool:
                del self._by_addr[addr]
            return False
        if len(self._all) >= self.total and not self._evict(self._all):
            return False
        pool[conn] = None
        self._all[conn] = None
        return True

    def release(self, conn: GuardedHandler, addr: str) -> None:
        """Forget ``conn`` (idempotent)."""
        self._all.pop(conn, None)
        pool = self._by_addr.get(addr)
        if pool is not None:
            pool.pop(conn, None)
            if not pool:
                del self._by_addr[addr]

    def _evict(self, pool: dict[GuardedHandler, None]) -> bool:
        for conn in pool:
            if not conn.busy():
                conn.evict()
                return True
        return False


class GuardedHandler(RequestHandler):
    """aiohttp's connection protocol with the checks of the module docstring."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, on_event: ConnEvent,
                 head_timeout_s: float = limits.API_HEAD_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._on_event = on_event
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads_at_arm = 0
        self._addr = ""
        self._refused = False

    def busy(self) -> bool:
        """A request is being handled or waits to be (its head arrived): not evictable."""
        return bool(self._request_in_progress or self._messages)

    def evict(self) -> None:
        self._guard.release(self, self._addr)
        self._event("evicted")
        self.force_close()

    def _event(self, reason: str) -> None:
        _ratelog.debug(time.monotonic(), "api_connection_closed", reason=reason, peer=self._addr)
        self._on_event(reason)

    # -- asyncio protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._addr = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        if not self._guard.admit(self, self._addr):
            self._refused = True
            self._event("refused")
            assert isinstance(transport, asyncio.Transport)
            transport.write(raw_error(ApiError(429, "too many connections from this address",
                                               code="too_many_connections", retry_after_s=1)))
            transport.close()
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._guard.release(self, self._addr)
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        was_idle = not self.busy()
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:
            self._cancel_head_timer()  # a head (or a parser error, answered as one) arrived
        elif was_idle and self._head_timer is None:
            self._arm_head_timer()  # the first bytes of the next request on a kept-alive connection

    # -- the head deadline -------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._heads_at_arm = self._request_count
        self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport
        if transport is None or self.busy() or self._request_count != self._heads_at_arm:
            return
        self._event("head_timeout")
        err = ApiError(408, f"request head not received within {self._head_timeout_s:g} s",
                       code="request_timeout", type_="invalid_request_error")
        transport.write(raw_error(err))  # flushed by close() before the socket shuts
        self.force_close()

    # -- errors of the parser (and any handler bug that escaped the middleware) ---------------------
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # the head went out already: nothing to answer with
            raise ConnectionError("response already started")
        if status >= 500:
            log.warning("api_internal_error", error=repr(exc))
            err = ApiError(status, "internal error")
        else:
            detail = (message or getattr(exc, "message", None) or HTTPStatus(status).phrase)
            err = ApiError(status, f"malformed HTTP request: {str(detail)[:200]}", code="bad_http_request",
                           type_="invalid_request_error")
            self._event("bad_http")
        resp = web.Response(status=err.status, body=err.body(), headers=err.headers())
        resp.force_close()
        return resp


def protocol_factory(server: web.Server, guard: ConnectionGuard, on_event: ConnEvent,
                     **overrides: Any) -> Callable[[], GuardedHandler]:
    """What ``loop.create_server`` calls per connection (instead of aiohttp's ``Server.__call__``)."""
    loop = asyncio.get_running_loop()
    kwargs: dict[str, Any] = {
        "loop": loop, "access_log": None, "keepalive_timeout": limits.API_KEEPALIVE_IDLE_S,
        "lingering_time": limits.API_LINGER_S, "max_line_size": limits.API_MAX_HEAD_LINE_BYTES,
        "max_field_size": limits.API_MAX_HEAD_LINE_BYTES,
    }
    kwargs.update(overrides)

    def make() -> GuardedHandler:
        return GuardedHandler(server, guard=guard, on_event=on_event, **kwargs)

    return make


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host:port`` (every address the name resolves to, as asyncio would bind).

    Raises ``OSError`` (address in use, not available, unknown host as ``socket.gaierror``).
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[Any] = set()
    try:
        for family, type_, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            s = socket.socket(family, type_, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a previous run
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr[0], port, *addr[2:]))
            if port == 0:  # one ephemeral port for every address of the name
                port = s.getsockname()[1]
            s.listen(128)
            s.setblocking(False)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks
