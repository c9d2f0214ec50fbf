"""A bounded, batching scheduler: one thread runs up to ``max_active`` sequences of one model.

``submit(prompt_ids, params)`` validates (``ValueError``), then either admits the request or raises
``Busy`` when ``max_active`` requests are already admitted (the API answers 429 with Retry-After). It
returns a ``RequestHandle``: iterate it with ``for ev in handle`` from a thread, or ``async for ev in
handle`` from asyncio (events are handed to the loop with ``loop.call_soon_threadsafe``; pass ``loop=`` or
submit from inside the loop). ``handle.cancel()`` ends the request within one decode step with a
``cancelled`` event; a closed consumer loop cancels it too.

Each iteration of the scheduler thread, in this order: (1) end cancelled requests, (2) run one chunk
(``PREFILL_CHUNK_TOKENS``) of the oldest prompt still being prefilled, so a long prompt delays running
sequences by one chunk per step, not by its whole prefill, (3) one decode step for every running
sequence: one ``model.forward_batch`` over all of them where it pays, else one ``model.forward`` per
sequence (``batching="auto"`` compares measured step times; ``"always"`` and ``"never"`` force a mode).
Events come from ``engine.generate.DecodeState``, the same state machine ``generate`` uses, so a
request's tokens do not depend on what else is running (given a model whose batched step equals its
single step). A model exception ends the affected requests with an ``error`` event.

A model with ``start_one``/``finish_one`` (a pipeline, ``engine.pipeline.client.PipelinedModel``) decodes
several sequences rolling instead: each sequence always has one step in flight, and a step takes the
oldest sequence's result, samples it, emits it and starts that sequence's next step at once, so the
stages never wait for the slowest sequence of a step (no bubble between steps). With ``decode_groups``/
``start_many`` (a pipeline on the compiled kernels) the sequences step in groups, one batched step each;
either way every sequence gets the bits of its lone run.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from engine.limits import MAX_ACTIVE_SEQUENCES, PREFILL_CHUNK_TOKENS

from engine.generate import (DecodeState, GenerationStats, TokenEvent, check_request, context_length,
                             forward_last, free_cache)
from engine.pipeline import trace
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer

log = structlog.get_logger("engine.scheduler")

DEFAULT_MAX_ACTIVE = MAX_ACTIVE_SEQUENCES


class Busy(Exception):
    """Every slot is taken; try again after ``retry_after_s``."""

    def __init__(self, active: int, retry_after_s: float = 1.0) -> None:
        super().__init__(f"model busy: {active} requests running")
        self.retry_after_s = retry_after_s


class SchedulerClosed(Exception):
    """The scheduler was closed; no new requests."""


_END = object()
_COST_EMA = 0.2  # weight of the newest step time in the per-batch-size moving average
_EXPLORE_EVERY = 32  # every n-th batching decision tries the other mode, so estimates track the load


class RequestHandle:
    """The consumer side of one request: an iterator (sync or async) of ``TokenEvent``."""

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request_id = request_id
        self.stats = GenerationStats()
        self._cancel = threading.Event()
        self._loop = loop
        self._sync: queue.Queue[Any] | None = None if loop is not None else queue.Queue()
        self._async: asyncio.Queue[Any] | None = asyncio.Queue() if loop is not None else None
        self._done = False

    def cancel(self) -> None:
        """Stop generating; the stream ends with a ``cancelled`` event within one decode step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # producer side (scheduler thread)
    def _push(self, item: Any) -> None:
        if self._loop is not None:
            assert self._async is not None
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody will read this
                self._cancel.set()
        else:
            assert self._sync is not None
            self._sync.put(item)

    # consumer side
    def __iter__(self) -> Iterator[TokenEvent]:
        if self._sync is None:
            raise TypeError("this request was submitted from an event loop: use `async for`")
        return self

    def __next__(self) -> TokenEvent:
        """Blocks for the next event (threads). Leaving early does not cancel: call ``cancel()``."""
        if self._sync is None:
            raise TypeError("this request was submitted from an event loop: use `async for`")
        if self._done:
            raise StopIteration
        item = self._sync.get()
        if item is _END:
            self._done = True
            raise StopIteration
        return item  # type: ignore[no-any-return]

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        if self._async is None:
            raise TypeError("this request was submitted without an event loop: use `for`")
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[TokenEvent]:
        assert self._async is not None
        try:
            while not self._done:
                item = await self._async.get()
                if item is _END:
                    self._done = True
                    return
                yield item
        finally:
            if not self._done:  # consumer stopped early (client went away): stop the work too
                self._cancel.set()


@dataclass(eq=False)
class _Seq:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    submitted: float
    state: DecodeState | None = None
    cache: Any = None
    prefilled: int = 0  # prompt tokens already in the cache
    prefill_s: float = 0.0
    inflight: Any = None  # a rolling decode step started and not yet taken (``model.start_one``)


