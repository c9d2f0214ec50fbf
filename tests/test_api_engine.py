"""The engine behind the API (the built-in ``tiny`` model): chat through its chat template, completions
with logprobs, greedy output equal to ``engine.generate`` run directly (the local reference), busy -> 429,
client disconnect cancels the scheduler's request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest

from api_helpers import LoopThread
from meshd.api.engine_backend import EngineSource, load_engine_backend
from meshd.api.server import ApiConfig, ApiServer

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def tiny(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    backend = load_engine_backend("tiny", tmp_path_factory.mktemp("state"), max_active=2)
    server = ApiServer(ApiConfig("tiny-node"), [backend])
    loop.run(server.start("127.0.0.1", 0))
    yield server
    loop.run(server.stop())


def _client(server: ApiServer) -> openai.OpenAI:
    assert server.address is not None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.address[1]}/v1", api_key="x", max_retries=0)


def _source(server: ApiServer) -> EngineSource:
    src = server.backends[0].source  # type: ignore[attr-defined]
    assert isinstance(src, EngineSource)
    return src


def _reference(src: EngineSource, ids: list[int], n: int) -> str:
    from engine.generate import generate
    from engine.sampling import SamplingParams

    evs = list(generate(src.model, src.tokenizer, ids, SamplingParams(max_tokens=n, temperature=0.0)))
    return "".join(e.text for e in evs)


def test_chat_uses_template_and_matches_engine(tiny: ApiServer) -> None:
    src = _source(tiny)
    ids = src.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True)
    c = _client(tiny)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == _reference(src, ids, 8)
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert text == _reference(src, ids, 8)


def test_completions_logprobs(tiny: ApiServer) -> None:
    src = _source(tiny)
    r = _client(tiny).completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(1 <= len(d) <= 3 for d in lp.top_logprobs)
    assert r.choices[0].text == _reference(src, src.tokenizer.encode("Once upon"), 5)
    with pytest.raises(openai.BadRequestError):  # longer than the context
        _client(tiny).completions.create(model="tiny", prompt=[5] * 5000, max_tokens=1)


def test_busy_and_disconnect_cancel(tiny: ApiServer) -> None:
    assert tiny.address is not None
    url = f"http://127.0.0.1:{tiny.address[1]}/v1/completions"
    sched = _source(tiny).scheduler
    long = {"model": "tiny", "prompt": "go", "max_tokens": 3000, "stream": True, "temperature": 0}

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            rs = [await s.post(url, json=long) for _ in range(2)]
            for r in rs:
                await r.content.readline()
            async with s.post(url, json=dict(long, stream=False)) as r3:
                assert r3.status == 429 and r3.headers["Retry-After"]
            for r in rs:
                r.close()
        deadline = time.monotonic() + 3
        while sched.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sched.active == 0

    asyncio.run(go())


def test_async_client_streams_tiny(tiny: ApiServer) -> None:
    src = _source(tiny)
    ids = src.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True)
    assert tiny.address is not None

    async def go() -> str:
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny.address[1]}/v1", api_key="x", max_retries=0)
        s = await c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
        await c.close()
        return text

    assert asyncio.run(go()) == _reference(src, ids, 6)
