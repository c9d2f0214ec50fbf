"""HTTP over the mesh: one ``StreamType.HTTP_TUNNEL`` stream per request on the existing peer connection.

Wire format, version 1. Each transport frame (one ``Stream.send``) is ``version:u8 | type:u8 | payload``.
``TunnelFrame`` is APPEND ONLY.

    front node (client side)                 serving node (server side)
    REQUEST_HEAD {"method","path"}  ->
    BODY bytes ...                  ->
    REQUEST_END + end of stream     ->
                                    <-  HEARTBEAT (every TUNNEL_HEARTBEAT_INTERVAL_S while silent)
                                    <-  RESPONSE_HEAD {"status","headers"}
                                    <-  BODY bytes ... (backpressure: Stream.send awaits)
                                    <-  ERROR {"status","message","type","code"}  (failure after the head)
                                    <-  RESPONSE_END + end of stream

The front half-closes after its request and resets the stream when its HTTP client goes away; the
transport then cancels the serving handler (STOP_SENDING/RESET), and the serving side's next send
(a token or a heartbeat) fails too, so generation stops within one decode step. The front treats
silence longer than ``TUNNEL_HEARTBEAT_TIMEOUT_S`` as the serving node's death. (CLOSE is unused
since the half-close; its number stays reserved.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import structlog

from meshd.api.errors import ApiError
from meshd.api.reply import Reply
from transport import limits
from transport.framing import ErrorCode

log = structlog.get_logger(__name__)

TUNNEL_VERSION = 1
RESET_CANCELLED = int(ErrorCode.CANCELLED)  # stream reset code: the HTTP client went away
RESET_PROTOCOL = int(ErrorCode.PROTOCOL_ERROR)  # stream reset code: the peer broke this protocol


class TunnelFrame(IntEnum):
    """Frame types. APPEND ONLY."""

    REQUEST_HEAD = 1
    BODY = 2
    REQUEST_END = 3
    RESPONSE_HEAD = 4
    ERROR = 5
    RESPONSE_END = 6
    HEARTBEAT = 7
    CLOSE = 8


_JSON_FRAMES = {TunnelFrame.REQUEST_HEAD, TunnelFrame.RESPONSE_HEAD, TunnelFrame.ERROR}
_EMPTY_FRAMES = {TunnelFrame.REQUEST_END, TunnelFrame.RESPONSE_END, TunnelFrame.HEARTBEAT, TunnelFrame.CLOSE}


class TunnelProtocolError(Exception):
    """A peer sent something this protocol does not allow. ``code`` is the stream reset code."""

    def __init__(self, reason: str, code: int = RESET_PROTOCOL) -> None:
        super().__init__(reason)
        self.code = code


def encode(ftype: TunnelFrame, payload: bytes | dict[str, Any] = b"") -> bytes:
    if isinstance(payload, dict):
        payload = json.dumps(payload, separators=(",", ":")).encode()
    return bytes((TUNNEL_VERSION, int(ftype))) + payload


def decode(data: bytes) -> tuple[TunnelFrame, Any]:
    """Parse one frame: ``(type, payload)`` where JSON frames give a dict, BODY gives bytes, others None.

    Raises ``TunnelProtocolError`` for anything else (never another exception)."""
    if not isinstance(data, (bytes, bytearray)) or len(data) < 2:
        raise TunnelProtocolError("short tunnel frame")
    if len(data) > limits.TUNNEL_MAX_FRAME_BYTES:
        raise TunnelProtocolError("tunnel frame too large")
    if data[0] != TUNNEL_VERSION:
        raise TunnelProtocolError(f"unsupported tunnel version {data[0]}")
    try:
        ftype = TunnelFrame(data[1])
    except ValueError:
        raise TunnelProtocolError(f"unknown tunnel frame type {data[1]}") from None
    payload = bytes(data[2:])
    if ftype == TunnelFrame.BODY:
        return ftype, payload
    if ftype in _EMPTY_FRAMES:
        if payload:
            raise TunnelProtocolError(f"{ftype.name} carries no payload")
        return ftype, None
    if len(payload) > limits.API_MAX_HEADER_BYTES:
        raise TunnelProtocolError(f"{ftype.name} too large")
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise TunnelProtocolError(f"{ftype.name} is not JSON") from None
    if not isinstance(obj, dict):
        raise TunnelProtocolError(f"{ftype.name} is not an object")
    if ftype == TunnelFrame.REQUEST_HEAD:
        if obj.get("method") not in ("GET", "POST") or not isinstance(obj.get("path"), str) \
                or not obj["path"].startswith("/"):
            raise TunnelProtocolError("bad request head")
    elif ftype == TunnelFrame.RESPONSE_HEAD:
        status, headers = obj.get("status"), obj.get("headers", {})
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599 \
                or not isinstance(headers, dict) \
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise TunnelProtocolError("bad response head")
    else:  # ERROR
        status = obj.get("status")
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599 \
                or not isinstance(obj.get("message"), str):
            raise TunnelProtocolError("bad error frame")
    return ftype, obj


class TunnelStream(Protocol):
    """What the tunnel needs from ``transport.quic.Stream``."""

    async def send(self, payload: bytes, end: bool = False) -> None: ...
    async def recv(self) -> bytes | None: ...
    def reset(self, code: int) -> None: ...


class TunnelPeer(Protocol):
    node_id: str

    async def open_stream(self, stream_type: Any) -> TunnelStream: ...


@dataclass
class TunnelConfig:
    connect_timeout_s: float = limits.TUNNEL_CONNECT_TIMEOUT_S
    first_byte_timeout_s: float = limits.TUNNEL_FIRST_BYTE_TIMEOUT_S
    heartbeat_interval_s: float = limits.TUNNEL_HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = limits.TUNNEL_HEARTBEAT_TIMEOUT_S
    sse_keepalive_s: float = limits.API_SSE_KEEPALIVE_S
    max_response_bytes: int = limits.TUNNEL_MAX_RESPONSE_BYTES


ByteCounter = Callable[[str, int], None]  # (direction "in"|"out", nbytes)


def _nocount(direction: str, n: int) -> None:
    return None


class _Conn:
    """One tunnel stream with byte counting and the heartbeat deadline on receive."""

    def __init__(self, stream: TunnelStream, count: ByteCounter, recv_timeout_s: float | None) -> None:
        self.stream = stream
        self.count = count
        self.recv_timeout_s = recv_timeout_s
        self.last_send = time.monotonic()

    async def send(self, ftype: TunnelFrame, payload: bytes | dict[str, Any] = b"", end: bool = False) -> None:
        data = encode(ftype, payload)
        self.count("out", len(data))
        self.last_send = time.monotonic()
        await self.stream.send(data, end)

    async def recv(self, timeout_s: float | None = None) -> tuple[TunnelFrame, Any] | None:
        t = timeout_s if timeout_s is not None else self.recv_timeout_s
        if t is None:
            data = await self.stream.recv()
        else:
            async with asyncio.timeout(t):  # no extra task per frame (unlike wait_for)
                data = await self.stream.recv()
        if data is None:
            return None
        self.count("in", len(data))
        return decode(data)


# --- client side (front node) ---------------------------------------------------------------------

class TunnelClient:
    """Opens tunnelled requests to peers. ``stream_type`` is ``StreamType.HTTP_TUNNEL``."""

    def __init__(self, stream_type: Any, config: TunnelConfig | None = None, count: ByteCounter = _nocount) -> None:
        self.stream_type = stream_type
        self.config = config or TunnelConfig()
        self.count = count
        self.opened = 0  # tunnel streams opened since start

    async def request(self, peer: TunnelPeer, method: str, path: str, body: bytes = b"") -> Reply:
        """Send one request; return once the response head arrived.

        Raises ``ApiError``: 502 if the peer fails before the head (unreachable, reset, silent, broken
        protocol), or the peer's own error status (404/429/503...) with its OpenAI-shaped message."""
        cfg = self.config
        self.opened += 1
        try:
            async with asyncio.timeout(cfg.connect_timeout_s):
                stream = await peer.open_stream(self.stream_type)
        except Exception as e:  # noqa: BLE001 - any transport failure means "try the next node"
            raise ApiError(502, f"node {peer.node_id[:12]} is unreachable ({type(e).__name__})") from None
        conn = _Conn(stream, self.count, cfg.heartbeat_timeout_s)
        finished = False
        try:
            await conn.send(TunnelFrame.REQUEST_HEAD, {"method": method, "path": path})
            for i in range(0, len(body), limits.TUNNEL_CHUNK_BYTES):
                await conn.send(TunnelFrame.BODY, body[i:i + limits.TUNNEL_CHUNK_BYTES])
            await conn.send(TunnelFrame.REQUEST_END, end=True)
            deadline = time.monotonic() + cfg.first_byte_timeout_s
            while True:
                frame = await conn.recv()
                if frame is None:
                    raise TunnelProtocolError("stream ended before the response head")
                ftype, obj = frame
                if ftype == TunnelFrame.HEARTBEAT:
                    if time.monotonic() > deadline:
                        raise asyncio.TimeoutError
                    continue
                if ftype != TunnelFrame.RESPONSE_HEAD:
                    raise TunnelProtocolError(f"expected RESPONSE_HEAD, got {ftype.name}")
                break
            status: int = obj["status"]
            headers: dict[str, str] = obj.get("headers", {})
            if status != 200:
                data = await _collect(conn, 64 * 1024)
                finished = True
                try:
                    payload: Any = json.loads(data)
                except ValueError:
                    payload = None
                err = ApiError.from_payload(status, payload)
                ra = headers.get("Retry-After")
                if ra and ra.isdigit():
                    err.retry_after_s = int(ra)
                raise err
        except ApiError:
            _end(stream, finished)
            raise
        except (TunnelProtocolError, asyncio.TimeoutError, Exception) as e:  # noqa: BLE001
            _end(stream, False)
            reason = "went silent" if isinstance(e, asyncio.TimeoutError) else f"failed ({type(e).__name__}: {e})"
            raise ApiError(502, f"node {peer.node_id[:12]} {reason} before answering") from None
        except BaseException:  # cancelled (the HTTP client went away): cancel on the serving node too
            _end(stream, False)
            raise

        state = {"done": False}

        async def on_close() -> None:
            if not state["done"]:
                _end(stream, False)

        sse = "event-stream" in headers.get("Content-Type", "")
        reply = Reply(status, headers, _body(conn, peer.node_id, state, cfg.sse_keepalive_s if sse else None),
                      stream=sse, node_id=headers.get("x-meshd-node", peer.node_id), route="tunnel",
                      on_close=on_close)
        return reply


