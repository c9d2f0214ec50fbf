"""Expert RPC codec: golden bytes for every message, mutation detection, strict parsing, property tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from engine import limits

from engine.experts import rpc

FP = bytes(range(32))

# Golden vectors: (message, request id, exact bytes[, header flags]). Any change in the wire format breaks these.
GOLDEN = {
    # coordinator -> worker
    "hello": (
        rpc.Hello(fingerprint=FP, min_version=1, max_version=1, max_message_bytes=1 << 20, max_rows=512), 1,
        "4d58010100000000010000002a0000000101000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
        "00001000000200008a40a33a"),
    "request": (
        rpc.ExpertRequest(layer=3, x=np.array([[1.0, -2.0], [0.5, 0.25]], dtype=np.float32),
                          pairs=np.array([[0, 1], [1, 1], [1, 4]], dtype=np.uint32)), 7,
        "4d58010300000000070000003900000003000000010200000002000000030000000000803f000000c00000003f0000803e"
        "0000000001000000010000000100000001000000040000009ed56296"),
    "hello_v2": (  # a v2 coordinator's hello: same layout, offers versions 1-2
        rpc.Hello(fingerprint=FP, max_version=2, max_message_bytes=1 << 20, max_rows=512), 1,
        "4d58010100000000010000002a0000000102000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
        "000010000002000028f7ead9"),
    "request_combine": (  # v2: row 1 (experts 4 then 1) is combined here, row 0's pair goes back raw
        rpc.ExpertCombineRequest(layer=3, x=np.array([[1.0, -2.0], [0.5, 0.25]], dtype=np.float32),
                                 pairs=np.array([[0, 1], [1, 1], [1, 4]], dtype=np.uint32),
                                 rows=np.array([1], dtype=np.uint32),
                                 experts=np.array([[4, 1]], dtype=np.uint32),
                                 weights=np.array([[0.75, 0.25]], dtype=np.float32)), 8,
        "4d580208000000000800000055000000030000000102000000020000000300000002000000010000000000803f000000c0"
        "0000003f0000803e0000000001000000010000000100000001000000040000000100000004000000010000000000403f"
        "0000803e4a3a870b"),
    "echo": (rpc.Echo(b"ping"), 9, "4d58010600000000090000000400000070696e67f220838e"),
    "hello_v3": (  # a v3 coordinator's hello: offers versions 1-3
        rpc.Hello(fingerprint=FP, max_version=3, max_message_bytes=1 << 20, max_rows=512), 1,
        "4d58010100000000010000002a0000000103000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
        "00001000000200008967fd31"),
    "hello_v4": (  # a v4 coordinator's hello: offers versions 1-4
        rpc.Hello(fingerprint=FP, max_version=4, max_message_bytes=1 << 20, max_rows=512), 1,
        "4d58010100000000010000002a0000000104000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
        "00001000000200002d9e08c4"),
    "hello_v5": (  # this coordinator's hello: offers versions 1-5 (v5: it parses ERROR LOADING)
        rpc.Hello(fingerprint=FP, max_message_bytes=1 << 20, max_rows=512), 1,
        ("4d58010100000000010000002a0000000105000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
         "00001000000200008c0e1f2c")),
    "request_poll": (  # v3: a decode row's request with FLAG_POLL (flags 0x0001 in the header)
        rpc.ExpertRequest(layer=3, x=np.array([[1.0, -2.0]], dtype=np.float32),
                          pairs=np.array([[0, 1], [0, 4]], dtype=np.uint32)), 10,
        "4d580103010000000a0000002900000003000000010100000002000000020000000000803f000000c00000000001000000"
        "0000000004000000b3e5cb0f", rpc.FLAG_POLL),
    "echo_poll": (rpc.Echo(b"ping"), 11, "4d580106010000000b0000000400000070696e67fc2fd0cc", rpc.FLAG_POLL),
    # worker -> coordinator
    "hello_ack": (
        rpc.HelloAck(version=1, fingerprint=FP, capacity=2.5,
                     ranges=(rpc.ShardRange(0, 3, 0, 7), rpc.ShardRange(5, 5, 2, 3)),
                     max_message_bytes=1 << 20, max_rows=512), 1,
        "4d58010200000000010000005500000001000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
        "0000100000020000000000000000044002000000000000000300000000000000070000000500000005000000020000000300"
        "00007b0b7461"),
    "hello_ack_v4": (  # v4: the ranges, then numerics_len u8 (0x28 = 40) and the worker's numerics tag
        rpc.HelloAck(version=4, fingerprint=FP, capacity=2.5, ranges=(rpc.ShardRange(0, 3, 0, 7),),
                     max_message_bytes=1 << 20, max_rows=512, numerics="kernels=numpy;numpy=2.4.6;blas=x:Haswell"), 1,
        "4d58010200000000010000006e00000004000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
        "000010000002000000000000000004400100000000000000030000000000000007000000286b65726e656c733d6e756d7079"
        "3b6e756d70793d322e342e363b626c61733d783a48617377656c6c54f12366"),
    "reply": (
        rpc.ExpertReply(layer=3, out=np.array([[1.5, 2.0], [-0.0, 3.0], [1e-6, 7.0]], dtype=np.float32),
                        compute_us=42), 7,
        "4d5801040000000007000000280000000300000003000000020000002a0000000000c03f000000400000008000004040bd37"
        "86350000e04062363626"),
    "error": (
        rpc.ErrorMsg(code=rpc.ErrorCode.NOT_HELD, text="layer 3 expert 4 is not held here", layer=3, expert=4), 7,
        "4d58010500000000070000002d0000000400030000000400000021006c617965722033206578706572742034206973206e6f"
        "742068656c6420686572658ebbe6f5"),
    "reply_combined": (  # v2: one combined row, then the raw pair
        rpc.ExpertCombinedReply(layer=3, combined=np.array([[1.5, 2.0]], dtype=np.float32),
                                out=np.array([[-0.0, 3.0]], dtype=np.float32), compute_us=42), 8,
        "4d580209000000000800000024000000030000000100000001000000020000002a0000000000c03f00000040000000800000"
        "40405bc040b3"),
    "echo_reply": (rpc.EchoReply(b"ping"), 9, "4d58010700000000090000000400000070696e67b1eb2509"),
}


def _same(a: rpc.Message, b: rpc.Message) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, rpc.ExpertRequest):
        assert isinstance(b, rpc.ExpertRequest)
        return a.layer == b.layer and a.x.tobytes() == b.x.tobytes() and a.pairs.tobytes() == b.pairs.tobytes()
    if isinstance(a, rpc.ExpertReply):
        assert isinstance(b, rpc.ExpertReply)
        return a.layer == b.layer and a.compute_us == b.compute_us and a.out.tobytes() == b.out.tobytes()
    if isinstance(a, rpc.ExpertCombineRequest):
        assert isinstance(b, rpc.ExpertCombineRequest)
        fields = ("x", "pairs", "rows", "experts", "weights")
        return a.layer == b.layer and all(getattr(a, f).tobytes() == getattr(b, f).tobytes() for f in fields)
    if isinstance(a, rpc.ExpertCombinedReply):
        assert isinstance(b, rpc.ExpertCombinedReply)
        return (a.layer == b.layer and a.compute_us == b.compute_us and a.out.tobytes() == b.out.tobytes()
                and a.combined.tobytes() == b.combined.tobytes())
    return a == b


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_encode_and_decode(name: str) -> None:
    msg, rid, hexed, *flagged = GOLDEN[name]
    flags = flagged[0] if flagged else 0
    assert rpc.encode(msg, rid, flags).hex() == hexed
    env = rpc.decode(bytes.fromhex(hexed))
    assert env.request_id == rid
    assert env.flags == flags
    assert _same(env.message, msg)


def test_row_request_encoder_sets_the_poll_flag_like_encode() -> None:
    msg, rid, hexed, flags = GOLDEN["request_poll"]
    assert isinstance(msg, rpc.ExpertRequest)
    assert rpc.encode_row_request(msg.layer, msg.x, [int(e) for _, e in msg.pairs], rid, flags).hex() == hexed


@pytest.mark.parametrize("name", ["hello", "hello_ack", "reply", "error", "echo_reply", "reply_combined"])
def test_poll_flag_is_refused_on_other_message_types(name: str) -> None:
    msg, rid, hexed = GOLDEN[name]
    with pytest.raises(ValueError, match="flags"):
        rpc.encode(msg, rid, rpc.FLAG_POLL)
    data = bytes.fromhex(hexed)
    with pytest.raises(rpc.ExpertProtocolError, match="flags"):
        rpc.decode(_reframe(data[3], data[16:-4], rid, version=data[2], flags=rpc.FLAG_POLL))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_mutating_any_byte_is_detected(name: str) -> None:
    data = bytes.fromhex(GOLDEN[name][2])
    for i in range(len(data)):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= flip
            with pytest.raises(rpc.ExpertProtocolError):
                rpc.decode(bytes(bad))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_truncation_and_trailing_bytes_are_detected(name: str) -> None:
    data = bytes.fromhex(GOLDEN[name][2])
    for n in range(len(data)):
        with pytest.raises(rpc.ExpertProtocolError):
            rpc.decode(data[:n])
    with pytest.raises(rpc.ExpertProtocolError):
        rpc.decode(data + b"\x00")


def _reframe(mtype: int, payload: bytes, rid: int = 1, version: int = 1, flags: int = 0) -> bytes:
    """A frame with a valid checksum around an arbitrary payload: tests the semantic checks."""
    import struct
    import zlib

    header = struct.pack("<2sBBHHII", b"MX", version, mtype, flags, 0, rid, len(payload))
    return header + payload + zlib.crc32(header + payload).to_bytes(4, "little")


def test_semantic_violations_raise_protocol_error() -> None:
    import struct

    x = np.zeros((2, 2), dtype="<f4").tobytes()
    head = struct.pack("<IBIII", 0, 1, 2, 2, 2)
    cases = {
        "unsorted pairs": head + x + np.array([[0, 4], [1, 1]], dtype="<u4").tobytes(),
        "duplicate pair": head + x + np.array([[0, 1], [0, 1]], dtype="<u4").tobytes(),
        "row outside x": head + x + np.array([[0, 1], [2, 1]], dtype="<u4").tobytes(),
        "unused row": head + x + np.array([[0, 1], [0, 2]], dtype="<u4").tobytes(),
        "bad dtype": struct.pack("<IBIII", 0, 2, 2, 2, 2) + x + np.array([[0, 1], [1, 1]], dtype="<u4").tobytes(),
        "zero rows": struct.pack("<IBIII", 0, 1, 0, 2, 0),
    }
    for why, payload in cases.items():
        with pytest.raises(rpc.ExpertProtocolError):
            rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST, payload))
        assert why
    good = head + x + np.array([[0, 1], [1, 1]], dtype="<u4").tobytes()
    assert isinstance(rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST, good)).message, rpc.ExpertRequest)
    assert rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST, good, flags=1)).flags == rpc.FLAG_POLL
    for bits in (2, 0x8000, 3):
        with pytest.raises(rpc.ExpertProtocolError, match="reserved"):
            rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST, good, flags=bits))
    with pytest.raises(ValueError, match="flags"):
        rpc.encode(rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST, good)).message, 1, 2)
    with pytest.raises(rpc.ExpertProtocolError, match="version"):
        rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST, good, version=2))
    with pytest.raises(rpc.ExpertProtocolError, match="unknown message type"):
        rpc.decode(_reframe(99, good))
    with pytest.raises(rpc.ExpertProtocolError, match="capacity"):
        ack = rpc.encode(GOLDEN["hello_ack"][0], 1)
        body = bytearray(ack[16:-4])
        body[1 + 32 + 8: 1 + 32 + 16] = struct.pack("<d", float("nan"))
        rpc.decode(_reframe(rpc.MsgType.HELLO_ACK, bytes(body)))


def test_combine_request_semantic_violations_raise_protocol_error() -> None:
    import struct

    x = np.zeros((2, 2), dtype="<f4").tobytes()
    pairs = np.array([[0, 1], [1, 1], [1, 4]], dtype="<u4").tobytes()

    def payload(rows: list[int], experts: list[list[int]], weights: list[list[float]], k: int = 2,
                pairs: bytes = pairs, npairs: int = 3) -> bytes:
        head = struct.pack("<IBIIIII", 0, 1, 2, 2, npairs, k, len(rows))
        slots = np.array(rows, dtype="<u4").tobytes() + np.array(experts, dtype="<u4").tobytes()
        return head + x + pairs + slots + np.array(weights, dtype="<f4").tobytes()

    cases = {
        "row outside x": payload([2], [[4, 1]], [[0.5, 0.5]]),
        "rows not ascending": payload([1, 1], [[4, 1], [4, 1]], [[0.5, 0.5], [0.5, 0.5]]),
        "a slot expert has no pair": payload([1], [[4, 2]], [[0.5, 0.5]]),
        "repeated slot expert": payload([1], [[4, 4]], [[0.5, 0.5]]),
        "row has a pair outside its slots": payload([1], [[4]], [[1.0]], k=1),
        "row missing a slot": payload([0], [[1, 4]], [[0.5, 0.5]]),
        "nan weight": payload([1], [[4, 1]], [[float("nan"), 0.5]]),
        "inf weight": payload([1], [[4, 1]], [[0.5, float("-inf")]]),
        "zero top_k": payload([], [], [], k=0),
        "no combined row": payload([], [], []),
        "unsorted pairs": payload([1], [[4, 1]], [[0.5, 0.5]], pairs=np.array([[1, 4], [0, 1], [1, 1]],
                                                                                dtype="<u4").tobytes()),
    }
    for why, body in cases.items():
        with pytest.raises(rpc.ExpertProtocolError):
            rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST_COMBINE, body, version=2))
        assert why
    good = payload([1], [[4, 1]], [[0.5, 0.5]])
    env = rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST_COMBINE, good, version=2))
    assert isinstance(env.message, rpc.ExpertCombineRequest)
    assert env.message.slot_pairs().tolist() == [[2, 1]]
    assert env.message.raw_mask().tolist() == [True, False, False]
    with pytest.raises(rpc.ExpertProtocolError, match="version"):  # a v2 type in a v1 header
        rpc.decode(_reframe(rpc.MsgType.EXPERT_REQUEST_COMBINE, good, version=1))
    reply = rpc.encode(GOLDEN["reply_combined"][0], 1)
    with pytest.raises(rpc.ExpertProtocolError, match="version"):
        rpc.decode(_reframe(rpc.MsgType.EXPERT_REPLY_COMBINED, reply[16:-4], version=1))


def test_combined_reply_without_raw_pairs_round_trips() -> None:
    msg = rpc.ExpertCombinedReply(layer=1, combined=np.ones((2, 3), dtype=np.float32),
                                  out=np.zeros((0, 3), dtype=np.float32))
    env = rpc.decode(rpc.encode(msg, 5))
    assert _same(env.message, msg)


def test_length_is_checked_before_buffering() -> None:
    import struct

    header = struct.pack("<2sBBHHII", b"MX", 1, 3, 0, 0, 1, 1 << 30)
    dec = rpc.MessageDecoder(max_message_bytes=1 << 20)
    with pytest.raises(rpc.ExpertProtocolError) as e:
        dec.feed(header)
    assert e.value.code == rpc.ErrorCode.TOO_LARGE


def test_stream_of_messages_byte_at_a_time_equals_one_chunk() -> None:
    stream = b"".join(bytes.fromhex(g[2]) for g in GOLDEN.values())
    whole = rpc.MessageDecoder().feed(stream)
    dec = rpc.MessageDecoder()
    pieces = []
    for i in range(len(stream)):
        pieces += dec.feed(stream[i:i + 1])
    assert len(whole) == len(pieces) == len(GOLDEN)
    for a, b in zip(whole, pieces):
        assert a.request_id == b.request_id and a.flags == b.flags and _same(a.message, b.message)
    for a, (msg, rid, _, *flagged) in zip(whole, GOLDEN.values()):
        assert a.request_id == rid and a.flags == (flagged[0] if flagged else 0) and _same(a.message, msg)


def _outcome(feed: list[bytes]) -> list[tuple[int, bytes]] | str:
    dec = rpc.MessageDecoder(max_message_bytes=1 << 16)
    out = []
    try:
        for chunk in feed:
            for env in dec.feed(chunk):
                out.append((env.request_id, rpc.encode(env.message, env.request_id)))
    except rpc.ExpertProtocolError as e:
        return f"error {e.code}"
    return out


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_messages_or_protocol_error(data: bytes) -> None:
    whole = _outcome([data])
    bytewise = _outcome([data[i:i + 1] for i in range(len(data))])
    assert whole == bytewise


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(GOLDEN)), st.integers(0, 10_000), st.binary(max_size=8))
def test_golden_with_random_corruption(name: str, pos: int, junk: bytes) -> None:
    orig = bytes.fromhex(GOLDEN[name][2])
    data = bytearray(orig)
    pos %= len(data)
    data[pos:pos + len(junk)] = junk
    res = _outcome([bytes(data)])
    if bytes(data) == orig:
        assert isinstance(res, list) and len(res) == 1
    elif bytes(data).startswith(orig):
        assert isinstance(res, str) or len(res) == 1  # trailing junk is the start of the next message
    else:
        assert isinstance(res, str) or res == []  # detected, or waiting for bytes that never come


def test_request_groups_are_the_work_items() -> None:
    msg = GOLDEN["request"][0]
    assert isinstance(msg, rpc.ExpertRequest)
    groups = msg.groups()
    assert [(e, r.tolist()) for e, r in groups] == [(1, [0, 1]), (4, [1])]


def test_error_text_is_bounded_and_never_split() -> None:
    long = "é" * 5000
    env = rpc.decode(rpc.encode(rpc.ErrorMsg(rpc.ErrorCode.INTERNAL, long), 3))
    assert isinstance(env.message, rpc.ErrorMsg)
    assert len(env.message.text.encode()) <= 1024 and set(env.message.text) == {"é"}


def _verdict(check, pairs: np.ndarray, rows: int) -> tuple[str, object]:  # type: ignore[no-untyped-def]
    try:
        return "ok", [(e, r.dtype.str, r.tolist()) for e, r in check(pairs, rows)]
    except rpc.ExpertProtocolError as e:
        return "bad", str(e)


@st.composite
def _valid_pairs(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Pairs strictly ascending by (expert, row), as a coordinator sends them; x has rows up to the
    largest one used (valid when every row in between is used too, else refused for the unused row)."""
    experts = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8, unique=True))
    pairs = sorted({(r, e) for e in experts for r in draw(st.sets(st.integers(0, 5), min_size=1))},
                   key=lambda p: (p[1], p[0]))
    return np.array(pairs, dtype=np.uint32).reshape(-1, 2), max(r for r, _ in pairs) + 1


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    _valid_pairs(),
    st.tuples(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5)), min_size=1, max_size=12).map(
        lambda ps: np.array(ps, dtype=np.uint32).reshape(-1, 2)), st.integers(1, 6)),
))
def test_small_request_checks_and_groups_match_the_numpy_ones(case: tuple[np.ndarray, int]) -> None:
    """A decode-sized request is checked and grouped in Python (``_small_pairs``); it must give exactly the
    verdict (the same error) and groups as the numpy path every larger request takes."""
    pairs, rows = case
    small = _verdict(lambda p, n: rpc._small_pairs(p.tolist(), n), pairs, rows)
    assert small == _verdict(rpc._large_pairs, pairs, rows)


