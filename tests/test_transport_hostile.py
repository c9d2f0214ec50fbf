"""A stranger attacking a node's QUIC port (issue 15): junk Initial floods and held handshake slots.

Real node processes (tests/transport_peer.py) on loopback, attacked with tests/hostile_tools.py; memory
read from /proc. The same attacks, before and after, are measured by bench/hostile.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hostile_tools import flood, junk_initial, rss_bytes
from transport_peer import PeerProcess, member_of, peer_config

from transport.connection import _Connection
from transport.credentials import MeshCredentials, create_mesh
from transport.identity import NodeIdentity
from transport.quic import MeshTransport, Peer, StreamType, TransportConfig

T0 = 1_700_000_000
MB = 1024 * 1024
FAILURES: list[str] = []  # why timed_connect failed, for the assertion messages


@pytest.fixture(scope="module")
def mesh() -> MeshCredentials:
    return create_mesh(NodeIdentity.generate(), "hostile", T0, 1, 1)


@pytest.fixture()
def node(mesh: MeshCredentials, tmp_path: Path) -> Iterator[PeerProcess]:
    ident = NodeIdentity.generate()
    proc = PeerProcess(peer_config(ident, member_of(mesh, ident)), tmp_path)
    yield proc
    assert proc.stop() == 0


def new_member(mesh: MeshCredentials, config: TransportConfig | None = None) -> MeshTransport:
    ident = NodeIdentity.generate()
    return MeshTransport(ident, member_of(mesh, ident), config)


async def stats_of(peer: Peer) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(await peer.request(StreamType.RPC, b"stats", 5.0))["stats"]
    return result


async def timed_connect(mesh: MeshCredentials, node: PeerProcess) -> float:
    """Seconds a fresh member takes to connect and get an RPC answered (inf if it failed)."""
    member = new_member(mesh)
    start = time.monotonic()
    try:
        peer = await member.connect(node.addr, expected_node_id=node.node_id)
        await peer.request(StreamType.RPC, b"echo:x", 5.0)
        return time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - a failure is a data point here
        FAILURES.append(repr(e))
        return float("inf")
    finally:
        await member.close()


def test_junk_initial_flood_leaves_nothing_behind(mesh: MeshCredentials, node: PeerProcess) -> None:
    """10,000 junk Initials in 10 s: RSS grows <= 20 MB and a member still connects within 1 s."""

    async def scenario() -> tuple[int, int, list[float], dict[str, Any], int]:
        assert await timed_connect(mesh, node) < 5.0  # warm up the code paths a member uses
        await asyncio.sleep(0.5)
        rss0 = rss_bytes(node.proc.pid)
        flooding = asyncio.ensure_future(asyncio.to_thread(flood, node.addr, 10_000, 10.0))
        times = []
        for _ in range(3):
            await asyncio.sleep(2.5)
            times.append(await timed_connect(mesh, node))
        sent = await flooding
        await asyncio.sleep(1.0)
        rss1 = rss_bytes(node.proc.pid)
        member = new_member(mesh)
        try:
            stats = await stats_of(await member.connect(node.addr))
        finally:
            await member.close()
        return rss0, rss1, times, stats, sent

    rss0, rss1, times, stats, sent = asyncio.run(scenario())
    assert sent == 10_000
    seen = stats.get("datagrams_garbage_initial", 0)
    assert seen >= 5_000, stats  # the node really read the flood (the kernel may drop a few)
    assert rss1 - rss0 <= 20 * MB, f"RSS grew {(rss1 - rss0) / MB:.1f} MB ({rss0 / MB:.0f} -> {rss1 / MB:.0f})"
    assert max(times) < 1.0, times


def test_junk_initials_leave_no_connection_object(mesh: MeshCredentials) -> None:
    """Once a junk Initial is processed, no _Connection (nor its aioquic connection) is alive."""

    async def scenario() -> tuple[int, int, int, dict[str, int]]:
        server = new_member(mesh)
        addr = await server.listen("127.0.0.1", 0)
        rng = random.Random(5)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for _ in range(50):
                sock.sendto(junk_initial(rng), addr)
            await asyncio.sleep(0.3)  # the node reads them and runs whatever they scheduled
            gc.collect()
            alive = sum(1 for o in gc.get_objects() if isinstance(o, _Connection))
            assert server._server is not None
            return alive, len(server._conns), len(server._server.protocols), dict(server.stats)
        finally:
            sock.close()
            await server.close()

    alive, conns, protocols, stats = asyncio.run(scenario())
    assert stats.get("datagrams_garbage_initial", 0) == 50, stats
    assert (alive, conns, protocols) == (0, 0, 0)


def test_junk_flood_does_not_make_members_wait(mesh: MeshCredentials) -> None:
    """A member connecting in-process while junk arrives gets in; the junk counts against no slot."""

    async def scenario() -> list[float]:
        server = new_member(mesh, replace(TransportConfig(), max_pending_handshakes=4))
        addr = await server.listen("127.0.0.1", 0)
        rng = random.Random(6)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        times = []
        try:
            for _ in range(5):
                for _ in range(20):
                    sock.sendto(junk_initial(rng), addr)
                member = new_member(mesh)
                start = time.monotonic()
                try:
                    await member.connect(addr)
                    times.append(time.monotonic() - start)
                finally:
                    await member.close()
            return times
        finally:
            sock.close()
            await server.close()

    times = asyncio.run(scenario())
    assert len(times) == 5 and max(times) < 1.0, times


def test_address_validation_when_handshakes_pile_up_and_hinted_members_skip_it(mesh: MeshCredentials) -> None:
    """Above ``retry_above_pending`` handshakes a client without a member hint gets a Retry first (and
    gets in); members, whose first Initial carries a valid hint, skip it."""
    import ssl

    from aioquic.asyncio.client import connect as quic_connect
    from aioquic.quic.configuration import QuicConfiguration

    from transport import ALPN

    async def scenario() -> dict[str, int]:
        server = new_member(mesh, replace(TransportConfig(), retry_above_pending=0))  # always validate
        addr = await server.listen("127.0.0.1", 0)
        try:
            for _ in range(3):
                member = new_member(mesh)
                try:
                    peer = await member.connect(addr)
                    assert peer.connected
                finally:
                    await member.close()
            assert server.stats.get("retries_sent", 0) == 0
            # a client with no hint (any QUIC client): Retry, then its TLS completes after the token
            config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
            async with quic_connect(addr[0], addr[1], configuration=config, wait_connected=True):
                pass
            return dict(server.stats)
        finally:
            await server.close()

    stats = asyncio.run(scenario())
    assert stats.get("handshakes_hinted", 0) == 3 and stats.get("peers_admitted", 0) == 3, stats
    assert stats.get("retries_sent", 0) == 1 and stats.get("refused_retry_token", 0) == 0, stats


def start_holder(node: PeerProcess, n: int, seconds: float, source: str) -> subprocess.Popen[str]:
    tool = Path(__file__).resolve().parent / "hostile_tools.py"
    host, port = node.addr
    return subprocess.Popen(
        [sys.executable, str(tool), "hold", host, str(port), str(n), str(seconds), source],
        stdout=subprocess.PIPE, text=True,
    )


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"], ids=["other_host", "same_address"])
def test_members_connect_while_a_stranger_holds_200_silent_connections(
    mesh: MeshCredentials, node: PeerProcess, source: str
) -> None:
    """10 of 10 member connects within 1 s while 200 silent TLS connections are held and reopened."""
    holder = start_holder(node, 200, 14.0, source)
    try:
        time.sleep(3.0)  # let the stranger fill every slot it can

        async def members() -> tuple[list[float], dict[str, Any]]:
            times = []
            for _ in range(10):
                times.append(await timed_connect(mesh, node))
                await asyncio.sleep(0.3)
            member = new_member(mesh)
            try:
                stats = await stats_of(await member.connect(node.addr))
            finally:
                await member.close()
            return times, stats

        times, stats = asyncio.run(members())
        out, _ = holder.communicate(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    held = json.loads(out)
    assert held["opened"] >= 200 and held["tls_done"] >= 100, held  # the attack really ran
    closed = stats.get("handshakes_evicted", 0) + stats.get("refused_handshake_timeout", 0)
    assert closed >= 100, stats
    assert max(times) < 1.0, (times, FAILURES, held, stats)


def test_aioquic_log_lines_become_rate_limited_debug_events(mesh: MeshCredentials) -> None:
    """aioquic's ~3 info lines per connection: none reach the log handlers; each kind once per 10 s."""
    import logging

    import structlog

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root = logging.getLogger()
    handler, level = Keep(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # what --log-level debug does: aioquic's info lines are made

    async def scenario() -> None:
        server = new_member(mesh)
        addr = await server.listen("127.0.0.1", 0)
        try:
            for _ in range(8):
                member = new_member(mesh)
                try:
                    await member.connect(addr)
                finally:
                    await member.close()
        finally:
            await server.close()

    try:
        with structlog.testing.capture_logs() as events:
            asyncio.run(scenario())
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    from_aioquic = [r for r in records if r.name == "quic" or r.name.startswith("quic.")]
    assert from_aioquic == [], [r.getMessage() for r in from_aioquic[:5]]
    routed = [e for e in events if e["event"] == "aioquic_log"]
    kinds = [e["kind"] for e in routed]
    assert routed and all(e["log_level"] == "debug" for e in routed)
    assert len(kinds) == len(set(kinds)), kinds  # 8 connections x ~3 lines, each kind once
