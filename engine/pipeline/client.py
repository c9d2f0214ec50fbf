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
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog

from engine.latency import LATENCY_BUCKETS_S, empty_buckets, observe  # noqa: F401 - buckets re-exported
from engine.moe import drive
from engine.pipeline import limits, trace, wire
from engine.pipeline.planner import Plan

log = structlog.get_logger(__name__)

MAX_RECOVERIES = 3  # re-plans one step may go through before it gives up


class StageFailed(Exception):
    """A stage did not answer a step (silent, stream broke, or an error frame)."""

    def __init__(self, node_id: str, reason: str, code: int | None = None) -> None:
        super().__init__(f"stage {node_id[:12]} failed: {reason}")
        self.node_id = node_id
        self.reason = reason
        self.code = code


class PipelineUnavailable(Exception):
    """No plan can serve the model now; the message says what is missing."""


@dataclass
class StageStats:
    calls: int = 0
    latency_s: float = 0.0
    compute_s: float = 0.0
    latency_max_s: float = 0.0
    buckets: list[int] = field(default_factory=empty_buckets)
    pings: int = 0
    ping_s: float = 0.0

    def add_ping(self, rtt_s: float) -> None:
        self.pings += 1
        self.ping_s += rtt_s

    def add(self, latency_s: float, compute_s: float) -> None:
        self.calls += 1
        self.latency_s += latency_s
        self.compute_s += compute_s
        self.latency_max_s = max(self.latency_max_s, latency_s)
        observe(self.buckets, latency_s)

    def as_dict(self) -> dict[str, Any]:
        n = self.calls or 1
        return {
            "calls": self.calls,
            "latency_ms_avg": round(self.latency_s / n * 1e3, 3),
            "compute_ms_avg": round(self.compute_s / n * 1e3, 3),
            "hop_overhead_ms_avg": round((self.latency_s - self.compute_s) / n * 1e3, 3),
            "latency_ms_max": round(self.latency_max_s * 1e3, 3),
            "pings": self.pings,
            "path_rtt_ms_avg": round(self.ping_s / self.pings * 1e3, 3) if self.pings else None,
        }




