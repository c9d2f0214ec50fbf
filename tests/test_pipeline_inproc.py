"""A pipeline in one process: real stage hosts behind real socket pairs, the real scheduler-facing model.

Parity is byte equality of generated token ids, their logprobs and the text against a local run.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from pathlib import Path

import numpy as np
import pytest

from engine.experts.channel import LoopThread
from engine.generate import generate
from engine.model import Model
from engine.sampling import SamplingParams
from engine.tiny import create_tiny
from engine.tokenizer import Tokenizer
from tests.pipeline_util import InprocProvider

PROMPT = "The mesh holds the layers"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture()
def lt():
    t = LoopThread()
    yield t
    t.stop()


def _run(model, tok, params, ids):
    evs = list(generate(model, tok, ids, params))
    return (
        [e.token_id for e in evs],
        [e.logprob for e in evs],
        [e.top_logprobs for e in evs],
        "".join(e.text for e in evs),
    )


def _cuts(n: int, stages: int) -> list[list[tuple[str, int, int]]]:
    out = []
    for cut in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cut, n]
        out.append([("local" if i == 0 else f"s{i}", bounds[i], bounds[i + 1] - 1) for i in range(stages)])
    return out


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("seed", [None, 7])
def test_every_cut_matches_local(tiny: Path, lt: LoopThread, stages: int, seed: int | None) -> None:
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    ids = tok.encode(PROMPT)
    params = SamplingParams(
        max_tokens=12, temperature=0.0 if seed is None else 0.9, seed=seed, top_logprobs=3, ignore_eos=True
    )
    ref = _run(model, tok, params, ids)
    cuts = _cuts(model.config.num_layers, stages)
    assert len(cuts) == 3
    for plan in cuts:
        prov = InprocProvider(lt, model, tiny, [plan])
        got = _run(prov.pipelined(), tok, params, ids)
        assert got == ref, plan


def test_negative_control_a_flipped_bit_is_seen(tiny: Path, lt: LoopThread) -> None:
    """The parity check can fail: a stage whose weights differ in one element (one bit) gives other logprobs."""
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=2, ignore_eos=True)
    ref = _run(model, tok, params, ids)
    prov = InprocProvider(lt, model, tiny, [[("local", 0, 1), ("s1", 2, 3)]])
    pm = prov.pipelined()
    pm.new_cache()  # opens the run, so the stage has loaded its layers
    part = next(iter(prov.hosts["s1"].parts.values()))
    q = part.layers[0].q.copy()
    # one element with its exponent bit 23 flipped (x2 or /2): a one-ulp change of one weight of this tiny
    # model can round away entirely (it did after session 6's kernels), which would prove nothing
    q.view(np.uint32)[0, 0] ^= np.uint32(1 << 23)
    part.layers[0].q = q
    got = _run(pm, tok, params, ids)
    assert got[1] != ref[1]


def test_stage_killed_mid_generation_recovers_byte_identical(tiny: Path, lt: LoopThread) -> None:
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, top_logprobs=2, ignore_eos=True)
    ref = _run(model, tok, params, ids)
    prov = InprocProvider(
        lt, model, tiny, [[("local", 0, 0), ("s1", 1, 2), ("s2", 3, 3)], [("local", 0, 1), ("s3", 2, 3)]]
    )
    out = []
    gc.disable()  # the recovered sequence is freed when it ends, not when a collection finds its cache
    try:
        for i, ev in enumerate(generate(prov.pipelined(), tok, ids, params)):
            out.append(ev)
            if i == 5:
                prov.kill("s1")
        deadline = time.monotonic() + 5
        while prov.hosts["s3"].live() and time.monotonic() < deadline:  # FREE is sent on the loop
            time.sleep(0.01)
        assert prov.hosts["s3"].live() == 0
    finally:
        gc.enable()
    got = (
        [e.token_id for e in out],
        [e.logprob for e in out],
        [e.top_logprobs for e in out],
        "".join(e.text for e in out),
    )
    assert got == ref
    assert prov.run is not None and [s.node_id for s in prov.run.plan.stages] == ["local", "s3"]
    deadline = time.monotonic() + 5
    while prov.hosts["s2"].live() and time.monotonic() < deadline:  # the survivor frees the old run
        time.sleep(0.01)
    assert prov.hosts["s2"].live() == 0


def test_dropped_cache_frees_every_stage(tiny: Path, lt: LoopThread) -> None:
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    prov = InprocProvider(lt, model, tiny, [[("local", 0, 0), ("s1", 1, 2), ("s2", 3, 3)]])
    pm = prov.pipelined()
    cache = pm.new_cache()
    pm.forward(tok.encode(PROMPT), cache, last_only=True)
    assert prov.hosts["s1"].live() == prov.hosts["s2"].live() == 1
    del cache
    deadline = time.monotonic() + 5
    while (prov.hosts["s1"].live() or prov.hosts["s2"].live()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prov.hosts["s1"].live() == prov.hosts["s2"].live() == 0


def test_no_capacity_left_raises(tiny: Path, lt: LoopThread) -> None:
    from engine.pipeline.client import PipelineUnavailable

    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    prov = InprocProvider(lt, model, tiny, [[("local", 0, 1), ("s1", 2, 3)]])
    pm = prov.pipelined()
    cache = pm.new_cache()
    pm.forward(tok.encode(PROMPT), cache, last_only=True)
    prov.kill("s1")
    with pytest.raises(PipelineUnavailable):
        pm.forward([5], cache, last_only=True)


def test_concurrent_sequences_through_the_scheduler_match_local_one_by_one(
    tiny: Path, lt: LoopThread
) -> None:
    """The scheduler hands every live sequence to forward_batch (in flight across the stages at once);
    each request's output is the one it gets alone on a local model, also when a stage dies meanwhile."""
    from engine.scheduler import Scheduler

    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    prompts = [tok.encode(p) for p in ("one two", "the mesh holds the layers of", "a", "seeded run here")]
    params = [
        SamplingParams(
            max_tokens=20, temperature=0.0 if i % 2 else 0.8, seed=i, top_logprobs=2, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    want = [_run(model, tok, p, ids) for p, ids in zip(params, prompts)]
    prov = InprocProvider(
        lt, model, tiny, [[("local", 0, 0), ("s1", 1, 2), ("s2", 3, 3)], [("local", 0, 1), ("s3", 2, 3)]]
    )
    sched = Scheduler(prov.pipelined(), tok, 8, batching="always")
    try:
        handles = [sched.submit(ids, p) for ids, p in zip(prompts, params)]
        got = []
        for i, h in enumerate(handles):
            evs = []
            for ev in h:
                evs.append(ev)
                if i == 0 and len(evs) == 8:
                    prov.kill("s2")
            got.append(
                (
                    [e.token_id for e in evs],
                    [e.logprob for e in evs],
                    [e.top_logprobs for e in evs],
                    "".join(e.text for e in evs),
                )
            )
        assert got == want
        assert sched.batched_steps > 0
        assert [s.node_id for s in prov.run.plan.stages] == ["local", "s3"]  # type: ignore[union-attr]
    finally:
        sched.close()


def test_rolling_decode_starts_a_sequence_while_others_are_on_the_stages(tiny: Path, lt: LoopThread) -> None:
    """Several sequences decode rolling: a sequence's next step starts as soon as its own result is in,
    while the other sequences' steps are still out (no step boundary where every stage idles), and every
    request's output is still the one it gets alone on a local model."""
    from engine.scheduler import Scheduler

    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    prompts = [tok.encode(p) for p in ("one two", "the mesh holds", "a b c d")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [_run(model, tok, params, ids)[0] for ids in prompts]
    prov = InprocProvider(lt, model, tiny, [[("local", 0, 1), ("s1", 2, 3)]])
    pm = prov.pipelined()
    out: dict[int, int] = {}  # sequence -> steps out now
    done: dict[int, int] = {}  # sequence -> steps taken
    overlapped = []  # (sequence, others out) at each start of a sequence's second or later step
    start, finish = pm.start_one, pm.finish_one

    def start_one(tok_id, cache, executor=None):  # type: ignore[no-untyped-def]
        if done.get(cache.seq):
            overlapped.append(sum(n for s, n in out.items() if s != cache.seq))
        out[cache.seq] = out.get(cache.seq, 0) + 1
        return start(tok_id, cache, executor)

    def finish_one(pending, executor=None):  # type: ignore[no-untyped-def]
        out[pending.cache.seq] -= 1
        done[pending.cache.seq] = done.get(pending.cache.seq, 0) + 1
        return finish(pending, executor)

    pm.start_one, pm.finish_one = start_one, finish_one  # type: ignore[method-assign]
    sched = Scheduler(pm, tok, 8, batching="always")
    try:
        handles = [sched.submit(ids, params) for ids in prompts]
        got = [[e.token_id for e in h] for h in handles]
    finally:
        sched.close()
    assert got == want
    assert max(out.values()) <= 1  # one step out per sequence at most
    # in steady state (all three decoding) a sequence restarts while both others are out
    assert overlapped.count(2) >= 10, overlapped


def _sched_run(model, tok, ids, params, chunk, kill=None):  # type: ignore[no-untyped-def]
    from engine.scheduler import Scheduler

    sched = Scheduler(model, tok, 8, batching="always", prefill_chunk=chunk)
    try:
        evs = list(sched.submit(ids, params))
    finally:
        sched.close()
    return [e.token_id for e in evs], [e.logprob for e in evs], "".join(e.text for e in evs)


def test_chunked_prefill_overlaps_stages_and_matches_local_chunking(tiny: Path, lt: LoopThread) -> None:
    """Prompt chunks go on to the stages without waiting (prefill_nowait); the bits are those of a local
    scheduler with the same chunk size, also when a stage dies while chunks are in flight."""
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    ids = tok.encode("the mesh holds the layers of a model too big for one machine, " * 4)
    assert len(ids) > 40
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=2, top_logprobs=1, ignore_eos=True)
    want = _sched_run(model, tok, ids, params, 8)
    prov = InprocProvider(
        lt, model, tiny, [[("local", 0, 0), ("s1", 1, 2), ("s2", 3, 3)], [("local", 0, 1), ("s3", 2, 3)]]
    )
    pm = prov.pipelined()
    calls = []
    real = pm.prefill_nowait

    def spy(chunk, cache, executor=None):  # type: ignore[no-untyped-def]
        calls.append(len(chunk))
        if len(calls) == 3:
            prov.kill("s1")  # chunks 1-2 may still be on the stages
        return real(chunk, cache, executor)

    pm.prefill_nowait = spy  # type: ignore[method-assign]
    assert _sched_run(pm, tok, ids, params, 8) == want
    assert calls and all(n == 8 for n in calls)
    assert [s.node_id for s in prov.run.plan.stages] == ["local", "s3"]  # type: ignore[union-attr]


def test_serving_node_that_only_embeds(tiny: Path, lt: LoopThread) -> None:
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=2, ignore_eos=True)
    prov = InprocProvider(lt, model, tiny, [[("local", 0, -1), ("s1", 0, 3)]])
    assert _run(prov.pipelined(), tok, params, ids) == _run(model, tok, params, ids)
    assert sorted(prov.hosts["s1"].parts) == [(0, 3)]


def test_a_failing_step_in_start_many_fails_only_its_sequence(tiny: Path, lt: LoopThread) -> None:
    """Sequences stepping alone inside ``start_many`` (a test-sized model has no batch step): one whose step
    cannot start (a token outside the vocabulary) gets its error from its own ``finish_one``; the others' steps
    give the logits of their lone steps (before, start_many raised for all after the first had started)."""
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    prov = InprocProvider(lt, model, tiny, [[("local", 0, 1), ("s1", 2, 3)]])
    pm = prov.pipelined()
    prompts = [tok.encode(p) for p in ("one two", "the mesh holds", "a b c d")]
    caches, ref = [], []
    for ids in prompts:
        c = pm.new_cache()
        pm.forward(ids, c, last_only=True)
        caches.append(c)
        r = model.new_cache()
        model.forward(np.asarray(ids), r, last_only=True)
        ref.append(model.forward(np.asarray([5]), r, last_only=True)[-1])
    started = pm.start_many([5, model.config.vocab_size, 5], caches)
    with pytest.raises(ValueError):
        pm.finish_one(started[1])
    for i in (0, 2):
        assert pm.finish_one(started[i]).tobytes() == ref[i].tobytes()
        assert caches[i].length == len(prompts[i]) + 1
    assert caches[1].length == len(prompts[1])


def test_a_serve_coroutine_closed_unfinished_frees_its_runs_and_awaits_nothing(tiny: Path, lt: LoopThread) -> None:
    """A stage session's coroutine closed while it waits (what the garbage collector does to a task nobody
    holds) frees the runs it opened and awaits nothing in its cleanup: an await there is "coroutine ignored
    GeneratorExit", the session's runs then held until the idle sweep."""
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    prov = InprocProvider(lt, model, tiny, [[("local", 0, 1), ("s1", 2, 3)]])
    pm = prov.pipelined()
    cache = pm.new_cache()
    pm.forward(tok.encode(PROMPT), cache, last_only=True)
    host = prov.hosts["s1"]
    assert host.live() == 1 and len(host.runs) == 1
    (task,) = prov.tasks
    near, far = prov.channels["s1"]

    async def close_it() -> None:
        # the stage's side of the socket full and the serving side not reading: an await on a send in the
        # cleanup would suspend (it does not when the send completes at once)
        near.pause_receiving()
        far._writer.write(bytes(8 << 20))
        task.get_coro().close()  # raises RuntimeError("coroutine ignored GeneratorExit") if the cleanup awaits
        # the task around it is still pending: end it here and take its error ("cannot reuse already awaited
        # coroutine"), or the loop thread's stop would cancel it and log "Task exception was never retrieved"
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        assert task.done()

    lt.run(close_it())
    assert host.live() == 0 and host.runs == {}
