"""The serving node's side of a pipeline: stage links, runs, and a model object the scheduler drives.

A ``Run`` is one plan put to work: this node's layer range (a view of the loaded model) and one
``StageLink`` (a PIPELINE stream, opened with OPEN/READY) per remote stage, in layer order. The serving
node embeds, runs its range, then hands the activations to each stage in turn and gets them back (a star:
every hop starts and ends here, so a failure is seen here at once); the last stage answers logits.

``PipelinedModel`` has the shape of ``engine.model.Model`` that ``engine.scheduler`` and
``engine.generate`` use (``config``, ``new_cache``, ``forward(ids, cache, executor, last_only=)``). Each
sequence's ``PipeCache`` stays on the run that was current when it started (the plan changes only between
requests) and remembers the token chunks it was fed. When a stage fails mid-step, the provider re-plans onto
the remaining capacity, the chunks are replayed with the same shapes (so the rebuilt caches hold the same
bits), and the step runs again: the output is the same as if nothing had happened. No capacity: the step
raises ``PipelineUnavailable``. A cache that is dropped (sequence finished, cancelled, failed) frees its
state on every stage (``weakref.finalize``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import structlog

from engine.latency import LATENCY_BUCKETS_S  # noqa: F401 - re-exported
from engine.decode_plan import forward_span
from engine.moe import drive
from engine.pipeline import limits, trace, wire
from engine.pipeline.batch import batch_step
from engine.pipeline.link import StageFailed, StageLink, StageStats  # noqa: F401 - re-exported
from engine.pipeline.planner import Plan
from engine.pipeline.stage import SERIAL, serial_if

log = structlog.get_logger(__name__)
_F32 = np.dtype(np.float32)

MAX_RECOVERIES = 3  # re-plans one step may go through before it gives up
BATCH = os.environ.get("MESHD_PIPELINE_BATCH", "1") != "0"  # batched decode steps (decode_groups); 0: lone


class PipelineUnavailable(Exception):
    """No plan can serve the model now; the message says what is missing."""


class Run:
    """One plan put to work (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, run_id: int, plan: Plan, local: Any, links: list[StageLink]) -> None:
        self.id = run_id
        self.plan = plan
        self.local = local  # Model view of this node's range (may hold no layers)
        self.links = links
        self.dead = False
        self.dead_reason = ""
        self.seqs: set[int] = set()
        self.started = time.time()
        self._seq_ids = itertools.count(1)
        try:  # runs are made on the daemon loop: steps are handed to it as plain callbacks (``start``)
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        # decode steps poll for what comes next (this node for a result, each stage for its next step)
        # only while every pipeline process on this machine has the cores its step computes on to itself:
        # polling keeps a core busy, and one the stages or this node's layers need is not free (stages
        # elsewhere use theirs). A step on the compiled kernels computes on the kernel pool's threads (all
        # cores by default), so then nothing is left to poll on: polling there took a core from the other
        # process's pool (measured, docs/pipeline.md session 5). MESHD_PIPELINE_POLL=0/1: never/always (A/B)
        here = sum(1 for link in links if getattr(link.channel, "on_loopback", False))
        force = os.environ.get("MESHD_PIPELINE_POLL", "")
        fits = (here + 1) * _compute_threads() <= _cores() if force not in ("0", "1") else force == "1"
        self.polling = self.loop is not None and fits
        # batched decode steps go out in this many groups: one per process with cores of its own (while this
        # node runs one group's layers, the stages work on the others); processes sharing this machine's
        # cores (the same test as polling's) count as one, since two of them computing at once only split
        # the cores (and each group gets fewer rows per weight read). MESHD_PIPELINE_GROUPS=N forces N (A/B)
        shared = here if (here + 1) * _compute_threads() > _cores() else 0
        forced = os.environ.get("MESHD_PIPELINE_GROUPS", "")
        self.groups = int(forced) if forced.isdigit() and int(forced) > 0 else len(links) + 1 - shared

    def new_seq(self) -> int:
        seq = next(self._seq_ids)
        self.seqs.add(seq)
        return seq

    async def forward(
        self, x: np.ndarray, span: tuple[wire.SeqSpan, ...], last_only: bool, first: int = 0
    ) -> np.ndarray:
        """Activations through every remote stage in order (loop thread), from link ``first`` on -> the last
        stage's logits. ``span``: one sequence's positions, or a row per sequence (a batched decode step)."""
        for i, link in enumerate(self.links[first:], first):
            last = i == len(self.links) - 1
            res = await link.call(wire.Forward(self.id, 0, span, x, last_only and last))
            wrong = self.wrong_result(res, span, last_only, last)
            if wrong:
                link.close(wrong)
                raise StageFailed(link.node_id, wrong)
            x = res.x
        return x

    def start(
        self, x: np.ndarray, span: tuple[wire.SeqSpan, ...], last_only: bool, wait: bool = False,
        handed: bool = False, first: int = 0
    ) -> concurrent.futures.Future[Any]:
        """``forward`` from another thread, as the latency path: one ``call_soon_threadsafe`` hands the step
        to the loop, each hop's RESULT is taken in the read callback, which sends the next hop right there,
        and the last one's logits (or a ``StageFailed``) go straight into the returned future: no task and no
        asyncio future on the way. A frame that cannot be written at once takes ``forward`` for the rest.
        ``wait``: the caller blocks on the result at once, so this node's loop may poll for it (``polling``);
        decode-sized steps ask their stages to poll for the next one the same way (FLAG_POLL). ``handed``:
        return once the loop has written the frame, or after ``HANDOFF_WAIT_S`` (a caller that computes
        meanwhile holds the GIL, and the loop thread, woken to send, could wait the whole switch interval
        for it: the stages would idle while this node computes the next sequence). ``first``: the link to
        start from (the hops before it were made over direct channels)."""
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        assert self.loop is not None
        if not handed:
            self.loop.call_soon_threadsafe(self._hop, out, first, x, span, last_only, wait)
            return out
        sent = threading.Event()

        def hop() -> None:
            try:
                self._hop(out, first, x, span, last_only, wait)
            finally:
                sent.set()

        self.loop.call_soon_threadsafe(hop)
        sent.wait(limits.HANDOFF_WAIT_S)  # the frame is out (or the link failed: the future says so), or
        # the loop thread found no free core that soon (a busy machine): this thread computes meanwhile
        return out

    def direct(self, x: np.ndarray, span: tuple[wire.SeqSpan, ...], last_only: bool
               ) -> concurrent.futures.Future[Any] | None:
        """A decode step (a row a sequence) over the stages' direct channels on this (the scheduler's) thread, blocking
        (``engine.pipeline.direct``) -> a done future of the last stage's logits; from a hop the channel cannot
        take on, the stream's latency path (``start``) from that link. None: the first link has no direct
        channel up (the caller uses ``start``)."""
        links = self.links
        if not links or links[0].direct is None or links[0].direct.closed:
            return None
        for i, link in enumerate(links):
            last = i == len(links) - 1
            hop = link.direct
            res = None
            if hop is not None and not link.closed and not self.dead:
                res = hop.call(link, wire.Forward(self.id, 0, span, x, last_only and last), last)
            if res is None:
                return self.start(x, span, last_only, wait=True, first=i)
            wrong = self.wrong_result(res, span, last_only, last)  # as on the stream: a member is not trusted
            if wrong:
                link.close(wrong)
                failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
                failed.set_exception(StageFailed(link.node_id, wrong))
                return failed
            x = res.x
        return _Done(x)  # type: ignore[return-value]

    def _hop(
        self,
        out: concurrent.futures.Future[Any],
        i: int,
        x: np.ndarray,
        span: tuple[wire.SeqSpan, ...],
        last_only: bool,
        wait: bool,
    ) -> None:
        link = self.links[i]
        last = i == len(self.links) - 1
        if trace.ON and i == 0 and x.shape[0] == 1:
            trace.mark("S.fwd")

        def done(reply: Any) -> None:
            if out.done():
                return
            wrong = "" if isinstance(reply, StageFailed) else self.wrong_result(reply, span, last_only, last)
            if isinstance(reply, StageFailed):
                out.set_exception(reply)
            elif wrong:
                link.close(wrong)
                out.set_exception(StageFailed(link.node_id, wrong))
            elif last:
                if trace.ON and reply.x.shape[0] == 1:
                    trace.mark("S.resume")
                out.set_result(reply.x)
            else:
                self._hop(out, i + 1, reply.x, span, last_only, wait)

        small = self.polling and x.shape[0] <= limits.INLINE_ROWS
        frame = wire.Forward(self.id, 0, span, x, last_only and last, small)
        if link.call_soon(frame, done, small and wait):
            return
        task = asyncio.ensure_future(self.forward(x, span, last_only, first=i))

        def settle(t: asyncio.Future[Any]) -> None:
            if out.done():
                return
            if t.cancelled():
                out.set_exception(StageFailed(link.node_id, "step cancelled"))
            elif t.exception() is not None:
                out.set_exception(t.exception())  # type: ignore[arg-type]
            else:
                out.set_result(t.result())

        task.add_done_callback(settle)

    def close(self, reason: str) -> None:
        for link in self.links:
            link.close(reason)

    def wrong_result(self, res: wire.Result, span: tuple[wire.SeqSpan, ...], last_only: bool, last: bool) -> str:
        """What is wrong with a stage's RESULT for a FORWARD of ``span`` ("" if nothing): its kind, type
        and shape must be what an honest stage computes (fp32; hidden states [rows, D] from a middle
        stage, logits [rows, V] from the last, one row when only the last is asked for). A stage is a
        member, not a trusted one: logits wider than the vocabulary would be sampled into token ids the
        model does not have."""
        if res.logits != last:
            return _wrong_kind(last)
        c = self.local.config
        if len(span) == 1:
            rows = 1 if last and last_only else span[0].count
        else:
            rows = len(span)
        want = (rows, c.vocab_size if last else c.hidden_size)
        dt = res.x.dtype
        if (dt is not _F32 and dt != _F32) or res.x.shape != want:  # (identity first: a cold lookup fewer)
            what = "logits" if last else "hidden states"
            return f"answered {what} {res.x.dtype}{list(res.x.shape)}, expected float32{list(want)}"
        return ""


