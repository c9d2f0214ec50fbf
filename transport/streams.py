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
    RELAY = 7  # path control between members: the lane's port (transport.lane); relay through a member


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
    StreamType.RELAY: limits.MAX_RELAY_FRAME_BYTES,
}
"""Largest frame payload accepted on each stream type, in bytes."""


LANE_STREAM_TYPES = frozenset(t for t in StreamType if t.name in ("EXPERT", "PIPELINE"))
"""Stream types that move bulk or latency-critical data: they use a peer's data lane when one is up
(``transport.lane``), QUIC otherwise. Every other type uses QUIC unless its opener asks for the lane
(``LANE_ACCEPTED_TYPES``)."""

LANE_ACCEPTED_TYPES = LANE_STREAM_TYPES | {StreamType.RELAY}
"""Stream types a lane carries: ``LANE_STREAM_TYPES``, and RELAY streams whose opener asks for the lane
(``Peer.open_stream(..., lane=True)``): a relay's legs (``transport.relay``) ride lanes where they are up."""


def max_frame_bytes(stream_type: StreamType) -> int:
    return MAX_FRAME_BYTES[stream_type]
