"""Sans-I/O framing codec for meshd streams.

Wire format, version 1 (all integers big-endian):

Stream preamble, the first 4 bytes of every stream, sent by the side that opens it::

    magic b"ms" | stream type u8 (``StreamType``) | protocol version u8

Frame, any number after the preamble::

    magic b"md" | framing version u8 (=1) | frame type u8 (``FrameType``) | flags u8 (reserved, 0)
    | payload length u32 | payload

Parsing is strict: wrong magic, unknown framing version, unknown frame type, a frame type that does not
belong on this stream type, non-zero reserved flags, a length above the stream type's limit (checked
from the header, before the payload is buffered), or a stream that ends inside a frame all raise
``RemoteProtocolError``. The QUIC layer turns that into a connection close with the error's code in one
place. A payload is consumed exactly: the next frame starts right after it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from transport import limits
from transport.streams import HANDSHAKE_STREAM_TYPES, StreamType, max_frame_bytes

FRAME_MAGIC = b"md"
PREAMBLE_MAGIC = b"ms"
FRAMING_VERSION = 1
FRAME_HEADER = struct.Struct(">2sBBBI")
PREAMBLE = struct.Struct(">2sBB")
assert FRAME_HEADER.size == limits.FRAME_HEADER_BYTES  # noqa: S101 - module constant, not input
assert PREAMBLE.size == limits.STREAM_PREAMBLE_BYTES  # noqa: S101


class FrameType(IntEnum):
    """APPEND ONLY. What a frame carries."""

    DATA = 0  # application payload (gossip, RPC request/response, tunnel chunk, expert call)
    ERROR = 1  # an RPC error reply: code u16 | UTF-8 reason
    HELLO = 2  # handshake: challenge (32) from the client; challenge (32) | public key (32) from the server
    AUTH = 3  # handshake: [client: public key (32)] | signature (64) | member certificate (none in join mode)
    ACCEPT = 4  # handshake: the server admitted the client (empty)
    JOIN_REQUEST = 5  # join: public key (32) | signature (64) | opaque request
    JOIN_REPLY = 6  # join: opaque reply
    PROOF = 7  # handshake: the client's blinded membership proof, HMAC-SHA256 (32)


class ErrorCode(IntEnum):
    """APPEND ONLY. QUIC application close codes and stream reset codes used by meshd."""

    NO_ERROR = 0
    PROTOCOL_ERROR = 1  # malformed preamble or frame
    FRAME_TOO_LARGE = 2
    UNKNOWN_STREAM_TYPE = 3
    UNSUPPORTED_VERSION = 4  # framing or protocol version we do not speak
    HANDSHAKE_FAILED = 5  # bad signature, pinned key mismatch, bad certificate
    NOT_ADMITTED = 6  # a stream other than the handshake before admission
    HANDSHAKE_TIMEOUT = 7
    REFUSED = 8  # admission hook said no (ban, protocol range, other mesh)
    TOO_MANY_STREAMS = 9
    SHUTDOWN = 10  # the node is stopping
    DISCONNECT = 11  # disconnect(node_id, reason) was called
    DUPLICATE = 12  # the other connection of a simultaneous dial won
    JOIN_DONE = 13  # the join exchange is over
    JOIN_REFUSED = 14  # the issuer refused the join request (reason attached)
    TOO_MANY_CONNECTIONS = 15
    PEER_UNRESPONSIVE = 16  # keep-alive pings went unanswered
    CANCELLED = 17  # stream reset: the request was cancelled or timed out
    INTERNAL_ERROR = 18  # a handler failed; the stream is reset
    RECV_OVERFLOW = 19  # the reader did not keep up; the stream is reset
    NO_HANDLER = 20  # nobody serves this stream type here


class RemoteProtocolError(Exception):
    """The peer broke the protocol or was refused. The QUIC layer closes the connection with ``code``."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = ErrorCode(code)
        self.reason = reason

    def __repr__(self) -> str:
        return f"RemoteProtocolError({self.code.name}, {self.reason!r})"


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame."""

    type: FrameType
    payload: bytes


_HANDSHAKE_FRAMES = frozenset(
    {FrameType.HELLO, FrameType.AUTH, FrameType.ACCEPT, FrameType.JOIN_REQUEST, FrameType.JOIN_REPLY,
     FrameType.PROOF}
)
_APP_FRAMES = frozenset({FrameType.DATA, FrameType.ERROR})


def allowed_frame_types(stream_type: StreamType) -> frozenset[FrameType]:
    return _HANDSHAKE_FRAMES if stream_type in HANDSHAKE_STREAM_TYPES else _APP_FRAMES


def encode_preamble(stream_type: StreamType, protocol_version: int) -> bytes:
    return PREAMBLE.pack(PREAMBLE_MAGIC, int(stream_type), protocol_version)


def encode_frame(frame_type: FrameType, payload: bytes, max_payload: int | None = None) -> bytes:
    """Encode one frame. Raises ``ValueError`` (a local bug, not a peer's) if the payload is too large."""
    limit = limits.MAX_EXPERT_FRAME_BYTES if max_payload is None else max_payload
    if len(payload) > limit:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds the limit of {limit}")
    return FRAME_HEADER.pack(FRAME_MAGIC, FRAMING_VERSION, int(frame_type), 0, len(payload)) + payload


def encode_error(code: int, reason: str) -> bytes:
    """Payload of an ERROR frame."""
    return struct.pack(">H", code) + reason.encode()[: limits.MAX_REFUSAL_REASON_BYTES]


def decode_error(payload: bytes) -> tuple[int, str]:
    """Parse an ERROR frame's payload; raises ``RemoteProtocolError`` if malformed."""
    if len(payload) < 2:
        raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "short error frame")
    if len(payload) > 2 + limits.MAX_REFUSAL_REASON_BYTES:
        raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "error reason too long")
    (code,) = struct.unpack_from(">H", payload)
    return code, payload[2:].decode("utf-8", errors="replace")


