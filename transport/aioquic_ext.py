"""Two adjustments to aioquic's sans-I/O connection (no asyncio here): coarse pacing and receive
credit that follows what the application reads. Used by ``transport.quic``."""

from __future__ import annotations

from aioquic import tls
from aioquic.quic.connection import MAX_STREAM_DATA_FRAME_CAPACITY, QuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketPacer, QuicPacketSpace
from aioquic.quic.stream import QuicStream


class CoarsePacer(QuicPacketPacer):
    """aioquic's pacer, minus gaps shorter than the event loop can time.

    On fast links aioquic asks for gaps of microseconds between packets; asyncio's timers (epoll has
    millisecond resolution) turn each into a 1 ms sleep, which capped a 4 KiB round trip at ~1 ms
    per packet. Gaps below ``PACING_GRANULARITY_S`` are sent at once; congestion control still applies.
    """

    def next_send_time(self, now: float) -> float | None:
        at = super().next_send_time(now)
        if at is not None and at - now < PACING_GRANULARITY_S:
            return None
        return at


class MeshQuicConnection(QuicConnection):
    """aioquic's connection, granting stream credit as the application reads (real backpressure).

    Stock aioquic doubles a stream's receive window whenever half of it has *arrived*, so a slow reader
    never slows the sender. For streams listed in ``app_consumed`` (stream id -> bytes the application
    has taken), the window is ``consumed + app_window`` instead, re-announced once it moved by half a
    window. Other streams (the handshake) keep aioquic's behaviour. Instances are made by aioquic as
    ``QuicConnection`` and switched to this class by ``_Connection``.
    """

    app_consumed: dict[int, int]
    app_window: int

    def ack_with_data(self, now: float) -> None:
        """Carry a pending (delayed) ACK in the next packet, which is about to carry stream data.

        aioquic writes an ACK frame only once its delay (1 ms) has passed, so a reply sent sooner goes
        without it and a separate ACK-only packet follows, which both ends pay for in Python. RFC 9000
        13.2.1: "an endpoint SHOULD include ACK frames in packets it sends when it has ACKs to send".
        """
        space = self._spaces.get(tls.Epoch.ONE_RTT)
        if space is not None and space.ack_at is not None and space.ack_at > now:
            space.ack_at = now

    def _write_stream_limits(
        self, builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream
    ) -> None:
        consumed = self.app_consumed.get(stream.stream_id)
        if consumed is None or not stream.max_stream_data_local:
            super()._write_stream_limits(builder=builder, space=space, stream=stream)
            return
        target = consumed + self.app_window
        if target - stream.max_stream_data_local >= self.app_window // 2:
            stream.max_stream_data_local = target
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local


PACING_GRANULARITY_S = 0.002  # seconds: below this, pacing gaps are skipped (see CoarsePacer)


AIOQUIC_PRIVATE: dict[str, tuple[str, ...]] = {
    # every private aioquic attribute meshd reads, writes or overrides, by the object it lives on;
    # tests/test_transport_aioquic_pins.py checks each on real objects of the installed aioquic
    "QuicConnection": (
        "_close_event",  # connection.py: a close has started (aioquic reports it only after draining)
        "_configuration",  # connection.py: rebuilding loss recovery for the packet size
        "_is_client",
        "_logger",
        "_loss",  # connection.py: packet size, coarse pacer, rtt_ms
        "_max_datagram_size",  # connection.py/stream.py: per-peer packet size
        "_on_max_stream_data_delivery",  # MeshQuicConnection._write_stream_limits
        "_quic_logger",
        "_send_probe",
        "_spaces",  # MeshQuicConnection.ack_with_data
        "_streams",  # connection.py: send buffer sizes, stream credit, pruning
        "_write_stream_limits",  # overridden by MeshQuicConnection
    ),
    "QuicPacketRecovery": ("_pacer", "_rtt_initialized", "_rtt_smoothed"),
    "QuicStream": ("max_stream_data_local", "max_stream_data_local_sent"),  # public, but relied on
    "QuicStreamSender": ("_buffer",),  # connection.py: unacknowledged bytes per stream (backpressure)
    "tls.Context": ("_peer_certificate",),  # connection.py: the channel binding of the handshake
    "QuicConnectionProtocol": (
        "_quic",
        "_loop",
        "_timer",  # connection.discard: cancelled so nothing keeps a refused connection alive
        "_transmit_task",  # ditto
        "_transport",
        "_process_events",
        "_handle_timer",
        "_transmit_soon",
        "_connection_id_issued_handler",  # server.py registers connection ids as aioquic's server did
        "_connection_id_retired_handler",
        "_connection_terminated_handler",
    ),
}
