"""A typed stream over one mesh connection: frames in, frames out, by task or by callback.

Made and fed by its carrier (``transport.stream_api.StreamCarrier``): a QUIC connection
(``transport.connection``) or a data lane (``transport.lane``); handed to applications by ``transport.quic``.
It knows its carrier only through that interface, so it imports neither.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from transport import limits
from transport.config import is_loopback_host
from transport.errors import RemoteError, StreamReset, TransportError
from transport.framing import ErrorCode, Frame, FrameDecoder, FrameType, decode_error, frame_parts
from transport.streams import StreamType, max_frame_bytes

if TYPE_CHECKING:
    from transport.stream_api import StreamCarrier

log = structlog.get_logger("meshd.transport")


class Stream:
    """One typed stream. ``send``/``recv`` frames; ``reset`` cancels both directions."""

    def __init__(self, conn: StreamCarrier, stream_id: int, stream_type: StreamType | None, decoder: FrameDecoder):
        self._conn = conn
        self.stream_id = stream_id
        self.stream_type = stream_type
        self._decoder = decoder
        self._frames: deque[Frame] = deque()
        self._queued_bytes = 0
        self._raw_received = 0  # stream bytes received from QUIC (preamble and frames)
        self._raw_queued = 0  # wire bytes of complete frames not yet read by the application
        self._ended = False  # peer finished sending
        self._error: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sent_end = False
        self._handler_task: asyncio.Task[Any] | None = None
        self._app_done = False  # its user is finished; kept until aioquic discards the QUIC stream
        self._receiver: tuple[Callable[[bytes], None], Callable[[Exception | None], None]] | None = None
        self._paused = False
        self._delivering = False  # _deliver is running: calls from inside a callback leave it to that run

    @property
    def peer(self) -> Any:
        return self._conn.peer

    @property
    def path(self) -> str:
        """What carries this stream: "quic", "lane" or "relay"."""
        return self._conn.path

    @property
    def max_datagram_bytes(self) -> int:
        """The packet size of this stream's path (QUIC: 16 KiB on loopback, else ~1350; lane: the TCP MSS)."""
        return int(self._conn.max_datagram_bytes)

    @property
    def on_loopback(self) -> bool:
        """Whether the peer is on this machine's loopback (so it shares this machine's CPU cores)."""
        addr = self._conn.remote_address
        return addr is not None and is_loopback_host(addr[0])

    async def send(self, payload: bytes, end: bool = False) -> None:
        """Send one DATA frame; waits while this stream's send buffer is full."""
        await self._send_frame(FrameType.DATA, payload, end)

    async def _send_frame(self, frame_type: FrameType, payload: bytes, end: bool) -> None:
        if self._sent_end:
            raise TransportError("stream already ended")
        if self._error is not None:
            raise self._error
        assert self.stream_type is not None  # noqa: S101 - set for local streams and after preamble
        parts = frame_parts(frame_type, payload, max_frame_bytes(self.stream_type))
        self._sent_end = end
        await self._conn.write(self.stream_id, parts, end)
        self._check_done()

    async def end(self) -> None:
        """Finish the sending side without a frame (no-op if already ended)."""
        if self._error is not None:
            raise self._error
        if not self._sent_end:
            self._sent_end = True
            await self._conn.write(self.stream_id, (), True)
            self._check_done()

    def _mark_done(self) -> None:
        """The application is finished with this stream: free its slot, stop flow accounting."""
        self._app_done = True
        self._conn.stream_done(self.stream_id)

    def _check_done(self) -> None:
        """Free the stream's slot once both directions ended."""
        if self._sent_end and self._ended and not self._frames:
            self._mark_done()

    def send_now(self, payload: bytes) -> bool:
        """Send one DATA frame at once, without waiting, and flush it to the network in this call.

        False (nothing sent) when the stream's send buffer is over its limit: use :meth:`send` then.
        For latency-bound request/reply traffic (expert RPC): no task switch and no deferred transmit.
        Raises like :meth:`send` if the stream or the connection is gone.
        """
        if self._sent_end:
            raise TransportError("stream already ended")
        if self._error is not None:
            raise self._error
        assert self.stream_type is not None  # noqa: S101 - set for local streams and after preamble
        if not self._conn.write_now(self.stream_id, frame_parts(FrameType.DATA, payload,
                                                                max_frame_bytes(self.stream_type))):
            return False
        self._check_done()
        return True

    def set_receiver(self, on_data: Callable[[bytes], None], on_end: Callable[[Exception | None], None]) -> None:
        """Deliver this stream's input by callback, on the loop, as each packet is read (no task wake).

        ``on_data(payload)`` for each DATA frame (frames already queued are delivered now), then once
        ``on_end(None)`` at a clean end or ``on_end(error)`` (StreamReset, RemoteError, TransportError).
        :meth:`recv` must not be used afterwards. Input is taken as it arrives, so the receiver bounds what it
        keeps. A callback that raises resets the stream.
        """
        self._receiver = (on_data, on_end)
        self._deliver()

    def pause_receiving(self) -> None:
        """Stop delivering to the receiver: input queues (and its flow credit stops) until resumed."""
        self._paused = True

    def resume_receiving(self) -> None:
        self._paused = False
        self._deliver()

    def _deliver(self) -> None:
        if self._receiver is None or self._paused or self._delivering:
            return
        self._delivering = True
        try:
            self._deliver_queued()
        finally:
            self._delivering = False

    def _deliver_queued(self) -> None:
        assert self._receiver is not None  # noqa: S101 - checked by _deliver
        on_data, on_end = self._receiver
        try:
            while self._frames:
                if self._paused:
                    self._conn.consumed(self)
                    return
                frame = self._pop_frame()
                if frame.type is FrameType.ERROR:
                    self._receiver = None
                    self._frames.clear()
                    self._queued_bytes = self._raw_queued = 0
                    on_end(RemoteError(*decode_error(frame.payload)))
                    return
                on_data(frame.payload)
            self._conn.consumed(self)
            if self._paused:
                return  # the end (or error) is delivered on resume, after any data queued meanwhile
            if self._error is not None:
                self._receiver = None
                on_end(self._error)
            elif self._ended:
                self._receiver = None
                self._check_done()
                on_end(None)
        except Exception as e:  # noqa: BLE001 - a receiver's bug resets its stream, never the connection
            log.warning("stream_receiver_failed", stream_type=self.stream_type, error=repr(e))
            on_end_called = self._receiver is None  # it was on_end that raised
            self._receiver = None
            self.reset(ErrorCode.INTERNAL_ERROR)
            if on_end_called:
                return
            try:
                on_end(TransportError(f"stream receiver failed: {e!r}"))
            except Exception as e2:  # noqa: BLE001
                log.warning("stream_receiver_failed", stream_type=self.stream_type, error=repr(e2))

    async def recv(self) -> bytes | None:
        """Next DATA payload; None at a clean end. Raises StreamReset, RemoteError or TransportError."""
        frame = await self._recv_frame()
        if frame is None:
            return None
        if frame.type is FrameType.ERROR:
            code, reason = decode_error(frame.payload)
            raise RemoteError(code, reason)
        return frame.payload

    async def _recv_frame(self) -> Frame | None:
        while not self._frames:
            if self._error is not None:
                raise self._error
            if self._ended:
                self._check_done()
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        frame = self._pop_frame()
        self._conn.consumed(self)
        return frame

    def _pop_frame(self) -> Frame:
        frame = self._frames.popleft()
        self._queued_bytes -= len(frame.payload)
        self._raw_queued -= limits.FRAME_HEADER_BYTES + len(frame.payload)
        return frame

    def reset(self, code: int = ErrorCode.CANCELLED) -> None:
        """Abort both directions; the peer's ``recv`` raises ``StreamReset(code)``. A receiver gets no more
        data, only ``on_end(StreamReset)``."""
        if self._receiver is not None:
            self._frames.clear()
            self._queued_bytes = self._raw_queued = 0
        self._conn.reset_stream(self.stream_id, code)
        self._set_error(StreamReset(code, "stream reset locally"))
        self._mark_done()

    # -- the carrier's side (public, for carriers other than the QUIC connection) ----------------------

    @property
    def decoder(self) -> FrameDecoder:
        return self._decoder

    @property
    def error(self) -> TransportError | None:
        """Why the stream broke (reset, carrier gone), or None."""
        return self._error

    @property
    def queued_bytes(self) -> int:
        """Payload bytes received and not yet taken by the application."""
        return self._queued_bytes

    @property
    def consumed_bytes(self) -> int:
        """Stream bytes received from the carrier that the application has taken (for flow credit)."""
        return self._raw_received - self._raw_queued

    def count_received(self, n: int) -> None:
        """The carrier received ``n`` more stream bytes (preamble and frames) for this stream."""
        self._raw_received += n

    def mark_done(self) -> None:
        """The stream's user is finished with it: its slot is free and late input is dropped."""
        self._mark_done()

    async def recv_frame(self) -> Frame | None:
        """The next frame (DATA or ERROR), None at a clean end; raises like :meth:`recv`."""
        return await self._recv_frame()

    async def send_frame(self, frame_type: FrameType, payload: bytes, end: bool) -> None:
        """Send one frame of any application type (an RPC handler's ERROR answer)."""
        await self._send_frame(frame_type, payload, end)

    @property
    def done(self) -> bool:
        """Its user is finished with it (or it was reset): late input for it is dropped."""
        return self._app_done

    @property
    def handler_task(self) -> asyncio.Task[Any] | None:
        return self._handler_task

    @handler_task.setter
    def handler_task(self, task: asyncio.Task[Any] | None) -> None:
        self._handler_task = task

    def deliver(self, frames: list[Frame], end: bool, recv_limit: int) -> bool:
        """Queue decoded input; False if the reader fell more than ``recv_limit`` bytes behind."""
        return self._on_frames(frames, end, recv_limit)

    def fail(self, error: TransportError, done: bool = True, cancel: bool = True) -> None:
        """The stream broke (reset by the peer, its carrier gone): readers and senders get ``error``;
        ``cancel``: its handler task is cancelled; ``done``: its slot is freed too (not when the peer only
        stopped reading: the stream's sending side is still to be finished)."""
        if done:
            self._mark_done()
        self._set_error(error)
        if cancel and self._handler_task is not None:
            self._handler_task.cancel()

    # -- called by the connection ----------------------------------------------------------------

    def _wake(self) -> None:
        if self._receiver is not None:
            self._deliver()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_frames(self, frames: list[Frame], end: bool, recv_limit: int) -> bool:
        """Queue frames; False if the reader fell too far behind (the caller resets the stream)."""
        for frame in frames:
            self._frames.append(frame)
            self._queued_bytes += len(frame.payload)
            self._raw_queued += limits.FRAME_HEADER_BYTES + len(frame.payload)
        if end:
            self._ended = True
        self._wake()
        self._check_done()  # a one-way sender that never reads (gossip) is done once the peer's end arrives
        return self._queued_bytes <= recv_limit

    def _set_error(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