def _end(stream: TunnelStream, clean: bool) -> None:
    if not clean:
        with contextlib.suppress(Exception):
            stream.reset(RESET_CANCELLED)


async def _see_end(conn: _Conn) -> None:
    """Read the end of stream that follows RESPONSE_END (the transport frees the stream once seen)."""
    with contextlib.suppress(Exception):
        await conn.recv()


async def _collect(conn: _Conn, limit: int) -> bytes:
    buf = bytearray()
    while True:
        frame = await conn.recv()
        if frame is None:
            raise TunnelProtocolError("stream ended before RESPONSE_END")
        ftype, obj = frame
        if ftype == TunnelFrame.BODY:
            buf += obj
            if len(buf) > limit:
                raise TunnelProtocolError("error body too large")
        elif ftype == TunnelFrame.RESPONSE_END:
            await _see_end(conn)
            return bytes(buf)
        elif ftype != TunnelFrame.HEARTBEAT:
            raise TunnelProtocolError(f"unexpected {ftype.name}")


async def _body(conn: _Conn, node_id: str, state: dict[str, bool], sse_keepalive_s: float | None) -> AsyncIterator[bytes]:
    """The response body from the serving node. For SSE (``sse_keepalive_s`` set), a comment line goes to
    the HTTP client after that much silence, so proxies in front of meshd do not cut a thinking model."""
    short = node_id[:12]
    last = time.monotonic()
    while True:
        try:
            frame = await conn.recv()
        except asyncio.TimeoutError:
            raise ApiError(502, f"node {short} stopped responding mid-response") from None
        except TunnelProtocolError as e:
            raise ApiError(502, f"node {short} broke the tunnel protocol ({e})") from None
        except Exception as e:  # noqa: BLE001 - reset or connection lost
            raise ApiError(502, f"node {short} failed mid-response ({type(e).__name__})") from None
        if frame is None:
            raise ApiError(502, f"node {short} ended the response early")
        ftype, obj = frame
        if ftype == TunnelFrame.BODY:
            yield obj
            last = time.monotonic()
        elif ftype == TunnelFrame.HEARTBEAT:
            if sse_keepalive_s is not None and time.monotonic() - last >= sse_keepalive_s:
                yield b": keep-alive\n\n"
                last = time.monotonic()
        elif ftype == TunnelFrame.RESPONSE_END:
            state["done"] = True
            await _see_end(conn)
            return
        elif ftype == TunnelFrame.ERROR:
            err = ApiError(obj["status"], obj["message"], code=obj.get("code") if isinstance(obj.get("code"), str)
                           else None, type_=obj.get("type") if isinstance(obj.get("type"), str) else None)
            raise err
        else:
            raise ApiError(502, f"node {short} sent an unexpected {ftype.name}")


