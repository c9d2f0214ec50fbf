"""Forward passes the remote expert executor runs on its event loop (``RemoteExecutor.drive``).

A forward pass written as steps (``engine.moe.drive``) whose first routed layer has at most
``LOOP_STEP_MAX_ROWS`` token rows, reached within ``LOOP_STEP_MAX_COMPUTE_S`` (a decode step), is handed
by its engine thread to the loop thread. The loop sends each routed layer's requests by the executor's fast
path, and the read callback that takes the layer's last reply resumes the pass right there: it computes up
to the next routed layer and sends that before it returns, so a layer costs no thread hand-off (the pass
costs two). While a layer's experts are out, the loop warms what runs next (``Model.warm``). A layer the
fast path does not take hands the pass back to its engine thread, which runs the rest layer by layer.

``LoopPasses`` is mixed into ``engine.experts.coordinator.RemoteExecutor`` and uses its loop, config,
counters and fast path (``_fast_call``, ``_fast_dispatch``, ``_assemble``, ``_routed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import structlog

from engine.experts.link import ExpertsUnavailable
from engine.experts.ownership import OwnershipMap
from engine.experts.planning import FastCall
from engine.moe import ForwardSteps, RoutedCall

log = structlog.get_logger(__name__)

# ``RemoteExecutor.drive`` runs a forward pass on the loop thread when its routed layers have at most this
# many token rows (decode steps, batched decode of up to this many sequences, tiny prefills) and its
# compute up to the first routed layer took at most LOOP_STEP_MAX_COMPUTE_S. The pass's own compute then
# runs on the loop between replies, holding up the node's other traffic that long at each layer, so only
# short passes go there (long contexts or big batches stay on the engine thread).
LOOP_STEP_MAX_ROWS = 16
LOOP_STEP_MAX_COMPUTE_S = 0.005
# An engine thread gives up on a loop-run pass the loop has not moved for a layer's timeout plus this
# (each layer settles or hands back within its timeout; the margin covers the pass's own compute).
LOOP_STALL_MARGIN_S = 5.0


class _LoopStep:
    """A forward pass the loop thread is running for an engine thread, which waits on ``lock``.

    Released once (``done``): with ``result`` (the pass ended), ``error`` (the pass or the loop's handling of
    it raised), or ``pending`` (a routed layer the fast path did not take, first tried at ``fast_started``:
    the engine thread runs it, and the rest of the pass, itself). The loop holds ``mutex`` while it runs
    the pass's own code and checks ``abandoned`` first; an engine thread that gives up sets ``abandoned``,
    then takes ``mutex`` to wait out code already running, so an abandoned pass never resumes, and one that
    finished just then is not lost (``done``). ``beat`` is when the loop last made progress on it.
    """

    def __init__(self, steps: ForwardSteps, omap: OwnershipMap, warm: Callable[[int], object] | None) -> None:
        self.steps = steps
        self.omap = omap  # pinned by the engine thread when the pass started
        self.warm = warm  # the model's ``warm(layer)``, or None
        self.lock = threading.Lock()
        self.lock.acquire()
        self.mutex = threading.Lock()
        self.done = False
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None
        self.pending: RoutedCall | None = None
        self.fast_started = 0.0
        self.timer: asyncio.TimerHandle | None = None  # the pass's watchdog (``RemoteExecutor._step_watch``)
        self.fast: FastCall | None = None  # the routed layer in flight
        self.abandoned = False  # the engine thread stopped waiting: leave the pass alone
        self.beat = time.monotonic()

    def hand_back(self, call: RoutedCall, started: float) -> None:
        if not self.done:
            self.pending, self.fast_started = call, started
            self._release()

    def finish(self, result: np.ndarray | None, error: BaseException | None) -> None:
        if not self.done:
            self.result, self.error = result, error
            self._release()

    def _release(self) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.lock.release()


class LoopPasses:
    """``RemoteExecutor.drive`` and the loop-driven pass (mixed into ``RemoteExecutor``)."""

    def drive(self, steps: ForwardSteps, warm: Callable[[int], object] | None = None) -> np.ndarray:
        """Run a forward pass written as steps (``engine.moe.drive``); -> its result.

        A pass whose first routed layer has at most ``LOOP_STEP_MAX_ROWS`` rows (a decode step), reached in
        at most ``LOOP_STEP_MAX_COMPUTE_S``, is handed to the loop thread from there on: each layer's
        requests go out from the loop, and the last reply resumes the pass on the loop, which computes up
        to the next routed layer and sends it. A layer then costs no thread hand-off; the pass costs two.
        Anything the fast path does not take hands the pass back to this thread, where that layer takes the
        general path and the rest runs layer by layer. ``warm(layer + 1)`` (the model's ``Model.warm``) runs
        on the loop once a layer's requests are out, unless a worker of the layer is on this machine
        (``_may_warm``): the pass would otherwise only wait, and the next layer's attention runs sooner with
        its weights in cache.
        """
        self._check_thread()
        t0 = time.perf_counter()
        try:
            call = next(steps)
        except StopIteration as stop:
            return stop.value
        short = time.perf_counter() - t0 <= LOOP_STEP_MAX_COMPUTE_S
        omap = self._map_for(call[0])
        fast_started: float | None = None
        # with a direct channel to every worker the pass stays here: each layer's call is made on this
        # thread (RemoteExecutor._run_direct), which costs no hand-off at all
        if (short and call[1].shape[0] <= LOOP_STEP_MAX_ROWS and self.loop.is_running()
                and not self.all_direct()):
            step = _LoopStep(steps, omap, warm if self.config.warm else None)
            with self._stats_lock:
                self.stats.passes_on_loop += 1
            self.loop.call_soon_threadsafe(self._step_layer, step, call)
            self._wait_for_loop(step)
            if step.error is not None:
                raise step.error
            if step.pending is None:
                return step.result  # type: ignore[return-value]  # set with the release
            call, fast_started = step.pending, step.fast_started
            with self._stats_lock:
                self.stats.passes_handed_back += 1
        try:
            while True:
                out = self._routed(*call, fast_started)
                fast_started = None
                call = steps.send(out)
        except StopIteration as stop:
            return stop.value

    def _wait_for_loop(self, step: _LoopStep) -> None:
        """Engine thread: until the loop is done with ``step``. Each layer settles or hands back within its
        timeout, so a pass the loop has not moved for longer than that (plus a margin for compute), or a
        loop that stopped, is given up: raises :class:`ExpertsUnavailable`."""
        stall_s = self._fast_timeout_s + LOOP_STALL_MARGIN_S
        while not step.lock.acquire(timeout=0.5):
            if time.monotonic() - step.beat < stall_s and self.loop.is_running():
                continue
            step.abandoned = True  # the loop checks this before it runs any more of the pass
            with step.mutex:  # waits out the pass's own code if the loop is running it right now
                pass
            if step.done:  # it finished (or handed back) just now after all
                return
            self._count_unavailable()
            raise ExpertsUnavailable("the expert event loop stopped running the forward pass")

    def _step_layer(self, step: _LoopStep, call: RoutedCall, done: tuple[RoutedCall, FastCall] | None = None) -> None:
        """Loop thread: send one routed layer of a loop-driven pass, or hand the pass back. Never raises:
        an error here (a bug, no memory) ends the pass with it, raised on its engine thread. ``done``: the
        layer before, whose bookkeeping waits until this one's requests are out (off the critical path),
        or until the pass is handed back."""
        if step.abandoned or step.done:
            return
        step.beat = started = time.monotonic()
        try:
            layer, x, routing = call
            x = np.ascontiguousarray(x, dtype=np.float32)
            settled = partial(self._step_settled, step, (layer, x, routing))
            fast = self._fast_call(layer, x, routing.work, step.omap, routing, settled)  # rows: checked by drive
            if fast is None:
                self._step_done(done)
                step.hand_back((layer, x, routing), started)
                return
            step.fast, step.fast_started = fast, started
            if step.timer is None:
                step.timer = self.loop.call_later(self._fast_timeout_s, self._step_watch, step)
            self._fast_dispatch(fast)
            self._step_done(done)
        except Exception as e:  # noqa: BLE001 - raised again on the pass's engine thread
            with contextlib.suppress(Exception):
                self._step_done(done)  # the layer before was answered and used
            step.finish(None, e)
            return
        if step.warm is not None and not (step.done or step.abandoned):
            self._step_warm(step, fast, layer + 1)

    def _step_warm(self, step: _LoopStep, fast: FastCall, layer: int) -> None:
        """Loop thread: warm what the pass runs after ``fast``'s layer, if that leaves its workers their CPU
        (its replies wait in the socket meanwhile, at most ~0.6 ms). Optional work: an error is logged and
        ends warming for this pass, never the pass."""
        try:
            if self._may_warm(fast):
                step.warm(layer)  # type: ignore[misc]  # checked by the caller
        except Exception as e:  # noqa: BLE001 - a failed warm-up must not fail a decode step
            step.warm = None
            log.warning("experts_warm_failed", layer=layer, error=repr(e))

    def _step_watch(self, step: _LoopStep) -> None:
        """Loop thread: the pass's one timer (re-armed rather than made per layer). Its layer in flight
        gets no more time than a fast-path call on the engine thread would."""
        step.timer = None
        fast = step.fast
        if step.done or fast is None or fast.settled:
            return
        due = step.fast_started + self._fast_timeout_s
        if time.monotonic() >= due:
            self._fast_timeout(fast)
        else:
            step.timer = self.loop.call_later(due - time.monotonic(), self._step_watch, step)

    def _step_done(self, done: tuple[RoutedCall, FastCall] | None) -> None:
        """Loop thread: the bookkeeping of a loop-driven layer whose output the pass has taken (once)."""
        if done is not None and not done[1].counted:
            (layer, _x, routing), fast = done
            fast.counted = True
            self._observe(fast)
            self._account(layer, routing.work, [], fast.sends)

    def _step_settled(self, step: _LoopStep, call: RoutedCall, fast: FastCall) -> None:
        """Loop thread: a loop-driven layer settled, usually in the read callback of its last reply: resume
        the pass right there (its next requests go out before that callback returns), or hand it back to
        its engine thread for the general path."""
        if fast.error is not None:
            step.hand_back(call, step.fast_started)
        else:
            self._step_resume(step, call, fast)

    def _step_resume(self, step: _LoopStep, call: RoutedCall, fast: FastCall) -> None:
        """Loop thread: every reply of the layer is in; run the pass up to its next routed layer."""
        layer, x, routing = call
        with step.mutex:
            if step.abandoned or step.done:  # given up, or already ended (an error after its requests went out)
                return
            step.beat = time.monotonic()
            try:
                out = self._assemble(routing, fast.sends, *x.shape)
                try:
                    nxt = step.steps.send(out)
                except StopIteration as stop:
                    self._step_done((call, fast))  # counted before its caller can look
                    step.finish(stop.value, None)
                    return
                except Exception:
                    with contextlib.suppress(Exception):
                        self._step_done((call, fast))  # the layer was answered and used
                    raise
            except Exception as e:  # noqa: BLE001 - the pass's own error, raised again on its engine thread
                step.finish(None, e)
                return
        self._step_layer(step, nxt, (call, fast))

    def _may_warm(self, fast: FastCall) -> bool:
        """Whether warming the next layer while ``fast``'s workers compute costs them nothing: only when
        none of them is on this machine's loopback. A worker here shares this machine's memory bus and
        last-level cache whatever the core count, and a layer's experts are read from memory: the warm's
        reads (up to 8 MiB) then slow the worker's compute by more than they save the pass (paired A/B, one
        loopback worker on two cores: decode 0.72x local with warming, 0.78x without; the worker's compute
        0.591 against 0.544 ms per layer)."""
        return not any(getattr(snd.link.channel, "on_loopback", False) for snd in fast.sends)
