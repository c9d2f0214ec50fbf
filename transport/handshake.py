"""Sans-I/O handshake on the first stream of a meshd connection.

Member mode (first stream type HANDSHAKE)::

    client -> server   preamble(HANDSHAKE, v) | HELLO(challenge_c, pub_c)
    server -> client   HELLO(challenge_s, pub_s) | AUTH(sig_s, cert_s)
    client -> server   AUTH(sig_c, cert_c)                  (only if the server checked out)
    server -> client   ACCEPT                               (only if the client checked out)

Join mode (first stream type JOIN; the client has no credentials and pins the issuer's key)::

    client -> server   preamble(JOIN, v) | HELLO(challenge_c, pub_c)
    server -> client   HELLO(challenge_s, pub_s) | AUTH(sig_s, cert_s)
    client -> server   JOIN_REQUEST(sig_c, request)
    server -> client   JOIN_REPLY(reply)        or a close with JOIN_REFUSED and the reason

Each signature is ``identity.sign(b"handshake", transcript(role))`` where the transcript binds the mode,
the signer's role, both challenges, both node ids, the protocol version and ``binding``: the SHA-256 of
the server's TLS certificate (DER), which both ends of one QUIC connection see and no relay can share, so
a handshake cannot be replayed onto another connection. The TLS certificate itself authenticates nothing.

A side is admitted when the other presented a valid certificate of our mesh for the key it proved, the
key matches the pinned one (client, when ``expected_node_id`` is set), and ``admission(node_id, cert)``
returned None. Every failure raises ``RemoteProtocolError``; the caller closes the connection with its
code. Events come out of ``next_event()``; bytes to send out of ``data_to_send()``.
"""

from __future__ import annotations

import hashlib
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
SIGNATURE_DOMAIN = b"handshake"
TRANSCRIPT_TAG = b"meshd-handshake-v1"

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
class JoinRequested:
    """Fires on the issuer when a joiner proved its key; answer with ``reply_join`` or ``refuse_join``."""

    public_key: bytes
    node_id: str
    request: bytes


@dataclass(frozen=True, slots=True)
class JoinReplied:
    """Fires on the joiner when the issuer (whose pinned key proved itself) answered."""

    reply: bytes


HandshakeEvent = PeerAdmitted | JoinRequested | JoinReplied


def tls_binding(server_certificate_der: bytes) -> bytes:
    """The channel binding both sides sign: SHA-256 of the server's TLS certificate."""
    return hashlib.sha256(server_certificate_der).digest()


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
    """The bytes each side signs (under the ``handshake`` signature domain)."""
    return b"".join(
        (
            TRANSCRIPT_TAG,
            struct.pack(">BBB", mode.value, 0 if signer_is_client else 1, protocol_version),
            challenge_c,
            challenge_s,
            node_id_c.encode(),
            node_id_s.encode(),
            binding,
        )
    )


def encode_hello(challenge: bytes, public_key: bytes) -> bytes:
    return encode_frame(FrameType.HELLO, challenge + public_key)