def test_small_and_large_requests_both_round_trip_with_their_groups() -> None:
    rng = np.random.default_rng(3)
    for rows, experts in ((1, 4), (40, 8)):  # 4 pairs (Python path), 320 pairs (numpy path)
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        pairs = np.array([(r, e) for e in range(experts) for r in range(rows)], dtype=np.uint32)
        assert (len(pairs) <= rpc.SMALL_PAIRS) == (rows == 1)
        got = rpc.decode(rpc.encode(rpc.ExpertRequest(layer=2, x=x, pairs=pairs), 9)).message
        assert isinstance(got, rpc.ExpertRequest) and got.work is not None
        assert [(e, r.tolist()) for e, r in got.groups()] == [(e, list(range(rows))) for e in range(experts)]
        assert [(e, r.tolist()) for e, r in got.groups()] == [(e, r.tolist()) for e, r in rpc._groups(pairs)]


@st.composite
def _combine_case(draw: st.DrawFn) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray, int]:
    """Checked pairs plus combine fields that are often right and sometimes wrong in each way."""
    pairs, rows = draw(_valid_pairs())
    k = draw(st.integers(1, 3))
    per_row: dict[int, list[int]] = {}
    for r, e in pairs.tolist():
        per_row.setdefault(r, []).append(e)
    candidates = sorted(r for r, es in per_row.items() if len(es) == k) or [0]
    crow = sorted(draw(st.sets(st.sampled_from(candidates), min_size=1)))
    if draw(st.booleans()):  # sometimes a bad row list: unsorted, repeated or out of x
        crow = draw(st.lists(st.integers(0, rows), min_size=1, max_size=3))
    experts = []
    for c in crow:
        es = (per_row.get(c, []) + [0] * k)[:k]
        if draw(st.booleans()):
            es = draw(st.permutations(es))  # slot order is any order of the row's experts
        if draw(st.integers(0, 5)) == 0:
            es[0] = draw(st.integers(0, 2**32 - 1))  # an expert the row has no pair for (or a repeat)
        experts.append(es)
    weights = [[draw(st.sampled_from([0.25, 0.5, 1.0, float("inf"), float("nan")])) if draw(st.integers(0, 6)) == 0
                else 0.5 for _ in range(k)] for _ in crow]
    return (pairs, rows, np.array(crow, dtype=np.uint32), np.array(experts, dtype=np.uint32).reshape(len(crow), k),
            np.array(weights, dtype=np.float32).reshape(len(crow), k), k)


