"""One node over real HTTP with the official ``openai`` client: engine-style backend (the seeded stand-in
generator) and the ``openai:URL`` backend in front of a stand-in server process; errors, keys, limits,
metrics, an external server that is down or slow, client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest

from api_helpers import LoopThread, StandInProcess
from api_standin import StandInSource, prompt_ids_of, standin_words
from meshd.api.backends import GenBackend, OpenAIBackend
from meshd.api.schema import parse_request
from meshd.api.server import ApiConfig, ApiServer

MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def standin() -> Iterator[StandInProcess]:
    p = StandInProcess("ext-a,ext-b", max_active=64)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def node(loop: LoopThread, standin: StandInProcess) -> Iterator[ApiServer]:
    """A node serving an engine-style model 'gen' (max 2 at once) and the external server's models."""
    src = StandInSource("gen", max_active=2)
    ext = OpenAIBackend(standin.url, first_byte_timeout_s=1.5, idle_timeout_s=1.0, health_interval_s=0.5)
    server = ApiServer(ApiConfig("node-1", extra_fields=frozenset({"standin"})), [GenBackend(src), ext])
    loop.run(server.start("127.0.0.1", 0))
    server.src = src  # type: ignore[attr-defined]
    yield server
    loop.run(server.stop())


def _client(server: ApiServer, key: str = "none", **kw: object) -> openai.OpenAI:
    assert server.address is not None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.address[1]}/v1", api_key=key, max_retries=0, **kw)


def _ref_chat(text_msgs: list[dict[str, str]], seed: int | None, n: int) -> str:
    req = parse_request("chat", json.dumps({"model": "x", "messages": text_msgs}).encode())
    return "".join(t for _, t, _ in standin_words(prompt_ids_of(req), seed, n))


