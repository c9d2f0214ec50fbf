"""The serving node's link to one stage: one PIPELINE stream of one run, one step at a time or several.

``StageLink.open`` sends OPEN and waits for READY; ``call`` runs one step (a coroutine, for prefill chunks
and anything large); ``call_soon`` is the latency path for decode steps: a plain loop callback writes the
frame and the read callback that takes the RESULT hands it on (no task, no asyncio future). Silence
(``SILENCE_S`` without any frame while a step is out), an error frame or a broken stream fail the step
with ``StageFailed``; ``close`` fails whatever is waiting and resets the stream (the stage frees the run).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import numerics
from engine.latency import empty_buckets, observe
from engine.pipeline import limits, trace, wire
from transport import poll


class StageFailed(Exception):
    """A stage did not answer a step (silent, stream broke, or an error frame)."""

    def __init__(self, node_id: str, reason: str, code: int | None = None) -> None:
        super().__init__(f"stage {node_id[:12]} failed: {reason}")
        self.node_id = node_id
        self.reason = reason
        self.code = code


@dataclass
class StageStats:
    calls: int = 0
    latency_s: float = 0.0
    compute_s: float = 0.0
    latency_max_s: float = 0.0
    buckets: list[int] = field(default_factory=empty_buckets)
    pings: int = 0
    ping_s: float = 0.0
    direct_calls: int = 0  # steps answered over the direct channel (engine.pipeline.direct), of ``calls``

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
            "direct_calls": self.direct_calls,
            "pings": self.pings,
            "path_rtt_ms_avg": round(self.ping_s / self.pings * 1e3, 3) if self.pings else None,
        }


class _Slot:
    """A latency-path step waiting on a link: what ``_on_data`` (or ``close``) resolves in place of a future.
    ``done(result)`` is called once, on the loop, with the RESULT or a ``StageFailed``."""

    __slots__ = ("done_cb", "finished", "link", "poller", "step", "t0", "timer")

    def __init__(self, link: StageLink, step: int, done_cb: Callable[[Any], None], t0: float) -> None:
        self.link = link
        self.step = step
        self.done_cb = done_cb
        self.t0 = t0
        self.timer: asyncio.TimerHandle | None = None
        self.poller: poll.Poller | None = None  # polling for the reply (released with it)
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def set_result(self, reply: wire.Frame) -> None:
        if self.finished:
            return
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()
        if self.poller is not None:
            self.poller.release(self)
        link = self.link
        link._pending.pop(self.step, None)
        if isinstance(reply, wire.Error):
            self.done_cb(StageFailed(link.node_id, reply.text, reply.code))
            return
        assert isinstance(reply, wire.Result)
        dt = time.perf_counter() - self.t0
        link.stats.add(dt, reply.compute_us / 1e6)
        if reply.x.shape[0] <= limits.INLINE_ROWS:  # a decode step: what a poll for the next one waits
            link.wait_s += limits.POLL_EMA * (min(dt, 2 * limits.POLL_MAX_S) - link.wait_s)
        self.done_cb(reply)


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
        self.wait_s = limits.POLL_MAX_S / 4  # moving average of a decode step's round trip (polling budget)
        self.direct: Any = None  # engine.pipeline.direct.DirectHop to this stage, when one is up (set by the
        #   daemon's pipeline service; one-row steps from the scheduler thread go over it)

    async def open(
        self,
        run: int,
        fingerprint: bytes,
        num_layers: int,
        timeout_s: float = limits.OPEN_TIMEOUT_S,
        silence_s: float = limits.OPEN_SILENCE_S,
        numerics_tag: str | None = None,
    ) -> wire.Ready:
        """OPEN this link's layers, wait for READY. Raises ``StageFailed``. ``numerics_tag``: the serving node's
        (default this process's, engine/numerics.py; "" sends none, as an older node does); a stage with another
        refuses with ``NUMERICS_MISMATCH``."""
        tag = numerics.tag() if numerics_tag is None else numerics_tag
        loop = asyncio.get_running_loop()
        self.channel.set_receiver(self._on_data, self._on_end)
        fut: asyncio.Future[wire.Frame] = loop.create_future()
        self._pending[0] = fut
        self._heard = loop.time()
        deadline = self._heard + timeout_s
        await self._send(wire.Open(run, self.first, self.last, num_layers, fingerprint, tag))
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
        frame = wire.Forward(frame.run, step, frame.spans, frame.x, frame.last_only, frame.poll)
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

    def call_soon(self, frame: wire.Forward, done: Callable[[Any], None], polled: bool = False) -> bool:
        """``call``'s latency path (loop thread; a plain callback: no task, no future): write the step now and
        have ``done(result)`` called by the read callback that takes the RESULT, or ``done(StageFailed)``
        (error frame, broken stream, ``SILENCE_S`` of silence). False, with nothing sent, when the frame
        cannot be written at once (over one slice, a slow-path frame half written, the send buffer full):
        use ``call`` then. ``polled``: poll this loop for the reply (``transport.poll``) up to about the
        recent round trip of a decode step (the caller has nothing else to do meanwhile)."""
        if self.closed:
            done(StageFailed(self.node_id, self.reason))
            return True
        if self._send_lock.locked():
            return False
        loop = asyncio.get_running_loop()
        if not self._pending and not self._pings and loop.time() - self._pinged >= limits.PING_EVERY_S:
            self._ping(loop)
        step = next(self._steps) % 0xFFFFFFFF + 1
        frame = wire.Forward(frame.run, step, frame.spans, frame.x, frame.last_only, frame.poll)
        data = wire.encode(frame)
        if len(data) > limits.SEND_CHUNK_BYTES:
            return False
        if trace.ON and frame.x.shape[0] == 1:
            trace.mark("S.sent")
        slot = _Slot(self, step, done, time.perf_counter())
        self._pending[step] = slot  # type: ignore[assignment]
        self._heard = loop.time()
        try:
            sent = self.channel.send_now(data)
        except Exception as e:  # noqa: BLE001 - any send failure means the stage is gone
            self._pending.pop(step, None)
            self.close(f"send failed: {e!r}")
            done(StageFailed(self.node_id, f"send failed: {e!r}"))
            return True
        if not sent:
            self._pending.pop(step, None)
            return False
        slot.timer = loop.call_later(limits.SILENCE_S, self._watch_slot, slot)
        if polled and self.wait_s < limits.POLL_MAX_S:
            slot.poller = poll.poller(loop)
            budget = min(self.wait_s * limits.POLL_MARGIN + limits.POLL_SLACK_S, limits.POLL_MAX_S)
            if not slot.poller.hold(slot, budget):
                slot.poller = None
        return True

    def _watch_slot(self, slot: _Slot) -> None:
        """A latency-path step's silence check (see ``_watch``)."""
        if slot.finished:
            return
        left = self._heard + limits.SILENCE_S - asyncio.get_running_loop().time()
        if left <= 0:
            self.close(f"silent for {limits.SILENCE_S:g} s")  # resolves the slot with an error
            return
        slot.timer = asyncio.get_running_loop().call_later(left, self._watch_slot, slot)

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
        for fut in list(self._pending.values()):  # a latency-path slot leaves _pending as it resolves
            if not fut.done():
                fut.set_result(wire.Error(0, wire.ErrorCode.PROTOCOL, f"link closed: {reason}"))
        self._pending.clear()
        with contextlib.suppress(Exception):
            self.channel.reset(0)
