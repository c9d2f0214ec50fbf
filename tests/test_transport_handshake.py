"""Handshake state machine (sans-I/O): admission, every refusal, join mode, timeouts, golden bytes."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from transport.credentials import Genesis, MemberCert, MeshCredentials
from transport.framing import ErrorCode, FrameType, RemoteProtocolError, encode_frame
from transport.handshake import (
    CHALLENGE_BYTES,
    NOT_A_MEMBER,
    Handshake,
    JoinReplied,
    JoinRequested,
    MembershipProven,
    Mode,
    PeerAdmitted,
    mesh_key,
    proof_mac,
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
    assert len(flights) == 6  # HELLO, HELLO, PROOF, AUTH, AUTH, ACCEPT
    [ec], [proven, es] = events(c), events(s)
    assert isinstance(proven, MembershipProven)
    assert isinstance(ec, PeerAdmitted) and ec.node_id == B.node_id and ec.cert.node_pub == B.public_key
    assert isinstance(es, PeerAdmitted) and es.node_id == A.node_id and es.public_key == A.public_key
    assert c.done and s.done and c.get_timer() is None


def test_golden_handshake_bytes() -> None:
    c, s = make(True, A, creds(A)), make(False, B, creds(B))
    flights = run(c, s)
    # client flight 1: preamble + HELLO(challenge); server: HELLO(challenge, pub): fully literal
    assert flights[0] == bytes.fromhex("6d730001" "6d6401020000000020") + b"\xc0" * 32
    assert flights[1] == bytes.fromhex("6d6401020000000040") + b"\x5e" * 32 + B.public_key
    mac = proof_mac(mesh_key(GENESIS.encoded), Mode.MEMBER, b"\xc0" * 32, b"\x5e" * 32, B.node_id, 1, BINDING)
    assert flights[2] == bytes.fromhex("6d6401070000000020") + mac  # PROOF
    cert_b = creds(B).cert.encoded
    assert flights[3][:9] == bytes.fromhex("6d64010300") + (64 + len(cert_b)).to_bytes(4, "big")  # AUTH
    assert flights[3].endswith(cert_b)  # server AUTH: sig | cert, only after the PROOF
    assert flights[4][9:41] == A.public_key  # client AUTH: pub | sig | cert
    assert flights[5] == bytes.fromhex("6d6401040000000000")  # ACCEPT
    digests = [hashlib.sha256(f).hexdigest()[:16] for f in flights]
    assert digests == GOLDEN_DIGESTS, digests


GOLDEN_DIGESTS = [  # handshake v2 (ALPN meshd/2)
    'a0dae3c1233baa63', 'c2052802199ef7f6', 'ab6b3e99a3ffbe42', 'efa848a4b9ced9ef', '3e313664d3c1dca6',
    '7f0be63e1aa21eb5',
]


def secrets_of(cr: MeshCredentials, node: NodeIdentity) -> list[bytes]:
    """Byte strings that would tell a stranger about the mesh (or who the dialling member is)."""
    g = cr.genesis
    return [g.mesh_id.encode(), g.admin_pub, g.admin_pub.hex().encode(), cr.cert.encoded, g.encoded,
            node.public_key, node.node_id.encode(), g.name.encode()]


def leaks(flights: list[bytes], cr: MeshCredentials, node: NodeIdentity) -> list[bytes]:
    import base64

    wire = b"".join(flights)
    found = []
    for secret in secrets_of(cr, node):
        for form in (secret, base64.b64encode(secret), base64.urlsafe_b64encode(secret).rstrip(b"=")):
            if len(form) >= 8 and form in wire:
                found.append(secret)
    return found


def test_a_stranger_dialling_a_member_learns_nothing_about_the_mesh() -> None:
    # a stranger (a member of another mesh, or anyone with a genesis of its own) dials B
    c, s = make(True, C, creds(C, ADMIN2, GENESIS2)), make(False, B, creds(B))
    c.initiate()
    s.receive_data(c.data_to_send())
    server_said = [s.data_to_send()]
    c.receive_data(server_said[0])
    with pytest.raises(RemoteProtocolError) as err:
        s.receive_data(c.data_to_send())
    assert err.value.code is ErrorCode.REFUSED and err.value.reason == NOT_A_MEMBER
    server_said.append(s.data_to_send())
    assert server_said == [bytes.fromhex("6d6401020000000040") + b"\x5e" * 32 + B.public_key, b""]  # HELLO only
    assert events(s) == []
    assert leaks(server_said, creds(B), ident(255)) == []
    # what the server said is its node key (also its TLS certificate and its mDNS TXT) and a challenge
    assert B.public_key in server_said[0]


def test_a_member_dialling_a_stranger_reveals_nothing() -> None:
    # A dials something that is not of its mesh: all A sends is a challenge and a blinded proof
    for stranger in (make(False, C, creds(C, ADMIN2, GENESIS2)), make(False, C, None, join_allowed=True)):
        c = make(True, A, creds(A))
        c.initiate()
        sent = [c.data_to_send()]
        # the stranger answers HELLO and an AUTH with whatever certificate it has
        stranger_hello = encode_frame(FrameType.HELLO, b"\x11" * 32 + C.public_key)
        c.receive_data(stranger_hello)
        sent.append(c.data_to_send())
        with pytest.raises(RemoteProtocolError):
            c.receive_data(encode_frame(FrameType.AUTH, C.sign(b"handshake", b"x") + creds(C, ADMIN2, GENESIS2).cert.encoded))
        sent.append(c.data_to_send())
        assert leaks(sent, creds(A), A) == [], leaks(sent, creds(A), A)
        assert [len(f) for f in sent] == [4 + 9 + 32, 9 + 32, 0]


def test_a_rogue_server_knowing_the_genesis_never_sees_the_client_certificate() -> None:
    # C holds our genesis (a former member) but no certificate of ours: the client stops at its AUTH
    rogue = MeshCredentials(GENESIS, creds(C, ADMIN2, GENESIS2).cert)
    c, s = make(True, A, creds(A)), make(False, C, rogue)
    flights: list[bytes] = []

    def record(i: int, data: bytes) -> bytes:
        flights.append(data)
        return data

    with pytest.raises(RemoteProtocolError) as err:
        run(c, s, tamper=record)
    assert err.value.code is ErrorCode.REFUSED and "another mesh" in err.value.reason
    client_flights = flights[0::2]
    assert all(A.public_key not in f and creds(A).cert.encoded not in f for f in client_flights)


def test_a_joiner_learns_no_certificate_before_its_request_checks() -> None:
    c, s = joiner(), make(False, B, creds(B), join_allowed=True)
    c.initiate()
    s.receive_data(c.data_to_send())
    issuer_said = s.data_to_send()
    assert leaks([issuer_said], creds(B), ident(255)) == []
    assert len(issuer_said) == (9 + 64) + (9 + 64)  # HELLO(challenge, key) | AUTH(signature)


def test_other_mesh_is_refused_by_the_server() -> None:
    # a stranger who knows our genesis but holds a certificate of its own mesh
    rogue = MeshCredentials(GENESIS, creds(C, ADMIN2, GENESIS2).cert)
    c, s = make(True, C, rogue), make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.REFUSED and "another mesh" in err.value.reason
    assert events(s) == [MembershipProven()]  # it knows the genesis, but is not admitted


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


def test_proofs_bound_to_the_tls_certificate() -> None:
    # A relay that terminates TLS itself shows the client another certificate: the client's membership
    # proof fails at the server, and (were the proof passed along) the server's signature at the client.
    c = make(True, A, creds(A), binding=tls_binding(b"relay-certificate"))
    s = make(False, B, creds(B))
    with pytest.raises(RemoteProtocolError) as err:
        run(c, s)
    assert err.value.code is ErrorCode.REFUSED and err.value.reason == NOT_A_MEMBER
    c = make(True, A, creds(A), binding=tls_binding(b"relay-certificate"))
    s = make(False, B, creds(B))
    c.initiate()
    s.receive_data(c.data_to_send())
    c.receive_data(s.data_to_send())
    c.data_to_send()
    s._state = "wait_proof"  # noqa: SLF001 - pretend the proof passed: the client still refuses
    s.receive_data(encode_frame(FrameType.PROOF, proof_mac(
        mesh_key(GENESIS.encoded), Mode.MEMBER, b"\xc0" * 32, b"\x5e" * 32, B.node_id, 1, BINDING)))
    with pytest.raises(RemoteProtocolError) as err:
        c.receive_data(s.data_to_send())
    assert err.value.code is ErrorCode.HANDSHAKE_FAILED and "signature" in err.value.reason


def test_tampered_signature_is_refused() -> None:
    def flip(i: int, data: bytes) -> bytes:
        if i == 4:  # client AUTH (header 9, key 32, signature 64): flip a bit of the signature
            return data[:50] + bytes([data[50] ^ 1]) + data[51:]
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


def test_aioquic_records_become_one_debug_event_per_kind_with_fake_clock() -> None:
    import logging

    from transport.ratelog import AioquicLogFilter, RateLimitedLog

    lines: list[tuple[str, dict[str, Any]]] = []

    class Sink:
        def debug(self, event: str, **fields: Any) -> None:
            lines.append((event, fields))

    now = [0.0]
    f = AioquicLogFilter(RateLimitedLog(Sink(), 10.0), lambda: now[0])

    def record(msg: str, *args: Any) -> logging.LogRecord:
        return logging.LogRecord("quic", logging.INFO, __file__, 1, msg, args, None)

    assert f.filter(record("[0a1b] TLS %s -> %s", "A", "B")) is False  # the record itself is dropped
    assert f.filter(record("[ffee] TLS %s -> %s", "B", "C")) is False  # same kind, another connection
    assert f.filter(record("[ffee] Negotiated protocol version %s", "v1")) is False
    now[0] = 10.0
    f.filter(record("[0c0d] TLS %s -> %s", "C", "D"))
    assert [(e, fields["kind"], fields.get("suppressed")) for e, fields in lines] == [
        ("aioquic_log", "TLS %s -> %s", None),
        ("aioquic_log", "Negotiated protocol version %s", None),
        ("aioquic_log", "TLS %s -> %s", 1),
    ]
    assert lines[0][1]["message"] == "[0a1b] TLS A -> B" and lines[0][1]["level"] == "info"
