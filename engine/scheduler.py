"""A bounded, batching scheduler: one thread runs up to ``max_active`` sequences of one model.

``submit(prompt_ids, params)`` validates (``ValueError``), then either admits the request or raises
``Busy`` when ``max_active`` requests are already admitted (the API answers 429 with Retry-After). It
returns a ``RequestHandle``: iterate it with ``for ev in handle`` from a thread, or ``async for ev in
handle`` from asyncio (events are handed to the loop with ``loop.call_soon_threadsafe``; pass ``loop=`` or
submit from inside the loop). ``handle.cancel()`` ends the request within one decode step with a
``cancelled`` event; a closed consumer loop cancels it too.

Each iteration of the scheduler thread, in this order: (1) end cancelled requests, (2) prefill at most
one newly admitted request (so a long prompt delays running ones by one prefill, not many), (3) one
decode step for every running sequence: ``model.forward_batch`` when two or more are running, else
``model.forward``. Events come from ``engine.generate.DecodeState``, the same state machine ``generate``
uses, so a request's tokens do not depend on what else is running (given a model whose batched step
equals its single step). A model exception ends the affected requests with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from transport.limits import MAX_ACTIVE_SEQUENCES

from engine.generate import DecodeState, GenerationStats, TokenEvent, check_request, context_length
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
        while not self._done:
            item = self._sync.get()
            if item is _END:
                self._done = True
                return
            yield item

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
    next_logits: np.ndarray | None = field(default=None, repr=False)


class Scheduler:
    """Runs requests for one model on a background thread. Call ``close()`` when done."""

    def __init__(self, model: Any, tokenizer: Tokenizer, max_active: int = DEFAULT_MAX_ACTIVE,
                 *, executor: Any = None, name: str = "model") -> None:
        if max_active < 1:
            raise ValueError("max_active must be at least 1")
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
                running = list(self._running)
                new = self._pending.popleft() if self._pending else None
                if new is not None:
                    self._running.append(new)  # counted as admitted throughout (Busy stays exact)
            for s in running:
                if s.handle.cancelled:
                    self._end(s, s.state.cancelled() if s.state else TokenEvent(None, "", None, (), "cancelled"))
            if new is not None:
                self._prefill(new)
            self._decode_step()

    def _end(self, s: _Seq, ev: TokenEvent) -> None:
        s.handle.stats.finish_reason = ev.finish_reason
        s.handle._push(ev)
        s.handle._push(_END)
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
            self._end(s, TokenEvent(None, "", None, (), "error", error=f"{type(e).__name__}: {e}"))

    def _prefill(self, s: _Seq) -> None:
        st = s.handle.stats
        st.queue_s = time.perf_counter() - s.submitted
        st.prompt_tokens = len(s.prompt_ids)
        s.state = DecodeState(self.tokenizer, s.prompt_ids, s.params, self._n_ctx)
        st.tokens = s.state.tokens
        if s.handle.cancelled:
            self._end(s, s.state.cancelled())
            return
        t0 = time.perf_counter()
        try:
            s.cache = self.model.new_cache()
            ids = np.asarray(s.prompt_ids, dtype=np.int64)
            if self.executor is None:
                logits = np.asarray(self.model.forward(ids, s.cache))[-1]
            else:
                logits = np.asarray(self.model.forward(ids, s.cache, executor=self.executor))[-1]
            st.prefill_s = time.perf_counter() - t0
            ev = s.state.step(logits)
        except Exception as e:  # a model failure must reach the client, not kill the thread
            self._fail([s], e)
            return
        self._emit(s, ev)

    def _decode_step(self) -> None:
        with self._lock:
            seqs = [s for s in self._running if s.state is not None and s.state.tokens and
                    s.state.finish_reason is None]
        if not seqs:
            return
        live = []
        for s in seqs:
            if s.handle.cancelled:
                self._end(s, s.state.cancelled())  # type: ignore[union-attr]
            else:
                live.append(s)
        if not live:
            return
        t0 = time.perf_counter()
        ids = np.asarray([s.state.last_token for s in live], dtype=np.int64)  # type: ignore[union-attr]
        try:
            if len(live) == 1:
                if self.executor is None:
                    logits = np.asarray(self.model.forward(ids, live[0].cache))[-1:]
                else:
                    logits = np.asarray(self.model.forward(ids, live[0].cache, executor=self.executor))[-1:]
            else:
                if self.executor is None:
                    logits = np.asarray(self.model.forward_batch(ids, [s.cache for s in live]))
                else:
                    logits = np.asarray(self.model.forward_batch(ids, [s.cache for s in live],
                                                                 executor=self.executor))
                self.batched_steps += 1
            self.steps += 1
            events = [s.state.step(logits[i]) for i, s in enumerate(live)]  # type: ignore[union-attr]
        except Exception as e:
            self._fail(live, e)
            return
        dt = time.perf_counter() - t0
        for s, ev in zip(live, events):
            s.handle.stats.decode_s += dt
            self._emit(s, ev)
