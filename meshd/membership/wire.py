"""Gossip frame codec. Pure.

Frame, protocol version 1::

    u8 version (=1) | u8 type (MsgType) | u16 reserved (=0) | u32 json_len | json object (UTF-8)
    | u16 blob_count | blob_count * (u8 blob kind (BlobKind) | u32 len | bytes)

The JSON object holds the small fields (sequence numbers, claims, digests, want lists); blobs are signed
documents carried byte-exact (records, ban lists) so their signatures can be checked without
re-encoding. Every length is checked against ``transport.limits`` before anything is buffered; any
deviation raises ``RemoteProtocolError``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from transport.limits import MAX_GOSSIP_BLOBS, MAX_GOSSIP_CLAIMS, MAX_MEMBERSHIP_FRAME_BYTES, MAX_GOSSIP_JSON_BYTES

WIRE_VERSION = 1
_HEAD = struct.Struct("!BBHI")
_BLOB = struct.Struct("!BI")


class MsgType(IntEnum):
    """APPEND ONLY."""

    PING = 1  # {"seq", "target"}: direct probe; the target answers ACK with the same seq
    ACK = 2  # {"seq"}: answer to PING (or relayed answer to PING_REQ)
    PING_REQ = 3  # {"seq", "target"}: please probe target for me, ACK me with seq if it answers
    GOSSIP = 4  # {"root", "l1"}: a gossip round: pushed rumours plus our state digest
    DIGEST = 5  # {"entries": [[id, inc, rank], ...]}: our entries in the buckets where digests differed
    DELTA = 6  # {"want": [id, ...]}: states the other side lacks, and the ids we want from it


class BlobKind(IntEnum):
    """APPEND ONLY."""

    RECORD = 1
    REVOCATIONS = 2


class RemoteProtocolError(Exception):
    """A peer sent a frame that breaks the format. ``code`` is stable, ``reason`` human readable."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(slots=True)
class Frame:
    type: MsgType
    fields: dict[str, Any] = field(default_factory=dict)
    claims: list[list[Any]] = field(default_factory=list)  # [state, node_id, incarnation, by]
    blobs: list[tuple[BlobKind, bytes]] = field(default_factory=list)


def encode_frame(frame: Frame) -> bytes:
    obj = dict(frame.fields)
    if frame.claims:
        obj["claims"] = frame.claims
    js = json.dumps(obj, separators=(",", ":")).encode()
    parts = [_HEAD.pack(WIRE_VERSION, int(frame.type), 0, len(js)), js, struct.pack("!H", len(frame.blobs))]
    for kind, data in frame.blobs:
        parts.append(_BLOB.pack(int(kind), len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_frame(data: bytes) -> Frame:
    """Parse one whole frame. Raises ``RemoteProtocolError`` for anything malformed."""
    if len(data) > MAX_MEMBERSHIP_FRAME_BYTES:
        raise RemoteProtocolError(1, "frame too large")
    if len(data) < _HEAD.size:
        raise RemoteProtocolError(2, "truncated header")
    version, mtype, reserved, js_len = _HEAD.unpack_from(data, 0)
    if version != WIRE_VERSION:
        raise RemoteProtocolError(3, f"unsupported gossip version {version}")
    if reserved != 0:
        raise RemoteProtocolError(4, "reserved bits set")
    try:
        typ = MsgType(mtype)
    except ValueError:
        raise RemoteProtocolError(5, f"unknown message type {mtype}") from None
    if js_len > MAX_GOSSIP_JSON_BYTES:
        raise RemoteProtocolError(1, "json part too large")
    pos = _HEAD.size
    if pos + js_len + 2 > len(data):
        raise RemoteProtocolError(2, "truncated json")
    try:
        obj = json.loads(data[pos:pos + js_len])
    except (ValueError, UnicodeDecodeError):
        raise RemoteProtocolError(6, "bad json") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(6, "json part is not an object")
    pos += js_len
    (count,) = struct.unpack_from("!H", data, pos)
    pos += 2
    if count > MAX_GOSSIP_BLOBS:
        raise RemoteProtocolError(1, "too many blobs")
    blobs: list[tuple[BlobKind, bytes]] = []
    for _ in range(count):
        if pos + _BLOB.size > len(data):
            raise RemoteProtocolError(2, "truncated blob header")
        kind, blen = _BLOB.unpack_from(data, pos)
        pos += _BLOB.size
        try:
            bkind = BlobKind(kind)
        except ValueError:
            raise RemoteProtocolError(5, f"unknown blob kind {kind}") from None
        if pos + blen > len(data):
            raise RemoteProtocolError(2, "truncated blob")
        blobs.append((bkind, data[pos:pos + blen]))
        pos += blen
    if pos != len(data):
        raise RemoteProtocolError(7, "trailing bytes")
    claims = obj.pop("claims", [])
    if not isinstance(claims, list) or len(claims) > MAX_GOSSIP_CLAIMS:
        raise RemoteProtocolError(8, "bad claims list")
    for c in claims:
        if not (isinstance(c, list) and len(c) == 4 and c[0] in ("suspect", "dead")
                and isinstance(c[1], str) and isinstance(c[2], int) and not isinstance(c[2], bool)
                and c[2] >= 0 and isinstance(c[3], str)):
            raise RemoteProtocolError(8, "bad claim")
    return Frame(typ, obj, claims, blobs)
