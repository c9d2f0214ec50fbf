"""Transport configuration and the pure formulas the QUIC layer uses (no I/O)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace

from transport import limits


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Transport tuning. Times in seconds, sizes in bytes. Presets are written as deltas."""

    keepalive_interval_s: float = 10.0  # PING after this much silence; 0 disables keep-alive
    idle_timeout_s: float = 300.0  # QUIC idle timeout (min of both sides' values applies)
    dead_peer_timeout_s: float = 30.0  # with keep-alive on: nothing heard for this long -> close
    handshake_timeout_s: float = 3.0  # a connection not admitted by then is closed
    connect_timeout_s: float = 5.0  # connect()/redeem() give up after this
    join_handler_timeout_s: float = 10.0  # the issuer's join handler must answer within this
    reconnect_min_s: float = 0.5  # keep_connected backoff: first delay ...
    reconnect_max_s: float = 30.0  # ... doubling up to this, times a jitter in [0.5, 1.0)
    simultaneous_dial_window_s: float = 5.0  # two connections admitted this close are a simultaneous dial
    max_connections: int = limits.MAX_CONNECTIONS
    max_pending_handshakes: int = limits.MAX_PENDING_HANDSHAKES  # unproven handshakes; a new one evicts one
    max_pending_handshakes_per_source: int = limits.MAX_PENDING_HANDSHAKES_PER_SOURCE  # ... per source address
    evict_min_age_s: float = 0.25  # a pending handshake younger than this is not evicted (new one refused)
    retry_above_pending: int = limits.RETRY_ABOVE_PENDING_HANDSHAKES  # address validation (Retry) from here on
    retry_token_lifetime_s: float = 10.0  # a Retry token is accepted this long after it was issued
    first_frame_timeout_s: float = 1.0  # server: a client must begin the meshd handshake within this
    max_streams_per_peer: int = limits.MAX_STREAMS_PER_PEER
    stream_send_buffer_bytes: int = limits.STREAM_SEND_BUFFER_BYTES
    stream_recv_queue_bytes: int = limits.STREAM_RECV_QUEUE_BYTES
    udp_recv_buffer_bytes: int = limits.UDP_RECV_BUFFER_BYTES  # SO_RCVBUF asked for; 0 = the OS default
    max_datagram_size: int = 1350  # QUIC packet payload; 1350 fits common internet paths
    loopback_datagram_size: int = 16384  # used instead when the peer is on loopback; 0 = never
    # (the loopback MTU is 64 KiB; aioquic 1.x breaks above ~16 KiB: "Failed to parse frame")
    quic_max_data: int = 4 * 1024 * 1024  # initial connection flow-control window
    quic_max_stream_data: int = 1024 * 1024  # initial per-stream flow-control window
    log_interval_s: float = 10.0  # rate limit of debug logs about refused input
    coalesce_transmit: bool = True  # defer sending to the end of the loop turn (fewer ACK-only packets)
    coarse_pacing: bool = True  # skip pacing gaps asyncio cannot time (see _CoarsePacer)

    @classmethod
    def lan(cls) -> TransportConfig:
        return cls()

    @classmethod
    def loopback(cls) -> TransportConfig:
        """Kept for callers of the first tag: loopback peers get 16 KiB packets automatically now."""
        return cls()

    @classmethod
    def wire_1350(cls) -> TransportConfig:
        """Internet-sized packets even on loopback (to measure or test the general path)."""
        return replace(cls(), loopback_datagram_size=0)



def backoff_delay_s(attempt: int, min_s: float, max_s: float, jitter: float) -> float:
    """Delay before redial number ``attempt`` (0-based): ``min_s * 2**attempt`` capped at ``max_s``, times
    ``0.5 + 0.5 * jitter`` for ``jitter`` in [0, 1) so that peers restarted together do not redial in step."""
    base = min(min_s * (2.0 ** min(attempt, 60)), max_s)
    return base * (0.5 + 0.5 * jitter)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address) is loopback, IPv4 seen through an IPv6 socket (::ffff:127.0.0.1) too."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback
