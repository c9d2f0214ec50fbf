"""Every private aioquic attribute meshd relies on exists, on real objects of the installed aioquic.

aioquic is pinned in pyproject.toml to the minor versions this passes on. If an upgrade renames any of
these, this test names what moved (instead of rtt_ms quietly becoming None, or a stranger's connection
quietly staying alive). The source scan makes a new private use without an entry here fail too.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import aioquic
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.recovery import QuicPacketRecovery

from transport import ALPN
from transport.aioquic_ext import AIOQUIC_PRIVATE
from transport.identity import NodeIdentity
from transport.tls import self_signed_certificate

ROOT = Path(__file__).resolve().parent.parent


def connected_pair() -> tuple[QuicConnection, QuicConnection]:
    """A client and a server QuicConnection, handshake done, in memory (sans-I/O)."""
    ident = NodeIdentity.generate()
    client = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN]))
    server_cfg = QuicConfiguration(is_client=False, alpn_protocols=[ALPN])
    server_cfg.certificate = self_signed_certificate(ident)
    server_cfg.private_key = ident.private_key()
    client._configuration.verify_mode = 0  # CERT_NONE, as meshd's client  # noqa: SLF001
    server = None
    now = 0.0
    client.connect(("127.0.0.1", 2), now=now)
    done = False
    for _ in range(20):
        now += 0.01
        for data, _addr in client.datagrams_to_send(now=now):
            if server is None:
                odcid = client._peer_cid.cid  # noqa: SLF001 - test only: the client's first destination id
                server = QuicConnection(configuration=server_cfg, original_destination_connection_id=odcid)
            server.receive_datagram(data, ("127.0.0.1", 1), now=now)
        assert server is not None
        replies = server.datagrams_to_send(now=now)
        now += 0.01  # a 10 ms round trip, so that the rtt estimate is not 0
        for data, _addr in replies:
            client.receive_datagram(data, ("127.0.0.1", 2), now=now)
        while (ev := client.next_event()) is not None:
            done = done or isinstance(ev, qe.HandshakeCompleted)
        if done:
            break
    assert done and server is not None
    return client, server


def test_aioquic_version_is_one_we_pinned() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"aioquic>=([0-9.]+),<([0-9.]+)"', text)
    assert pin is not None, "aioquic must be pinned with an upper bound in pyproject.toml"
    low, high = (tuple(int(x) for x in v.split(".")) for v in pin.groups())
    have = tuple(int(x) for x in aioquic.__version__.split(".")[:3])
    assert low <= have < high, (aioquic.__version__, pin.groups())


def test_every_private_attribute_we_use_exists() -> None:
    client, server = connected_pair()
    client.send_stream_data(0, b"x")
    qstream = client._streams[0]  # noqa: SLF001
    missing = []

    def check(kind: str, obj: object) -> None:
        for name in AIOQUIC_PRIVATE[kind]:
            if not hasattr(obj, name):
                missing.append(f"{kind}.{name}")

    for conn in (client, server):
        check("QuicConnection", conn)
        check("QuicPacketRecovery", conn._loss)  # noqa: SLF001
        check("tls.Context", conn.tls)
    check("QuicStreamSender", qstream.sender)
    check("QuicStream", qstream)

    async def protocol_attrs() -> None:
        check("QuicConnectionProtocol", QuicConnectionProtocol(client))

    asyncio.run(protocol_attrs())
    assert missing == [], f"aioquic {aioquic.__version__} lacks: {missing}"
    # and what they mean, where meshd reads them
    assert client._loss._rtt_initialized and client._loss._rtt_smoothed > 0  # noqa: SLF001
    assert client.tls._peer_certificate is not None  # noqa: SLF001
    assert client._close_event is None  # noqa: SLF001
    assert isinstance(client._streams, dict) and len(qstream.sender._buffer) >= 0  # noqa: SLF001


def test_signatures_we_override_or_call() -> None:
    params = list(inspect.signature(QuicConnection._write_stream_limits).parameters)  # noqa: SLF001
    assert params == ["self", "builder", "space", "stream"], params
    recovery = set(inspect.signature(QuicPacketRecovery.__init__).parameters)
    wanted = {"congestion_control_algorithm", "initial_rtt", "max_datagram_size",
              "peer_completed_address_validation", "quic_logger", "send_probe", "logger"}
    assert wanted <= recovery, wanted - recovery
    init = set(inspect.signature(QuicConnection.__init__).parameters)
    assert {"original_destination_connection_id", "retry_source_connection_id"} <= init


def test_no_private_use_outside_the_list() -> None:
    """Private attributes read off aioquic objects in transport/ are all listed in AIOQUIC_PRIVATE."""
    listed = {name for names in AIOQUIC_PRIVATE.values() for name in names}
    pattern = re.compile(
        r"(?:\b_quic|\bq|\bquic|\bprotocol|\bloss|_loss|\.tls|\.sender|qstream|super\(\))\.(_[a-z][a-z_]*)"
    )
    used = set()
    for path in (ROOT / "transport").glob("*.py"):
        used |= set(pattern.findall(path.read_text()))
    ours = {"_flow", "_conn", "_mesh"}  # meshd's own attributes on the same names
    assert used - listed - ours == set(), sorted(used - listed - ours)