def _combine_verdict(check, *args) -> tuple[str, object, object]:  # type: ignore[no-untyped-def]
    try:
        slots, raw = check(*args)
        return "ok", (slots.dtype.str, slots.tolist()), (raw.dtype.str, raw.tolist())
    except rpc.ExpertProtocolError as e:
        return "bad", str(e), None


@settings(max_examples=400, deadline=None)
@given(_combine_case())
def test_small_combine_checks_match_the_numpy_ones(case: tuple) -> None:  # type: ignore[type-arg]
    """A decode-sized combine request is checked in Python (``_small_combine``): the same verdicts (the same
    error), slot map and raw mask as the numpy path of larger requests."""
    pairs, rows, crow, experts, weights, k = case
    small = _combine_verdict(rpc._small_combine, pairs.tolist(), rows, crow.tolist(), experts.tolist(),
                             weights.tolist(), k)
    assert small == _combine_verdict(rpc._large_combine, pairs, rows, crow, experts, weights, k)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 2**32 - 1), st.integers(1, 48),
       st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8, unique=True).map(sorted), st.integers(0, 2**31))
def test_one_row_request_encoder_gives_the_generic_bytes(layer: int, rid: int, dim: int, experts: list[int],
                                                         seed: int) -> None:
    """A decode step's request is encoded without the message object (``encode_row_request``): byte for
    byte what ``encode`` makes of the same ``ExpertRequest``, and it decodes to the same groups."""
    x = np.random.default_rng(seed).standard_normal((1, dim)).astype(np.float32)
    data = rpc.encode_row_request(layer, x, experts, rid)
    pairs = np.array([(0, e) for e in experts], dtype=np.uint32).reshape(-1, 2)
    assert data == rpc.encode(rpc.ExpertRequest(layer=layer, x=x, pairs=pairs), rid)
    got = rpc.decode(data)
    assert got.request_id == rid and [(e, r.tolist()) for e, r in got.message.groups()] == [(e, [0]) for e in experts]


