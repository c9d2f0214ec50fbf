"""Sans-I/O handshake on the first stream of a meshd connection (ALPN ``meshd/2``).

Member mode (first stream type HANDSHAKE)::

    client -> server   preamble(HANDSHAKE, v) | HELLO(challenge_c)
    server -> client   HELLO(challenge_s, pub_s)
    client -> server   PROOF(mac_c)                          membership, blinded: reveals no mesh identity
    server -> client   AUTH(sig_s, cert_s)                   (only if mac_c checked out)
    client -> server   AUTH(pub_c, sig_c, cert_c)            (only if the server checked out)
    server -> client   ACCEPT                                (only if the client checked out)

Join mode (first stream type JOIN; the client has no credentials and pins the issuer's key)::

    client -> server   preamble(JOIN, v) | HELLO(challenge_c)
    server -> client   HELLO(challenge_s, pub_s) | AUTH(sig_s)        (no certificate)
    client -> server   JOIN_REQUEST(pub_c, sig_c, request)
    server -> client   JOIN_REPLY(reply)        or a close with JOIN_REFUSED and the reason

Whoever proves first reveals nothing: the client's PROOF is ``HMAC(mesh_key(genesis), proof transcript)``,
which only a holder of the mesh's genesis can make or check, bound to both challenges and ``binding``.
Until it checked, a stranger has seen the server's node key (also in its TLS certificate and its mDNS
TXT) and 32 random bytes; it never sees a certificate, a mesh id or the client's key. The client shows
its own key and certificate only after the server's certificate checked out.

Each signature is ``identity.sign(b"handshake", transcript(role))``. The transcript binds the mode, the
signer's role, both challenges, the server's node id, the client's (in the client's signature), the
protocol version and ``binding``: the SHA-256 of the server's TLS certificate (DER), which both ends of one
QUIC connection see and no relay can share, so a proof cannot be replayed onto another connection. The TLS
certificate itself authenticates nothing.

A side is admitted when the other presented a valid certificate of our mesh for the key it proved, the
key matches the pinned one (client, when ``expected_node_id`` is set), and ``admission(node_id, cert)``
returned None. Every failure raises ``RemoteProtocolError``; the caller closes the connection with its
code. Events come out of ``next_event()``; bytes to send out of ``data_to_send()``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from transport import limits
from transport.credentials import CredentialError, MemberCert, MeshCredentials
from transport.framing import (
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameType,
    RemoteProtocolError,
    encode_frame,
    encode_preamble,
)
from transport.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    IdentityError,
    NodeIdentity,
    node_id_from_public_key,
    verify_signature,
)
from transport.streams import StreamType

CHALLENGE_BYTES = 32
PROOF_BYTES = 32
SIGNATURE_DOMAIN = b"handshake"
TRANSCRIPT_TAG = b"meshd-handshake-v2"
PROOF_TAG = b"meshd-proof-v2"
MESH_KEY_TAG = b"meshd-mesh-key-v2"
NOT_A_MEMBER = "not a member of this mesh"

Admission = Callable[[str, MemberCert], "str | None"]
"""``admission(node_id, cert)`` -> a refusal reason, or None to admit."""


class Mode(Enum):
    MEMBER = StreamType.HANDSHAKE
    JOIN = StreamType.JOIN


@dataclass(frozen=True, slots=True)
class PeerAdmitted:
    """Fires once on each side when the peer proved its key and membership and was admitted."""

    public_key: bytes
    node_id: str
    cert: MemberCert
    protocol_version: int


@dataclass(frozen=True, slots=True)
class MembershipProven:
    """Fires on the server when the client's PROOF checked: it holds our mesh's genesis (not yet admitted)."""


@dataclass(frozen=True, slots=True)
class JoinRequested:
    """Fires on the issuer when a joiner proved its key; answer with ``reply_join`` or ``refuse_join``."""

    public_key: bytes
    node_id: str
    request: bytes


@dataclass(frozen=True, slots=True)
class JoinReplied:
    """Fires on the joiner when the issuer (whose pinned key proved itself) answered."""

    reply: bytes


HandshakeEvent = PeerAdmitted | MembershipProven | JoinRequested | JoinReplied


def tls_binding(server_certificate_der: bytes) -> bytes:
    """The channel binding both sides sign: SHA-256 of the server's TLS certificate."""
    return hashlib.sha256(server_certificate_der).digest()