@pytest.mark.parametrize("model", ["gen", "ext-a"])
def test_chat_sync_stream_and_not(node: ApiServer, model: str) -> None:
    c = _client(node)
    raw = c.chat.completions.with_raw_response.create(model=model, messages=MSGS, max_tokens=6, seed=7)
    assert raw.headers["x-meshd-node"] == "node-1" and raw.headers["x-meshd-route"] == "local"
    r = raw.parse()
    assert r.choices[0].message.content == _ref_chat(MSGS, 7, 6)
    assert r.model == model and r.usage is not None and r.usage.completion_tokens == 6
    chunks = list(c.chat.completions.create(model=model, messages=MSGS, max_tokens=6, seed=7, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == _ref_chat(MSGS, 7, 6)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("model", ["gen", "ext-b"])
def test_completions_logprobs_async(node: ApiServer, model: str) -> None:
    assert node.address is not None

    async def go() -> None:
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{node.address[1]}/v1", api_key="x", max_retries=0)
        r = await c.completions.create(model=model, prompt="abc", max_tokens=4, logprobs=2, seed=1)
        ref = standin_words(list(b"abc"), 1, 4)
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens == [t for _, t, _ in ref]
        assert lp.token_logprobs == [x for _, _, x in ref]
        assert lp.top_logprobs is not None and all(len(d) == 2 for d in lp.top_logprobs)
        stream = await c.completions.create(model=model, prompt="abc", max_tokens=4, seed=1, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        assert text == "".join(t for _, t, _ in ref)
        await c.close()

    asyncio.run(go())


def test_chat_logprobs_and_stop(node: ApiServer) -> None:
    c = _client(node)
    full = _ref_chat(MSGS, 3, 8)
    r = c.chat.completions.create(model="gen", messages=MSGS, max_tokens=8, seed=3, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 8
    assert all(len(t.top_logprobs) == 3 for t in lp.content)
    stop = full.split()[2]
    r = c.chat.completions.create(model="gen", messages=MSGS, max_tokens=8, seed=3, stop=[" " + stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(" " + stop)]


def test_models_and_auto(node: ApiServer) -> None:
    c = _client(node)
    assert sorted(m.id for m in c.models.list().data) == ["ext-a", "ext-b", "gen"]
    r = c.chat.completions.create(model="auto", messages=MSGS, max_tokens=2)
    assert r.model in ("ext-a", "ext-b", "gen")


def test_error_codes(node: ApiServer) -> None:
    c = _client(node)
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="nope", messages=MSGS)
    assert "ext-a" in str(nf.value) and "gen" in str(nf.value)
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="gen", messages=MSGS, n=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="gen", prompt="x", logprobs=9)


def test_raw_http_errors_and_body_limit(loop: LoopThread, node: ApiServer) -> None:
    assert node.address is not None
    base = f"http://127.0.0.1:{node.address[1]}"

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/chat/completions", data=b"{not json") as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
            big = json.dumps({"model": "gen", "messages": [{"role": "user", "content": "x" * (5 << 20)}]})
            async with s.post(base + "/v1/chat/completions", data=big) as r:
                assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"
            async with s.get(base + "/v1/nothing") as r:
                err = (await r.json())["error"]
                assert r.status == 404 and err["code"] == "unknown_url"  # not "model_not_found": no model named
            async with s.get(base + "/health") as r:
                assert (await r.json())["status"] == "ok"

    asyncio.run(go())


def test_overloaded_is_429_with_retry_after(loop: LoopThread, node: ApiServer) -> None:
    assert node.address is not None
    url = f"http://127.0.0.1:{node.address[1]}/v1/chat/completions"
    slow = {"model": "gen", "messages": MSGS, "max_tokens": 2, "standin": {"think_s": 1.0}}
    gen = next(b for b in node.backends if "gen" in b.models())

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            busy = [asyncio.create_task(s.post(url, json=slow)) for _ in range(2)]
            # both slots taken before the third asks (a fixed 0.3 s sleep was a race on a loaded machine)
            deadline = time.monotonic() + 10
            while gen.in_flight() < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert gen.in_flight() == 2
            async with s.post(url, json=dict(slow, standin={})) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["type"] == "rate_limit_error"
            for t in busy:
                (await t).release()

    asyncio.run(go())


def test_stream_failure_is_an_error_event(node: ApiServer) -> None:
    c = _client(node)
    for model in ("gen", "ext-a"):
        got = []
        with pytest.raises(openai.APIError) as ei:
            for ch in c.chat.completions.create(model=model, messages=MSGS, max_tokens=8, stream=True,
                                                extra_body={"standin": {"fail_after": 3}}):
                got.append(ch)
        assert "failed" in str(ei.value)
        assert len([ch for ch in got if ch.choices and ch.choices[0].delta.content]) == 3


def test_slow_external_backend_times_out(node: ApiServer) -> None:
    c = _client(node)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as ei:
        c.chat.completions.create(model="ext-a", messages=MSGS, max_tokens=2, extra_body={"standin": {"think_s": 5}})
    assert ei.value.status_code == 502 and time.monotonic() - t0 < 4
    with pytest.raises(openai.APIError):  # silent mid-stream: error event after the idle timeout
        for _ in c.chat.completions.create(model="ext-a", messages=MSGS, max_tokens=3, stream=True,
                                           extra_body={"standin": {"token_delay_s": 3}}):
            pass


def test_external_backend_down_serves_nothing(loop: LoopThread) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    ext = OpenAIBackend(f"http://127.0.0.1:{port}/v1", health_interval_s=0.2, health_timeout_s=0.5)
    server = ApiServer(ApiConfig("node-2", extra_fields=frozenset({"standin"})), [ext])
    loop.run(server.start("127.0.0.1", 0))
    try:
        c = _client(server)
        assert c.models.list().data == []  # no phantom models
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="ext-a", messages=MSGS)
    finally:
        loop.run(server.stop())


def test_external_backend_comes_and_goes(loop: LoopThread) -> None:
    p = StandInProcess("late")
    ext = OpenAIBackend(p.url, health_interval_s=0.2, health_timeout_s=0.5, alias="renamed")
    server = ApiServer(ApiConfig("node-3", extra_fields=frozenset({"standin"})), [ext])
    loop.run(server.start("127.0.0.1", 0))
    try:
        c = _client(server)
        assert [m.id for m in c.models.list().data] == ["renamed"]
        r = c.chat.completions.create(model="renamed", messages=MSGS, max_tokens=2)
        assert r.model == "renamed"
        chunks = list(c.chat.completions.create(model="renamed", messages=MSGS, max_tokens=2, stream=True))
        assert all(ch.model == "renamed" for ch in chunks)
        p.stop()
        deadline = time.monotonic() + 5
        while c.models.list().data and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.models.list().data == []  # gone from the listing at once (no phantoms) ...
        with pytest.raises(openai.APIStatusError) as ei:  # ... but still known: 503, retry later
            c.chat.completions.create(model="renamed", messages=MSGS)
        assert ei.value.status_code == 503 and ei.value.response.headers["Retry-After"] == "5"
    finally:
        p.stop()
        loop.run(server.stop())


def test_api_keys(loop: LoopThread) -> None:
    server = ApiServer(ApiConfig("node-k", extra_fields=frozenset({"standin"}), api_keys=[b"secret-1", b"secret-2"]), [GenBackend(StandInSource("g"))])
    loop.run(server.start("127.0.0.1", 0))
    try:
        with pytest.raises(openai.AuthenticationError):
            _client(server, "wrong").chat.completions.create(model="g", messages=MSGS)
        with pytest.raises(openai.AuthenticationError):
            _client(server, "wrong").models.list()
        assert _client(server, "secret-2").chat.completions.create(model="g", messages=MSGS, max_tokens=1)
    finally:
        loop.run(server.stop())


def test_client_disconnect_cancels_generation(loop: LoopThread, node: ApiServer) -> None:
    assert node.address is not None
    src: StandInSource = node.src  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{node.address[1]}/v1/chat/completions"
    before = src.cancelled

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            r = await s.post(url, json={"model": "gen", "messages": MSGS, "max_tokens": 1000, "stream": True,
                                        "standin": {"token_delay_s": 0.05}})
            await r.content.readline()
            r.close()  # drop the connection mid-stream
        deadline = time.monotonic() + 3
        while src.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(go())
    assert src.active == 0 and src.cancelled == before + 1


def test_metrics(node: ApiServer) -> None:
    assert node.address is not None
    _client(node).chat.completions.create(model="gen", messages=MSGS, max_tokens=2)
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{node.address[1]}/metrics").read().decode()
    for name in ("meshd_api_requests_total", "meshd_api_tokens_total", "meshd_api_request_seconds_bucket",
                 "meshd_api_in_flight", "meshd_route_decisions_total", "meshd_api_errors_total", "meshd_peers"):
        assert name in text, name
    assert 'meshd_api_requests_total{code="200",endpoint="chat",route="local"}' in text


def test_disconnect_while_external_server_thinks_releases_slot(loop: LoopThread, node: ApiServer) -> None:
    assert node.address is not None
    ext = node.backends[1]
    url = f"http://127.0.0.1:{node.address[1]}/v1/chat/completions"

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(url, json={"model": "ext-a", "messages": MSGS, "max_tokens": 1,
                                                         "standin": {"think_s": 1.0}}))
            deadline = time.monotonic() + 3
            while ext.in_flight() == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert ext.in_flight() == 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        deadline = time.monotonic() + 3
        while ext.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    asyncio.run(go())
    assert ext.in_flight() == 0


def test_external_stream_cut_without_done_is_an_error_event(loop: LoopThread) -> None:
    """An external server that closes a stream early (no [DONE], no error event) is reported, not hidden."""
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "cut", "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "cut",
                 "choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)

    async def start() -> tuple[web.AppRunner, int]:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    runner, port = loop.run(start())
    server = ApiServer(ApiConfig("node-cut", extra_fields=frozenset({"standin"})), [OpenAIBackend(f"http://127.0.0.1:{port}/v1")])
    loop.run(server.start("127.0.0.1", 0))
    try:
        got = []
        with pytest.raises(openai.APIError) as ei:
            for ch in _client(server).chat.completions.create(model="cut", messages=MSGS, stream=True):
                got.append(ch)
        assert "ended the stream early" in str(ei.value) and len(got) == 1
    finally:
        loop.run(server.stop())
        loop.run(runner.cleanup())