class _Done:
    """A step's answer that is already here (``Run.direct``), where a future is expected: ``done`` and ``result``
    without the lock and condition a ``concurrent.futures.Future`` makes (on the hop, with cold caches)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


def _wait(run: Run, fut: concurrent.futures.Future[Any]) -> Any:
    """The stages' answer to a step (scheduler thread). A step with no answer within ``STEP_TIMEOUT_S`` (a
    stage that sends only KEEPALIVE, which keeps its link from being found silent) fails the links still
    waiting on a step, so it raises the ``StageFailed`` that names that stage and recovers like any stage
    failure, instead of a bare ``TimeoutError``."""
    try:
        return fut.result(timeout=limits.STEP_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        pass
    reason = f"no answer to a step within {limits.STEP_TIMEOUT_S:g} s"

    def close_stuck() -> None:
        for link in run.links:
            if link._pending:
                link.close(reason)

    if run.loop is not None:
        run.loop.call_soon_threadsafe(close_stuck)
    try:
        return fut.result(timeout=limits.SILENCE_S * 2)
    except concurrent.futures.TimeoutError:
        raise StageFailed("", reason) from None


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _compute_threads() -> int:
    """Threads one decode step of this process computes on: the compiled kernels' pool when they are loaded
    (a stage on the same machine runs the same install), else 1 (numpy's BLAS, one thread in a node that
    shares its cores: the benchmark's setting)."""
    kernels = sys.modules.get("engine.kernels")
    if kernels is None or not getattr(kernels, "AVAILABLE", False):
        return 1
    return max(1, int(kernels.threads()))


def _wrong_kind(last: bool) -> str:
    return "answered hidden states where logits were due" if last else "answered logits from a middle stage"


class RunProvider(Protocol):
    """What ``PipelinedModel`` needs from the daemon side (``meshd.pipeline_service``)."""

    def current(self) -> Run: ...  # the run new sequences start on (raises PipelineUnavailable)

    def recover(
        self, failed: Run, error: StageFailed
    ) -> Run: ...  # blocking re-plan (raises PipelineUnavailable)

    def run_on_loop(self, coro: Any) -> Any: ...  # run a coroutine on the daemon loop, blocking

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]: ...  # start it on the loop, do not wait

    def release(self, run: Run, seq: int) -> None: ...  # a sequence ended: free it everywhere (any thread)


