"""Scheduler: busy signal, batched decode equals unbatched, cancellation, async consumers, failures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from engine_gen_toy import ToyCache, ToyModel

from engine.generate import SamplingParams, generate
from engine.scheduler import Busy, Scheduler, SchedulerClosed
from engine.tiny import create_tiny
from engine.tokenizer import Tokenizer

PROMPTS = ["The mesh wakes", "Rain came in from the west", "Tokens are small", "🙂 你好", "def greet(",
           "The baker on the corner", "Numbers and units:", "A"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.load(create_tiny(tmp_path_factory.mktemp("tiny")))


Make = Callable[..., Scheduler]


@pytest.fixture
def sched_factory() -> Iterator[Make]:
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


@pytest.mark.parametrize("batching", ["always", "auto"])
def test_batched_decode_equals_unbatched(tok: Tokenizer, sched_factory: Make,
                                        batching: str) -> None:
    model = ToyModel(vocab_size=768, gate=threading.Event())
    sched = sched_factory(model, tok, max_active=8, batching=batching)
    handles = [sched.submit(tok.encode(p), _params(i)) for i, p in enumerate(PROMPTS)]
    model.gate.set()  # type: ignore[union-attr]  # all admitted before the first forward
    got = [list(h) for h in handles]
    for i, p in enumerate(PROMPTS):
        want = list(generate(ToyModel(vocab_size=768), tok, tok.encode(p), _params(i)))
        assert got[i] == want, i
    batch_sizes = [n for kind, n in model.calls if kind == "batch"]
    assert sched.batched_steps > 0 and max(batch_sizes) == len(PROMPTS)


def test_busy_when_full(tok: Tokenizer, sched_factory: Make) -> None:
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


def test_bad_request_is_value_error(tok: Tokenizer, sched_factory: Make) -> None:
    sched = sched_factory(ToyModel(vocab_size=768, max_positions=5), tok, max_active=1)
    with pytest.raises(ValueError, match="empty"):
        sched.submit([], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        sched.submit([1] * 5, SamplingParams())
    assert sched.active == 0


def test_cancel_stops_within_one_decode_step(tok: Tokenizer, sched_factory: Make) -> None:
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


def test_async_consumer_and_early_exit_cancels(tok: Tokenizer, sched_factory: Make) -> None:
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


def test_sync_iteration_of_async_handle_is_refused(tok: Tokenizer, sched_factory: Make) -> None:
    sched = sched_factory(ToyModel(vocab_size=768), tok, max_active=1)

    async def main() -> None:
        h = sched.submit([1, 2], SamplingParams(max_tokens=1))
        with pytest.raises(TypeError):
            iter(h)
        [ev async for ev in h]

    asyncio.run(main())


def test_model_failure_ends_with_error_event(tok: Tokenizer, sched_factory: Make) -> None:
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


def test_sequential_mode_gives_the_same_events(tok: Tokenizer, sched_factory: Make) -> None:
    model = ToyModel(vocab_size=768, gate=threading.Event())
    sched = sched_factory(model, tok, max_active=8, batching="never")
    handles = [sched.submit(tok.encode(p), _params(i)) for i, p in enumerate(PROMPTS)]
    model.gate.set()  # type: ignore[union-attr]
    for i, (p, h) in enumerate(zip(PROMPTS, handles)):
        assert list(h) == list(generate(ToyModel(vocab_size=768), tok, tok.encode(p), _params(i)))
    assert sched.batched_steps == 0 and all(kind == "forward" for kind, _ in model.calls)


def test_batching_decision_follows_measured_cost(tok: Tokenizer, sched_factory: Make) -> None:
    sched = sched_factory(ToyModel(vocab_size=768), tok, max_active=8)
    assert sched._use_batch(4)  # nothing measured: try batching first
    sched._cost = {4: 3.0}
    assert not sched._use_batch(4)  # then measure single steps
    sched._cost = {1: 1.0, 4: 3.0}  # a batch of 4 costs less than 4 singles: batch
    sched._decisions = 0
    picks = [sched._use_batch(4) for _ in range(64)]
    assert picks.count(True) == 62  # with an occasional re-check of the other mode
    sched._cost = {1: 1.0, 4: 5.0}  # an MoE batch touching 4x the experts: run singles
    picks = [sched._use_batch(4) for _ in range(64)]
    assert picks.count(False) == 62
    sched._note_cost(4, 0.0)
    assert sched._cost[4] == pytest.approx(4.0)  # moving average, not the last sample


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(tok: Tokenizer, sched_factory: Make) -> None:
    model = ToyModel(vocab_size=768)
    sched = sched_factory(model, tok, max_active=2, prefill_chunk=8)
    short = sched.submit([1, 2, 3], SamplingParams(max_tokens=1_000_000, ignore_eos=True))
    next(iter(short))  # running (until cancelled below)
    long_prompt = list(range(10, 60))  # 50 tokens -> 7 chunks
    h = sched.submit(long_prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    got = list(h)
    short.cancel()
    list(short)
    # Same tokens as a one-shot prefill (the toy model's math is position-by-position).
    assert got == list(generate(ToyModel(vocab_size=768), tok, long_prompt, SamplingParams(max_tokens=3,
                                                                                           ignore_eos=True)))
    prefill_calls = [n for kind, n in model.calls if kind == "forward" and n > 1]
    assert prefill_calls[-7:] == [8, 8, 8, 8, 8, 8, 2]
    # Decode steps of the running request happened between the chunks (it was not stalled).
    first = next(i for i, c in enumerate(model.calls) if c == ("forward", 8))
    last = max(i for i, c in enumerate(model.calls) if c == ("forward", 2))
    assert any(n == 1 for _, n in model.calls[first:last])
    assert h.stats.prefill_s > 0 and h.stats.prompt_tokens == 50


def test_cancel_during_a_long_prefill(tok: Tokenizer, sched_factory: Make) -> None:
    gate = threading.Event()
    model = ToyModel(vocab_size=768, gate=gate)
    sched = sched_factory(model, tok, max_active=1, prefill_chunk=4)
    h = sched.submit(list(range(1, 200)), SamplingParams(max_tokens=5, ignore_eos=True))
    h.cancel()
    gate.set()
    assert [e.finish_reason for e in h] == ["cancelled"]
    assert len(model.calls) <= 1  # at most the chunk already running


class _NaNModel(ToyModel):
    def forward(self, ids, cache, executor=None, *, last_only=False):  # type: ignore[no-untyped-def]
        out = super().forward(ids, cache, executor, last_only=last_only)
        if cache.length > 4:
            out[-1, 3] = np.nan
        return out


def test_non_finite_logits_end_with_an_error(tok: Tokenizer, sched_factory: Make) -> None:
    sched = sched_factory(_NaNModel(vocab_size=768), tok, max_active=1)
    evs = list(sched.submit([1, 2], SamplingParams(max_tokens=20, ignore_eos=True)))
    assert evs[-1].finish_reason == "error" and "non-finite" in (evs[-1].error or "")
    assert all(e.logprob is None or np.isfinite(e.logprob) for e in evs)
    with pytest.raises(FloatingPointError):
        list(generate(_NaNModel(vocab_size=768), tok, [1, 2], SamplingParams(max_tokens=20, ignore_eos=True)))


def test_an_internal_failure_does_not_hang_clients(tok: Tokenizer, sched_factory: Make,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sched = sched_factory(ToyModel(vocab_size=768), tok, max_active=2)

    def broken(*a: object, **k: object) -> None:
        raise KeyError("bug")

    monkeypatch.setattr("engine.scheduler.DecodeState", broken)
    evs = list(sched.submit([1, 2], SamplingParams(max_tokens=3)))
    assert evs[-1].finish_reason == "error" and "bug" in (evs[-1].error or "")
    monkeypatch.undo()
    assert len(list(sched.submit([1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))) == 3



class _PoisonModel(ToyModel):
    """A toy model whose steps fail for one sequence (the one whose prompt starts with ``BAD``) from its fourth
    decode step on, alone or in a batch: a batched step that includes it raises for the whole batch."""

    BAD = 7

    def forward(self, ids: np.ndarray, cache: ToyCache, executor: object = None, *,  # type: ignore[override]
                last_only: bool = False) -> np.ndarray:
        if cache.length == 0:
            cache.poisoned = int(ids[0]) == self.BAD  # type: ignore[attr-defined]
        self._check([cache])
        return super().forward(ids, cache, executor, last_only=last_only)

    def forward_batch(self, ids: np.ndarray, caches: list[ToyCache]) -> np.ndarray:
        self.calls.append(("batch-try", len(ids)))
        self._check(caches)
        return super().forward_batch(ids, caches)

    def _check(self, caches: list[ToyCache]) -> None:
        for c in caches:
            if getattr(c, "poisoned", False) and c.length >= 6:
                raise RuntimeError("poisoned sequence")


@pytest.mark.parametrize("batching", ["always", "auto"])
def test_a_failing_sequence_in_a_batched_step_fails_alone(tok: Tokenizer, sched_factory: Make, batching: str) -> None:
    """One sequence's step raising inside a batched decode step ends that sequence with the error; the others
    of the batch go on to the tokens they give alone (before, every sequence of the batch ended with it)."""
    model = _PoisonModel(vocab_size=768, gate=threading.Event())
    sched = sched_factory(model, tok, max_active=8, batching=batching)
    prompts = [[_PoisonModel.BAD, 1, 2], [1, 2, 3], [4, 5], [9, 9, 9, 9]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    handles = [sched.submit(p, params) for p in prompts]
    model.gate.set()  # type: ignore[union-attr]
    got = [list(h) for h in handles]
    assert got[0][-1].finish_reason == "error" and "poisoned sequence" in (got[0][-1].error or "")
    assert [e.token_id for e in got[0][:-1]] == [e.token_id for e in list(generate(ToyModel(vocab_size=768), tok,
                                                                             prompts[0], params))[:4]]
    for p, evs in zip(prompts[1:], got[1:]):
        assert evs == list(generate(ToyModel(vocab_size=768), tok, p, params))
    calls = model.calls
    failed = [i for i, c in enumerate(calls) if c[0] == "batch-try" and calls[i + 1] != ("batch", c[1])]
    assert len(failed) == 1 and calls[failed[0]][1] > 1  # one batched step raised, with others in it
    assert any(k == "batch" for k, _ in calls[failed[0] + 1 :])  # and batching went on without the failed one


@dataclass
class _RollCache(ToyCache):
    """A toy cache that keeps its past states, so ``truncate`` can put it back."""

    past: list[np.ndarray] = field(default_factory=list)
    poisoned: bool = False

    def truncate(self, n: int) -> None:
        self.state = self.past[n]
        del self.past[n:]
        self.length = n


class _RollingPoisonModel(ToyModel):
    """A toy model with the rolling decode API of a pipeline (``start_one``/``finish_one``, and steps in
    one group: ``decode_groups``/``start_many``). Steps fail for the sequence whose prompt starts with
    ``BAD`` from its fourth decode step on; a group step steps its members in order, so one that includes
    it raises after the members before it were advanced."""

    BAD = 7

    def new_cache(self) -> _RollCache:
        return _RollCache(np.zeros(self.hidden, dtype=np.float32))

    def _step(self, tok: int, cache: _RollCache) -> np.ndarray:  # type: ignore[override]
        if cache.length == 0:
            cache.poisoned = tok == self.BAD
        if cache.poisoned and cache.length >= 6:
            raise RuntimeError("poisoned sequence")
        cache.past.append(cache.state)
        return super()._step(tok, cache)

    def start_one(self, tok: int, cache: _RollCache, executor: object = None) -> np.ndarray:
        self._tick("start_one", 1)
        return self._step(int(tok), cache)

    def finish_one(self, pending: np.ndarray, executor: object = None) -> np.ndarray:
        return pending

    def decode_groups(self, caches: list[_RollCache]) -> int:
        return 1 if len(caches) > 1 else 0

    def start_many(self, toks: list[int], caches: list[_RollCache],
                   executor: object = None) -> list[np.ndarray]:
        self._tick("group", len(toks))
        return [self._step(int(t), c) for t, c in zip(toks, caches)]


def test_a_failing_sequence_in_a_group_step_fails_alone(tok: Tokenizer, sched_factory: Make) -> None:
    """One sequence's step raising inside a group step of the rolling decode (``start_many``) ends that
    sequence with the error; the others, put back where the failed group advanced them, go on to the
    tokens they give alone (before, every sequence of the group ended with the error)."""
    model = _RollingPoisonModel(vocab_size=768, gate=threading.Event())
    sched = sched_factory(model, tok, max_active=8, batching="always")
    prompts = [[1, 2, 3], [_RollingPoisonModel.BAD, 1, 2], [4, 5], [9, 9, 9, 9]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    handles = [sched.submit(p, params) for p in prompts]
    model.gate.set()  # type: ignore[union-attr]
    got = [list(h) for h in handles]
    assert got[1][-1].finish_reason == "error" and "poisoned sequence" in (got[1][-1].error or "")
    alone = [list(generate(ToyModel(vocab_size=768), tok, p, params)) for p in prompts]
    assert [e.token_id for e in got[1][:-1]] == [e.token_id for e in alone[1][:4]]
    for i in (0, 2, 3):
        assert got[i] == alone[i]
    groups = [n for k, n in model.calls if k == "group"]
    last4 = len(groups) - 1 - groups[::-1].index(4)  # the group step that failed: the last one of all four
    assert 3 in groups[last4 + 1 :], groups  # the three others went on stepping in groups
