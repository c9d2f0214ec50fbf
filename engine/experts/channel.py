"""The byte channel expert RPC runs over, and an in-process one for tests and benchmarks.

A channel has the shape of ``transport.quic.Stream``: ``send(payload, end=False)``, ``recv() -> bytes |
None`` (None at a clean end) and ``reset(code)``. The codec is self-delimiting, so a channel may deliver
bytes in any chunking. :func:`socketpair_channels` gives two connected channels over a kernel socket pair:
real bytes, real buffering, no network.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from transport import limits

T = TypeVar("T")


class ByteChannel(Protocol):
    async def send(self, payload: bytes, end: bool = False) -> None: ...

    async def recv(self) -> bytes | None: ...

    def reset(self, code: int) -> None: ...


class ChannelClosed(Exception):
    """The other side reset the channel or it broke."""


class SocketChannel:
    """A :class:`ByteChannel` over an asyncio stream pair (here: one end of a socket pair)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

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