class PipeCache:
    """One sequence's state on the serving node: its run, its id there, this node's KV cache, the chunks fed."""

    def __init__(self, provider: RunProvider, run: Run) -> None:
        self.run = run
        self.seq = run.new_seq()
        self.local = run.local.new_cache()
        self.history: list[np.ndarray] = []
        self.replay = False
        self.inflight: list[concurrent.futures.Future[Any]] = []  # prefill chunks still on the remote stages
        self._holder = [run, self.seq]
        self._freed = weakref.finalize(self, _release, provider, self._holder)

    def free(self) -> None:
        """The sequence is over: free its state on every stage now (once; dropping the cache does the same,
        but only when it is collected, and after a recovery a reference cycle can keep it for a while)."""
        self._freed()

    @property
    def length(self) -> int:
        return int(self.local.length)

    def move(self, provider: RunProvider, run: Run) -> None:
        """Start over on ``run`` (after a failure): the chunks are replayed before the next step."""
        provider.release(self.run, self.seq)
        self.run = run
        self.seq = run.new_seq()
        self.local = run.local.new_cache()
        self._holder[:] = [run, self.seq]
        self.replay = True
        self.inflight = []


def _release(provider: RunProvider, holder: list[Any]) -> None:
    with contextlib.suppress(Exception):
        provider.release(holder[0], holder[1])