@pytest.mark.parametrize("layer, rid, experts", [(2**32, 1, [0]), (-1, 1, [0]), (0, 2**32, [0]), (0, 1, [2**32]),
                                                 (0, 1, [-1])])
def test_one_row_request_encoder_refuses_what_does_not_fit(layer: int, rid: int, experts: list[int]) -> None:
    x = np.zeros((1, 4), dtype=np.float32)
    with pytest.raises(ValueError):
        rpc.encode_row_request(layer, x, experts, rid)
    with pytest.raises(ValueError):
        rpc.encode_row_request(0, np.zeros((2, 4), dtype=np.float32), [0], 1)  # not one row


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(1, 9), st.integers(1, 48),
       st.integers(0, 2**40), st.integers(0, 2**31))
def test_reply_built_in_place_gives_the_generic_bytes(layer: int, rid: int, pairs: int, dim: int, us: int,
                                                      seed: int) -> None:
    """A decode step's reply is computed into its message (``ReplyBuffer``): byte for byte what ``encode``
    makes of the same ``ExpertReply`` (compute time clamped alike), and it decodes to the outputs."""
    out = np.random.default_rng(seed).standard_normal((pairs, dim)).astype(np.float32)
    buf = rpc.ReplyBuffer(layer, pairs, dim, rid)
    buf.out[...] = out
    data = bytes(buf.finish(us))
    assert data == rpc.encode(rpc.ExpertReply(layer=layer, out=out, compute_us=us), rid)
    got = rpc.decode(data)
    assert got.request_id == rid and got.message.out.tobytes() == out.tobytes()


def test_reply_buffer_refuses_what_does_not_fit() -> None:
    for args in ((2**32, 1, 4, 1), (0, 1, 4, 2**32), (0, 0, 4, 1), (0, 1, 0, 1),
                 (0, limits.EXPERT_MAX_MESSAGE_BYTES // 4, 2, 1)):
        with pytest.raises(ValueError):
            rpc.ReplyBuffer(*args)
