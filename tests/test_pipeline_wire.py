"""The stage protocol codec: golden bytes, round trips, strict parsing (property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.pipeline import limits, wire

X2 = np.array([[1.0, -2.0], [0.5, 3.25]], dtype=np.float32)
GOLDEN = [
    (
        wire.Open(0x0102030405060708, 2, 3, 4, bytes(range(32))),
        ("350000004d5001010000080706050403020102000300040020000102030405060708090a0b0c0d0e0f1011121314151617"
        "18191a1b1c1d1e1f"),
    ),
    (wire.Ready(7, 2, 3, 15), "160000004d50010200000700000000000000020003000f000000"),
    (
        wire.Forward(7, 9, (wire.SeqSpan(1, 5, 2),), X2, True),
        ("3e0000004d5001030100070000000000000009000000010001000000000000000500000002000000010202000000020000"
        "000000803f000000c00000003f00005040"),
    ),
    (  # the same step asking the stage to poll for the next frame (FLAG_POLL)
        wire.Forward(7, 9, (wire.SeqSpan(1, 5, 2),), X2, True, True),
        ("3e0000004d5001030300070000000000000009000000010001000000000000000500000002000000010202000000020000"
        "000000803f000000c00000003f00005040"),
    ),
    (
        wire.Result(7, 9, 120, np.array([[0.25, -0.0]], dtype=np.float32), True),
        "280000004d500104010007000000000000000900000078000000010201000000020000000000803e00000080",
    ),
    (wire.Free(7, (1, 2)), "200000004d50010500000700000000000000020001000000000000000200000000000000"),
    (
        wire.Error(9, 5, "sequence 1 is at position 3, asked from 5"),
        ("370000004d5001060000090000000500290073657175656e6365203120697320617420706f736974696f6e20332c206173"
        "6b65642066726f6d2035"),
    ),
    (wire.Keepalive(9), "0a0000004d500107000009000000"),
]


def _same(a: wire.Frame, b: wire.Frame) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__slots__:  # type: ignore[union-attr]
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize(("frame", "hexed"), GOLDEN)
def test_golden_bytes(frame: wire.Frame, hexed: str) -> None:
    assert wire.encode(frame).hex() == hexed
    (back,) = wire.FrameDecoder().feed(bytes.fromhex(hexed))
    assert _same(back, frame)


def test_raw_bits_survive_nan_payloads_and_negative_zero() -> None:
    bits = np.array([[0x7FC00001, 0x80000000, 0x00000001, 0xFF800000]], dtype=np.uint32)
    x = bits.view(np.float32)
    (back,) = wire.FrameDecoder().feed(wire.encode(wire.Result(1, 1, 0, x)))
    assert back.x.view(np.uint32).tolist() == bits.tolist()
    assert back.x.flags.writeable


def test_byte_at_a_time_equals_one_chunk() -> None:
    data = b"".join(wire.encode(f) for f, _ in GOLDEN)
    whole = wire.FrameDecoder().feed(data)
    dec = wire.FrameDecoder()
    parts = [f for i in range(len(data)) for f in dec.feed(data[i : i + 1])]
    assert len(whole) == len(parts) == len(GOLDEN)
    assert all(_same(a, b) for a, b in zip(whole, parts))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:4] + b"XX" + b[6:], "bad frame magic"),
        (lambda b: b[:6] + b"\x09" + b[7:], "unsupported stage protocol version 9"),
        (lambda b: b[:7] + b"\x63" + b[8:], "unknown frame kind 99"),
        (lambda b: b[:8] + b"\x02" + b[9:], "unknown flags"),
        (lambda b: b[:9] + b"\x01" + b[10:], "reserved bits set"),
        (
            lambda b: (int.from_bytes(b[:4], "little") + 1).to_bytes(4, "little") + b[4:] + b"\x00",
            "left over",
        ),
        (lambda b: (0xFFFFFFF0).to_bytes(4, "little") + b[4:], "frame length"),
    ],
)
def test_strict_header_and_body(mutate, reason: str) -> None:  # type: ignore[no-untyped-def]
    good = wire.encode(wire.Ready(7, 2, 3, 15))
    with pytest.raises(wire.RemoteProtocolError, match=reason):
        wire.FrameDecoder().feed(mutate(good))


def test_forward_rows_must_match_the_spans() -> None:
    bad = wire.encode(wire.Forward(1, 1, (wire.SeqSpan(1, 0, 3),), X2))  # 3 positions, 2 rows
    with pytest.raises(wire.RemoteProtocolError, match="do not match"):
        wire.FrameDecoder().feed(bad)


def test_length_is_checked_before_buffering() -> None:
    dec = wire.FrameDecoder(max_frame_bytes=100)
    head = (1000).to_bytes(4, "little") + b"MP\x01\x03\x00\x00"
    with pytest.raises(wire.RemoteProtocolError, match="frame length"):
        dec.feed(head)  # refused from the header alone, nothing else sent
    assert limits.MAX_FRAME_BYTES < 2**32


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_frames_or_protocol_error(data: bytes) -> None:
    def run(chunks: list[bytes]) -> list[wire.Frame] | str:
        dec, out = wire.FrameDecoder(), []
        try:
            for c in chunks:
                out.extend(dec.feed(c))
        except wire.RemoteProtocolError as e:
            return f"error {e.code}"
        return out

    whole = run([data])
    single = run([data[i : i + 1] for i in range(len(data))])
    if isinstance(whole, str) or isinstance(single, str):
        # an error may be found earlier byte by byte (magic), never a frame in one and an error in the other
        assert isinstance(whole, str) and isinstance(single, str)
    else:
        assert len(whole) == len(single) and all(_same(a, b) for a, b in zip(whole, single))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(GOLDEN), st.integers(0, 200), st.integers(0, 255))
def test_mutated_golden_frames_never_escape(item, pos: int, byte: int) -> None:  # type: ignore[no-untyped-def]
    data = bytearray(wire.encode(item[0]))
    data[pos % len(data)] = byte
    try:
        wire.FrameDecoder().feed(bytes(data))
    except wire.RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(GOLDEN), st.binary(max_size=40), st.integers(0, 200))
def test_decode_one_takes_exactly_one_whole_frame(item, junk: bytes, cut: int) -> None:  # type: ignore[no-untyped-def]
    """A direct channel's message (engine.pipeline.direct): exactly one frame, else RemoteProtocolError."""
    data = wire.encode(item[0])
    assert _same(wire.decode_one(data), item[0])
    for bad in (data + data, data[: cut % len(data)], data + (junk or b"\0")):
        with pytest.raises(wire.RemoteProtocolError):
            wire.decode_one(bad)
    with pytest.raises(wire.RemoteProtocolError):  # the direct channel's own bound
        wire.decode_one(data, max_frame_bytes=len(data) - 5)