class FrameDecoder:
    """Incremental decoder for one direction of one stream.

    ``feed(data)`` returns the complete frames now available; ``feed_eof()`` checks the stream did not
    end inside a frame (or before its preamble). Both raise ``RemoteProtocolError``; after that the
    decoder is dead and every later call raises the same error.

    With ``stream_type=None`` the decoder expects a preamble first (the stream was opened by the peer)
    and ``accepted_versions`` bounds its protocol version; otherwise frames start at once.
    """

    def __init__(
        self,
        stream_type: StreamType | None = None,
        accepted_versions: tuple[int, int] = (1, 1),
    ) -> None:
        self._buffer = bytearray()
        self._accepted_versions = accepted_versions
        self.stream_type: StreamType | None = stream_type
        self.protocol_version: int | None = None
        self._limit = max_frame_bytes(stream_type) if stream_type is not None else 0
        self._allowed = allowed_frame_types(stream_type) if stream_type is not None else frozenset()
        self._need: int | None = None  # payload length of the frame whose header was parsed
        self._header_type: FrameType | None = None
        self._error: RemoteProtocolError | None = None

    @property
    def has_preamble(self) -> bool:
        return self.stream_type is not None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        if self._error is not None:
            raise self._error
        self._buffer += data
        try:
            return self._parse()
        except RemoteProtocolError as e:
            self._error = e
            self._buffer.clear()
            raise

    def feed_eof(self) -> None:
        if self._error is not None:
            raise self._error
        if self.stream_type is None:
            self._error = RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "stream ended before its preamble")
        elif self._buffer or self._need is not None:
            self._error = RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "stream ended inside a frame")
        if self._error is not None:
            raise self._error

    def _parse(self) -> list[Frame]:
        frames: list[Frame] = []
        buf = self._buffer
        if self.stream_type is None:
            if len(buf) < PREAMBLE.size:
                # Reject a wrong magic as soon as its bytes are in, without waiting for more.
                if buf[: len(PREAMBLE_MAGIC)] != PREAMBLE_MAGIC[: len(buf)]:
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "bad stream preamble magic")
                return frames
            magic, stype, version = PREAMBLE.unpack_from(buf)
            if magic != PREAMBLE_MAGIC:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "bad stream preamble magic")
            try:
                stream_type = StreamType(stype)
            except ValueError:
                raise RemoteProtocolError(
                    ErrorCode.UNKNOWN_STREAM_TYPE, f"unknown stream type {stype}"
                ) from None
            lo, hi = self._accepted_versions
            if not lo <= version <= hi:
                raise RemoteProtocolError(
                    ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version} outside {lo}..{hi}"
                )
            self.stream_type = stream_type
            self.protocol_version = version
            self._limit = max_frame_bytes(stream_type)
            self._allowed = allowed_frame_types(stream_type)
            del buf[: PREAMBLE.size]
        while True:
            if self._need is None:
                if len(buf) < FRAME_HEADER.size:
                    if buf[: len(FRAME_MAGIC)] != FRAME_MAGIC[: len(buf)]:
                        raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "bad frame magic")
                    return frames
                magic, version, ftype, flags, length = FRAME_HEADER.unpack_from(buf)
                if magic != FRAME_MAGIC:
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "bad frame magic")
                if version != FRAMING_VERSION:
                    raise RemoteProtocolError(
                        ErrorCode.UNSUPPORTED_VERSION, f"framing version {version} not supported"
                    )
                try:
                    frame_type = FrameType(ftype)
                except ValueError:
                    raise RemoteProtocolError(
                        ErrorCode.PROTOCOL_ERROR, f"unknown frame type {ftype}"
                    ) from None
                if frame_type not in self._allowed:
                    assert self.stream_type is not None  # noqa: S101 - set above
                    raise RemoteProtocolError(
                        ErrorCode.PROTOCOL_ERROR,
                        f"frame {frame_type.name} not allowed on a {self.stream_type.name} stream",
                    )
                if flags != 0:
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "reserved frame flags set")
                if length > self._limit:
                    raise RemoteProtocolError(
                        ErrorCode.FRAME_TOO_LARGE, f"frame of {length} bytes exceeds {self._limit}"
                    )
                del buf[: FRAME_HEADER.size]
                self._need = length
                self._header_type = frame_type
            if len(buf) < self._need:
                return frames
            assert self._header_type is not None  # noqa: S101 - set with _need
            frames.append(Frame(self._header_type, bytes(buf[: self._need])))
            del buf[: self._need]
            self._need = None
            self._header_type = None