class Scheduler:
    """Runs requests for one model on a background thread. Call ``close()`` when done."""

    def __init__(self, model: Any, tokenizer: Tokenizer, max_active: int = DEFAULT_MAX_ACTIVE,
                 *, executor: Any = None, name: str = "model", batching: str = "auto",
                 prefill_chunk: int = PREFILL_CHUNK_TOKENS) -> None:
        if max_active < 1:
            raise ValueError("max_active must be at least 1")
        if batching not in ("auto", "always", "never"):
            raise ValueError("batching must be auto, always or never")
        self.batching = batching
        self.prefill_chunk = max(1, prefill_chunk)
        self._cost: dict[int, float] = {}  # moving average of decode-step seconds per batch size
        self._decisions = 0
        self.model = model
        self.tokenizer = tokenizer
        self.max_active = max_active
        self.executor = executor
        self.name = name
        self._n_ctx = context_length(model)
        self._lock = threading.Condition()
        self._pending: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._closed = False
        self._ids = itertools.count(1)
        self.steps = 0  # decode steps run (batched or not), for metrics and tests
        self.batched_steps = 0
        self._thread = threading.Thread(target=self._loop, name=f"scheduler-{name}", daemon=True)
        self._thread.start()

    # -- public --

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._running)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Admit a request. Raises ``ValueError`` (bad request), ``Busy`` (full), ``SchedulerClosed``."""
        check_request(self.model, prompt_ids, params)
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        with self._lock:
            if self._closed:
                raise SchedulerClosed("scheduler is closed")
            n = len(self._pending) + len(self._running)
            if n >= self.max_active:
                raise Busy(n)
            handle = RequestHandle(next(self._ids), loop)
            self._pending.append(_Seq(handle, list(prompt_ids), params, time.perf_counter()))
            self._lock.notify()
        return handle

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel everything and stop the thread."""
        with self._lock:
            self._closed = True
            for s in list(self._pending) + self._running:
                s.handle.cancel()
            self._lock.notify()
        self._thread.join(timeout_s)

    # -- thread --

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._running and not self._closed:
                    self._lock.wait()
                if self._closed and not self._pending and not self._running:
                    return
                new = self._pending.popleft() if self._pending else None
                if new is not None:
                    self._running.append(new)  # counted as admitted throughout (Busy stays exact)
                running = list(self._running)
            try:
                for s in running:
                    if s.handle.cancelled:
                        ev = s.state.cancelled() if s.state else TokenEvent(None, "", None, (), "cancelled")
                        self._end(s, ev)
                # The oldest admitted request whose prompt is not fully in its cache yet.
                prefilling = next((s for s in running if not s.handle.cancelled and
                                   (s.state is None or not s.state.tokens)), None)
                if prefilling is not None:
                    self._prefill_chunk(prefilling)
                self._decode_step()
            except Exception as e:  # a bug here must not leave every client waiting forever
                log.exception("scheduler_step_failed", model=self.name)
                with self._lock:
                    victims = list(self._running)
                self._fail(victims, e)

    def _end(self, s: _Seq, ev: TokenEvent) -> None:
        s.handle.stats.finish_reason = ev.finish_reason
        s.handle._push(ev)
        s.handle._push(_END)
        s.inflight = None  # a step still in flight is dropped with its cache (which frees it everywhere)
        free_cache(s.cache)
        s.cache = None
        with self._lock:
            if s in self._running:
                self._running.remove(s)

    def _emit(self, s: _Seq, ev: TokenEvent) -> bool:
        """Deliver one event; True if the sequence goes on."""
        s.handle.stats.completion_tokens = len(s.state.tokens) if s.state else 0
        if ev.finish_reason is not None:
            self._end(s, ev)
            return False
        s.handle._push(ev)
        return True

    def _fail(self, seqs: Sequence[_Seq], e: Exception) -> None:
        log.error("generation_failed", model=self.name, error=str(e), error_type=type(e).__name__,
                  requests=len(seqs))
        for s in seqs:
            self._end(s, TokenEvent(None, "", None, (), "error", error=f"{type(e).__name__}: {e}", exception=e))

    def _prefill_chunk(self, s: _Seq) -> None:
        """Run the next ``PREFILL_CHUNK_TOKENS`` of a prompt; after the last chunk, pick the first token.

        A long prompt therefore delays the running sequences by one chunk per decode step, not by its
        whole prefill, and its own cancel is seen between chunks."""
        st = s.handle.stats
        t0 = time.perf_counter()
        if s.state is None:
            st.queue_s = time.perf_counter() - s.submitted
            st.prompt_tokens = len(s.prompt_ids)
            s.state = DecodeState(self.tokenizer, s.prompt_ids, s.params, self._n_ctx)
            st.tokens = s.state.tokens
        try:
            if s.cache is None:
                s.cache = self.model.new_cache()
            end = min(s.prefilled + self.prefill_chunk, len(s.prompt_ids))
            chunk = s.prompt_ids[s.prefilled:end]
            nowait = getattr(self.model, "prefill_nowait", None)  # a pipelined model: stages overlap chunks
            if end < len(s.prompt_ids) and nowait is not None:
                nowait(chunk, s.cache, self.executor)  # no logits needed: the next chunk may start now
                s.prefilled = end
                st.prefill_s += time.perf_counter() - t0
                return
            logits = forward_last(self.model, chunk, s.cache, self.executor)
            s.prefilled = end
            st.prefill_s += time.perf_counter() - t0
            if end < len(s.prompt_ids):
                return
            ev = s.state.step(logits)
        except Exception as e:  # a model failure must reach the client, not kill the thread
            self._fail([s], e)
            return
        self._emit(s, ev)

    def _forward_one(self, tok: int, cache: Any) -> np.ndarray:
        return forward_last(self.model, [tok], cache, self.executor)

    def _forward_batch(self, ids: np.ndarray, caches: list[Any]) -> np.ndarray:
        if self.executor is None:
            return np.asarray(self.model.forward_batch(ids, caches))
        return np.asarray(self.model.forward_batch(ids, caches, executor=self.executor))

    def _note_cost(self, b: int, seconds: float) -> None:
        old = self._cost.get(b)
        self._cost[b] = seconds if old is None else old + _COST_EMA * (seconds - old)

    def _use_batch(self, b: int) -> bool:
        """Batch the decode step of b >= 2 sequences only where it pays (an MoE batch touches more experts,
        so a batched step can cost as much as b single steps). Decided from moving averages of measured
        step times; each mode is re-tried every ``_EXPLORE_EVERY`` decisions so the estimate follows load."""
        if self.batching != "auto":
            return self.batching == "always"
        cb, c1 = self._cost.get(b), self._cost.get(1)
        if cb is None:
            return True
        if c1 is None:
            return False
        self._decisions += 1
        batch = cb < b * c1
        return (not batch) if self._decisions % _EXPLORE_EVERY == 0 else batch

    def _decode_step(self) -> None:
        with self._lock:
            seqs = [s for s in self._running if s.state is not None and s.state.tokens and
                    s.state.finish_reason is None]
        live = []
        for s in seqs:
            if s.handle.cancelled:
                self._end(s, s.state.cancelled())  # type: ignore[union-attr]
            else:
                live.append(s)
        if not live:
            return
        self.steps += 1
        if (self.batching != "never" and getattr(self.model, "start_one", None) is not None
                and (len(live) > 1 or live[0].inflight is not None)):
            self._decode_rolling(live)
            return
        if len(live) == 1 or not self._use_batch(len(live)):
            self._decode_each(live)
            return
        t0 = time.perf_counter()
        ids = np.asarray([s.state.last_token for s in live], dtype=np.int64)  # type: ignore[union-attr]
        lengths = [getattr(s.cache, "length", None) for s in live]
        try:
            logits = self._forward_batch(ids, [s.cache for s in live])
        except Exception as e:  # noqa: BLE001 - which sequence failed is found by stepping each alone
            self._after_failed_batch(live, lengths, e)
            return
        dt = time.perf_counter() - t0
        self._note_cost(len(live), dt)
        self.batched_steps += 1
        for i, s in enumerate(live):
            try:
                ev = s.state.step(logits[i])  # type: ignore[union-attr]
            except Exception as e:  # one sequence's failure (sampling, a constraint) ends that sequence only
                self._fail([s], e)
                continue
            s.handle.stats.decode_s += dt
            self._emit(s, ev)

    def _decode_each(self, seqs: Sequence[_Seq]) -> None:
        """One single-token forward per sequence; events go out as soon as each is ready, and a failure ends
        only the sequence whose step failed."""
        for s in seqs:
            if s.handle.cancelled:
                self._end(s, s.state.cancelled())  # type: ignore[union-attr]
                continue
            t0 = time.perf_counter()
            if trace.ON:
                trace.mark("X.tok")
            try:
                logits = self._forward_one(s.state.last_token, s.cache)  # type: ignore[union-attr]
                if trace.ON:
                    trace.mark("X.fwd")
                dt = time.perf_counter() - t0
                self._note_cost(1, dt)
                ev = s.state.step(logits)  # type: ignore[union-attr]
            except Exception as e:  # a model failure must reach the client, not kill the thread
                self._fail([s], e)
                continue
            s.handle.stats.decode_s += time.perf_counter() - t0
            self._emit(s, ev)

    def _after_failed_batch(self, live: Sequence[_Seq], lengths: Sequence[int | None], e: Exception) -> None:
        """A batched decode step raised: which sequence's step fails is not known, so each takes its step alone
        (``_decode_each``), and only those that fail alone end with an error. A cache the failed batch advanced
        anyway is put back (``truncate``) first; one that cannot be put back ends with the batch's error."""
        log.warning("batched_step_failed", model=self.name, error=str(e), error_type=type(e).__name__,
                    requests=len(live))
        retry = []
        for s, n in zip(live, lengths):
            now = getattr(s.cache, "length", None)
            if now != n:
                try:
                    s.cache.truncate(n)  # type: ignore[union-attr]
                except Exception:  # noqa: BLE001 - no way back for this cache: its sequence ends here
                    self._fail([s], e)
                    continue
            retry.append(s)
        self._decode_each(retry)

    def _decode_rolling(self, live: list[_Seq]) -> None:
        """One rolling decode step (see the module docstring): for each sequence, oldest step first, take
        its step in flight (if any), emit its token, and start its next step while more than one sequence
        runs (a lone sequence takes the plain path: its step waits at once, and may poll). A model that
        batches steps (``decode_groups``, ``start_many``: a pipeline on the compiled kernels) gets them in
        groups: each sequence taken joins the next group, which starts once it has its share of the live
        sequences, so the groups roll through the processes as single sequences do."""
        self.batched_steps += 1
        groups = getattr(self.model, "decode_groups", None)
        n = groups([s.cache for s in live]) if groups is not None else 0
        size = -(-len(live) // n) if n > 0 else 0
        ready: list[_Seq] = []
        for s in live:
            if s.handle.cancelled:
                self._end(s, s.state.cancelled())  # type: ignore[union-attr]
                continue
            t0 = time.perf_counter()
            try:
                if s.inflight is not None:
                    pending, s.inflight = s.inflight, None
                    logits = self.model.finish_one(pending, self.executor)
                    ev = s.state.step(logits)  # type: ignore[union-attr]
                    t1 = time.perf_counter()
                    s.handle.stats.decode_s += t1 - t0
                    t0 = t1
                    if not self._emit(s, ev):
                        continue
                if size:
                    ready.append(s)
                    if len(ready) >= size:
                        self._start_group(ready)
                        ready = []
                elif len(live) > 1:
                    tok = s.state.last_token  # type: ignore[union-attr]
                    s.inflight = self.model.start_one(tok, s.cache, self.executor)
                    s.handle.stats.decode_s += time.perf_counter() - t0
            except Exception as e:  # a model failure must reach the client, not kill the thread
                self._fail([s], e)
        if ready:
            self._start_group(ready)

    def _start_group(self, group: list[_Seq]) -> None:
        """One batched step of ``group`` (``model.start_many``); its time counts to each member's decode.
        If it raises, which member's step failed is not known: as after a failed batched step
        (``_after_failed_batch``) each member's cache the group advanced anyway is put back (``truncate``;
        one that cannot be ends with the group's error) and each starts its step alone
        (``model.start_one``), so only a member whose lone step fails ends, with its own error."""
        t0 = time.perf_counter()
        lengths = [getattr(s.cache, "length", None) for s in group]
        try:
            started = self.model.start_many([s.state.last_token for s in group],  # type: ignore[union-attr]
                                            [s.cache for s in group], self.executor)
        except Exception as e:  # noqa: BLE001 - which member failed is found by starting each alone
            self._after_failed_group(group, lengths, e)
            return
        dt = time.perf_counter() - t0
        for s, pending in zip(group, started):
            s.inflight = pending
            s.handle.stats.decode_s += dt

    def _after_failed_group(self, group: Sequence[_Seq], lengths: Sequence[int | None], e: Exception) -> None:
        log.warning("group_step_failed", model=self.name, error=str(e), error_type=type(e).__name__,
                    requests=len(group))
        for s, n in zip(group, lengths):
            if s.handle.cancelled:
                self._end(s, s.state.cancelled())  # type: ignore[union-attr]
                continue
            if getattr(s.cache, "length", None) != n:
                try:
                    s.cache.truncate(n)  # type: ignore[union-attr]
                except Exception:  # noqa: BLE001 - no way back for this cache: its sequence ends here
                    self._fail([s], e)
                    continue
            t0 = time.perf_counter()
            tok = s.state.last_token  # type: ignore[union-attr]
            try:
                s.inflight = self.model.start_one(tok, s.cache, self.executor)
            except Exception as e1:  # noqa: BLE001 - a model failure must reach the client, not kill the thread
                self._fail([s], e1)
                continue
            s.handle.stats.decode_s += time.perf_counter() - t0
