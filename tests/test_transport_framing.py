"""Framing codec: every frame type, every rejection branch, golden bytes, property tests."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import limits
from transport.framing import (
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameType,
    RemoteProtocolError,
    decode_error,
    encode_error,
    encode_frame,
    encode_preamble,
)
from transport.streams import MAX_FRAME_BYTES, StreamType

APP_TYPES = [FrameType.DATA, FrameType.ERROR]
HS_TYPES = [FrameType.HELLO, FrameType.AUTH, FrameType.ACCEPT, FrameType.JOIN_REQUEST, FrameType.JOIN_REPLY]


def test_enums_are_append_only() -> None:
    assert {t.name: t.value for t in StreamType} == {
        "HANDSHAKE": 0, "GOSSIP": 1, "RPC": 2, "HTTP_TUNNEL": 3, "EXPERT": 4, "JOIN": 5, "PIPELINE": 6,
    }
    assert {t.name: t.value for t in FrameType} == {
        "DATA": 0, "ERROR": 1, "HELLO": 2, "AUTH": 3, "ACCEPT": 4, "JOIN_REQUEST": 5, "JOIN_REPLY": 6,
        "PROOF": 7,
    }
    assert [c.value for c in ErrorCode] == list(range(len(ErrorCode)))
    assert ErrorCode.NO_HANDLER == 20 and ErrorCode.HANDSHAKE_TIMEOUT == 7


def test_golden_frame_header_and_preamble() -> None:
    assert encode_preamble(StreamType.RPC, 1) == bytes.fromhex("6d730201")
    assert encode_preamble(StreamType.JOIN, 1) == b"ms\x05\x01"
    assert encode_frame(FrameType.DATA, b"hi") == bytes.fromhex("6d6401000000000002") + b"hi"
    assert encode_frame(FrameType.ERROR, encode_error(7, "no")) == (
        bytes.fromhex("6d6401010000000004") + b"\x00\x07no"
    )
    assert encode_frame(FrameType.ACCEPT, b"") == bytes.fromhex("6d6401040000000000")
    assert len(encode_frame(FrameType.DATA, b"")) == limits.FRAME_HEADER_BYTES


@pytest.mark.parametrize("stream_type", list(StreamType))
def test_every_frame_type_roundtrips_on_its_streams(stream_type: StreamType) -> None:
    types = HS_TYPES if stream_type in (StreamType.HANDSHAKE, StreamType.JOIN) else APP_TYPES
    wire = encode_preamble(stream_type, 1)
    frames = [Frame(t, bytes([i]) * (i * 7)) for i, t in enumerate(types)]
    for f in frames:
        wire += encode_frame(f.type, f.payload)
    dec = FrameDecoder(None)
    assert dec.feed(wire) == frames
    assert dec.stream_type is stream_type and dec.protocol_version == 1
    dec.feed_eof()


def test_frame_of_exactly_the_limit_is_accepted() -> None:
    limit = MAX_FRAME_BYTES[StreamType.HANDSHAKE]
    dec = FrameDecoder(StreamType.HANDSHAKE)
    assert dec.feed(encode_frame(FrameType.HELLO, b"x" * limit)) == [Frame(FrameType.HELLO, b"x" * limit)]


def _header(magic: bytes = b"md", version: int = 1, ftype: int = 0, flags: int = 0, length: int = 0) -> bytes:
    return struct.pack(">2sBBBI", magic, version, ftype, flags, length)


@pytest.mark.parametrize(
    ("data", "code", "fragment"),
    [
        (b"xx" + b"\x02\x01", ErrorCode.PROTOCOL_ERROR, "preamble magic"),
        (b"x", ErrorCode.PROTOCOL_ERROR, "preamble magic"),  # rejected before the preamble is complete
        (b"ms\x20\x01", ErrorCode.UNKNOWN_STREAM_TYPE, "unknown stream type 32"),
        (b"ms\xff\x01", ErrorCode.UNKNOWN_STREAM_TYPE, "unknown stream type 255"),
        (b"ms\x02\x00", ErrorCode.UNSUPPORTED_VERSION, "protocol version 0"),
        (b"ms\x02\x02", ErrorCode.UNSUPPORTED_VERSION, "protocol version 2"),
        (b"ms\x02\x01" + _header(magic=b"mX"), ErrorCode.PROTOCOL_ERROR, "frame magic"),
        (b"ms\x02\x01" + b"q", ErrorCode.PROTOCOL_ERROR, "frame magic"),  # partial header, wrong magic
        (b"ms\x02\x01" + _header(version=2), ErrorCode.UNSUPPORTED_VERSION, "framing version 2"),
        (b"ms\x02\x01" + _header(ftype=8), ErrorCode.PROTOCOL_ERROR, "unknown frame type 8"),
        (b"ms\x02\x01" + _header(ftype=7), ErrorCode.PROTOCOL_ERROR, "PROOF not allowed on a RPC"),
        (b"ms\x02\x01" + _header(ftype=2), ErrorCode.PROTOCOL_ERROR, "HELLO not allowed on a RPC"),
        (b"ms\x00\x01" + _header(ftype=0), ErrorCode.PROTOCOL_ERROR, "DATA not allowed on a HANDSHAKE"),
        (b"ms\x02\x01" + _header(flags=1), ErrorCode.PROTOCOL_ERROR, "reserved frame flags"),
        (b"ms\x02\x01" + _header(flags=0x80), ErrorCode.PROTOCOL_ERROR, "reserved frame flags"),
        (
            b"ms\x00\x01" + _header(ftype=2, length=limits.MAX_HANDSHAKE_FRAME_BYTES + 1),
            ErrorCode.FRAME_TOO_LARGE,
            "exceeds",
        ),
        (b"ms\x02\x01" + _header(length=0xFFFFFFFF), ErrorCode.FRAME_TOO_LARGE, "exceeds"),
    ],
)
def test_rejections(data: bytes, code: ErrorCode, fragment: str) -> None:
    dec = FrameDecoder(None)
    with pytest.raises(RemoteProtocolError) as err:
        dec.feed(data)
    assert err.value.code is code
    assert fragment in err.value.reason
    with pytest.raises(RemoteProtocolError):  # the decoder stays dead
        dec.feed(b"")


def test_oversize_rejected_from_the_header_without_the_payload() -> None:
    dec = FrameDecoder(StreamType.GOSSIP)
    with pytest.raises(RemoteProtocolError) as err:
        dec.feed(_header(length=limits.MAX_GOSSIP_FRAME_BYTES + 1))  # no payload bytes at all
    assert err.value.code is ErrorCode.FRAME_TOO_LARGE
    assert dec.buffered_bytes == 0


def test_limits_differ_per_stream_type() -> None:
    size = limits.MAX_GOSSIP_FRAME_BYTES + 1
    assert FrameDecoder(StreamType.EXPERT).feed(_header(length=size)) == []  # fine for experts, waits
    with pytest.raises(RemoteProtocolError):
        FrameDecoder(StreamType.GOSSIP).feed(_header(length=size))


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "before its preamble"),
        (b"ms\x02", "before its preamble"),
        (b"ms\x02\x01" + _header(length=5) + b"abc", "inside a frame"),
        (b"ms\x02\x01" + _header()[:5], "inside a frame"),
    ],
)
def test_truncated_stream(data: bytes, fragment: str) -> None:
    dec = FrameDecoder(None)
    dec.feed(data)
    with pytest.raises(RemoteProtocolError) as err:
        dec.feed_eof()
    assert fragment in err.value.reason and err.value.code is ErrorCode.PROTOCOL_ERROR


def test_exact_consumption_and_split_frames() -> None:
    wire = encode_frame(FrameType.DATA, b"abc") + encode_frame(FrameType.DATA, b"") + encode_frame(
        FrameType.DATA, b"z" * 100
    )
    dec = FrameDecoder(StreamType.RPC)
    out = dec.feed(wire[:10]) + dec.feed(wire[10:13]) + dec.feed(wire[13:])
    assert [f.payload for f in out] == [b"abc", b"", b"z" * 100]
    assert dec.buffered_bytes == 0
    dec.feed_eof()


def test_error_payload() -> None:
    assert decode_error(encode_error(513, "bad thing")) == (513, "bad thing")
    assert len(encode_error(1, "x" * 1000)) == 2 + limits.MAX_REFUSAL_REASON_BYTES
    with pytest.raises(RemoteProtocolError):
        decode_error(b"\x00")
    with pytest.raises(RemoteProtocolError):
        decode_error(b"\x00\x01" + b"x" * (limits.MAX_REFUSAL_REASON_BYTES + 1))


def test_encoder_refuses_oversize_payload() -> None:
    with pytest.raises(ValueError):
        encode_frame(FrameType.DATA, b"x" * 11, max_payload=10)


def _decode_all(chunks: list[bytes], stream_type: StreamType | None) -> tuple[list[Frame], RemoteProtocolError | None]:
    dec = FrameDecoder(stream_type)
    frames: list[Frame] = []
    try:
        for chunk in chunks:
            frames += dec.feed(chunk)
        dec.feed_eof()
    except RemoteProtocolError as e:
        return frames, e
    return frames, None


def _valid_streams() -> st.SearchStrategy[bytes]:
    frame = st.tuples(st.sampled_from(APP_TYPES), st.binary(max_size=64)).map(lambda t: encode_frame(*t))
    return st.lists(frame, max_size=5).map(lambda fs: encode_preamble(StreamType.RPC, 1) + b"".join(fs))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), _valid_streams(), _valid_streams().map(lambda b: b[:-1])))
def test_property_arbitrary_bytes_give_frames_or_protocol_error(data: bytes) -> None:
    whole, err = _decode_all([data], None)
    for frame in whole:
        assert isinstance(frame, Frame) and isinstance(frame.payload, bytes)
    bytewise, err2 = _decode_all([data[i : i + 1] for i in range(len(data))], None)
    assert bytewise == whole
    assert (err is None) == (err2 is None)
    if err is not None and err2 is not None:
        assert (err.code, err.reason) == (err2.code, err2.reason)


@settings(max_examples=200, deadline=None)
@given(_valid_streams(), st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_property_any_chunking_equals_one_chunk(data: bytes, cuts: list[int]) -> None:
    chunks, pos = [], 0
    for c in cuts:
        chunks.append(data[pos : pos + c])
        pos += c
    chunks.append(data[pos:])
    assert _decode_all(chunks, None) == _decode_all([data], None)
    frames, err = _decode_all([data], None)
    assert err is None
    assert b"".join(encode_frame(f.type, f.payload) for f in frames) == data[4:]
