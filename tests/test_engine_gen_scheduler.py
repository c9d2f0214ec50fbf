"""Scheduler: busy signal, batched decode equals unbatched, cancellation, async consumers, failures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_gen_toy import ToyModel

from engine.generate import SamplingParams, generate
from engine.scheduler import Busy, Scheduler, SchedulerClosed
from engine.tiny import create_tiny
from engine.tokenizer import Tokenizer

PROMPTS = ["The mesh wakes", "Rain came in from the west", "Tokens are small", "🙂 你好", "def greet(",
           "The baker on the corner", "Numbers and units:", "A"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.load(create_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def sched_factory() -> Iterator:  # type: ignore[type-arg]
    made: list[Scheduler] = []

    def make(*args: object, **kw: object) -> Scheduler:
        s = Scheduler(*args, **kw)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=12 + i, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
    return SamplingParams(max_tokens=12 + i, ignore_eos=True, top_logprobs=2)


def test_batched_decode_equals_unbatched(tok: Tokenizer, sched_factory) -> None:  # type: ignore[no-untyped-def]
    model = ToyModel(vocab_size=768, gate=threading.Event())
    sched = sched_factory(model, tok, max_active=8)
    handles = [sched.submit(tok.encode(p), _params(i)) for i, p in enumerate(PROMPTS)]
    model.gate.set()  # type: ignore[union-attr]  # all admitted before the first forward
    got = [list(h) for h in handles]
    for i, p in enumerate(PROMPTS):
        want = list(generate(ToyModel(vocab_size=768), tok, tok.encode(p), _params(i)))
        assert got[i] == want, i
    batch_sizes = [n for kind, n in model.calls if kind == "batch"]
    assert sched.batched_steps > 0 and max(batch_sizes) == len(PROMPTS)


def test_busy_when_full(tok: Tokenizer, sched_factory) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()
    sched = sched_factory(ToyModel(vocab_size=768, gate=gate), tok, max_active=2)
    h1 = sched.submit([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    h2 = sched.submit([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(Busy) as e:
        sched.submit([1, 2], SamplingParams())
    assert e.value.retry_after_s > 0
    gate.set()
    assert len(list(h1)) == 3 and len(list(h2)) == 3
    # Slots are free again.
    assert len(list(sched.submit([1, 2], SamplingParams(max_tokens=2, ignore_eos=True)))) == 2


def test_bad_request_is_value_error(tok: Tokenizer, sched_factory) -> None:  # type: ignore[no-untyped-def]
    sched = sched_factory(ToyModel(vocab_size=768, max_positions=5), tok, max_active=1)
    with pytest.raises(ValueError, match="empty"):
        sched.submit([], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        sched.submit([1] * 5, SamplingParams())
    assert sched.active == 0


def test_cancel_stops_within_one_decode_step(tok: Tokenizer, sched_factory) -> None:  # type: ignore[no-untyped-def]
    model = ToyModel(vocab_size=768)
    sched = sched_factory(model, tok, max_active=4)
    other = sched.submit(tok.encode("other"), SamplingParams(max_tokens=40, ignore_eos=True))
    h = sched.submit(tok.encode("The mesh"), SamplingParams(max_tokens=10_000, ignore_eos=True))
    n, at_cancel = 0, -1
    for ev in h:
        if ev.token_id is not None:
            n += 1
            if n == 5:
                h.cancel()
                at_cancel = h.stats.completion_tokens  # tokens generated when cancel() returned
        else:
            assert ev.finish_reason == "cancelled"
    # At most the decode step already running when cancel() was called finishes; no step starts after it.
    assert at_cancel >= 5 and n <= at_cancel + 1
    assert h.stats.finish_reason == "cancelled"
    assert len(list(other)) == 40  # the other request is unaffected
    assert sched.active == 0


def test_async_consumer_and_early_exit_cancels(tok: Tokenizer, sched_factory) -> None:  # type: ignore[no-untyped-def]
    sched = sched_factory(ToyModel(vocab_size=768), tok, max_active=2)
    want = list(generate(ToyModel(vocab_size=768), tok, tok.encode("Rain"), SamplingParams(max_tokens=12,
                                                                                           ignore_eos=True)))

    async def main() -> tuple[list, int]:  # type: ignore[type-arg]
        h = sched.submit(tok.encode("Rain"), SamplingParams(max_tokens=12, ignore_eos=True))
        got = [ev async for ev in h]
        h2 = sched.submit(tok.encode("Rain"), SamplingParams(max_tokens=100_000, ignore_eos=True))
        async for _ev in h2:
            break  # the client went away
        for _ in range(200):
            if sched.active == 0:
                break
            await asyncio.sleep(0.01)
        return got, sched.active

    got, active = asyncio.run(main())
    assert got == want
    assert active == 0  # the abandoned request was cancelled, not run to 100k tokens


def test_sync_iteration_of_async_handle_is_refused(tok: Tokenizer, sched_factory) -> None:  # type: ignore[no-untyped-def]
    sched = sched_factory(ToyModel(vocab_size=768), tok, max_active=1)

    async def main() -> None:
        h = sched.submit([1, 2], SamplingParams(max_tokens=1))
        with pytest.raises(TypeError):
            iter(h).__next__()
        [ev async for ev in h]

    asyncio.run(main())


def test_model_failure_ends_with_error_event(tok: Tokenizer, sched_factory) -> None:  # type: ignore[no-untyped-def]
    model = ToyModel(vocab_size=768, fail_after=3)
    sched = sched_factory(model, tok, max_active=2)
    evs = list(sched.submit([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    assert evs[-1].finish_reason == "error" and "toy model failure" in (evs[-1].error or "")
    model.fail_after = None
    assert len(list(sched.submit([1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))) == 3  # still alive


def test_close_cancels_and_refuses(tok: Tokenizer) -> None:
    sched = Scheduler(ToyModel(vocab_size=768), tok, max_active=2)
    h = sched.submit([1, 2], SamplingParams(max_tokens=1_000_000, ignore_eos=True))
    next(iter(h))
    sched.close()
    assert list(h)[-1].finish_reason == "cancelled"
    with pytest.raises(SchedulerClosed):
        sched.submit([1], SamplingParams())