def mesh_key(genesis_encoded: bytes) -> bytes:
    """The key of the blinded membership proof: known to every holder of the mesh's genesis."""
    return hashlib.sha256(MESH_KEY_TAG + genesis_encoded).digest()


def transcript(
    mode: Mode,
    signer_is_client: bool,
    challenge_c: bytes,
    challenge_s: bytes,
    node_id_c: str,
    node_id_s: str,
    protocol_version: int,
    binding: bytes,
) -> bytes:
    """The bytes each side signs (under the ``handshake`` signature domain). The server signs before it
    knows the client's key, so its ``node_id_c`` is empty."""
    return b"".join(
        (
            TRANSCRIPT_TAG,
            struct.pack(">BBB", mode.value, 0 if signer_is_client else 1, protocol_version),
            challenge_c,
            challenge_s,
            node_id_s.encode(),
            binding,
            node_id_c.encode(),
        )
    )


def proof_mac(
    key: bytes, mode: Mode, challenge_c: bytes, challenge_s: bytes, node_id_s: str, protocol_version: int,
    binding: bytes,
) -> bytes:
    """The client's blinded membership proof (HMAC-SHA256 under ``mesh_key``)."""
    msg = b"".join(
        (PROOF_TAG, struct.pack(">BB", mode.value, protocol_version), challenge_c, challenge_s,
         node_id_s.encode(), binding)
    )
    return hmac.new(key, msg, hashlib.sha256).digest()


def encode_hello(challenge: bytes, public_key: bytes = b"") -> bytes:
    """Client HELLO: the challenge; server HELLO: challenge and public key."""
    return encode_frame(FrameType.HELLO, challenge + public_key)


def encode_auth(signature: bytes, cert: bytes, public_key: bytes = b"") -> bytes:
    """Server AUTH: signature and certificate; client AUTH: public key, signature and certificate."""
    return encode_frame(FrameType.AUTH, public_key + signature + cert)