def encode_auth(signature: bytes, cert: bytes) -> bytes:
    return encode_frame(FrameType.AUTH, signature + cert)


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
        self.done = False

    # -- driver interface ------------------------------------------------------------------------

    def initiate(self) -> None:
        """Client: queue the preamble and HELLO."""
        if not self.is_client or self._state != "start":
            raise RuntimeError("initiate() is for a fresh client handshake")
        assert self.mode is not None  # noqa: S101 - set for clients
        self._out += encode_preamble(self.mode.value, self._version)
        self._out += encode_hello(self._challenge, self._identity.public_key)
        self._state = "wait_server"

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

    def _read_hello(self, frame: Frame) -> None:
        if frame.type is not FrameType.HELLO:
            raise self._unexpected(frame)
        if len(frame.payload) != CHALLENGE_BYTES + PUBLIC_KEY_BYTES:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "malformed HELLO")
        self._peer_challenge = frame.payload[:CHALLENGE_BYTES]
        self._peer_pub = frame.payload[CHALLENGE_BYTES:]
        try:
            self._peer_id = node_id_from_public_key(self._peer_pub)
        except IdentityError:  # pragma: no cover - length checked above
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "malformed HELLO key") from None
        if self._peer_pub == self._identity.public_key:
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "peer presented our own key")

    def _transcript(self, signer_is_client: bool) -> bytes:
        assert self.mode is not None and self._peer_challenge is not None  # noqa: S101 - state
        assert self._peer_id is not None  # noqa: S101
        if self.is_client:
            cc, cs = self._challenge, self._peer_challenge
            idc, ids = self._identity.node_id, self._peer_id
        else:
            cc, cs = self._peer_challenge, self._challenge
            idc, ids = self._peer_id, self._identity.node_id
        return transcript(self.mode, signer_is_client, cc, cs, idc, ids, self._peer_version, self._binding)

    def _my_signature(self) -> bytes:
        return self._identity.sign(SIGNATURE_DOMAIN, self._transcript(self.is_client))

    def _check_signature(self, signature: bytes) -> None:
        assert self._peer_pub is not None  # noqa: S101 - state
        if not verify_signature(
            self._peer_pub, SIGNATURE_DOMAIN, self._transcript(not self.is_client), signature
        ):
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "bad handshake signature")

    def _read_auth(self, frame: Frame) -> MemberCert | bytes:
        """Verify an AUTH frame's signature; return the verified cert (member mode) or raw cert bytes."""
        if frame.type is not FrameType.AUTH:
            raise self._unexpected(frame)
        if len(frame.payload) < SIGNATURE_BYTES:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "malformed AUTH")
        self._check_signature(frame.payload[:SIGNATURE_BYTES])
        cert_bytes = frame.payload[SIGNATURE_BYTES:]
        if self._credentials is None:
            return cert_bytes  # a joiner cannot check certificates; it pinned the issuer's key
        return self._check_cert(cert_bytes)

    def _check_cert(self, cert_bytes: bytes) -> MemberCert:
        assert self._credentials is not None and self._peer_id is not None  # noqa: S101 - state
        try:
            cert = MemberCert.decode(cert_bytes, self._credentials.genesis)
        except CredentialError as e:
            raise RemoteProtocolError(ErrorCode.REFUSED, f"not a member of this mesh: {e}") from None
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

    def _client_frame(self, frame: Frame) -> None:
        if self._state == "wait_server":
            self._read_hello(frame)
            if self._expected is not None and self._peer_id != self._expected:
                raise RemoteProtocolError(
                    ErrorCode.HANDSHAKE_FAILED,
                    f"pinned node {self._expected} presented another key ({self._peer_id})",
                )
            self._state = "wait_server_auth"
        elif self._state == "wait_server_auth":
            verified = self._read_auth(frame)
            if self.mode is Mode.JOIN:
                assert self._join_request is not None  # noqa: S101 - checked in __init__
                self._out += encode_frame(
                    FrameType.JOIN_REQUEST,
                    self._my_signature() + self._join_request,
                    limits.MAX_JOIN_FRAME_BYTES,
                )
                self._state = "wait_join_reply"
            else:
                assert self._credentials is not None  # noqa: S101 - member mode
                self._out += encode_auth(self._my_signature(), self._credentials.cert.encoded)
                self._server_cert = verified
                self._state = "wait_accept"
        elif self._state == "wait_accept":
            if frame.type is not FrameType.ACCEPT or frame.payload:
                raise self._unexpected(frame)
            cert = self._server_cert
            assert isinstance(cert, MemberCert)  # noqa: S101 - member mode
            self._admitted(cert)
        elif self._state == "wait_join_reply":
            if frame.type is not FrameType.JOIN_REPLY:
                raise self._unexpected(frame)
            self._state = "done"
            self.done = True
            self._events.append(JoinReplied(frame.payload))
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
            self._read_hello(frame)
            self._out += encode_hello(self._challenge, self._identity.public_key)
            cert = self._credentials.cert.encoded if self._credentials is not None else b""
            self._out += encode_auth(self._my_signature(), cert)
            self._state = "wait_client_auth"
        elif self._state == "wait_client_auth":
            if self.mode is Mode.JOIN:
                if frame.type is not FrameType.JOIN_REQUEST or len(frame.payload) < SIGNATURE_BYTES:
                    raise self._unexpected(frame)
                self._check_signature(frame.payload[:SIGNATURE_BYTES])
                assert self._peer_pub is not None and self._peer_id is not None  # noqa: S101 - state
                self._state = "join_pending"
                self._events.append(
                    JoinRequested(self._peer_pub, self._peer_id, frame.payload[SIGNATURE_BYTES:])
                )
            else:
                cert = self._read_auth(frame)
                assert isinstance(cert, MemberCert)  # noqa: S101 - member mode has credentials
                self._out += encode_frame(FrameType.ACCEPT, b"")
                self._admitted(cert)
        else:
            raise self._unexpected(frame)
