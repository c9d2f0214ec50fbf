"""meshd transport: node identity, mesh credentials, framing, handshake and the QUIC layer.

The codecs and state machines here are sans-I/O (bytes and ``now`` in, bytes, timers and events out).
Only ``transport.quic`` touches asyncio and sockets.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
"""The meshd wire protocol version this build speaks (see ``PROTOCOL_MIN``/``PROTOCOL_MAX``)."""
PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
ALPN = "meshd/2"
"""The QUIC ALPN: the generation of framing and handshake (2: the client proves membership first, blinded).
A peer offering an older one is told so and closed (``ALPN_RETIRED``)."""
ALPN_RETIRED = ("meshd/1",)