class Handshake:
    """One side of the handshake. Create, call ``initiate()`` on the client, then feed stream bytes.

    ``challenge`` must be ``CHALLENGE_BYTES`` fresh random bytes (passed in: no randomness here).
    ``now`` and ``timeout_s`` set the deadline reported by ``get_timer()``; ``handle_timer(now)``
    raises ``RemoteProtocolError(HANDSHAKE_TIMEOUT)`` once it passed.
    """

    def __init__(
        self,
        *,
        is_client: bool,
        mode: Mode,
        identity: NodeIdentity,
        credentials: MeshCredentials | None,
        binding: bytes,
        challenge: bytes,
        now: float,
        timeout_s: float,
        protocol_version: int,
        accepted_versions: tuple[int, int],
        expected_node_id: str | None = None,
        admission: Admission | None = None,
        join_request: bytes | None = None,
        join_allowed: bool = False,
    ) -> None:
        if len(challenge) != CHALLENGE_BYTES:
            raise ValueError("challenge must be 32 bytes")
        if is_client and mode is Mode.MEMBER and credentials is None:
            raise ValueError("member handshake needs credentials")
        if mode is Mode.JOIN and is_client and (join_request is None or expected_node_id is None):
            raise ValueError("join needs a request and the issuer's node id")
        self.is_client = is_client
        self.mode: Mode | None = mode if is_client else None  # the server learns it from the preamble
        self._identity = identity
        self._credentials = credentials
        self._binding = binding
        self._challenge = challenge
        self._deadline = now + timeout_s
        self._version = protocol_version
        self._expected = expected_node_id
        self._admission = admission
        self._join_request = join_request
        self._join_allowed = join_allowed
        self._decoder = FrameDecoder(
            stream_type=mode.value if is_client else None, accepted_versions=accepted_versions
        )
        self._out = bytearray()
        self._events: deque[HandshakeEvent] = deque()
        self._peer_challenge: bytes | None = None
        self._peer_pub: bytes | None = None
        self._peer_id: str | None = None
        self._peer_version = protocol_version
        self._state = "start"
        self._server_cert: MemberCert | None = None
        self.done = False

    # -- driver interface ------------------------------------------------------------------------

    def initiate(self) -> None:
        """Client: queue the preamble and HELLO."""
        if not self.is_client or self._state != "start":
            raise RuntimeError("initiate() is for a fresh client handshake")
        assert self.mode is not None  # noqa: S101 - set for clients
        self._out += encode_preamble(self.mode.value, self._version)
        self._out += encode_hello(self._challenge)
        self._state = "wait_server_hello"

    def data_to_send(self) -> bytes:
        data = bytes(self._out)
        self._out.clear()
        return data

    def next_event(self) -> HandshakeEvent | None:
        return self._events.popleft() if self._events else None

    @property
    def awaiting_join_reply(self) -> bool:
        """Issuer: a JoinRequested event is out and ``reply_join`` was not called yet."""
        return self._state == "join_pending"

    @property
    def awaiting_accept(self) -> bool:
        """Client: our AUTH is out and the server's ACCEPT has not arrived yet."""
        return self._state == "wait_accept"

    def get_timer(self) -> float | None:
        return None if self.done else self._deadline

    def handle_timer(self, now: float) -> None:
        if not self.done and now >= self._deadline:
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_TIMEOUT, "handshake timed out")

    def receive_data(self, data: bytes, end_stream: bool = False) -> None:
        """Feed bytes of the handshake stream. Raises ``RemoteProtocolError`` on any failure."""
        for frame in self._decoder.feed(data):
            self._handle(frame)
        if end_stream and not self.done:
            self._decoder.feed_eof()
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "handshake stream ended early")

    def reply_join(self, reply: bytes) -> None:
        """Issuer: send the join handler's reply. The caller closes the connection afterwards."""
        if self._state != "join_pending":
            raise RuntimeError("no join request pending")
        self._out += encode_frame(FrameType.JOIN_REPLY, reply, limits.MAX_JOIN_FRAME_BYTES)
        self._state = "done"
        self.done = True

    # -- state machine ---------------------------------------------------------------------------

    def _handle(self, frame: Frame) -> None:
        if self.done:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "frame after the handshake ended")
        if self.is_client:
            self._client_frame(frame)
        else:
            self._server_frame(frame)

    def _unexpected(self, frame: Frame) -> RemoteProtocolError:
        return RemoteProtocolError(
            ErrorCode.PROTOCOL_ERROR, f"unexpected {frame.type.name} in handshake state {self._state}"
        )

    def _set_peer_key(self, pub: bytes) -> None:
        self._peer_pub = pub
        try:
            self._peer_id = node_id_from_public_key(pub)
        except IdentityError:  # pragma: no cover - length checked by the callers
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "malformed key") from None
        if pub == self._identity.public_key:
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "peer presented our own key")

    def _ids(self) -> tuple[bytes, bytes, str, str]:
        """(challenge_c, challenge_s, node_id_c or "", node_id_s)."""
        assert self._peer_challenge is not None  # noqa: S101 - state
        if self.is_client:
            return self._challenge, self._peer_challenge, self._identity.node_id, self._peer_id or ""
        return self._peer_challenge, self._challenge, self._peer_id or "", self._identity.node_id

    def _transcript(self, signer_is_client: bool) -> bytes:
        assert self.mode is not None  # noqa: S101 - state
        cc, cs, idc, ids = self._ids()
        return transcript(self.mode, signer_is_client, cc, cs, idc if signer_is_client else "", ids,
                          self._peer_version, self._binding)

    def _proof(self) -> bytes:
        assert self.mode is not None and self._credentials is not None  # noqa: S101 - member mode
        cc, cs, _, ids = self._ids()
        return proof_mac(mesh_key(self._credentials.genesis.encoded), self.mode, cc, cs, ids, self._peer_version,
                         self._binding)

    def _my_signature(self) -> bytes:
        return self._identity.sign(SIGNATURE_DOMAIN, self._transcript(self.is_client))

    def _check_signature(self, signature: bytes) -> None:
        assert self._peer_pub is not None  # noqa: S101 - state
        if not verify_signature(
            self._peer_pub, SIGNATURE_DOMAIN, self._transcript(not self.is_client), signature
        ):
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "bad handshake signature")

    def _check_cert(self, cert_bytes: bytes) -> MemberCert:
        assert self._credentials is not None and self._peer_id is not None  # noqa: S101 - state
        try:
            cert = MemberCert.decode(cert_bytes, self._credentials.genesis)
        except CredentialError as e:
            raise RemoteProtocolError(ErrorCode.REFUSED, f"{NOT_A_MEMBER}: {e}") from None
        if cert.node_pub != self._peer_pub:
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "certificate is for another key")
        if not self._credentials.genesis.accepts_protocol(self._peer_version):
            g = self._credentials.genesis
            raise RemoteProtocolError(
                ErrorCode.REFUSED,
                f"protocol version {self._peer_version} outside the mesh range {g.proto_min}..{g.proto_max}",
            )
        if self._admission is not None:
            reason = self._admission(self._peer_id, cert)
            if reason is not None:
                raise RemoteProtocolError(ErrorCode.REFUSED, reason)
        return cert

    def _admitted(self, cert: MemberCert) -> None:
        assert self._peer_pub is not None and self._peer_id is not None  # noqa: S101 - state
        self._state = "done"
        self.done = True
        self._events.append(PeerAdmitted(self._peer_pub, self._peer_id, cert, self._peer_version))

    def _expect(self, frame: Frame, ftype: FrameType, size: int | None = None, at_least: int = 0) -> bytes:
        """The payload of ``frame`` if it is of type ``ftype`` and its size fits; else a protocol error."""
        if frame.type is not ftype:
            raise self._unexpected(frame)
        n = len(frame.payload)
        if (size is not None and n != size) or n < at_least:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, f"malformed {ftype.name}")
        return frame.payload

    def _client_frame(self, frame: Frame) -> None:
        if self._state == "wait_server_hello":
            payload = self._expect(frame, FrameType.HELLO, CHALLENGE_BYTES + PUBLIC_KEY_BYTES)
            self._peer_challenge = payload[:CHALLENGE_BYTES]
            self._set_peer_key(payload[CHALLENGE_BYTES:])
            if self._expected is not None and self._peer_id != self._expected:
                raise RemoteProtocolError(
                    ErrorCode.HANDSHAKE_FAILED,
                    f"pinned node {self._expected} presented another key ({self._peer_id})",
                )
            if self.mode is Mode.MEMBER:
                self._out += encode_frame(FrameType.PROOF, self._proof())
            self._state = "wait_server_auth"
        elif self._state == "wait_server_auth":
            if self.mode is Mode.JOIN:
                # the joiner pinned the issuer's key; the issuer shows no certificate to an unproven peer
                self._check_signature(self._expect(frame, FrameType.AUTH, SIGNATURE_BYTES))
                assert self._join_request is not None  # noqa: S101 - checked in __init__
                self._out += encode_frame(
                    FrameType.JOIN_REQUEST,
                    self._identity.public_key + self._my_signature() + self._join_request,
                    limits.MAX_JOIN_FRAME_BYTES,
                )
                self._state = "wait_join_reply"
                return
            payload = self._expect(frame, FrameType.AUTH, at_least=SIGNATURE_BYTES)
            self._check_signature(payload[:SIGNATURE_BYTES])
            self._server_cert = self._check_cert(payload[SIGNATURE_BYTES:])
            assert self._credentials is not None  # noqa: S101 - member mode
            self._out += encode_auth(self._my_signature(), self._credentials.cert.encoded, self._identity.public_key)
            self._state = "wait_accept"
        elif self._state == "wait_accept":
            self._expect(frame, FrameType.ACCEPT, 0)
            assert self._server_cert is not None  # noqa: S101 - set on the way to wait_accept
            self._admitted(self._server_cert)
        elif self._state == "wait_join_reply":
            payload = self._expect(frame, FrameType.JOIN_REPLY)
            self._state = "done"
            self.done = True
            self._events.append(JoinReplied(payload))
        else:
            raise self._unexpected(frame)

    def _server_frame(self, frame: Frame) -> None:
        if self._state == "start":
            stype = self._decoder.stream_type
            if stype is StreamType.JOIN:
                if not self._join_allowed:
                    raise RemoteProtocolError(ErrorCode.REFUSED, "this node does not accept joins")
                self.mode = Mode.JOIN
            elif stype is StreamType.HANDSHAKE:
                if self._credentials is None:
                    raise RemoteProtocolError(ErrorCode.REFUSED, "this node is not a member of a mesh yet")
                self.mode = Mode.MEMBER
            else:  # pragma: no cover - the I/O layer only hands us the first stream
                raise RemoteProtocolError(ErrorCode.NOT_ADMITTED, "first stream must be the handshake")
            self._peer_version = self._decoder.protocol_version or self._version
            self._peer_challenge = self._expect(frame, FrameType.HELLO, CHALLENGE_BYTES)
            self._out += encode_hello(self._challenge, self._identity.public_key)
            if self.mode is Mode.JOIN:
                self._out += encode_auth(self._my_signature(), b"")
                self._state = "wait_join_request"
            else:
                self._state = "wait_proof"
        elif self._state == "wait_proof":
            mac = self._expect(frame, FrameType.PROOF, PROOF_BYTES)
            if not hmac.compare_digest(mac, self._proof()):
                raise RemoteProtocolError(ErrorCode.REFUSED, NOT_A_MEMBER)
            self._events.append(MembershipProven())
            assert self._credentials is not None  # noqa: S101 - member mode
            self._out += encode_auth(self._my_signature(), self._credentials.cert.encoded)
            self._state = "wait_client_auth"
        elif self._state == "wait_client_auth":
            payload = self._expect(frame, FrameType.AUTH, at_least=PUBLIC_KEY_BYTES + SIGNATURE_BYTES)
            self._set_peer_key(payload[:PUBLIC_KEY_BYTES])
            self._check_signature(payload[PUBLIC_KEY_BYTES : PUBLIC_KEY_BYTES + SIGNATURE_BYTES])
            cert = self._check_cert(payload[PUBLIC_KEY_BYTES + SIGNATURE_BYTES :])
            self._out += encode_frame(FrameType.ACCEPT, b"")
            self._admitted(cert)
        elif self._state == "wait_join_request":
            payload = self._expect(frame, FrameType.JOIN_REQUEST, at_least=PUBLIC_KEY_BYTES + SIGNATURE_BYTES)
            self._set_peer_key(payload[:PUBLIC_KEY_BYTES])
            self._check_signature(payload[PUBLIC_KEY_BYTES : PUBLIC_KEY_BYTES + SIGNATURE_BYTES])
            assert self._peer_pub is not None and self._peer_id is not None  # noqa: S101 - state
            self._state = "join_pending"
            self._events.append(
                JoinRequested(self._peer_pub, self._peer_id, payload[PUBLIC_KEY_BYTES + SIGNATURE_BYTES :])
            )
        else:
            raise self._unexpected(frame)