def _general_decode(data: bytes) -> wire.Frame:
    """``data`` through the general decoder only (header checks, ``decode_body``), not the decode step's fast path."""
    length, magic, version, kind, flags, reserved = wire.HEADER.unpack_from(data)
    if length + 4 != len(data) or magic != wire.MAGIC or version != wire.VERSION or reserved:
        raise wire.RemoteProtocolError(wire.ErrorCode.PROTOCOL, "header")
    return wire.decode_body(kind, flags, memoryview(data)[wire.HEADER.size:])


_U32 = st.integers(0, 2**32 - 1)


@st.composite
def _step_frames(draw: st.DrawFn) -> wire.Frame:
    """A decode step's frames (a one-sequence FORWARD, a RESULT) with any fp32 bits (NaN payloads included)."""
    rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    bits = draw(st.lists(_U32, min_size=rows * cols, max_size=rows * cols))
    x = np.array(bits, dtype=np.uint32).view(np.float32).reshape(rows, cols)
    run, step = draw(st.integers(0, 2**64 - 1)), draw(_U32)
    if draw(st.booleans()):
        span = wire.SeqSpan(draw(st.integers(0, 2**64 - 1)), draw(_U32), rows)
        return wire.Forward(run, step, (span,), x, draw(st.booleans()), draw(st.booleans()))
    return wire.Result(run, step, draw(_U32), x, draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(_step_frames(), st.integers(0, 200), st.integers(0, 255))
def test_the_decode_steps_codec_equals_the_general_one(frame: wire.Frame, pos: int, byte: int) -> None:
    """The one-struct codec of a decode step's frames (``_encode_step``, ``_decode_step``) gives the general
    codec's bytes and frames; a mutated frame it takes is one the general decoder gives the same way (anything
    else it leaves to the general decoder, which says what is wrong)."""
    data = wire._encode_general(frame)
    assert wire._encode_step(frame) == data and wire.encode(frame) == data
    fast = wire._decode_step(data, limits.MAX_FRAME_BYTES)
    assert fast is not None and _same(fast, frame) and _same(_general_decode(data), frame)
    bad = bytearray(data)
    bad[pos % len(bad)] = byte
    got = wire._decode_step(bytes(bad), limits.MAX_FRAME_BYTES)
    if got is not None:
        assert _same(got, _general_decode(bytes(bad)))
    assert wire._decode_step(data, len(data) - 5) is None  # over the bound: the general decoder refuses it
    # the direct channel's forms: the parts joined are the bytes (also with another step number, and from a
    # tensor that is not contiguous), and an owned buffer decodes to a writable view of itself, the same frame
    (head, x), n = wire.step_parts(frame)  # type: ignore[misc]
    assert b"".join((head, x)) == data and n == len(data)
    step = (frame.step + 1) % 2**32
    other = wire._encode_general(type(frame)(**{**{f: getattr(frame, f) for f in frame.__slots__}, "step": step}))
    (head, x), n = wire.step_parts(frame, step)  # type: ignore[misc]
    assert b"".join((head, x)) == other and n == len(other)
    strided = np.repeat(frame.x, 2, axis=1)[:, ::2]
    assert strided.shape[1] == 1 or not strided.flags.c_contiguous
    (head, x), n = wire.step_parts(type(frame)(**{**{f: getattr(frame, f) for f in frame.__slots__},  # type: ignore[misc]
                                               "x": strided}))
    assert b"".join((head, x)) == data and n == len(data)
    # read after its lead (``recv_owned``), the rows are viewed in place, 16-byte aligned; at another offset (a
    # FORWARD's rows 50 bytes in, a RESULT's 36) they are copied, so they are aligned as a copy's either way
    lead = wire.FORWARD_LEAD if isinstance(frame, wire.Forward) else wire.RESULT_LEAD
    for at in (lead, 0, lead + 1):
        buf = bytearray(at) + bytearray(data)
        owned = wire.decode_one(buf, limits.MAX_FRAME_BYTES, owned=True, at=at)
        assert _same(owned, frame) and owned.x.flags.writeable and owned.x.flags.aligned
        assert owned.x.ctypes.data % 16 == 0
        assert np.shares_memory(owned.x, np.frombuffer(buf, np.uint8)) == (at == lead)
        assert not np.shares_memory(wire.decode_one(buf, limits.MAX_FRAME_BYTES, at=at).x, np.frombuffer(buf, np.uint8))
