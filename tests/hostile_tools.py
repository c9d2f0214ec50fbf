"""What a stranger on the LAN can do to a node's QUIC port, for tests and bench/hostile.py.

- ``junk_initial(rng)``: a 1200-byte datagram that looks like a QUIC v1 Initial (long header ``0xC3``,
  random 8-byte connection ids, random payload) and cannot decrypt.
- ``flood(addr, count, duration_s)``: send ``count`` of them at an even rate over ``duration_s``.
- ``hold_silent(addr, n, until)``: keep ``n`` QUIC connections with our ALPN open that finish TLS and
  then say nothing, reopening each as the node closes it (the "held handshake slots" attack).
- ``rss_bytes(pid)``: resident memory of a process from /proc.

Only loopback addresses are ever used by the callers (the tests and the benchmark).
"""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import time
from functools import partial
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from transport import ALPN

Address = tuple[str, int]


def junk_initial(rng: random.Random, size: int = 1200) -> bytes:
    """A datagram with a valid QUIC v1 Initial long header and a random (undecryptable) payload."""
    dcid = rng.randbytes(8)
    scid = rng.randbytes(8)
    head = bytes([0xC3]) + (1).to_bytes(4, "big") + bytes([8]) + dcid + bytes([8]) + scid + b"\x00"
    rest = size - len(head) - 2
    return head + (0x4000 | rest).to_bytes(2, "big") + rng.randbytes(rest)


def flood(addr: Address, count: int, duration_s: float, seed: int = 1, source: str = "127.0.0.1") -> int:
    """Send ``count`` junk Initials to ``addr`` evenly over ``duration_s`` (blocking). Returns the count sent."""
    rng = random.Random(seed)
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((source, 0))
        start = time.monotonic()
        batch = 10
        for i in range(0, count, batch):
            for _ in range(min(batch, count - i)):
                sock.sendto(junk_initial(rng), addr)
                sent += 1
            delay = start + (i + batch) * duration_s / count - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    return sent


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS from /proc/PID/status), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class _Silent(QuicConnectionProtocol):
    """A client that finishes TLS and then says nothing; notes when the node ends the connection."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ended = asyncio.Event()
        self.tls_done = False

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        if isinstance(event, qe.HandshakeCompleted):
            self.tls_done = True
        elif isinstance(event, qe.ConnectionTerminated):
            self.ended.set()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        if self._quic._close_event is not None:
            self.ended.set()


async def _one_silent(addr: Address, source: str, until: float, stats: dict[str, int], alpn: str) -> None:
    loop = asyncio.get_running_loop()
    while time.monotonic() < until:
        config = QuicConfiguration(is_client=True, alpn_protocols=[alpn], verify_mode=ssl.CERT_NONE,
                                   idle_timeout=60.0)
        quic = QuicConnection(configuration=config)
        transport, proto = await loop.create_datagram_endpoint(
            partial(_Silent, quic), local_addr=(source, 0)
        )
        silent: _Silent = proto  # type: ignore[assignment]
        stats["opened"] = stats.get("opened", 0) + 1
        try:
            silent.connect(addr)
            try:
                await asyncio.wait_for(silent.ended.wait(), max(0.0, until - time.monotonic()))
            except TimeoutError:
                pass
            stats["tls_done"] = stats.get("tls_done", 0) + int(silent.tls_done)
            stats["closed_by_node"] = stats.get("closed_by_node", 0) + int(silent.ended.is_set())
            if not silent.ended.is_set():
                silent._quic.close()
                silent.transmit()
        finally:
            transport.close()
        await asyncio.sleep(0.01)


async def hold_silent(
    addr: Address, n: int, until: float, source: str = "127.0.0.1", alpn: str = ALPN
) -> dict[str, int]:
    """Hold ``n`` silent connections to ``addr`` until ``until`` (monotonic), reopening as they close."""
    stats: dict[str, int] = {}
    await asyncio.gather(*(_one_silent(addr, source, until, stats, alpn) for _ in range(n)))
    return stats


def main(argv: list[str]) -> int:
    """``python tests/hostile_tools.py hold HOST PORT N SECONDS [SOURCE [ALPN]]``: hold N silent connections
    for SECONDS, then print their stats as one JSON line. ``flood HOST PORT COUNT SECONDS [SOURCE]``: junk."""
    import json

    cmd, host, port, n, seconds = argv[:5]
    source = argv[5] if len(argv) > 5 else "127.0.0.1"
    if cmd == "hold":
        until = time.monotonic() + float(seconds)
        alpn = argv[6] if len(argv) > 6 else ALPN
        stats = asyncio.run(hold_silent((host, int(port)), int(n), until, source, alpn))
    elif cmd == "flood":
        stats = {"sent": flood((host, int(port)), int(n), float(seconds), source=source)}
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