# --- server side (serving node) -------------------------------------------------------------------

Dispatch = Callable[[str, str, bytes], Awaitable[Reply]]  # (method, path, body) -> Reply, raises ApiError


class TunnelServer:
    """Serves tunnelled requests with ``dispatch`` (which answers from local backends only)."""

    def __init__(self, dispatch: Dispatch, config: TunnelConfig | None = None, count: ByteCounter = _nocount,
                 max_body_bytes: int = limits.API_MAX_BODY_BYTES) -> None:
        self.dispatch = dispatch
        self.config = config or TunnelConfig()
        self.count = count
        self.max_body_bytes = max_body_bytes
        self.active = 0
        self.served = 0  # tunnel streams handled since start

    async def handle(self, peer: Any, stream: TunnelStream) -> None:
        """The ``on_stream(HTTP_TUNNEL)`` handler. Never raises."""
        conn = _Conn(stream, self.count, None)
        self.active += 1
        self.served += 1
        try:
            await self._handle(conn, getattr(peer, "node_id", "?"))
        except TunnelProtocolError as e:
            log.debug("tunnel_protocol_error", peer=getattr(peer, "node_id", "?"), reason=str(e))
            _end(stream, False)
        except Exception as e:  # noqa: BLE001 - a network callback never lets an exception escape
            log.debug("tunnel_stream_failed", peer=getattr(peer, "node_id", "?"), error=type(e).__name__)
            _end(stream, False)
        finally:
            self.active -= 1

    async def _handle(self, conn: _Conn, peer_id: str) -> None:
        frame = await conn.recv(limits.TUNNEL_REQUEST_TIMEOUT_S)
        if frame is None or frame[0] != TunnelFrame.REQUEST_HEAD:
            raise TunnelProtocolError("expected REQUEST_HEAD")
        head = frame[1]
        body = bytearray()
        while True:
            frame = await conn.recv(limits.TUNNEL_REQUEST_TIMEOUT_S)
            if frame is None:
                raise TunnelProtocolError("stream ended inside the request")
            ftype, obj = frame
            if ftype == TunnelFrame.REQUEST_END:
                break
            if ftype != TunnelFrame.BODY:
                raise TunnelProtocolError(f"unexpected {ftype.name} in the request")
            body += obj
            if len(body) > self.max_body_bytes:
                raise TunnelProtocolError("request body over the limit")
        # The front half-closed. If it gives up now, the transport cancels this handler (its reset or
        # STOP_SENDING), and any send of ours fails: both end the reply below, cancelling generation.
        try:
            await self._respond(conn, head["method"], head["path"], bytes(body))
        except asyncio.CancelledError:
            log.info("tunnel_cancelled", peer=peer_id, path=head["path"])
            raise

    async def _respond(self, conn: _Conn, method: str, path: str, body: bytes) -> None:
        beat = _Heartbeat(conn, self.config.heartbeat_interval_s)
        reply: Reply | None = None
        try:
            try:
                reply = await self.dispatch(method, path, body)
            except ApiError as e:
                await _stop(beat)
                await conn.send(TunnelFrame.RESPONSE_HEAD, {"status": e.status, "headers": e.headers()})
                await conn.send(TunnelFrame.BODY, e.body())
                await conn.send(TunnelFrame.RESPONSE_END, end=True)
                return
            first = True
            try:
                chunks = _coalesced(reply.body) if reply.stream else reply.body
                async for chunk in chunks:
                    if first:
                        await conn.send(TunnelFrame.RESPONSE_HEAD, {"status": reply.status, "headers": reply.headers})
                        first = False
                    for i in range(0, len(chunk), limits.TUNNEL_CHUNK_BYTES):
                        await conn.send(TunnelFrame.BODY, chunk[i:i + limits.TUNNEL_CHUNK_BYTES])
                await _stop(beat)
                if first:
                    await conn.send(TunnelFrame.RESPONSE_HEAD, {"status": reply.status, "headers": reply.headers})
                await conn.send(TunnelFrame.RESPONSE_END, end=True)
            except ApiError as e:
                await _stop(beat)
                if first:
                    await conn.send(TunnelFrame.RESPONSE_HEAD, {"status": e.status, "headers": e.headers()})
                    await conn.send(TunnelFrame.BODY, e.body())
                else:
                    await conn.send(TunnelFrame.ERROR, {"status": e.status, "message": e.message,
                                                        "type": e.type, "code": e.code})
                await conn.send(TunnelFrame.RESPONSE_END, end=True)
        finally:
            await _stop(beat)
            if reply is not None:
                await reply.aclose()