class StageLink:
    """One PIPELINE stream to a stage for one run: ``open`` then ``call`` (one step at a time). Loop thread."""

    def __init__(self, node_id: str, channel: Any, first: int, last: int) -> None:
        self.node_id = node_id
        self.channel = channel
        self.first, self.last = first, last
        self.stats = StageStats()
        self.closed = False
        self.reason = ""
        self._dec = wire.FrameDecoder()
        self._pending: dict[int, asyncio.Future[wire.Frame]] = {}
        self._steps = itertools.count(1)
        self._heard = 0.0
        self._pinged = 0.0  # loop time of the last ping sent
        self._pings: dict[int, float] = {}  # ping id -> perf_counter when sent
        self._send_lock = (
            asyncio.Lock()
        )  # FIFO: frames of concurrent steps go out in the order they were made

    async def open(
        self,
        run: int,
        fingerprint: bytes,
        num_layers: int,
        timeout_s: float = limits.OPEN_TIMEOUT_S,
        silence_s: float = limits.OPEN_SILENCE_S,
    ) -> wire.Ready:
        loop = asyncio.get_running_loop()
        self.channel.set_receiver(self._on_data, self._on_end)
        fut: asyncio.Future[wire.Frame] = loop.create_future()
        self._pending[0] = fut
        self._heard = loop.time()
        deadline = self._heard + timeout_s
        await self._send(wire.Open(run, self.first, self.last, num_layers, fingerprint))
        while True:  # a loading stage sends KEEPALIVE; a dead one (or a stale connection) stays silent
            wait = min(self._heard + silence_s, deadline) - loop.time()
            if wait <= 0:
                self.close("no READY")
                raise StageFailed(self.node_id, "no answer to OPEN")
            with contextlib.suppress(TimeoutError):
                reply = await asyncio.wait_for(asyncio.shield(fut), wait)
                break
        self._pending.pop(0, None)
        if isinstance(reply, wire.Error):
            self.close("refused")
            raise StageFailed(self.node_id, reply.text, reply.code)
        if not isinstance(reply, wire.Ready) or (reply.first, reply.last) != (self.first, self.last):
            self.close("bad READY")
            raise StageFailed(self.node_id, f"answered OPEN with {reply!r}", wire.ErrorCode.PROTOCOL)
        return reply

    async def call(self, frame: wire.Forward) -> wire.Result:
        """One step: send ``frame`` (its step id is set here), wait for the RESULT. Raises ``StageFailed``
        on an error frame, a broken stream, or ``SILENCE_S`` without any frame from the stage."""
        loop = asyncio.get_running_loop()
        if self.closed:
            raise StageFailed(self.node_id, self.reason)
        if (
            not self._pending
            and not self._pings
            and not self._send_lock.locked()  # a frame half written: a ping must not land inside it
            and loop.time() - self._pinged >= limits.PING_EVERY_S
        ):
            self._ping(loop)  # goes out just ahead of the step: the stage echoes it before computing
        step = next(self._steps) % 0xFFFFFFFF + 1
        frame = wire.Forward(frame.run, step, frame.spans, frame.x, frame.last_only)
        fut: asyncio.Future[wire.Frame] = loop.create_future()
        self._pending[step] = fut
        t0 = time.perf_counter()
        self._heard = loop.time()
        watch: list[asyncio.TimerHandle] = []
        try:
            await self._send(frame)
            # one timer checks for silence (re-armed from the last frame heard) while the step waits on its
            # future directly: no wait_for/shield tasks, so a result is handed over in one loop iteration
            watch.append(loop.call_later(limits.SILENCE_S, self._watch, fut, watch))
            reply = await fut
            if trace.ON and frame.x.shape[0] == 1:
                trace.mark("S.resume")
        finally:
            if watch:
                watch[-1].cancel()
            self._pending.pop(step, None)
        if isinstance(reply, wire.Error):
            raise StageFailed(self.node_id, reply.text, reply.code)
        assert isinstance(reply, wire.Result)
        self.stats.add(time.perf_counter() - t0, reply.compute_us / 1e6)
        return reply

    def _watch(self, fut: asyncio.Future[wire.Frame], watch: list[asyncio.TimerHandle]) -> None:
        """A step's silence check: no frame from the stage for ``SILENCE_S`` fails the link (and the step)."""
        if fut.done():
            return
        loop = asyncio.get_running_loop()
        left = self._heard + limits.SILENCE_S - loop.time()
        if left <= 0:
            self.close(f"silent for {limits.SILENCE_S:g} s")
            return
        watch.append(loop.call_later(left, self._watch, fut, watch))

    def _ping(self, loop: asyncio.AbstractEventLoop) -> None:
        """Measure the path's round trip now (the stage echoes a KEEPALIVE); the echo is timed in
        ``_on_data``. Sent just before a step with nothing else out on the link: the stage answers it
        before it computes, and this node's scheduler thread is waiting for that step, not holding the GIL
        (a ping sent after a result came back timed the scheduler's sampling and next layers instead).
        Ping ids come from the step counter, so they never equal a running step's id."""
        self._pinged = loop.time()
        pid = next(self._steps) % 0xFFFFFFFF + 1
        data = wire.encode(wire.Keepalive(pid))
        self._pings[pid] = time.perf_counter()
        if not self.channel.send_now(data):
            self._pings.pop(pid, None)  # not written at once: this sample would time the queue, not the path
            return
        loop.call_later(limits.PING_TIMEOUT_S, self._pings.pop, pid, None)

    async def _send(self, frame: wire.Frame) -> None:
        data = wire.encode(frame)
        if trace.ON and isinstance(frame, wire.Forward) and frame.x.shape[0] == 1:
            trace.mark("S.sent")
        step = limits.SEND_CHUNK_BYTES
        try:
            async with self._send_lock:
                if len(data) <= step and self.channel.send_now(data):
                    return  # written and flushed in this call (the latency path)
                for i in range(0, len(data), step):
                    await self.channel.send(data[i : i + step])
        except Exception as e:  # noqa: BLE001 - any send failure means the stage is gone
            self.close(f"send failed: {e!r}")
            raise StageFailed(self.node_id, f"send failed: {e!r}") from None

    def free(self, run: int, seqs: Sequence[int]) -> None:
        """Tell the stage to drop these sequences' caches (fire and forget; loop thread)."""
        if not self.closed:
            task = asyncio.ensure_future(self._send(wire.Free(run, tuple(seqs))))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    def _on_data(self, data: bytes) -> None:
        if self.closed:
            return
        self._heard = asyncio.get_running_loop().time()
        try:
            frames = self._dec.feed(data)
        except wire.RemoteProtocolError as e:
            self.close(f"protocol error: {e.reason}")
            return
        for f in frames:
            if trace.ON and isinstance(f, wire.Result) and f.x.shape[0] == 1:
                trace.mark("S.rx")
            if isinstance(f, wire.Keepalive):
                sent = self._pings.pop(f.step, None)
                if sent is not None:
                    self.stats.add_ping(time.perf_counter() - sent)
                continue
            key = f.step if isinstance(f, wire.Result | wire.Error) else 0
            fut = self._pending.get(key)
            if fut is None and isinstance(f, wire.Error) and key == 0 and self._pending:
                fut = next(iter(self._pending.values()))  # a stream-level error fails what is waiting
            if fut is not None and not fut.done():
                fut.set_result(f)

    def _on_end(self, error: Exception | None) -> None:
        self.close("stream ended" if error is None else f"stream broke: {error!r}")

    def close(self, reason: str) -> None:
        """Fail what is waiting and reset the stream: the stage frees the run's state."""
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_result(wire.Error(0, wire.ErrorCode.PROTOCOL, f"link closed: {reason}"))
        self._pending.clear()
        with contextlib.suppress(Exception):
            self.channel.reset(0)


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

    def new_seq(self) -> int:
        seq = next(self._seq_ids)
        self.seqs.add(seq)
        return seq

    async def forward(self, x: np.ndarray, seq: int, past: int, last_only: bool) -> np.ndarray:
        """Activations through every remote stage in order (loop thread) -> the last stage's logits."""
        if trace.ON and x.shape[0] == 1:
            trace.mark("S.fwd")
        span = (wire.SeqSpan(seq, past, x.shape[0]),)
        for i, link in enumerate(self.links):
            last = i == len(self.links) - 1
            res = await link.call(wire.Forward(self.id, 0, span, x, last_only and last))
            if res.logits != last:
                link.close("wrong result kind")
                raise StageFailed(
                    link.node_id,
                    "answered hidden states where logits were due"
                    if last
                    else "answered logits from a middle stage",
                )
            x = res.x
        return x

    def close(self, reason: str) -> None:
        for link in self.links:
            link.close(reason)


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
        weakref.finalize(self, _release, provider, self._holder)

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
            cache.local.reserve(past + t)
            x = drive(local.span_steps(x, cache.local, past), executor or local.local_executor, local.warm)
        cache.inflight.append(self.provider.submit(run.forward(x, cache.seq, past, True)))
        cache.local.length = past + t
        cache.history.append(arr)

    def _settle(self, cache: PipeCache) -> None:
        """Wait for this sequence's chunks still on the stages; a failure there marks the run for recovery."""
        pending, cache.inflight = cache.inflight, []
        for fut in pending:
            try:
                fut.result(timeout=limits.OPEN_TIMEOUT_S * 2)
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
            cache.local.reserve(past + t)
            x = drive(local.span_steps(x, cache.local, past), executor or local.local_executor, local.warm)
        if run.links:
            t1 = time.perf_counter()
            if trace.ON and t == 1:
                trace.mark("S.local")
            x = self.provider.run_on_loop(run.forward(x, cache.seq, past, last_only))
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

    def decode_status(self) -> dict[str, Any]:
        """Lone one-token steps as this node's scheduler saw them (ms): its own layers, and the wait for the
        stages, which is the stages' latency plus the hand-offs between the scheduler thread and the loop."""
        n = self.decode_steps or 1
        return {
            "steps": self.decode_steps,
            "local_ms_avg": round(self.decode_local_s / n * 1e3, 3),
            "remote_ms_avg": round(self.decode_remote_s / n * 1e3, 3),
        }

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
        started: list[tuple[PipeCache, np.ndarray, int, Any]] = []
        for tok, cache in zip(ids, caches):
            arr = self.model._check_ids([int(tok)])
            if cache.run.dead or cache.replay or not cache.run.links or cache.inflight:
                started.append((cache, arr, -1, None))  # the plain path (recovers, or all local)
                continue
            local, past = cache.run.local, cache.local.length
            x = self.model.embed(arr)
            if local.layers:
                cache.local.reserve(past + 1)
                x = drive(
                    local.span_steps(x, cache.local, past), executor or local.local_executor, local.warm
                )
            started.append(
                (cache, arr, past, self.provider.submit(cache.run.forward(x, cache.seq, past, True)))
            )
        rows = []
        for cache, arr, past, fut in started:
            if fut is not None:
                try:
                    logits = fut.result(timeout=limits.OPEN_TIMEOUT_S * 2)
                    cache.local.length = past + 1
                    cache.history.append(arr)
                    rows.append(logits[-1])
                    continue
                except StageFailed:
                    pass  # the plain path below re-plans and replays, the step runs again
            rows.append(self.forward(arr, cache, executor, last_only=True)[-1])
        return np.stack(rows)
