"""Sans-I/O wire format of the data lane: the proof of identity inside TLS, and the stream multiplexer.

A lane is TLS 1.3 over TCP between two members already admitted over QUIC (``transport.lane`` drives it).
The server presents the self-signed certificate made from its node key (``transport.tls``); the client
presents none. Inside TLS, before anything else::

    client -> server   HELLO  magic b"mlane" | version u8 | client public key (32) | client nonce (32)
    server -> client   AUTH   server nonce (32) | server signature (64)
    client -> server   AUTH   client signature (64)
    server -> client   READY  status u8 (0 = accepted) | reason length u8 | reason (UTF-8)

Each signature is ``identity.sign(b"lane", transcript(role, ...))`` over both public keys, both fresh
nonces and the SHA-256 of the server certificate **as the signer saw it in this TLS session**. The client
also requires the certificate's key to be the server's node key it knows from QUIC.

Why a machine in the middle that terminates TLS itself fails: it cannot present the server's certificate
(TLS 1.3 makes the server prove the certificate key in CertificateVerify, and that key is the node key),
so the client sees another certificate. The client refuses it (wrong key), and even if it did not, its
signature would cover the other certificate's hash, which the real server refuses (not its own), while
the server's signature covers its own certificate's hash, which the client refuses (not what it saw).
Fresh nonces from both sides make every proof good for one session only. So each end knows the TLS
session it is in ends at the holder of the other node key: the TLS keys are the channel binding that
stdlib ``ssl`` (no exporter, no tls-unique in TLS 1.3) cannot give directly.

After READY, both directions carry multiplexed streams, each the same bytes as a QUIC stream (preamble,
then frames; ``transport.framing``)::

    kind u8 | stream id u32 | length u32 | payload      (kinds: DATA, FIN, RESET, PING, PONG)

The dialing side opens even stream ids, the accepting side odd ones, each increasing. Parsing is strict;
every violation raises ``RemoteProtocolError`` and the lane is closed.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import IntEnum

from transport import limits
from transport.framing import ErrorCode, RemoteProtocolError
from transport.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeIdentity, verify_signature
from transport.streams import LANE_ACCEPTED_TYPES, max_frame_bytes

LANE_MAGIC = b"mlane"
LANE_VERSION = 1
NONCE_BYTES = 32
SIGNATURE_DOMAIN = b"lane"
TRANSCRIPT_TAG = b"meshd-lane-v1"
HELLO_BYTES = len(LANE_MAGIC) + 1 + PUBLIC_KEY_BYTES + NONCE_BYTES
SERVER_AUTH_BYTES = NONCE_BYTES + SIGNATURE_BYTES
CLIENT_AUTH_BYTES = SIGNATURE_BYTES
MUX_HEADER = struct.Struct(">BII")
assert MUX_HEADER.size == limits.LANE_MUX_HEADER_BYTES  # noqa: S101 - module constant, not input
MAX_CHUNK_BYTES = max(max_frame_bytes(t) for t in LANE_ACCEPTED_TYPES) + limits.FRAME_HEADER_BYTES + \
    limits.STREAM_PREAMBLE_BYTES
"""Largest DATA payload: one whole frame of the largest lane stream type, with a stream preamble."""


def cert_hash(certificate_der: bytes) -> bytes:
    return hashlib.sha256(certificate_der).digest()


def transcript(signer_is_client: bool, pub_c: bytes, pub_s: bytes, nonce_c: bytes, nonce_s: bytes,
               server_cert_hash: bytes, tag: bytes = TRANSCRIPT_TAG) -> bytes:
    """The bytes each side signs (under the ``lane`` signature domain). ``tag`` names what the session is
    for (a lane, or a direct channel of one service: ``transport.lane_direct``), so no proof made for one
    can stand for another."""
    return b"".join((tag, struct.pack(">BB", LANE_VERSION, 0 if signer_is_client else 1),
                     pub_c, pub_s, nonce_c, nonce_s, server_cert_hash))


def encode_hello(public_key: bytes, nonce: bytes) -> bytes:
    return LANE_MAGIC + bytes([LANE_VERSION]) + public_key + nonce


def decode_hello(data: bytes) -> tuple[bytes, bytes]:
    """(client public key, client nonce) from exactly ``HELLO_BYTES``; raises ``RemoteProtocolError``."""
    if len(data) != HELLO_BYTES or data[: len(LANE_MAGIC)] != LANE_MAGIC:
        raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "not a meshd lane")
    if data[len(LANE_MAGIC)] != LANE_VERSION:
        raise RemoteProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"lane version {data[len(LANE_MAGIC)]}")
    at = len(LANE_MAGIC) + 1
    return data[at: at + PUBLIC_KEY_BYTES], data[at + PUBLIC_KEY_BYTES:]


def encode_ready(accepted: bool, reason: str = "") -> bytes:
    text = reason.encode()[: min(255, limits.MAX_REFUSAL_REASON_BYTES)]
    return bytes([0 if accepted else 1, len(text)]) + text


def sign(identity: NodeIdentity, signer_is_client: bool, pub_c: bytes, pub_s: bytes, nonce_c: bytes,
         nonce_s: bytes, server_cert_hash: bytes, tag: bytes = TRANSCRIPT_TAG) -> bytes:
    return identity.sign(SIGNATURE_DOMAIN, transcript(signer_is_client, pub_c, pub_s, nonce_c, nonce_s,
                                                      server_cert_hash, tag))


def verify(public_key: bytes, signature: bytes, signer_is_client: bool, pub_c: bytes, pub_s: bytes,
           nonce_c: bytes, nonce_s: bytes, server_cert_hash: bytes, tag: bytes = TRANSCRIPT_TAG) -> None:
    """Raises ``RemoteProtocolError(HANDSHAKE_FAILED)`` unless ``signature`` is right."""
    if len(signature) != SIGNATURE_BYTES or not verify_signature(
            public_key, SIGNATURE_DOMAIN,
            transcript(signer_is_client, pub_c, pub_s, nonce_c, nonce_s, server_cert_hash, tag), signature):
        raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "lane proof of identity failed")


class MuxKind(IntEnum):
    """APPEND ONLY. What a lane record carries."""

    DATA = 0  # stream bytes (the first DATA of a stream starts with its preamble)
    FIN = 1  # the sender finished the stream (empty)
    RESET = 2  # the sender aborted the stream: code u16
    PING = 3  # keep-alive (empty); answered by PONG
    PONG = 4


@dataclass(frozen=True, slots=True)
class MuxRecord:
    """A lane record, or for DATA a piece of one (a record's payload may come in several pieces, each
    handed on as it arrives: the stream's own decoder reassembles frames, so a payload is never buffered
    twice). ``payload`` may be a memoryview into the bytes fed."""

    kind: MuxKind
    stream_id: int
    payload: bytes | memoryview


def mux_header(kind: MuxKind, stream_id: int, length: int) -> bytes:
    return MUX_HEADER.pack(int(kind), stream_id, length)


def encode_reset(stream_id: int, code: int) -> bytes:
    return mux_header(MuxKind.RESET, stream_id, 2) + struct.pack(">H", code & 0xFFFF)


class MuxDecoder:
    """Incremental, strict decoder of lane records. ``feed`` returns the records (DATA in pieces) the bytes
    complete; after an error every call raises it again."""

    def __init__(self) -> None:
        self._head = bytearray()  # a header (or a RESET payload) split across reads
        self._kind: MuxKind | None = None  # the record whose header was parsed...
        self._sid = 0
        self._left = 0  # ...and its payload bytes still to come
        self._error: RemoteProtocolError | None = None

    def feed(self, data: bytes) -> list[MuxRecord]:
        if self._error is not None:
            raise self._error
        try:
            return self._parse(memoryview(data))
        except RemoteProtocolError as e:
            self._error = e
            self._head.clear()
            raise

    def _parse(self, mv: memoryview) -> list[MuxRecord]:
        out: list[MuxRecord] = []
        at, n = 0, len(mv)
        while at < n:
            if self._kind is MuxKind.DATA:
                take = min(self._left, n - at)
                out.append(MuxRecord(MuxKind.DATA, self._sid, mv[at: at + take]))
                at += take
                self._left -= take
                if not self._left:
                    self._kind = None
                continue
            if self._kind is MuxKind.RESET:
                take = min(self._left, n - at)
                self._head += mv[at: at + take]
                at += take
                self._left -= take
                if not self._left:
                    out.append(MuxRecord(MuxKind.RESET, self._sid, bytes(self._head)))
                    self._head.clear()
                    self._kind = None
                continue
            if not self._head and n - at >= MUX_HEADER.size:
                header = mv[at: at + MUX_HEADER.size]
                at += MUX_HEADER.size
            else:
                take = min(MUX_HEADER.size - len(self._head), n - at)
                self._head += mv[at: at + take]
                at += take
                if len(self._head) < MUX_HEADER.size:
                    break
                header = memoryview(bytes(self._head))
                self._head.clear()
            kind_b, sid, length = MUX_HEADER.unpack(header)
            self._header(kind_b, sid, length, out)
        return out

    def _header(self, kind_b: int, sid: int, length: int, out: list[MuxRecord]) -> None:
        try:
            kind = MuxKind(kind_b)
        except ValueError:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, f"unknown lane record {kind_b}") from None
        if kind is MuxKind.DATA:
            if length == 0 or length > MAX_CHUNK_BYTES:
                raise RemoteProtocolError(ErrorCode.FRAME_TOO_LARGE, f"lane record of {length} bytes")
        elif kind is MuxKind.RESET:
            if length != 2:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "bad lane RESET")
        elif length != 0:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, f"lane {kind.name} with a payload")
        if length:
            self._kind, self._sid, self._left = kind, sid, length
        else:
            out.append(MuxRecord(kind, sid, b""))

    @property
    def buffered_bytes(self) -> int:
        return len(self._head)