class PipelinedModel:
    """A model whose layers run on a pipeline (see the module docstring). Thread-safe per sequence."""

    def __init__(self, model: Any, provider: RunProvider) -> None:
        self.model = model  # the full model, memory-mapped: embeddings, this node's range, local fallback
        self.config = model.config
        self.provider = provider
        self._lock = threading.Lock()
        # one-token steps of one sequence (scheduler thread): count, seconds in this node's layers, seconds
        # waiting for the stages (thread hand-offs to the loop and back included)
        self.decode_steps = 0
        self.decode_local_s = 0.0
        self.decode_remote_s = 0.0
        self._out: list[concurrent.futures.Future[Any]] = []  # steps start_one put on the stages (scheduler
        # thread; the ones still there decide whether this node's own layers run single-threaded)

    def new_cache(self, capacity: int = 256) -> PipeCache:
        return PipeCache(self.provider, self.provider.current())

    def forward(
        self,
        ids: Sequence[int] | np.ndarray,
        cache: PipeCache,
        executor: Any = None,
        *,
        last_only: bool = False,
    ) -> np.ndarray:
        arr = self.model._check_ids(ids)
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                self._settle(cache)
                if cache.run.dead:
                    raise StageFailed("", cache.run.dead_reason or "the run failed")
                if cache.replay:
                    t0 = time.perf_counter()
                    for chunk in cache.history:
                        self._step(cache, chunk, True, executor)
                    cache.replay = False
                    log.info(
                        "pipeline_replayed",
                        run=f"{cache.run.id:016x}",
                        seq=cache.seq,
                        chunks=len(cache.history),
                        positions=cache.length,
                        replay_ms=round((time.perf_counter() - t0) * 1e3, 1),
                    )
                out = self._step(cache, arr, last_only, executor)
                cache.history.append(arr)
                return out
            except StageFailed as e:
                if attempt == MAX_RECOVERIES:
                    raise PipelineUnavailable(f"gave up after {MAX_RECOVERIES} re-plans: {e}") from None
                cache.move(self.provider, self.provider.recover(cache.run, e))
        raise AssertionError("unreachable")

    def prefill_nowait(self, ids: Sequence[int] | np.ndarray, cache: PipeCache, executor: Any = None) -> None:
        """A prompt chunk whose logits nobody reads: run this node's layers, send the rest on its way and
        return, so the next chunk's layers here overlap this one's on the stages. The chunk counts as fed
        (a failure on the way is found by the next step on this cache, which then re-plans and replays)."""
        arr = self.model._check_ids(ids)
        run = cache.run
        if run.dead or cache.replay or not run.links:
            self.forward(arr, cache, executor, last_only=True)
            return
        local, past, t = run.local, cache.local.length, arr.shape[0]
        x = self.model.embed(arr)
        if local.layers:
            x = _local_layers(local, x, cache.local, past, executor)[0]
        cache.inflight.append(self.provider.submit(run.forward(x, _span(cache.seq, past, t), True)))
        cache.local.length = past + t
        cache.history.append(arr)

    def _settle(self, cache: PipeCache) -> None:
        """Wait for this sequence's chunks still on the stages; a failure there marks the run for recovery."""
        pending, cache.inflight = cache.inflight, []
        for fut in pending:
            try:
                _wait(cache.run, fut)
            except StageFailed as e:
                if not cache.run.dead:
                    cache.move(self.provider, self.provider.recover(cache.run, e))
                else:
                    cache.move(self.provider, self.provider.current())
                return

    def _step(self, cache: PipeCache, arr: np.ndarray, last_only: bool, executor: Any) -> np.ndarray:
        run, local = cache.run, cache.run.local
        t, past = arr.shape[0], cache.local.length
        if trace.ON and t == 1:
            trace.mark("S.step")
        t0 = time.perf_counter()
        x = self.model.embed(arr)  # [T, D]
        if local.layers:
            x, done = _local_layers(local, x, cache.local, past, executor, not run.links)
            if done:  # no stages: the plan ended in this node's head
                cache.local.length = past + t
                return x
        if run.links:
            t1 = time.perf_counter()
            if trace.ON and t == 1:
                trace.mark("S.local")
            x = _wait(run, self._remote(run, x, cache.seq, past, last_only, True))
            if trace.ON and t == 1:
                trace.mark("S.back")
            if t == 1:
                self.decode_steps += 1
                self.decode_local_s += t1 - t0
                self.decode_remote_s += time.perf_counter() - t1
        else:
            x = local.logits(x[-1:] if last_only else x)
        cache.local.length = past + t
        return x

    def _remote(
        self, run: Run, x: np.ndarray, seq: int, past: int, last_only: bool, wait: bool = False
    ) -> concurrent.futures.Future[Any]:
        """The remote stages' part of a step, started from this (scheduler) thread (``wait``: it blocks on
        the result right away; else it computes meanwhile, so the frame must be out before it goes on)."""
        if run.loop is not None:
            if wait and x.shape[0] == 1:  # a lone step: over the direct channels when they are up
                fut = run.direct(x, _span(seq, past, 1), last_only)
                if fut is not None:
                    return fut
            return run.start(x, _span(seq, past, x.shape[0]), last_only, wait, handed=not wait)
        fut = self.provider.submit(run.forward(x, _span(seq, past, x.shape[0]), last_only))
        return fut  # type: ignore[no-any-return]

    def decode_status(self) -> dict[str, Any]:
        """Lone one-token steps as this node's scheduler saw them (ms): its own layers, and the wait for the
        stages, which is the stages' latency plus the hand-offs between the scheduler thread and the loop."""
        n = self.decode_steps or 1
        return {
            "steps": self.decode_steps,
            "local_ms_avg": round(self.decode_local_s / n * 1e3, 3),
            "remote_ms_avg": round(self.decode_remote_s / n * 1e3, 3),
        }

    def start_one(self, tok: int, cache: PipeCache, executor: Any = None) -> Pending:
        """Start one decode step of one sequence (token ``tok``): this node's layers, then the activations go
        on to the stages and this returns without waiting for them (the scheduler's rolling decode computes
        other sequences meanwhile). Take the result with ``finish_one``; until then nothing else may run on
        this cache. A step that needs recovery first (or a run with no stages) runs at once, blocking."""
        return self._start(tok, cache, executor, False)

    def finish_one(self, pending: Pending, executor: Any = None) -> np.ndarray:
        """The logits [V] of a step from ``start_one``; a stage that failed meanwhile is recovered from
        (re-plan, replay) and the step runs again, so the result is the same either way."""
        if pending.error is not None:
            raise pending.error
        if pending.fut is None:
            return pending.logits  # type: ignore[return-value]
        cache = pending.cache
        try:
            logits = _wait(cache.run, pending.fut)
        except StageFailed:
            return self.forward(pending.arr, cache, executor, last_only=True)[-1]
        cache.local.length = pending.past + 1
        cache.history.append(pending.arr)
        return logits[pending.row]  # type: ignore[no-any-return]

    def _start(self, tok: int, cache: PipeCache, executor: Any, wait: bool) -> Pending:
        arr = self.model._check_ids([int(tok)])
        if cache.run.dead or cache.replay or not cache.run.links or cache.inflight:
            return Pending(cache, arr, -1, None, self.forward(arr, cache, executor, last_only=True)[-1])
        local, past = cache.run.local, cache.local.length
        x = self.model.embed(arr)
        self._out = [f for f in self._out if not f.done()]
        if local.layers:  # another sequence's step on the stages: both processes compute (limits)
            with serial_if(SERIAL and bool(self._out)):
                x = _local_layers(local, x, cache.local, past, executor)[0]
        if trace.ON:
            trace.mark("S.submit")
        fut = self._remote(cache.run, x, cache.seq, past, True, wait)
        self._out.append(fut)
        return Pending(cache, arr, past, fut)

    def decode_groups(self, caches: Sequence[PipeCache]) -> int:
        """In how many groups the scheduler's rolling decode should step the sequences of ``caches``
        (``start_many``): ``Run.groups``, one per pipeline process with cores of its own; 0 when steps are not
        batched (fewer than two sequences, no numba: BLAS products are not row-invariant,
        ``MESHD_PIPELINE_BATCH=0``, a run with no stages): each sequence steps alone."""
        if len(caches) < 2 or not BATCH:
            return 0
        run = caches[0].run
        if run.dead or not run.links or batch_step(run.local) is None:
            return 0
        return min(len(caches), run.groups)

    def start_many(self, toks: Sequence[int], caches: Sequence[PipeCache],
                   executor: Any = None) -> list[Pending]:
        """``start_one`` of several sequences as one batched step (``engine.pipeline.batch``): this node's
        layers over all their rows at once, then one FORWARD with a row per sequence to each stage; every row
        has the bits of its lone step. Take each sequence's result with ``finish_one``. Sequences that cannot
        join (on another run, replaying, a prefill chunk still out, a run with no stages, experts delegated
        from this node) step alone, and then the failure of one's step is raised by its ``finish_one``, not
        here (the others' steps stand). Raising here, it has advanced no cache."""
        if len(caches) != len(toks):
            raise ValueError(f"{len(toks)} tokens for {len(caches)} caches")
        run = caches[0].run if caches else None
        step = None
        local_experts = run is not None and (executor is None or executor is run.local.local_executor)
        if run is not None and run.links and not run.dead and local_experts:
            step = batch_step(run.local)
        if step is None or len(caches) < 2 or any(c.run is not run or c.replay or c.inflight for c in caches):
            return [self._start_or_error(int(t), c, executor) for t, c in zip(toks, caches)]
        arrs = [self.model._check_ids([int(t)]) for t in toks]
        pasts = [c.local.length for c in caches]
        x = self.model.embed(np.concatenate(arrs))
        if run.local.layers:
            x = step.run(x, [c.local for c in caches])
        span = tuple(wire.SeqSpan(c.seq, p, 1) for c, p in zip(caches, pasts))
        fut = None
        if run.loop is not None and run.groups == 1 and x.shape[0] <= limits.INLINE_ROWS:
            # one group: the scheduler takes this step's results next, with nothing to compute meanwhile,
            # so the step can go over the direct channels on this thread like a lone one
            fut = run.direct(x, span, False)
        if fut is None:
            fut = run.start(x, span, False, False, handed=True) if run.loop is not None else \
                self.provider.submit(run.forward(x, span, False))
        self._out.append(fut)
        return [Pending(c, a, p, fut, row=i) for i, (c, a, p) in enumerate(zip(caches, arrs, pasts))]

    def _start_or_error(self, tok: int, cache: PipeCache, executor: Any) -> Pending:
        """``_start`` of one sequence stepping alone inside ``start_many``: a failure of its step is kept in its
        ``Pending`` (``finish_one`` raises it), so it ends that sequence only; the others' steps, started or
        run already (their caches advanced), stand."""
        try:
            return self._start(tok, cache, executor, False)
        except Exception as e:  # noqa: BLE001 - handed to this sequence's finish_one
            return Pending(cache, np.zeros(0, dtype=np.int64), -1, None, error=e)

    def forward_batch(
        self, ids: Sequence[int] | np.ndarray, caches: Sequence[PipeCache], executor: Any = None
    ) -> np.ndarray:
        """One decode step of B sequences, in flight across the stages at once (micro-batching): this node
        runs sequence i's layers while sequence i-1's activations are on the remote stages. Each sequence is
        its own single-token step, so every row has the bits of ``forward([id], cache, last_only=True)``
        and a replay after a failure rebuilds the same caches. -> logits [B, V]."""
        if len(caches) != len(ids):
            raise ValueError(f"{len(ids)} ids for {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each sequence needs its own cache")
        last = len(caches) - 1  # after the last one this thread only waits: its loop may poll
        started = [self._start(int(t), c, executor, i == last) for i, (t, c) in enumerate(zip(ids, caches))]
        return np.stack([self.finish_one(p, executor) for p in started])


