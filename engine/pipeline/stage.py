"""What a stage node runs: the layers it was given and the KV caches of the sequences passing through.

``StageHost(path, fingerprint, pin)``; ``await host.serve(channel, peer_id)`` answers one PIPELINE stream
(a serving node's session; it may open several runs on it) until it ends. Per frame:

- ``OPEN(run, first, last, num_layers, fp)``: refuse another checkpoint (``FINGERPRINT_MISMATCH``, naming
  ours) or a range against our pin (``BAD_RANGE``); load exactly layers first..last (memory-mapped, other
  layers never touched; kept while a run uses them) and answer ``READY``.
- ``FORWARD(run, step, spans, x)``: run our layers over x (a thread; ``KEEPALIVE`` every
  ``KEEPALIVE_S`` meanwhile), the sequences' caches keyed by (run, seq) created at start 0; a start that is
  not the cache's length is ``POSITION_MISMATCH`` (state lost: the serving node replays). The stage
  holding the last layer answers logits (``FLAG_LOGITS``), the others hidden states.
- ``FREE(run, seqs)``: drop those caches (all of the run's when empty).

A stream that ends or breaks frees every cache of its runs; a cache idle for ``SEQ_IDLE_S`` is freed by
``sweep``. ``status()`` shows loaded ranges and live sequences per run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from engine import numerics
from engine.decode_plan import forward_span
from engine.moe import drive
from engine.pipeline import limits, trace, wire
from engine.pipeline.batch import batch_step
from transport import poll

log = structlog.get_logger(__name__)

ExecutorFactory = Callable[[Any], Any]  # (model part) -> expert executor, or None for local experts


@dataclass
class _Seq:
    cache: Any
    used: float
    redo: tuple[int, np.ndarray] | None = None  # (start, input row) of its last step if that came over a direct
    #   channel: the serving node may not have its reply, and may send the same step again on the stream. The
    #   row is a view of the direct message's own buffer (``wire.decode_one(owned=True)``), which nothing
    #   writes to: kept, not copied, and compared bit for bit only when a step comes again


class StageError(Exception):
    def __init__(self, code: wire.ErrorCode, text: str) -> None:
        super().__init__(text)
        self.code = code


class StageHost:
    """See the module docstring. ``load(path, first, last)`` builds a model part (default ``Model.load``)."""

    def __init__(
        self,
        path: str | Path,
        fingerprint: bytes,
        pin: tuple[int, int] | None = None,
        *,
        load: Callable[[Path, int, int], Any] | None = None,
        executor_for: Callable[[Any], Any] | None = None,
        numerics_tag: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        # this process's numerics tag (engine/numerics.py): an OPEN from a serving node with another is refused
        self.numerics = numerics_tag if numerics_tag is not None else numerics.tag()
        self.pin = pin
        self._load = load or _load_part
        self._executor_for = executor_for
        self.parts: dict[tuple[int, int], Any] = {}
        self.executors: dict[tuple[int, int], Any] = {}
        self.runs: dict[int, tuple[int, int]] = {}  # run -> its range
        self.owners: dict[int, str] = {}  # run -> the node that opened it (on its stream; direct steps too)
        self.seqs: dict[tuple[int, int], _Seq] = {}  # (run, seq) -> cache
        self.steps = 0
        self.compute_s = 0.0
        self.direct_steps = 0  # one-row steps answered over a direct channel (engine.pipeline.direct)
        self.rewound = 0  # steps taken again on the stream after their direct reply was lost
        self.loading: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._lock = threading.Lock()  # seqs is touched by the loop (free, sweep) and compute threads
        self.max_buffered_bytes = limits.MAX_BUFFERED_BYTES  # partly received frames over all streams
        self._buffered: dict[int, int] = {}  # stream (id of its decoder) -> bytes of its partial frame
        self._step_lock = threading.Lock()  # one decode-sized step at a time: the loop's inline steps and
        #   the direct channels' threads (a step taken again on the stream waits for the direct one)

    # --- state ------------------------------------------------------------------------------------

    def live(self, run: int | None = None) -> int:
        with self._lock:
            return sum(1 for (r, _s) in self.seqs if run is None or r == run)

    def free(self, run: int, seqs: tuple[int, ...] = ()) -> int:
        """Drop caches of ``run`` (all of them when ``seqs`` is empty); -> how many."""
        with self._lock:
            keys = [k for k in self.seqs if k[0] == run and (not seqs or k[1] in seqs)]
            for k in keys:
                del self.seqs[k]
        if not seqs:
            self.runs.pop(run, None)
            self.owners.pop(run, None)
            self._drop_unused_parts()
        return len(keys)

    def _drop_unused_parts(self) -> None:
        """Unload ranges no run uses, except the newest one: the next plan most likely gives the same range
        again (a re-plan after a failure, a pinned stage), and loading it anew would map the file twice."""
        used = set(self.runs.values())
        unused = [r for r in self.parts if r not in used]
        keep = unused[-1:] if not used else []
        dropped = False
        for rng in unused:
            if rng in keep:
                continue
            del self.parts[rng]
            self.executors.pop(rng, None)
            dropped = True
            log.info("pipeline_stage_unloaded", first=rng[0], last=rng[1])
        if dropped:
            gc.collect()  # a model part is in a reference cycle (its executor); release its mapping now

    def sweep(self, now: float) -> int:
        """Free caches idle longer than ``SEQ_IDLE_S``; -> how many."""
        with self._lock:
            old = [k for k, s in self.seqs.items() if now - s.used > limits.SEQ_IDLE_S]
            for k in old:
                del self.seqs[k]
        if old:
            log.info("pipeline_stage_idle_freed", sequences=len(old))
        return len(old)

    def status(self) -> dict[str, Any]:
        runs: dict[str, int] = {f"{r:016x}": 0 for r in self.runs}
        with self._lock:
            keys = list(self.seqs)
        for r, _s in keys:
            runs[f"{r:016x}"] = runs.get(f"{r:016x}", 0) + 1
        return {
            "path": str(self.path),
            "fingerprint": self.fingerprint.hex()[:16],
            "pin": list(self.pin) if self.pin else None,
            "loaded": [list(r) for r in sorted(self.parts)],
            "live_sequences": len(keys),
            "runs": runs,
            "steps": self.steps,
            "direct_steps": self.direct_steps,
            "rewound": self.rewound,
            "compute_ms_avg": round(self.compute_s / self.steps * 1e3, 3) if self.steps else 0.0,
        }

    # --- the stream -------------------------------------------------------------------------------

    async def serve(self, channel: Any, peer_id: str = "") -> None:
        """Answer one stream until it ends; every run opened on it is freed then.

        Frames are read by callback as their packets arrive (``set_receiver``). A decode step (at most
        ``INLINE_ROWS`` rows, experts local), a ping and a FREE are answered inside that callback, the reply
        flushed there: no task wake, no queue. Everything else (OPEN, prefill chunks, delegated experts),
        and whatever arrives while such a frame is still being handled, goes through a queue to this
        coroutine, in order."""
        dec = wire.FrameDecoder()
        mine: set[int] = set()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        busy = False  # this coroutine is handling a frame (frames behind it must queue)
        poller, hold = poll.poller(), object()  # FLAG_POLL: poll for the next frame instead of sleeping
        answered = 0.0  # when the last step asking for it was answered (0: none pending)
        gap = limits.POLL_MAX_S / 4  # moving average of the wait from such an answer to the next frame

        refused = False  # this stream went over the stage's buffer budget: nothing more is read
        closed = False  # the coroutine is being closed: its finally may not await

        def on_data(data: bytes) -> None:
            nonlocal answered, gap, refused
            t_rx = time.monotonic_ns() if trace.ON else 0
            if answered:
                poller.release(hold)
                waited = min(time.perf_counter() - answered, 2 * limits.POLL_MAX_S)
                gap += limits.POLL_EMA * (waited - gap)
                answered = 0.0
            if refused:
                return
            try:
                frames = dec.feed(data)
            except wire.RemoteProtocolError as e:
                queue.put_nowait(e)
                return
            if not self._hold(id(dec), dec.buffered):
                refused = True
                queue.put_nowait(wire.RemoteProtocolError(
                    wire.ErrorCode.PROTOCOL,
                    f"frames being received hold over {self.max_buffered_bytes} bytes on this stage"))
                return
            for f in frames:
                if trace.ON and isinstance(f, wire.Forward) and f.x.shape[0] == 1:
                    trace.mark_at("T.rx", t_rx)
                unsent = None if busy or not queue.empty() else self._answer_now(channel, f, mine)
                if unsent is None:
                    queue.put_nowait(f)
                    continue
                if unsent:  # answered, but the reply could not be written at once: in order, queued
                    queue.put_nowait(_Unsent(unsent))
                if isinstance(f, wire.Forward) and f.poll and gap < limits.POLL_MAX_S:
                    answered = time.perf_counter()
                    poller.hold(hold, min(gap * limits.POLL_MARGIN + limits.POLL_SLACK_S, limits.POLL_MAX_S))

        def on_end(error: Exception | None) -> None:
            queue.put_nowait(error)

        try:
            channel.set_receiver(on_data, on_end)
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, wire.RemoteProtocolError):
                    log.info("pipeline_stage_protocol_error", peer=peer_id[:12], reason=item.reason)
                    await _send(channel, wire.Error(0, wire.ErrorCode.PROTOCOL, item.reason))
                    break
                if isinstance(item, Exception):
                    raise item
                busy = True
                try:
                    if isinstance(item, _Unsent):
                        await _send_data(channel, item.data)
                    else:
                        await self._handle(channel, item, mine, peer_id)
                finally:
                    busy = False
        except Exception as e:  # noqa: BLE001 - a broken stream ends the session, never the daemon
            log.info("pipeline_stage_stream_ended", peer=peer_id[:12], error=repr(e))
        except GeneratorExit:  # closed, not cancelled (a task destroyed pending): free, but await nothing
            closed = True
            raise
        finally:
            poller.release(hold)
            self._buffered.pop(id(dec), None)
            freed = sum(self.free(r) for r in list(mine))
            log.info("pipeline_stage_session_closed", peer=peer_id[:12], runs=len(mine), freed=freed)
            if not closed:
                with contextlib.suppress(Exception):
                    await channel.send(b"", end=True)  # our side is done too (the serving node's reader ends)

    def _hold(self, stream: int, held: int) -> bool:
        """Account ``held`` bytes of a partial frame on ``stream`` (loop thread); False (and nothing held) if
        that takes the stage over ``max_buffered_bytes`` over all its streams."""
        if not held:
            self._buffered.pop(stream, None)
            return True
        others = sum(n for k, n in self._buffered.items() if k != stream)
        if others + held > self.max_buffered_bytes:
            self._buffered.pop(stream, None)
            return False
        self._buffered[stream] = held
        return True

    def _answer_now(self, channel: Any, f: wire.Frame, mine: set[int]) -> bytes | None:
        """Answer ``f`` inside the read callback if it is quick (a decode step, a ping, a FREE). -> None:
        not handled (it goes the queued way); b"": answered; else the reply's bytes, which could not be
        written at once (the caller queues them, so later replies stay behind them)."""
        if isinstance(f, wire.Keepalive):  # a ping from the serving node: echo it at once
            data = wire.encode(f)
        elif isinstance(f, wire.Free):
            self._free_frame(f, mine)
            return b""
        elif not isinstance(f, wire.Forward) or f.run not in mine or f.x.shape[0] > limits.INLINE_ROWS:
            return None
        else:
            rng = self.runs[f.run]
            if rng in self.executors:  # experts delegated from this stage: the queued way (it awaits them)
                return None
            reply = self._step_reply(self.parts[rng], None, f)
            data = wire.encode(reply)
            if trace.ON and isinstance(reply, wire.Result) and reply.x.shape[0] == 1:
                trace.mark("T.sent")
        if len(data) <= limits.SEND_CHUNK_BYTES and channel.send_now(data):
            return b""
        return data

    def direct_step(self, f: wire.Forward, peer_id: str) -> wire.Frame:
        """A step that came over a direct channel from ``peer_id`` (its thread): a decode step (one row of each
        sequence, at most ``INLINE_ROWS``) of a run that ``peer_id`` opened on its stream and has not freed;
        computed as the stream's inline steps are (``_step_reply``). -> its RESULT, or the ERROR that says why not (the serving node then sends the step
        on its stream)."""
        if self.owners.get(f.run) != peer_id:
            return wire.Error(f.step, wire.ErrorCode.UNKNOWN_RUN, f"run {f.run:016x} is not open here")
        if not _one_row_each(f) or len(f.spans) > limits.INLINE_ROWS:  # (as many rows as spans)
            return wire.Error(f.step, wire.ErrorCode.PROTOCOL, "a direct step is a decode step (a row a sequence)")
        rng = self.runs.get(f.run)
        part = self.parts.get(rng) if rng is not None else None
        if part is None:
            return wire.Error(f.step, wire.ErrorCode.UNKNOWN_RUN, f"run {f.run:016x} is not open here")
        if rng in self.executors:
            return wire.Error(f.step, wire.ErrorCode.PROTOCOL, "experts delegated here: steps go on the stream")
        reply = self._step_reply(part, None, f, direct=True)
        if isinstance(reply, wire.Result):
            self.direct_steps += 1
        return reply

    def _step_reply(self, part: Any, executor: Any, f: wire.Forward, direct: bool = False) -> wire.Frame:
        """Run a step here and now -> its RESULT, or the ERROR that says why not."""
        try:
            with self._step_lock:
                out, logits, us = self._compute(part, executor, f, direct)
        except StageError as e:
            return wire.Error(f.step, e.code, str(e))
        except Exception as e:  # noqa: BLE001 - the layers failed: say why, keep serving
            log.warning("pipeline_stage_compute_failed", error=repr(e))
            return wire.Error(f.step, wire.ErrorCode.COMPUTE_FAILED, f"{type(e).__name__}: {e}")
        return wire.Result(f.run, f.step, us, out, logits)

    def _free_frame(self, f: wire.Free, mine: set[int]) -> None:
        if f.run in mine:
            n = self.free(f.run, f.seqs)
            if not f.seqs:
                mine.discard(f.run)
            log.debug("pipeline_stage_freed", run=f"{f.run:016x}", sequences=n)

    async def _handle(self, channel: Any, f: wire.Frame, mine: set[int], peer_id: str = "") -> None:
        if isinstance(f, wire.Open):
            task = asyncio.ensure_future(self._open(f))
            while True:  # loading may take a while: say we are alive meanwhile
                done, _ = await asyncio.wait({task}, timeout=limits.KEEPALIVE_S)
                if done:
                    break
                await _send(channel, wire.Keepalive(0))
            try:
                ready = task.result()
            except StageError as e:
                await _send(channel, wire.Error(0, e.code, str(e)))
                return
            mine.add(f.run)
            self.owners[f.run] = peer_id
            await _send(channel, ready)
        elif isinstance(f, wire.Forward):
            await self._forward(channel, f, mine)
        elif isinstance(f, wire.Keepalive):  # a ping from the serving node: echo it at once
            await _send(channel, f)
        elif isinstance(f, wire.Free):
            self._free_frame(f, mine)
        else:
            await _send(
                channel, wire.Error(0, wire.ErrorCode.PROTOCOL, f"a stage does not take {type(f).__name__}")
            )

    async def _open(self, f: wire.Open) -> wire.Ready:
        if f.fingerprint != self.fingerprint:
            raise StageError(
                wire.ErrorCode.FINGERPRINT_MISMATCH,
                f"this stage holds checkpoint {self.fingerprint.hex()[:16]} ({self.path.name}), "
                f"not {f.fingerprint.hex()[:16]}",
            )
        if f.numerics and f.numerics != self.numerics:  # none: an older serving node, nothing to check
            raise StageError(
                wire.ErrorCode.NUMERICS_MISMATCH,
                "this stage computes with other numerics than the serving node: "
                + numerics.difference(self.numerics, f.numerics, "on this stage", "on the serving node"),
            )
        if self.pin is not None and (f.first, f.last) != self.pin:
            raise StageError(
                wire.ErrorCode.BAD_RANGE,
                f"this stage is pinned to layers {self.pin[0]}-{self.pin[1]}, asked for {f.first}-{f.last}",
            )
        rng = (f.first, f.last)
        t0 = time.perf_counter()
        if rng not in self.parts:
            fut = self.loading.get(rng)
            if fut is None:
                fut = asyncio.ensure_future(asyncio.to_thread(self._load, self.path, f.first, f.last))
                self.loading[rng] = fut
            try:
                part = await asyncio.shield(fut)
            except Exception as e:  # noqa: BLE001 - reported to the serving node by name
                self.loading.pop(rng, None)
                raise StageError(
                    wire.ErrorCode.LOAD_FAILED, f"cannot load layers {f.first}-{f.last}: {e}"
                ) from None
            self.loading.pop(rng, None)
            if part.config.num_layers != f.num_layers:
                raise StageError(
                    wire.ErrorCode.BAD_RANGE,
                    f"the model has {part.config.num_layers} layers, not {f.num_layers}",
                )
            self.parts[rng] = part
            if self._executor_for is not None:
                self.executors[rng] = await self._executor_for(part)
            log.info(
                "pipeline_stage_loaded",
                first=f.first,
                last=f.last,
                load_ms=round((time.perf_counter() - t0) * 1e3, 1),
            )
        self.runs[f.run] = rng
        return wire.Ready(f.run, f.first, f.last, int((time.perf_counter() - t0) * 1e3))

    async def _forward(self, channel: Any, f: wire.Forward, mine: set[int]) -> None:
        if f.run not in mine:
            await _send(
                channel, wire.Error(f.step, wire.ErrorCode.UNKNOWN_RUN, f"run {f.run:016x} is not open here")
            )
            return
        rng = self.runs[f.run]
        part, executor = self.parts[rng], self.executors.get(rng)
        inline = f.x.shape[0] <= limits.INLINE_ROWS and executor is None
        task: asyncio.Future[Any] | None = None
        if not inline:  # a prefill chunk (or experts delegated from this stage): a thread, KEEPALIVE meanwhile
            task = asyncio.ensure_future(asyncio.to_thread(self._compute, part, executor, f))
            while True:
                done, _ = await asyncio.wait({task}, timeout=limits.KEEPALIVE_S)
                if done:
                    break
                await _send(channel, wire.Keepalive(f.step))
        # a decode step queued behind other work runs right here: a few ms
        if task is None:
            reply = self._step_reply(part, executor, f)
        else:
            try:
                out, logits, us = task.result()
                reply = wire.Result(f.run, f.step, us, out, logits)
            except StageError as e:
                reply = wire.Error(f.step, e.code, str(e))
            except Exception as e:  # noqa: BLE001 - the layers failed: say why, keep serving
                log.warning("pipeline_stage_compute_failed", error=repr(e))
                reply = wire.Error(f.step, wire.ErrorCode.COMPUTE_FAILED, f"{type(e).__name__}: {e}")
        await _send(channel, reply)

    def _compute(self, part: Any, executor: Any, f: wire.Forward,
                 direct: bool = False) -> tuple[np.ndarray, bool, int]:
        """Our layers over f.x (a worker thread). -> (hidden or logits, is logits, compute µs)."""
        if trace.ON and f.x.shape[0] == 1:
            trace.mark("T.c0")
        t0 = time.perf_counter()
        now = time.monotonic()
        _check_forward(part.config, f)
        with self._lock:
            caches = self._caches(part, f, now, direct)
            crowded = f.x.shape[0] == 1 and SERIAL and self._crowded(now)
        ex = executor or part.local_executor
        logits = part.lm_head is not None
        planned = None
        if len(f.spans) == 1:
            s, cache = f.spans[0], caches[0]
            if s.count == 1 and executor is None:  # a one-token step: the decode plan's layer-range form
                with serial_if(crowded):
                    planned = forward_span(part, f.x, cache, None, logits)
            if planned is None:
                cache.reserve(s.start + s.count)
                x = drive(part.span_steps(f.x, cache, s.start), ex, part.warm)
            else:
                x = planned
            cache.length = s.start + s.count
            if f.last_only and logits:
                x = x[-1:]
        elif all(s.count == 1 for s in f.spans):  # a batched decode step: every row its lone step's bits
            step = batch_step(part) if executor is None else None
            if step is not None:
                x = step.run(f.x, caches, logits)
            else:
                x = _lone_rows(part, executor, f.x, caches, logits)
            planned = x
            for c in caches:
                c.length += 1
        else:
            for c in caches:
                c.reserve(c.length + 1)
            pos = np.array([s.start for s in f.spans], dtype=np.int64)
            x = drive(part.span_batch_steps(f.x, caches, pos), ex, part.warm)
            for c in caches:
                c.length += 1
        if logits and planned is None:
            x = part.logits(x)
        dt = time.perf_counter() - t0
        if trace.ON and f.x.shape[0] == 1:
            trace.mark("T.c1")
        self.steps += 1
        self.compute_s += dt
        return x, logits, int(dt * 1e6)

    def _crowded(self, now: float) -> bool:
        """Whether another sequence (any run) stepped within ``CROWDED_WINDOW_S`` (lock held)."""
        n = 0
        for entry in self.seqs.values():
            if now - entry.used < limits.CROWDED_WINDOW_S:
                n += 1
                if n > 1:
                    return True
        return False

    def _caches(self, part: Any, f: wire.Forward, now: float, direct: bool = False) -> list[Any]:
        """The caches of f's sequences (lock held), created at position 0. In a decode step (a row a sequence),
        a sequence one position ahead of its start whose last step came over a direct channel with exactly this
        row as input is rewound by that step (the serving node lost the direct reply and sent the step again on
        its stream): the row is computed again over the same positions, so the cache and the reply get the same
        bits (every row of a step has its lone step's bits)."""
        caches = []
        rows = _one_row_each(f)
        rewind: list[Any] = []  # caches to rewind once every span is known to be fine
        for r, s in enumerate(f.spans):
            entry = self.seqs.get((f.run, s.seq))
            if entry is None:
                if s.start != 0:
                    raise StageError(
                        wire.ErrorCode.POSITION_MISMATCH,
                        f"sequence {s.seq} has no state here (asked from position {s.start})",
                    )
                if len(self.seqs) >= limits.MAX_LIVE_SEQUENCES:
                    raise StageError(
                        wire.ErrorCode.TOO_MANY_SEQUENCES, f"{len(self.seqs)} sequences live here"
                    )
                entry = _Seq(part.new_cache(), now)
                self.seqs[(f.run, s.seq)] = entry
            if entry.cache.length != s.start:
                redo = entry.redo
                if not (rows and redo is not None and entry.cache.length == s.start + 1
                        and redo[0] == s.start and redo[1].tobytes() == f.x[r].tobytes()):
                    raise StageError(
                        wire.ErrorCode.POSITION_MISMATCH,
                        f"sequence {s.seq} is at position {entry.cache.length}, asked from {s.start}",
                    )
                rewind.append(entry.cache)
            caches.append(entry.cache)
        for cache in rewind:
            cache.truncate(cache.length - 1)
        self.rewound += len(rewind)
        for r, s in enumerate(f.spans):
            entry = self.seqs[(f.run, s.seq)]
            entry.redo = (s.start, f.x[r]) if direct and rows else None
            entry.used = now
        return caches


def _check_forward(config: Any, f: wire.Forward) -> None:
    """Refuse (``StageError``) a FORWARD no honest serving node sends, before any state or memory: rows of
    another width than the model's hidden size (the compiled kernels trust their shapes), positions past the
    model's context (a serving node stops there; a KV cache would otherwise grow frame after frame), one
    sequence twice in a batched step (its cache would move two positions for one written)."""
    width, d = int(f.x.shape[1]), config.hidden_size
    if width != d:
        raise StageError(wire.ErrorCode.PROTOCOL, f"activations of width {width}, the model's is {d}")
    ctx = config.max_position_embeddings
    for s in f.spans:
        if s.start + s.count > ctx:
            raise StageError(wire.ErrorCode.CONTEXT_EXCEEDED,
                             f"positions {s.start}-{s.start + s.count - 1} of sequence {s.seq} are past the "
                             f"model's context ({ctx})")
    seen: set[int] = set()
    for s in f.spans:
        if s.seq in seen:
            raise StageError(wire.ErrorCode.PROTOCOL, f"sequence {s.seq} appears twice in one step")
        seen.add(s.seq)


def _one_row_each(f: wire.Forward) -> bool:
    """Whether ``f`` is a decode step: one row of each of its sequences."""
    spans = f.spans
    if len(spans) == 1:  # a lone step (on the hop, with cold caches: no generator)
        return spans[0].count == 1 and f.x.shape[0] == 1
    return f.x.shape[0] == len(spans) and all(s.count == 1 for s in spans)


SERIAL = os.environ.get("MESHD_PIPELINE_SERIAL", "0") == "1"  # off by default: see limits.CROWDED_WINDOW_S


def serial_if(crowded: bool) -> Any:
    """``kernels.single_threaded()`` when ``crowded`` (and the kernels are loaded at all: without them no
    product uses a pool), else a no-op context."""
    kernels = sys.modules.get("engine.kernels")
    if crowded and kernels is not None and hasattr(kernels, "single_threaded"):
        return kernels.single_threaded()
    return contextlib.nullcontext()


def _lone_rows(part: Any, executor: Any, x: np.ndarray, caches: list[Any], logits: bool) -> np.ndarray:
    """Each row of a batched decode step as its own one-token step (no ``BatchStep`` here: without numba, or
    with delegated experts), so each has its lone step's bits. -> hidden [B, D] or logits [B, V]."""
    out = []
    for r, cache in enumerate(caches):
        xr = x[r : r + 1]
        got = forward_span(part, xr, cache, None, logits) if executor is None else None
        if got is None:
            cache.reserve(cache.length + 1)
            got = drive(part.span_steps(xr, cache, cache.length), executor or part.local_executor, part.warm)
            if logits:
                got = part.logits(got)
        out.append(got)
    return np.concatenate(out)


def _load_part(path: Path, first: int, last: int) -> Any:
    from engine.model import Model

    return Model.load(path, layers=(first, last), prefetch=False)


@dataclass
class _Unsent:
    """A reply made in the read callback that could not be written at once (sent in order, queued)."""

    data: bytes


async def _send_data(channel: Any, data: bytes) -> None:
    for i in range(0, len(data), limits.SEND_CHUNK_BYTES):
        await channel.send(data[i : i + limits.SEND_CHUNK_BYTES])


async def _send(channel: Any, frame: wire.Frame) -> None:
    data = wire.encode(frame)
    if trace.ON and isinstance(frame, wire.Result) and frame.x.shape[0] == 1:
        trace.mark("T.sent")
    step = limits.SEND_CHUNK_BYTES
    send_now = getattr(channel, "send_now", None)
    if len(data) <= step and send_now is not None and send_now(data):
        return  # written and flushed in this call (the latency path)
    for i in range(0, len(data), step):
        await channel.send(data[i : i + step])
