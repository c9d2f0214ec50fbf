"""The byte channel expert RPC runs over, and an in-process one for tests and benchmarks.

A channel has the shape of ``transport.quic.Stream``: ``send(payload, end=False)``, ``recv() -> bytes |
None`` (None at a clean end) and ``reset(code)``, plus the latency path expert RPC uses: ``send_now(payload)
-> bool`` (sent and flushed at once, or False if the send buffer is full) and ``set_receiver(on_data,
on_end)`` (input delivered by callback on the loop instead of ``recv``). The codec is self-delimiting, so a
channel may deliver bytes in any chunking. :func:`socketpair_channels` gives two connected channels over a kernel socket pair:
real bytes, real buffering, no network.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from engine import limits

T = TypeVar("T")


class ByteChannel(Protocol):
    async def send(self, payload: bytes, end: bool = False) -> None: ...

    async def recv(self) -> bytes | None: ...

    def reset(self, code: int) -> None: ...

    def send_now(self, payload: bytes) -> bool: ...

    def set_receiver(self, on_data: Callable[[bytes], None], on_end: Callable[[Exception | None], None]) -> None: ...

    def pause_receiving(self) -> None: ...

    def resume_receiving(self) -> None: ...


class ChannelClosed(Exception):
    """The other side reset the channel or it broke."""


class SocketChannel:
    """A :class:`ByteChannel` over an asyncio stream pair (here: one end of a socket pair)."""

    SEND_BUFFER_BYTES = 1024 * 1024  # send_now refuses above this much unsent data

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._pump: asyncio.Task[None] | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._reset = False  # reset() was called: the receiver gets no more data, only on_end(ChannelClosed)

    def pause_receiving(self) -> None:
        self._resumed.clear()

    def resume_receiving(self) -> None:
        self._resumed.set()

    def send_now(self, payload: bytes) -> bool:
        transport = self._writer.transport
        if transport is None or transport.is_closing():
            raise ChannelClosed("channel closed")
        if transport.get_write_buffer_size() > self.SEND_BUFFER_BYTES:
            return False
        self._writer.write(payload)
        return True

    def set_receiver(self, on_data: Callable[[bytes], None], on_end: Callable[[Exception | None], None]) -> None:
        """As ``Stream.set_receiver``: nothing is delivered while paused (the end neither), a reset ends
        delivery with ``on_end(ChannelClosed)``, and an ``on_data`` that raises resets the channel."""

        async def pump() -> None:
            error: Exception | None = None
            try:
                while (data := await self.recv()) is not None:
                    await self._resumed.wait()  # paused while the read was pending: hold the data
                    if self._reset:
                        break
                    try:
                        on_data(data)
                    except Exception as e:  # noqa: BLE001 - a receiver's bug resets its channel
                        error = ChannelClosed(f"receiver failed: {e!r}")
                        self.reset(0)
                        break
                    if self._reset:
                        break
                else:
                    await self._resumed.wait()
            except asyncio.CancelledError:
                error = ChannelClosed("channel reset")
            except Exception as e:  # noqa: BLE001 - reported to the receiver
                error = e
            if error is None and self._reset:
                error = ChannelClosed("channel reset")
            on_end(error)

        self._pump = asyncio.get_running_loop().create_task(pump())

    async def send(self, payload: bytes, end: bool = False) -> None:
        try:
            self._writer.write(payload)
            await self._writer.drain()
            if end:
                self._writer.write_eof()
        except (ConnectionError, RuntimeError) as e:
            raise ChannelClosed(str(e)) from None

    async def recv(self) -> bytes | None:
        try:
            data = await self._reader.read(limits.EXPERT_SEND_CHUNK_BYTES)
        except ConnectionError as e:
            raise ChannelClosed(str(e)) from None
        return data or None

    def reset(self, code: int) -> None:
        # The receiver's task ends itself (the abort wakes its read): a task cancelled before it first
        # ran would never call on_end.
        self._reset = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._resumed.set()
        transport = self._writer.transport
        if transport is not None and not transport.is_closing():
            transport.abort()


async def socketpair_channels() -> tuple[SocketChannel, SocketChannel]:
    """Two connected channels (call on the loop that will use them)."""
    a, b = socket.socketpair()
    ra, wa = await asyncio.open_connection(sock=a)
    rb, wb = await asyncio.open_connection(sock=b)
    return SocketChannel(ra, wa), SocketChannel(rb, wb)


class LoopThread:
    """An asyncio loop running in a daemon thread (tests, benchmarks, and the engine-side glue)."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="experts-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_cancel_all(), timeout=5.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5.0)
            if not self._thread.is_alive():
                self.loop.close()
