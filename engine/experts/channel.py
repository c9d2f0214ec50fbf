"""The byte channel expert RPC runs over, and an in-process one for tests and benchmarks.

A channel has the shape of ``transport.quic.Stream``: ``send(payload, end=False)``, ``recv() -> bytes |
None`` (None at a clean end) and ``reset(code)``. The codec is self-delimiting, so a channel may deliver
bytes in any chunking. :func:`socketpair_channels` gives two connected channels over a kernel socket pair:
real bytes, real buffering, no network.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

from transport import limits


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
