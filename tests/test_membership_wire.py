"""Gossip frame codec: strict parsing, round trips, arbitrary bytes never escape as anything else."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.membership.wire import BlobKind, Frame, MsgType, RemoteProtocolError, decode_frame, encode_frame
from transport.limits import MAX_GOSSIP_BLOBS, MAX_MEMBERSHIP_FRAME_BYTES


def test_roundtrip() -> None:
    f = Frame(MsgType.GOSSIP, {"root": "ab", "l1": ["0"] * 17}, [["suspect", "a" * 32, 3, "b" * 32]],
              [(BlobKind.RECORD, b"xyz"), (BlobKind.REVOCATIONS, b"")])
    g = decode_frame(encode_frame(f))
    assert (g.type, g.fields, g.claims, g.blobs) == (f.type, f.fields, f.claims, f.blobs)


@pytest.mark.parametrize(("mutate", "code"), [
    (lambda b: b"\x02" + b[1:], 3),  # version
    (lambda b: b[:1] + b"\x63" + b[2:], 5),  # unknown type
    (lambda b: b[:2] + b"\x00\x01" + b[4:], 4),  # reserved bits
    (lambda b: b + b"\x00", 7),  # trailing bytes
    (lambda b: b[:-1], 2),  # truncated
    (lambda b: b[:4] + struct.pack("!I", 10**9) + b[8:], 1),  # json length over the limit
])
def test_malformed_frames_are_refused_with_a_code(mutate, code) -> None:  # type: ignore[no-untyped-def]
    good = encode_frame(Frame(MsgType.PING, {"seq": 1, "target": "x"}, blobs=[(BlobKind.RECORD, b"r")]))
    with pytest.raises(RemoteProtocolError) as info:
        decode_frame(mutate(good))
    assert info.value.code == code


def test_limits_checked_before_parsing() -> None:
    with pytest.raises(RemoteProtocolError, match="too large"):
        decode_frame(b"\x01" * (MAX_MEMBERSHIP_FRAME_BYTES + 1))
    many = encode_frame(Frame(MsgType.DELTA, blobs=[(BlobKind.RECORD, b"")] * (MAX_GOSSIP_BLOBS + 1)))
    with pytest.raises(RemoteProtocolError, match="too many blobs"):
        decode_frame(many)
    bad_claim = encode_frame(Frame(MsgType.GOSSIP, claims=[["alive", "a", 1, "b"]]))
    with pytest.raises(RemoteProtocolError, match="bad claim"):
        decode_frame(bad_claim)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_a_frame_or_protocol_error(data: bytes) -> None:
    try:
        decode_frame(data)
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.integers(0, 10_000))
def test_mutated_valid_frames_never_raise_anything_else(junk: bytes, pos: int) -> None:
    good = encode_frame(Frame(MsgType.GOSSIP, {"root": "1"}, [["dead", "a" * 32, 1, "b" * 32]],
                              [(BlobKind.RECORD, b"abc")]))
    p = pos % len(good)
    try:
        decode_frame(good[:p] + junk + good[p + len(junk):])
    except RemoteProtocolError:
        pass


def test_core_survives_garbage_from_a_member() -> None:
    from membership_helpers import Mesh
    m = Mesh(2)
    a, b = m.names
    for junk in (b"", b"\x01\x04\x00\x00\x00\x00\x00\x02{}\x00\x00", b"\x01\x04\x00\x00\x00\x00\x00\x02[]\x00\x00",
                 encode_frame(Frame(MsgType.DIGEST, {"buckets": ["x"], "entries": [[1, 2]]})),
                 encode_frame(Frame(MsgType.DELTA, {"want": [None, 5]})),
                 encode_frame(Frame(MsgType.ACK, {"seq": "no"})),
                 encode_frame(Frame(MsgType.GOSSIP, {"root": 1, "l1": [1] * 17}))):
        m.cores[a].receive(b, junk, 0.0)
    assert m.cores[a].stats["bad_frames"] >= 1
