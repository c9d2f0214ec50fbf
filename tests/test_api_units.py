"""Pure parts of the API: request validation, stop sequences, routing tables, tunnel frame parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.api.errors import ApiError
from meshd.api.reply import StopMatcher, TokenOut
from meshd.api.router import NodeInfo, PeerStats, Target, choose_auto, cost_ms, plan, routable_models
from meshd.api.schema import parse_request
from meshd.api.server import ensure_safe_bind, key_matches
from meshd.api.tunnel import TunnelFrame, TunnelProtocolError, decode, encode
from meshd.errors import UsageError


def _chat(**kw: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return json.dumps(body).encode()


@pytest.mark.parametrize("kw,param", [
    ({"n": 2}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": ""}, "model"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_chat_validation_rejects(kw: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as ei:
        parse_request("chat", _chat(**kw))
    assert ei.value.status == 400 and ei.value.param == param


def test_chat_validation_accepts_and_fills() -> None:
    r = parse_request("chat", _chat(max_tokens=5, temperature=0, seed=3, stop="x", logprobs=True, top_logprobs=2,
                                    stream=True, stream_options={"include_usage": True}, n=1, user="u"))
    assert (r.max_tokens, r.temperature, r.seed, r.stop, r.logprobs, r.top_logprobs, r.include_usage) == \
        (5, 0.0, 3, ["x"], True, 2, True)


def test_completion_prompt_forms_and_logprobs() -> None:
    assert parse_request("completion", b'{"model":"m","prompt":"a"}').prompt == "a"
    assert parse_request("completion", b'{"model":"m","prompt":["a"]}').prompt == "a"
    assert parse_request("completion", b'{"model":"m","prompt":[1,2]}').prompt == [1, 2]
    r = parse_request("completion", b'{"model":"m","prompt":"a","logprobs":3}')
    assert r.logprobs and r.top_logprobs == 3
    for bad in (b'{"model":"m","prompt":["a","b"]}', b'{"model":"m","prompt":5}',
                b'{"model":"m","prompt":"a","logprobs":6}', b'[1]', b'{', b'\xff'):
        with pytest.raises(ApiError) as ei:
            parse_request("completion", bad)
        assert ei.value.status == 400


def _toks(*texts: str) -> list[TokenOut]:
    return [TokenOut(t, -0.1) for t in texts]


def _run(stops: list[str], texts: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = ""
    for t in _toks(*texts):
        emitted, stopped = m.push(t)
        out += "".join(e.text for e in emitted)
        if stopped:
            return out, True
    return out + "".join(e.text for e in m.flush()), False


@pytest.mark.parametrize("stops,texts,want", [
    ([], ["a", "b"], ("ab", False)),
    (["END"], ["he", "llo E", "N", "D more"], ("hello ", True)),
    (["END"], ["he", "llo E", "N", "x"], ("hello ENx", False)),
    (["xy", "b"], ["a", "b", "c"], ("a", True)),
    (["lo"], ["hel", "lo"], ("hel", True)),
])
def test_stop_matcher(stops: list[str], texts: list[str], want: tuple[str, bool]) -> None:
    assert _run(stops, texts) == want


def test_stop_matcher_holds_back_possible_prefix() -> None:
    m = StopMatcher(["END"])
    emitted, stopped = m.push(TokenOut("abc E"))
    assert emitted == [] and not stopped  # " E" might begin END: whole token held
    emitted, stopped = m.push(TokenOut("x"))
    assert "".join(t.text for t in emitted) == "abc Ex" and not stopped


A = NodeInfo("a", "serve", ("m",), in_flight=0, capacity=4)
B = NodeInfo("b", "serve", ("m",), in_flight=0, capacity=4, rtt_ms=1.0)
C = NodeInfo("c", "serve", ("m", "k"), in_flight=3, capacity=4, rtt_ms=1.0)
CL = NodeInfo("x", "client", ("m",), in_flight=0, capacity=4)


@pytest.mark.parametrize("local,peers,want", [
    (A, [B, C], [("a", True), ("b", False), ("c", False)]),  # local first when it has room
    (NodeInfo("a", "serve", ("m",), 4, 4), [B, C], [("b", False), ("c", False), ("a", True)]),  # overloaded: last
    (None, [C, B], [("b", False), ("c", False)]),  # lower load wins
    (None, [CL], []),  # never route to clients
    (None, [NodeInfo("b", "serve", ("m",), 4, 4), C], [("c", False), ("b", False)]),  # saturated after free
    (NodeInfo("a", "client", (), 0, 1), [B], [("b", False)]),
])
def test_plan_table(local: NodeInfo | None, peers: list[NodeInfo], want: list[tuple[str, bool]]) -> None:
    assert plan("m", local, peers) == [Target(n, loc) for n, loc in want]


def test_plan_uses_measured_latency() -> None:
    fast, slow = NodeInfo("s1", "serve", ("m",), 0, 1, 1.0), NodeInfo("s2", "serve", ("m",), 0, 1, 1.0)
    stats = {"s1": PeerStats(ttfb_ms=200.0), "s2": PeerStats(ttfb_ms=20.0)}
    assert [t.node_id for t in plan("m", None, [fast, slow], stats)] == ["s2", "s1"]
    assert cost_ms(fast, stats["s1"]) == 201.0
    rate = {"s1": PeerStats(ttfb_ms=20.0, tok_per_s=10.0), "s2": PeerStats(ttfb_ms=20.0, tok_per_s=100.0)}
    assert [t.node_id for t in plan("m", None, [fast, slow], rate)] == ["s2", "s1"]  # faster decode wins
    assert cost_ms(slow, rate["s2"]) == 1.0 + 20.0 + 640.0


def test_models_and_auto() -> None:
    assert routable_models(None, [B, C, CL]) == {"m": ["b", "c"], "k": ["c"]}
    assert choose_auto(None, [B, C, CL]) == "m"  # served by most nodes
    assert choose_auto(NodeInfo("a", "serve", ("k",), 0, 1), [B, C]) == "k"  # local with room first
    assert choose_auto(None, [CL]) is None


def test_key_compare_and_bind_rule() -> None:
    assert key_matches(b"k2", [b"k1", b"k2"]) and not key_matches(b"k", [b"k1", b"k2"])
    ensure_safe_bind("127.0.0.1", False)
    ensure_safe_bind("::1", False)
    ensure_safe_bind("0.0.0.0", True)
    with pytest.raises(UsageError):
        ensure_safe_bind("0.0.0.0", False)


def test_tunnel_frames_roundtrip() -> None:
    assert decode(encode(TunnelFrame.REQUEST_HEAD, {"method": "POST", "path": "/v1/x"})) == \
        (TunnelFrame.REQUEST_HEAD, {"method": "POST", "path": "/v1/x"})
    assert decode(encode(TunnelFrame.BODY, b"abc")) == (TunnelFrame.BODY, b"abc")
    assert decode(encode(TunnelFrame.HEARTBEAT)) == (TunnelFrame.HEARTBEAT, None)
    for bad in (b"", b"\x01", b"\x02\x02", b"\x01\x63", b"\x01\x07x", b"\x01\x04{}", b"\x01\x01[]",
                b"\x01\x04" + json.dumps({"status": 200, "headers": {"a": 1}}).encode(),
                b"\x01\x01" + json.dumps({"method": "DELETE", "path": "/"}).encode(),
                b"\x01\x05" + json.dumps({"status": 200, "message": "x"}).encode()):
        with pytest.raises(TunnelProtocolError):
            decode(bad)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_tunnel_decode_never_raises_anything_else(data: bytes) -> None:
    try:
        ftype, _ = decode(data)
    except TunnelProtocolError:
        return
    assert isinstance(ftype, TunnelFrame)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(TunnelFrame)), st.binary(max_size=32))
def test_tunnel_decode_typed_prefix(ftype: TunnelFrame, payload: bytes) -> None:
    try:
        got, _ = decode(bytes((1, int(ftype))) + payload)
    except TunnelProtocolError:
        return
    assert got == ftype


def test_plan_puts_recently_failed_peers_last() -> None:
    b, c = NodeInfo("b", "serve", ("m",), 0, 4), NodeInfo("c", "serve", ("m",), 3, 4)
    stats = {"b": PeerStats(failed_at=100.0)}
    assert [t.node_id for t in plan("m", None, [b, c], stats, now=110.0)] == ["c", "b"]
    assert [t.node_id for t in plan("m", None, [b, c], stats, now=200.0)] == ["b", "c"]  # penalty expired


def test_coalescing_keeps_slow_streams_per_token_and_batches_fast_ones() -> None:
    import asyncio

    from meshd.api.tunnel import _coalesced

    async def gen(n: int, delay: float, fail: bool = False):  # type: ignore[no-untyped-def]
        for i in range(n):
            yield b"%03d," % i
            await asyncio.sleep(delay)
        if fail:
            raise ApiError(500, "boom")

    async def collect(n: int, delay: float) -> list[bytes]:
        return [c async for c in _coalesced(gen(n, delay))]

    slow = asyncio.run(collect(10, 0.01))
    assert slow == [b"%03d," % i for i in range(10)]  # one frame per chunk, nothing delayed
    fast = asyncio.run(collect(2000, 0.0))
    assert b"".join(fast) == b"".join(b"%03d," % i for i in range(2000))  # nothing lost or reordered
    assert len(fast) < 200  # batched

    async def failing() -> None:
        async for _ in _coalesced(gen(3, 0.0, fail=True)):
            pass

    with pytest.raises(ApiError):
        asyncio.run(failing())