_EOF = object()


async def _coalesced(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Re-yield ``body``'s chunks, joining those that arrive close together into one frame.

    A slow generator still gets one frame per token (no added latency). Once chunks keep following each
    other within ``TUNNEL_COALESCE_WINDOW_S`` (4 frames in a row), a frame that is not yet full waits
    that long and carries everything that arrived (up to ``TUNNEL_CHUNK_BYTES``) instead of paying one
    QUIC packet per token; a full frame goes at once. At most ``TUNNEL_COALESCE_CHUNKS`` chunks wait
    here: beyond that the generator waits (backpressure)."""
    buf: collections.deque[Any] = collections.deque()
    ready = asyncio.Event()
    room = asyncio.Event()
    room.set()
    pending = 0  # bytes of chunks in buf

    async def pump() -> None:
        nonlocal pending
        try:
            async for chunk in body:
                while len(buf) >= limits.TUNNEL_COALESCE_CHUNKS:
                    room.clear()
                    await room.wait()
                buf.append(chunk)
                pending += len(chunk)
                ready.set()
            buf.append(_EOF)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer below
            buf.append(e)
        ready.set()

    task = asyncio.ensure_future(pump())
    last = 0.0
    fast = 0  # frames in a row that followed the previous one within the window
    try:
        while True:
            await ready.wait()
            fast = fast + 1 if time.monotonic() - last < limits.TUNNEL_COALESCE_WINDOW_S else 0
            if fast >= 4 and pending < limits.TUNNEL_CHUNK_BYTES and len(buf) < limits.TUNNEL_COALESCE_CHUNKS \
                    and isinstance(buf[-1], (bytes, bytearray)):
                # Tokens are flowing fast: gather what arrives in the next window into this frame.
                await asyncio.sleep(limits.TUNNEL_COALESCE_WINDOW_S)
            ready.clear()
            out = bytearray()
            while buf and isinstance(buf[0], (bytes, bytearray)) \
                    and not (out and len(out) + len(buf[0]) > limits.TUNNEL_CHUNK_BYTES):
                out += buf.popleft()
            pending -= len(out)
            room.set()
            if out:
                yield bytes(out)
                last = time.monotonic()
            if buf and not isinstance(buf[0], (bytes, bytearray)):
                item = buf.popleft()
                if item is _EOF:
                    return
                raise item
            if buf:
                ready.set()
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()


class _Heartbeat:
    """While a reply is silent (thinking, or between slow tokens), send HEARTBEAT every ``interval_s``.

    A timer, not a task, so that a fast request pays nothing for it."""

    def __init__(self, conn: _Conn, interval_s: float) -> None:
        self.conn = conn
        self.interval_s = interval_s
        self.loop = asyncio.get_running_loop()
        self.sending: asyncio.Task[None] | None = None
        self.handle: asyncio.TimerHandle | None = self.loop.call_later(interval_s, self._due)

    def _due(self) -> None:
        self.handle = None
        idle = time.monotonic() - self.conn.last_send
        if idle >= self.interval_s and (self.sending is None or self.sending.done()):
            self.sending = asyncio.ensure_future(self._send())
            idle = 0.0
        self.handle = self.loop.call_later(max(0.01, self.interval_s - idle), self._due)

    async def _send(self) -> None:
        with contextlib.suppress(Exception):
            await self.conn.send(TunnelFrame.HEARTBEAT)


async def _stop(beat: _Heartbeat) -> None:
    if beat.handle is not None:
        beat.handle.cancel()
        beat.handle = None
    if beat.sending is not None and not beat.sending.done():
        beat.sending.cancel()
        with contextlib.suppress(BaseException):
            await beat.sending
