"""Stream types and the stream preamble. APPEND ONLY: values are on the wire and never re-meant.

Every QUIC stream meshd opens starts with a 4-byte preamble (see ``transport.framing``): the stream
type below and the protocol version the opener speaks. The first stream of a connection is HANDSHAKE
(a member proving itself) or JOIN (a node without credentials redeeming an invite); no other stream may
be opened before the handshake admits the peer.
"""

from __future__ import annotations

from enum import IntEnum

from transport import limits


class StreamType(IntEnum):
    """APPEND ONLY. The purpose of a stream, sent in its preamble."""

    HANDSHAKE = 0
    GOSSIP = 1
    RPC = 2
    HTTP_TUNNEL = 3
    EXPERT = 4
    JOIN = 5
    PIPELINE = 6  # layer-pipeline stage protocol (engine.pipeline.wire)


HANDSHAKE_STREAM_TYPES = frozenset({StreamType.HANDSHAKE, StreamType.JOIN})
"""Stream types that may only be the first stream of a connection."""

MAX_FRAME_BYTES: dict[StreamType, int] = {
    StreamType.HANDSHAKE: limits.MAX_HANDSHAKE_FRAME_BYTES,
    StreamType.GOSSIP: limits.MAX_GOSSIP_FRAME_BYTES,
    StreamType.RPC: limits.MAX_RPC_FRAME_BYTES,
    StreamType.HTTP_TUNNEL: limits.MAX_HTTP_TUNNEL_FRAME_BYTES,
    StreamType.EXPERT: limits.MAX_EXPERT_FRAME_BYTES,
    StreamType.JOIN: limits.MAX_JOIN_FRAME_BYTES,
    StreamType.PIPELINE: limits.MAX_PIPELINE_FRAME_BYTES,
}
"""Largest frame payload accepted on each stream type, in bytes."""


def max_frame_bytes(stream_type: StreamType) -> int:
    return MAX_FRAME_BYTES[stream_type]
