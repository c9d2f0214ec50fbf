"""The one small interface every meshd stream has, and the one its carrier gives it.

:class:`MeshStream` is what applications use, whatever carries the stream: a QUIC stream
(``transport.connection``), a stream on a TLS data lane (``transport.lane``) or, later, a relayed stream.
Each is a ``transport.stream.Stream`` over a :class:`StreamCarrier`; ``Stream`` never imports a carrier,
so ``stream``, ``connection``, ``quic`` and ``lane`` form no import circle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from transport.streams import StreamType

Address = tuple[str, int]

PATH_QUIC = "quic"
PATH_LANE = "lane"
PATH_RELAY = "relay"


class MeshStream(Protocol):
    """A typed stream to one peer: frames in, frames out, by task (``recv``) or by callback."""

    stream_id: int
    stream_type: StreamType | None

    @property
    def peer(self) -> Any: ...

    @property
    def path(self) -> str: ...  # "quic", "lane" or "relay"

    @property
    def max_datagram_bytes(self) -> int: ...

    @property
    def on_loopback(self) -> bool: ...

    async def send(self, payload: bytes, end: bool = False) -> None: ...

    def send_now(self, payload: bytes) -> bool: ...

    async def end(self) -> None: ...

    async def recv(self) -> bytes | None: ...

    def reset(self, code: int = ...) -> None: ...

    def set_receiver(self, on_data: Callable[[bytes], None], on_end: Callable[[Exception | None], None]) -> None: ...

    def pause_receiving(self) -> None: ...

    def resume_receiving(self) -> None: ...


class StreamCarrier(Protocol):
    """What a ``Stream`` needs from the connection that carries it (QUIC connection or lane)."""

    path: str
    remote_address: Address | None

    @property
    def peer(self) -> Any: ...

    @property
    def max_datagram_bytes(self) -> int: ...

    async def write(self, stream_id: int, parts: Sequence[bytes], end: bool) -> None:
        """Queue ``parts`` (one frame, in pieces) on the stream; waits while its send buffer is full."""

    def write_now(self, stream_id: int, parts: Sequence[bytes]) -> bool:
        """Send now without waiting; False (nothing sent) if the send buffer is over its limit."""

    def reset_stream(self, stream_id: int, code: int) -> None: ...

    def stream_done(self, stream_id: int) -> None:
        """The stream's user is finished with it: stop its flow accounting."""

    def consumed(self, stream: Any) -> None:
        """The application took queued input from ``stream`` (flow credit may be due)."""