def _span(seq: int, past: int, rows: int) -> tuple[wire.SeqSpan, ...]:
    return (wire.SeqSpan(seq, past, rows),)


def _local_layers(local: Any, x: np.ndarray, cache: Any, past: int, executor: Any,
                  head: bool = False) -> tuple[np.ndarray, bool]:
    """This node's layer range over x [T, D] at positions past.. (room reserved here, ``length`` left to the
    caller): a one-token step through the decode plan's layer-range form when it applies, else the general
    pass; same bits. -> (hidden states, False), or with ``head`` (a run with no stages: this node holds the
    head) possibly (the plan's logits [1, V], True)."""
    if x.shape[0] == 1:
        out = forward_span(local, x, cache, executor, head)
        if out is not None:
            return out, head
    cache.reserve(past + x.shape[0])
    return drive(local.span_steps(x, cache, past), executor or local.local_executor, local.warm), False


@dataclass
class Pending:
    """A decode step of one sequence in flight (``PipelinedModel.start_one``): the future of the stages'
    logits, or the logits themselves when the step ran at once."""

    cache: PipeCache
    arr: np.ndarray
    past: int
    fut: concurrent.futures.Future[Any] | None
    logits: np.ndarray | None = None
    row: int = -1  # this sequence's row of the future's logits (a batched step: ``start_many``)
    error: Exception | None = None  # this sequence's step failed to start (``start_many``): finish_one raises it
