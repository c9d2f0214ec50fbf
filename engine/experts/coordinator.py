"""The coordinator: an ``ExpertExecutor`` that runs routed experts on workers, bit for bit.

Threads: the engine calls the executor from its own thread; the links live on an asyncio loop, which the
engine thread never blocks on. A layer call (``__call__``/``run_routed``) takes the fast path (below) or
hands the layer to the loop with ``run_coroutine_threadsafe`` and waits. A whole forward pass written as
steps (``drive``, the ``engine.moe.drive`` protocol) of a decode step runs on the loop thread instead: the
loop sends each layer's requests and the last reply resumes the pass there, so a layer costs no thread
hand-off. Calling the executor from the loop thread itself is refused (it would deadlock).

Per layer: every work item goes to the highest-ranked live holder of its (layer, expert) in the ownership
map pinned for the current forward pass; one request per worker carries the rows it needs once and the
(row, expert) pairs, split only by whole work items when a message would exceed a limit. All requests go
out before any reply is awaited. Each reply must arrive within ``message_timeout_s`` and the whole layer
within ``layer_timeout_s``. A worker that fails (timeout, typed error, broken stream) is dropped and its
items are retried on the next live holder; items nobody live holds are computed locally in ``prefer``
mode (counted, logged) or make the call raise :class:`ExpertsUnavailable` in ``on`` mode.

Combining on workers (``run_routed``, the ``engine.moe.RoutedExecutor`` extension ``run_block`` uses): on
the fast path, a worker that acked protocol v2 is also sent, for each token whose k experts all went to
it, the token's slot experts and weights, and returns that token's combined row instead of k rows; the
coordinator combines the other tokens from raw outputs. Both sum in slot order with ``weighted_sum``, so
the result is bit-identical to ``combine``. The general path sends v1 requests only (raw pairs, combined
here): it chunks, retries and falls back by work item, and a layer lands there only when something is
unusual or too large for one request.

The ownership map is rebuilt when workers come or go but an engine thread picks it up only at the start of
a forward pass (the call for the first sparse layer) or of an explicit :meth:`RemoteExecutor.pinned`
scope, so ownership never changes in the middle of a token.

This module decides where a layer's work goes and runs the fast path (``RemoteExecutor``). Loop-driven
passes (``drive``) are ``engine.experts.passes`` and the general path (retries, size splits, the local
fallback) is ``engine.experts.general``, both mixed into ``RemoteExecutor``. The channel to one worker,
its hello and counters are ``engine.experts.link`` (``WorkerLink``, ``LinkStats``, ``WorkerFailed``,
``WorkerRefused``, ``ExpertsUnavailable``, re-exported here); splitting work into requests, building them
and filling outputs from replies are pure functions in ``engine.experts.planning``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import structlog

from engine.experts import decode_steps, planning, rpc
from engine.experts.direct import DirectFailed, DirectPath
from engine.experts.channel import ByteChannel
from engine.experts.general import GeneralPath
from engine.experts.layout import MoeLayout
from engine.experts.link import (LATENCY_BUCKETS_S, ExpertsUnavailable, LinkStats, NotAWorker, WorkerFailed,
                                 WorkerLink, WorkerRefused)
from engine.experts.ownership import OwnershipMap, WorkerInfo, build_map
from engine.experts.passes import LoopPasses
from engine.experts.planning import FastCall, FastSend
from engine.moe import ExpertWeightsFn, ForwardSteps, Routing, WorkItem, combine
from engine import limits
from transport import poll

# The link's names are re-exported: callers import everything the coordinator API uses from here.
__all__ = ["LATENCY_BUCKETS_S", "MODES", "CoordinatorConfig", "CoordinatorStats", "ExpertsUnavailable",
           "LinkStats", "NotAWorker", "RemoteExecutor", "WorkerFailed", "WorkerLink", "WorkerRefused"]

# Hello refusals of a peer that is an expert worker, only not one this coordinator can use.
_WORKER_REFUSALS = frozenset({rpc.ErrorCode.FINGERPRINT_MISMATCH, rpc.ErrorCode.VERSION_UNSUPPORTED,
                              rpc.ErrorCode.NUMERICS_MISMATCH})

log = structlog.get_logger(__name__)

MODES = ("on", "prefer")


@dataclass(frozen=True)
class CoordinatorConfig:
    """Timeouts (seconds) and the ``--remote-experts`` mode."""

    mode: str = "on"
    connect_timeout_s: float = 5.0  # transport connect + stream + hello
    message_timeout_s: float = 10.0  # one request until its reply
    layer_timeout_s: float = 30.0  # one layer, retries included
    warm: bool = True  # a loop-driven pass warms its next layer's weights while a layer's experts are out
    poll_s: float = limits.EXPERT_POLL_S  # poll this long for a fast-path layer's replies (0: sleep at once)
    direct: bool = True  # dial a direct channel beside each lane link (engine.experts.direct)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"remote experts mode must be one of {MODES}")
        if not 0 <= self.poll_s <= limits.EXPERT_MAX_POLL_S:
            raise ValueError(f"poll_s must be between 0 and {limits.EXPERT_MAX_POLL_S}")
        for name in ("connect_timeout_s", "message_timeout_s", "layer_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be positive and finite")




@dataclass
class CoordinatorStats:
    layers: int = 0  # layer calls handled by the executor
    layers_delegated: int = 0  # layers where at least one item went to a worker
    items_delegated: int = 0
    items_local: int = 0  # items computed here (prefer fallback)
    local_fallback_layers: int = 0
    retries: int = 0  # items moved to another holder after a failure
    rows_combined: int = 0  # token rows a worker combined (one reply row instead of k)
    unavailable: int = 0  # 'on' calls that failed
    passes_on_loop: int = 0  # forward passes ``drive`` ran on the loop thread (decode steps)
    passes_handed_back: int = 0  # of those, passes a layer handed back to the engine thread
    expert_rows: dict[tuple[int, int], int] = field(default_factory=dict)  # hits, delegated and local


class RemoteExecutor(DirectPath, LoopPasses, GeneralPath):
    """The remote expert executor. Create on any thread; links are added on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fingerprint: bytes, layout: MoeLayout,
                 config: CoordinatorConfig | None = None, local_weights: ExpertWeightsFn | None = None) -> None:
        self.loop = loop
        self.fingerprint = fingerprint
        self.layout = layout
        self.config = config or CoordinatorConfig()
        self._local_weights = local_weights
        self.links: dict[str, WorkerLink] = {}
        # node id -> why a worker's hello was refused (another checkpoint, no common version, other numerics),
        # until it is greeted again or removed; named in unavailable_reason (the API's 503). Peers that are no
        # workers at all (no answer, no expert stream) are not listed: every plain mesh member is one.
        self.refused: dict[str, str] = {}
        # node id -> "expert worker X is still loading: ...": answered the hello with LOADING (its daemon is up,
        # its --experts are still being mapped). Not an error; named in unavailable_reason until it answers.
        self.loading: dict[str, str] = {}
        self.link_stats: dict[str, LinkStats] = {}
        self.stats = CoordinatorStats()
        self._keys = [(layer, e) for layer in layout.sparse_layers for e in range(layout.num_experts)]
        self._map = build_map([], self._keys)
        self._map_version = 0
        self._tls = threading.local()
        self._stats_lock = threading.Lock()
        self._last_fallback_log = 0.0
        self._first_sparse = layout.sparse_layers[0] if layout.sparse_layers else -1
        self._last_sparse = layout.sparse_layers[-1] if layout.sparse_layers else -1
        affinity = getattr(os, "sched_getaffinity", None)
        self._cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)  # ours to use
        self._loopback_links = 0  # workers on this machine's loopback (_rebuild)
        self._poller = poll.poller(loop)

    # --- workers (loop thread) ------------------------------------------------------------------

    async def add_worker(self, node_id: str, channel: ByteChannel) -> rpc.HelloAck:
        """Hello a worker over ``channel`` and, if it holds our checkpoint, start using it at the next forward.

        Raises :class:`WorkerRefused` (naming the worker and why) otherwise.
        """
        known = node_id in self.link_stats
        stats = self.link_stats.setdefault(node_id, LinkStats())
        link = WorkerLink(node_id, channel, stats)
        try:
            ack = await link.hello(self.fingerprint, self.layout, self.config.connect_timeout_s)
        except WorkerRefused as e:
            if e.code == rpc.ErrorCode.LOADING or isinstance(e, NotAWorker):
                if isinstance(e, NotAWorker):
                    self.loading.pop(node_id, None)
                else:
                    self.loading[node_id] = str(e)
                if not known:  # no row in the workers table (and no error) for a worker that never answered
                    self.link_stats.pop(node_id, None)
                raise
            self.loading.pop(node_id, None)
            stats.errors += 1
            if e.code in _WORKER_REFUSALS:
                self.refused[node_id] = str(e)
            raise
        self.refused.pop(node_id, None)
        self.loading.pop(node_id, None)
        old = self.links.pop(node_id, None)
        if old is not None:
            old.retire("replaced")
        self.links[node_id] = link
        link.on_close = self._link_closed
        self._rebuild()
        log.info("experts_worker_added", worker=node_id, held=len(link.holds), capacity=ack.capacity)
        return ack

    def remove_worker(self, node_id: str, reason: str = "removed") -> None:
        self.refused.pop(node_id, None)
        self.loading.pop(node_id, None)
        link = self.links.pop(node_id, None)
        if link is not None:
            link.close(reason)
            self._rebuild()
            log.info("experts_worker_removed", worker=node_id, reason=reason)

    def _link_closed(self, link: WorkerLink, reason: str) -> None:
        """A link ended by itself (stream broke or ended, protocol error, failed send): stop counting on it,
        so the ownership map and coverage say so and the service greets the worker again."""
        if self.links.get(link.node_id) is link:
            del self.links[link.node_id]
            self._rebuild()
            log.info("experts_worker_removed", worker=link.node_id, reason=reason)

    def _rebuild(self) -> None:
        live = [WorkerInfo(n, link.ack.capacity if link.ack else 1.0, link.holds)
                for n, link in self.links.items() if not link.closed]
        self._map = build_map(live, self._keys)
        self._map_version += 1
        self._loopback_links = sum(1 for link in self.links.values()
                                   if getattr(link.channel, "on_loopback", False))

    @property
    def _polling(self) -> bool:
        """Whether fast-path layers poll for their replies and ask their workers to poll (FLAG_POLL). Either
        keeps a core busy: only while every worker on this machine's loopback, and this node, has a core of
        its own (one loopback worker on two cores: yes; two: no). Workers elsewhere use their own machine's.
        This sees only loopback links: a worker of this machine reached at a LAN address, another
        coordinator or a container's CPU quota are left to the poller, which yields a core that turns out
        to be wanted (transport.poll)."""
        return self.config.poll_s > 0 and self._loopback_links + 1 <= self._cores

    @property
    def current_map(self) -> OwnershipMap:
        return self._map

    def coverage(self) -> list[tuple[int, int]]:
        """(layer, expert)s no live worker holds right now."""
        return self._map.missing(self._keys)

    def unavailable_reason(self) -> str | None:
        """In ``on`` mode, why a request would fail now (for a 503 before any work); else None."""
        if self.config.mode != "on":
            return None
        missing = self.coverage()
        if not missing:
            return None
        if not self.links:
            reason = "no expert workers hold this model's routed experts"
        else:
            names = ", ".join(f"{la}/{e}" for la, e in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            reason = f"no live expert worker holds layer/expert {names}{more}"
        for name, said in (("refused", self.refused), ("loading", self.loading)):
            if said:  # a worker that would cover them may have been refused, or be loading: say which and why
                first = sorted(said.items())[:2]
                more = f"; and {len(said) - 2} more" if len(said) > 2 else ""
                reason += f" ({name}: {'; '.join(r for _, r in first)}{more})"
        return reason

    def echo_rtt(self, node_id: str, payload: bytes, polled: bool = False) -> float:
        """Engine thread: seconds from sending an ECHO of ``payload`` to reading its reply, both on the loop.

        It goes the way a fast-path layer call goes (sent from a loop callback and flushed at once, the
        reply taken in the read callback), so it is the transport's round trip under the same conditions,
        without the thread hand-off and the expert work (benchmarks). ``polled``: also poll for the reply,
        and have the worker poll for the next message, as a fast-path layer does when this node polls.
        """
        link = self.links[node_id]
        direct = link.direct
        if direct is not None and not direct.closed:  # the way a layer call goes now
            with direct.channel.lock:
                try:
                    return direct.echo(payload, self.config.message_timeout_s)
                except DirectFailed as e:
                    raise WorkerFailed(str(e)) from None
        rid = link.next_id()
        polling = polled and self._polling
        data = rpc.encode(rpc.Echo(payload), rid, _poll_flag(link, polling))
        done = threading.Lock()
        done.acquire()
        box: dict[str, object] = {}

        def sink(reply: rpc.Message | WorkerFailed) -> None:
            if "reply" in box:
                return  # a failed send may report twice (the link's close, then the raise)
            box["t1"], box["reply"] = time.perf_counter(), reply
            self._poller.release(done)
            done.release()

        def send() -> None:
            box["t0"] = time.perf_counter()
            try:
                link.expect(rid, sink)
                if not link.send_now(data):
                    link.forget(rid)
                    sink(WorkerFailed("send buffer full"))
                elif polling and "reply" not in box:
                    self._poller.hold(done, self.config.poll_s)
            except WorkerFailed as e:
                sink(e)

        self.loop.call_soon_threadsafe(send)
        if not done.acquire(timeout=self.config.message_timeout_s):
            self.loop.call_soon_threadsafe(link.forget, rid)
            raise WorkerFailed("no echo reply in time")
        reply = box["reply"]
        if isinstance(reply, WorkerFailed):
            raise reply
        if not isinstance(reply, rpc.EchoReply) or reply.payload != payload:
            raise WorkerFailed("bad echo reply")
        return float(box["t1"]) - float(box["t0"])  # type: ignore[arg-type]

    async def close(self) -> None:
        for node_id in list(self.links):
            self.remove_worker(node_id, "coordinator closing")

    # --- engine side (engine thread) -------------------------------------------------------------

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Use one ownership map for every call this thread makes inside the scope (one request)."""
        prev = getattr(self._tls, "scope", None)
        self._tls.scope = self._map
        try:
            yield
        finally:
            self._tls.scope = prev

    def _map_for(self, layer: int) -> OwnershipMap:
        scope = getattr(self._tls, "scope", None)
        if scope is not None:
            return scope
        current = getattr(self._tls, "map", None)
        if current is None or layer == self._first_sparse:
            current = self._map  # a new forward pass starts: pick up the latest map
            self._tls.map = current
        return current

    def __call__(self, layer: int, x: np.ndarray, work: Sequence[WorkItem]) -> list[np.ndarray]:
        """The executor: ``expert_ffn(x[rows], W_e)`` for each work item, computed by workers."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        work = list(work)
        sends, results = self._execute(layer, x, work, None)
        if sends is None:
            return results
        out: list[np.ndarray | None] = [None] * len(work)
        for snd in sends:
            assert isinstance(snd.reply, rpc.ExpertReply)  # noqa: S101 - no routing: v1 requests only
            planning.fill(layer, work, snd.items, snd.reply, out)
        return [r for r in out if r is not None]

    @staticmethod
    def decode_steps(model: object, ids: object, cache: object) -> ForwardSteps | None:
        """``Model.forward``'s hook: a one-token pass as the coordinator's planned steps (prebuilt buffers and
        kernel tables, ``engine.experts.decode_steps``), or None for the general pass. Same bits."""
        return decode_steps.decode_steps(model, ids, cache)  # type: ignore[arg-type]

    def run_routed(self, layer: int, x: np.ndarray, routing: Routing) -> np.ndarray:
        """The ``RoutedExecutor`` extension: [T, D] fp32, bit for bit ``combine(routing, self(...), T, D)``.

        On the fast path v2 workers combine the tokens whose experts they all hold (module docstring)."""
        return self._routed(layer, x, routing, None)

    def _routed(self, layer: int, x: np.ndarray, routing: Routing, fast_started: float | None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        t, d = x.shape
        sends, results = self._execute(layer, x, routing.work, routing, fast_started)
        if sends is None:
            return combine(routing, results, t, d)
        return self._assemble(routing, sends, t, d)

    _assemble = staticmethod(planning.assemble)  # a fast-path layer's output from its replies

    def _check_thread(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise RuntimeError("the remote expert executor must not be called from its event loop thread")

    def _execute(self, layer: int, x: np.ndarray, work: list[WorkItem], routing: Routing | None,
                 fast_started: float | None = None) -> tuple[list[FastSend] | None, list[np.ndarray]]:
        """Run a layer: the fast path's answered requests (and no outputs), or, when it gave up, None and
        every item's output from the general path and the local fallback. ``fast_started``: the fast path
        was already tried (on the loop) from that ``time.monotonic()``, and gave up."""
        self._check_thread()
        omap = self._map_for(layer)
        started = time.monotonic() if fast_started is None else fast_started
        sends = self._run_fast(layer, x, work, omap, routing) if fast_started is None else None
        local: list[int] = []
        results: list[np.ndarray | None] = []
        if sends is None:  # what the fast path spent waiting counts against the layer's timeout
            budget = self.config.layer_timeout_s - (time.monotonic() - started)
            results, local = self._run_general(layer, x, work, omap, budget)
            if local:
                self._fallback(layer, x, work, results, local)
        self._account(layer, work, local, sends)
        if sends is not None:
            return sends, []
        out = [r for r in results if r is not None]
        if len(out) != len(work):
            raise RuntimeError(f"layer {layer}: {len(work) - len(out)} expert outputs missing")
        return None, out

    def _account(self, layer: int, work: Sequence[WorkItem], local: list[int], sends: list[FastSend] | None) -> None:
        with self._stats_lock:
            st = self.stats
            st.layers += 1
            if len(local) < len(work):
                st.layers_delegated += 1
            st.items_delegated += len(work) - len(local)
            for expert, rows in work:
                st.expert_rows[(layer, expert)] = st.expert_rows.get((layer, expert), 0) + len(rows)
            if sends is not None:
                st.rows_combined += sum(len(snd.combined) for snd in sends if snd.combined is not None)

    # --- the fast path: the common case of a decode step -----------------------------------------
    #
    # Every item has a live pinned holder and each worker's share fits one request. The requests are built
    # and encoded (by the engine thread, or by the loop for a loop-driven pass), one loop callback sends
    # them all (each flushed at once), and the replies are matched as their packets are read; an engine
    # thread sleeps on a lock meanwhile, or the last reply resumes the loop-driven pass. No task, no
    # future chain: a layer costs the loop two wake-ups (send, and each reply's packet). Anything else
    # (a worker gone, a typed error, a timeout, a full send buffer) gives up and the layer is run again by
    # the general path, which retries, falls back and reports. With the layer's routing, a v2 worker also
    # gets the slot experts and weights of the tokens whose k experts all went to it, and combines them.

    def _run_fast(self, layer: int, x: np.ndarray, work: list[WorkItem], omap: OwnershipMap,
                  routing: Routing | None) -> list[FastSend] | None:
        """Engine thread: the answered requests, or None when the layer must take the general path."""
        call = self._fast_call(layer, x, work, omap, routing)
        if call is None:
            return None
        if self._direct_for(call):
            return self._run_direct(call)
        self.loop.call_soon_threadsafe(self._fast_dispatch, call)
        assert call.lock is not None  # noqa: S101 - made without on_settle
        if not call.lock.acquire(timeout=self._fast_timeout_s):
            self.loop.call_soon_threadsafe(self._fast_timeout, call)
            return None
        if call.error is not None:
            return None
        return call.sends

    def _fast_call(self, layer: int, x: np.ndarray, work: list[WorkItem], omap: OwnershipMap,
                   routing: Routing | None, on_settle: Callable[[FastCall], None] | None = None) -> FastCall | None:
        """The layer's requests, built and encoded (any thread), or None when they are not for the fast path.
        ``on_settle``: see ``FastCall`` (None: an engine thread waits on the call's lock)."""
        by_worker: dict[str, list[int]] = {}
        links = self.links
        for i, (expert, _rows) in enumerate(work):
            for h in omap.holders(layer, expert):
                link = links.get(h)
                if link is not None and not link.closed:
                    by_worker.setdefault(h, []).append(i)
                    break
            else:
                return None
        whole = None  # per token, the worker all its experts went to (only worked out if combining can pay)
        if routing is not None and work and any(self._may_combine(links.get(n), x, routing) for n in by_worker):
            whole = planning.whole_rows(work, by_worker, routing)
        sends: list[FastSend] = []
        polling = self._polling
        # After the last sparse layer the next request is a forward pass away (the output head, sampling,
        # the next token's first attention: a few ms): a worker polling across that would only hold a core
        # while this node's engine thread needs one.
        ask_poll = polling and layer != self._last_sparse
        for w, (node, items) in enumerate(by_worker.items()):
            link = links.get(node)
            if link is None or link.ack is None:
                return None
            max_bytes, max_rows = planning.limits_of(link)
            # one token (a decode step): one row, one pair per item, and the request builds without them
            tokens = None if x.shape[0] == 1 else planning.token_rows(work, items)
            n_rows, n_pairs = (1, len(items)) if tokens is None else (len(tokens[1]), len(tokens[0]))
            size = planning.request_bytes(x.shape[1], n_rows, n_pairs)
            if n_rows > max_rows or size > min(max_bytes, limits.EXPERT_SEND_CHUNK_BYTES):
                return None  # not one frame: the general path splits it and sends it in slices
            combined = None
            if whole is not None and routing is not None and link.ack.version >= 2:
                rows = np.flatnonzero(whole == w)  # tokens whose k experts all went to this worker
                if len(rows) and self._combining_pays(link, len(rows), routing.experts.shape[1], x.shape[1]):
                    combined = rows
            rid = link.next_id()
            flags = _poll_flag(link, ask_poll)
            if tokens is None and combined is None:  # one token, its outputs sent back raw (a decode step)
                data = rpc.encode_row_request(layer, x, [work[i][0] for i in items], rid, flags)
                snd = FastSend(node, link, rid, data, items, 1, len(items), x.shape[1])
            else:
                req: rpc.ExpertRequest | rpc.ExpertCombineRequest = planning.request(layer, x, work, items, tokens)
                snd = FastSend(node, link, rid, b"", items, req.x.shape[0], req.pairs.shape[0], x.shape[1])
                if combined is not None and routing is not None:
                    req, snd.raw_mask = planning.combine_request(req, tokens, routing, combined)
                    snd.combined = combined
                snd.data = rpc.encode(req, rid, flags)
            if len(snd.data) > min(limits.EXPERT_SEND_CHUNK_BYTES, max_bytes):
                return None  # the combine fields took it over the bound checked above
            sends.append(snd)
        return FastCall(layer, sends, on_settle, self._poller if polling else None)

    @property
    def _fast_timeout_s(self) -> float:
        """How long a fast-path layer waits for its replies (on the engine thread or the loop)."""
        return min(self.config.message_timeout_s, self.config.layer_timeout_s)

    def _may_combine(self, link: WorkerLink | None, x: np.ndarray, routing: Routing) -> bool:
        """Whether combining could pay on ``link`` even if every token of the layer were whole there."""
        k = routing.experts.shape[1]
        return (link is not None and link.ack is not None and link.ack.version >= 2
                and k <= limits.EXPERT_MAX_TOP_K and self._combining_pays(link, x.shape[0], k, x.shape[1]))

    @staticmethod
    def _combining_pays(link: WorkerLink, rows: int, k: int, d: int) -> bool:
        """Whether combining ``rows`` tokens on the worker saves at least one packet of reply: it costs both
        sides CPU (slot arrays built, sent, checked), which a decode step on loopback (16 KiB packets hold
        the raw reply too) does not earn back. Channels without packets (tests) always combine."""
        packet = getattr(link.channel, "max_datagram_bytes", None)
        return packet is None or rows * (k - 1) * d * 4 >= packet

    def _fast_dispatch(self, call: FastCall) -> None:
        """Loop thread: send every request of the call."""
        now = time.perf_counter()
        for snd in call.sends:
            if self.links.get(snd.node) is not snd.link:
                call.settle(f"worker {snd.node} is gone")
                return
            try:
                snd.link.expect(snd.rid, partial(self._fast_reply, call, snd))
                snd.t0 = now
                if not snd.link.send_now(snd.data):
                    call.settle(f"send buffer to {snd.node} is full")
                    return
            except WorkerFailed as e:
                call.settle(str(e))
                return
            snd.link.stats.rows += snd.rows
            snd.link.stats.pairs += snd.pairs
        if call.poller is not None and not call.settled:  # until the last reply settles it (settle releases)
            call.poller.hold(call, self.config.poll_s)

    def _fast_reply(self, call: FastCall, snd: FastSend, reply: rpc.Message | WorkerFailed) -> None:
        """Loop thread: one worker's reply (or its link's failure)."""
        if call.settled:
            return
        if isinstance(reply, WorkerFailed | rpc.ErrorMsg):  # the general path retries, moves or reports
            self.link_stats[snd.node].errors += 1  # a request that failed: its link broke, or a typed error
            self._count_retries(len(snd.items))
            call.settle(f"worker {snd.node}: {reply if isinstance(reply, WorkerFailed) else reply.text}")
            return
        if not snd.answers(reply, call.layer):  # a reply that does not fit the request: drop its worker
            why = f"layer {call.layer}: reply does not match the request ({type(reply).__name__})"
            log.warning("experts_worker_error", worker=snd.node, layer=call.layer, reason=why)
            self.link_stats[snd.node].errors += 1
            self._count_retries(len(snd.items))
            call.settle(f"worker {snd.node}: {why}")
            self._drop(snd.node, why)
            return
        snd.t1 = time.perf_counter()
        snd.reply = reply  # type: ignore[assignment]  # answers() checked its type
        call.left -= 1
        if call.left == 0:
            if call.on_settle is None:  # an engine thread waits: counted before it wakes
                self._observe(call)
            call.settle()

    @staticmethod
    def _observe(call: FastCall) -> None:
        """Loop thread: an answered call's link counters (a loop-driven layer's once the next layer is out)."""
        for snd in call.sends:
            if snd.reply is not None:
                snd.link.stats.answered(snd.reply.compute_us, snd.t1 - snd.t0)

    def _fast_timeout(self, call: FastCall) -> None:
        """Loop thread: the engine thread stopped waiting; drop the workers that did not answer."""
        if call.settled and call.error is None:
            return  # the replies came just after the engine gave up; the general path recomputes the layer
        silent = [snd for snd in call.sends if snd.reply is None]
        call.settle("timeout")
        self._count_retries(sum(len(snd.items) for snd in silent))
        for snd in silent:
            if self.links.get(snd.node) is snd.link:
                self.link_stats[snd.node].errors += 1
                self._drop(snd.node, f"layer {call.layer}: no reply within {self.config.message_timeout_s}s")

    def _count_retries(self, items: int) -> None:
        with self._stats_lock:
            self.stats.retries += items

    def _count_unavailable(self) -> None:
        with self._stats_lock:
            self.stats.unavailable += 1

    def _drop(self, node_id: str, reason: str) -> None:
        link = self.links.get(node_id)
        if link is not None:
            log.warning("experts_worker_dropped", worker=node_id, reason=reason)
            self.remove_worker(node_id, reason)


    # --- telemetry ------------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        omap = self._map
        shares = omap.shares()
        workers = {}
        for node_id, st in self.link_stats.items():
            link = self.links.get(node_id)
            d = st.as_dict()
            d["connected"] = link is not None and not link.closed
            d["owned"] = shares.get(node_id, 0)
            d["protocol"] = link.ack.version if link is not None and link.ack is not None else None
            d["direct"] = link is not None and link.direct is not None and not link.direct.closed
            workers[node_id] = d
        with self._stats_lock:
            s = self.stats
            hits = sum(s.expert_rows.values())
            return {"mode": self.config.mode, "fingerprint": self.fingerprint.hex(),
                    "covered": not self.coverage(), "workers": workers, "loading": dict(self.loading), "layers": s.layers,
                    "layers_delegated": s.layers_delegated, "items_delegated": s.items_delegated,
                    "items_local": s.items_local, "local_fallback_layers": s.local_fallback_layers,
                    "retries": s.retries, "rows_combined": s.rows_combined, "unavailable": s.unavailable,
                    "passes_on_loop": s.passes_on_loop, "passes_handed_back": s.passes_handed_back,
                    "polling": self._polling, "expert_hits": hits,
                    "experts_hit": len(s.expert_rows)}


def _poll_flag(link: WorkerLink, asked: bool) -> int:
    """The header flags asking ``link``'s worker to poll for the next request: only a v3 worker knows them,
    and a request on a direct channel asks nothing (its worker thread waits in ``recv``)."""
    if link.direct is not None and not link.direct.closed:
        return 0
    return rpc.FLAG_POLL if asked and link.ack is not None and link.ack.version >= 3 else 0
