"""Handshake state machine (sans-I/O): admission, every refusal, join mode, timeouts, golden bytes."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from transport.credentials import Genesis, MemberCert, MeshCredentials
from transport.framing import ErrorCode, FrameType, RemoteProtocolError, encode_frame
from transport.handshake import (
    CHALLENGE_BYTES,
    Handshake,
    JoinReplied,
    JoinRequested,
    Mode,
    PeerAdmitted,
    tls_binding,
)
from transport.identity import NodeIdentity

T0 = 1_700_000_000


def ident(i: int) -> NodeIdentity:
    return NodeIdentity.from_private_bytes(bytes([i]) * 32)


ADMIN, ADMIN2 = ident(1), ident(2)
A, B, C = ident(10), ident(11), ident(12)
GENESIS = Genesis.create(ADMIN, "golden", T0, 1, 1)
GENESIS2 = Genesis.create(ADMIN2, "other", T0, 1, 1)


def creds(node: NodeIdentity, admin: NodeIdentity = ADMIN, genesis: Genesis = GENESIS) -> MeshCredentials:
    return MeshCredentials(genesis, MemberCert.issue(admin, genesis, node.public_key, T0))


BINDING = tls_binding(b"server-certificate-der")


def make(is_client: bool, identity: NodeIdentity, cr: MeshCredentials | None, **kw: Any) -> Handshake:
    args: dict[str, Any] = dict(
        is_client=is_client,
        mode=Mode.MEMBER,
        identity=identity,
        credentials=cr,
        binding=BINDING,
        challenge=bytes([0xC0 if is_client else 0x5E]) * CHALLENGE_BYTES,
        now=0.0,
        timeout_s=3.0,
        protocol_version=1,
        accepted_versions=(1, 1),
    )
    args.update(kw)
    return Handshake(**args)


def run(client: Handshake, server: Handshake, tamper: Any = None) -> list[bytes]:
    """Pump bytes both ways until quiet; returns every flight (client first)."""
    flights: list[bytes] = []
    client.initiate()
    sides = [(client, server), (server, client)]
    turn = 0
    while True:
        src, dst = sides[turn % 2]
        data = src.data_to_send()
        if not data:
            if not sides[(turn + 1) % 2][0]._out:  # noqa: SLF001 - both quiet
                return flights
        else:
            if tamper is not None:
                data = tamper(len(flights), data)
            flights.append(data)
            dst.receive_data(data)
        turn += 1


def events(hs: Handshake) -> list[Any]:
    out = []
    while (ev := hs.next_event()) is not None:
        out.append(ev)
    return out


def test_members_admit_each_other() -> None:
    c, s = make(True, A, creds(A)), make(False, B, creds(B))
    flights = run(c, s)
    assert len(flights) == 4
    [ec], [es] = events(c), events(s)
    assert isinstance(ec, PeerAdmitted) and ec.node_id == B.node_id and ec.cert.node_pub == B.public_key
    assert isinstance(es, PeerAdmitted) and es.node_id == A.node_id and es.public_key == A.public_key
    assert c.done and s.done and c.get_timer() is None


def test_golden_handshake_bytes() -> None:
    c, s = make(True, A, creds(A)), make(False, B, creds(B))
    flights = run(c, s)
    # client flight 1: preamble + HELLO(challenge, pub): fully literal
    assert flights[0] == bytes.fromhex("6d730001" "6d6401020000000040") + b"\xc0" * 32 + A.public_key
    assert flights[1][:9] == bytes.fromhex("6d6401020000000040")
    assert flights[3] == bytes.fromhex("6d6401040000000000")  # ACCEPT
    digests = [hashlib.sha256(f).hexdigest()[:16] for f in flights]
    assert digests == GOLDEN_DIGESTS, digests


GOLDEN_DIGESTS = ['0285f570c3bac314', 'd9f97e8acf8e721a', '8c4baf18650317b5', '7f0be63e1aa21eb5']


def test_other_mesh_is_refused_by_the_server() -> None:
    # a stranger who knows our genesis but holds a certificate of its own mesh
    rogue = MeshCredentials(GENESIS, creds(C, ADMIN2, GENESIS2).cert)
    c, s = make(True, C, rogue), make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.REFUSED and "another mesh" in err.value.reason
    assert events(s) == []


def test_self_made_certificate_is_refused() -> None:
    forged = MemberCert.__new__(MemberCert)  # a cert for our mesh id, signed by the stranger itself
    import transport.credentials as cred

    body = {"v": 1, "mesh_id": GENESIS.mesh_id, "node_pub": cred.b64e(C.public_key), "node_id": C.node_id,
            "issued_at": T0}
    object.__setattr__(forged, "encoded", cred.sign_document(C, b"member-cert", body))
    rogue = MeshCredentials(GENESIS, forged)
    c, s = make(True, C, rogue), make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.REFUSED and "bad signature" in err.value.reason


def test_client_refuses_a_server_of_another_mesh() -> None:
    c, s = make(True, A, creds(A)), make(False, C, creds(C, ADMIN2, GENESIS2))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.REFUSED


def test_pinned_key_mismatch() -> None:
    c, s = make(True, A, creds(A), expected_node_id=C.node_id), make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.HANDSHAKE_FAILED and "pinned" in err.value.reason


def test_certificate_of_another_key_is_refused() -> None:
    stolen = MeshCredentials(GENESIS, creds(B).cert)  # C presents B's certificate
    c, s = make(True, C, stolen), make(False, A, creds(A))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.HANDSHAKE_FAILED and "another key" in err.value.reason


def test_signature_bound_to_the_tls_certificate() -> None:
    # A relay that terminates TLS itself shows the client another certificate: the server's signature fails.
    c = make(True, A, creds(A), binding=tls_binding(b"relay-certificate"))
    s = make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.HANDSHAKE_FAILED and "signature" in err.value.reason


def test_tampered_signature_is_refused() -> None:
    def flip(i: int, data: bytes) -> bytes:
        if i == 2:  # client AUTH: flip a bit of the signature
            return data[:20] + bytes([data[20] ^ 1]) + data[21:]
        return data

    with pytest.raises(RemoteProtocolError) as err:
        run(make(True, A, creds(A)), make(False, B, creds(B)), tamper=flip)
    assert err.value.code is ErrorCode.HANDSHAKE_FAILED


def test_admission_hook_refuses_with_its_reason() -> None:
    seen = []

    def admission(node_id: str, cert: MemberCert) -> str | None:
        seen.append(node_id)
        return "banned by the mesh admin" if node_id == A.node_id else None

    c, s = make(True, A, creds(A)), make(False, B, creds(B), admission=admission)
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.REFUSED and err.value.reason == "banned by the mesh admin"
    assert seen == [A.node_id]


def test_protocol_range_of_the_genesis() -> None:
    g = Genesis.create(ADMIN, "future", T0, 2, 3)
    cr_a = MeshCredentials(g, MemberCert.issue(ADMIN, g, A.public_key, T0))
    cr_b = MeshCredentials(g, MemberCert.issue(ADMIN, g, B.public_key, T0))
    with pytest.raises(RemoteProtocolError) as err:
        run(make(True, A, cr_a), make(False, B, cr_b))
    assert err.value.code is ErrorCode.REFUSED and "outside the mesh range 2..3" in err.value.reason


def test_timeout_with_fake_clock() -> None:
    s = make(False, B, creds(B), now=100.0, timeout_s=3.0)
    assert s.get_timer() == 103.0
    s.handle_timer(102.9)
    with pytest.raises(RemoteProtocolError) as err:
        s.handle_timer(103.0)
    assert err.value.code is ErrorCode.HANDSHAKE_TIMEOUT


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n", b"\x00" * 40, b"ms\x02\x01", b"ms\x00\x01" + encode_frame(FrameType.ACCEPT, b"")],
)
def test_garbage_first_flight_fails_at_once(garbage: bytes) -> None:
    s = make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError):
        s.receive_data(garbage)
        s.receive_data(b"", end_stream=True)


def test_short_hello_and_early_end() -> None:
    s = make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError) as err:
        s.receive_data(b"ms\x00\x01" + encode_frame(FrameType.HELLO, b"x" * 10))
    assert "malformed HELLO" in err.value.reason


def test_own_key_is_refused() -> None:
    with pytest.raises(RemoteProtocolError) as err:
        run(make(True, A, creds(A)), make(False, A, creds(A)))
    assert "our own key" in err.value.reason


def test_server_without_credentials_refuses_members() -> None:
    s = make(False, B, None)
    c = make(True, A, creds(A))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.REFUSED and "not a member" in err.value.reason


# -- join mode ------------------------------------------------------------------------------------


def joiner(**kw: Any) -> Handshake:
    args: dict[str, Any] = dict(mode=Mode.JOIN, expected_node_id=B.node_id, join_request=b"token")
    args.update(kw)
    return make(True, C, None, **args)


def test_join_exchange() -> None:
    c, s = joiner(), make(False, B, creds(B), join_allowed=True)
    run(c, s)
    [req] = events(s)
    assert isinstance(req, JoinRequested) and req.public_key == C.public_key and req.request == b"token"
    assert s.awaiting_join_reply and s.get_timer() == 3.0
    s.reply_join(b"genesis+cert")
    c.receive_data(s.data_to_send())
    assert events(c) == [JoinReplied(b"genesis+cert")]
    assert c.done and s.done


def test_join_pins_the_issuer_key() -> None:
    c, s = joiner(expected_node_id=A.node_id), make(False, B, creds(B), join_allowed=True)
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.HANDSHAKE_FAILED


def test_join_refused_when_not_allowed() -> None:
    with pytest.raises(RemoteProtocolError) as err:
        run(joiner(), make(False, B, creds(B), join_allowed=False))
    assert err.value.code is ErrorCode.REFUSED and "does not accept joins" in err.value.reason


def test_joiner_cannot_send_member_frames() -> None:
    c, s = joiner(), make(False, B, creds(B), join_allowed=True)
    c.initiate()
    s.receive_data(c.data_to_send())
    s.data_to_send()
    with pytest.raises(RemoteProtocolError):
        s.receive_data(encode_frame(FrameType.AUTH, b"x" * 80))


# -- small pure pieces of the QUIC layer -----------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "jitter", "expected"),
    [(0, 0.0, 0.25), (0, 0.999, 0.49975), (1, 0.0, 0.5), (3, 0.5, 3.0), (6, 0.0, 15.0), (200, 0.0, 15.0)],
)
def test_backoff_table(attempt: int, jitter: float, expected: float) -> None:
    from transport.quic import backoff_delay_s

    assert backoff_delay_s(attempt, 0.5, 30.0, jitter) == pytest.approx(expected)


def test_rate_limited_log_with_fake_clock() -> None:
    from transport.ratelog import RateLimitedLog

    class Sink:
        def __init__(self) -> None:
            self.lines: list[tuple[str, dict[str, Any]]] = []

        def debug(self, event: str, **fields: Any) -> None:
            self.lines.append((event, fields))

    sink = Sink()
    rl = RateLimitedLog(sink, interval_s=10.0)
    now = 0.0
    assert rl.debug(now, "garbage", n=1)
    for _ in range(5):
        now += 1.0
        assert not rl.debug(now, "garbage", n=2)
    assert rl.debug(now, "other")  # separate budget per event
    now = 10.0
    assert rl.debug(now, "garbage", n=3)
    assert sink.lines == [("garbage", {"n": 1}), ("other", {}), ("garbage", {"n": 3, "suppressed": 5})]
