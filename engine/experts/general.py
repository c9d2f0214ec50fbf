"""The general path of the remote expert executor: a layer the fast path did not take.

A layer lands here when something is unusual or too large for one request per worker: a worker gone, a
typed error or a timeout on the fast path, or work that must be split by the message size limits. Every
work item goes to the highest-ranked live holder in the pinned ownership map (or, when none is left, any
live worker holding it); requests to one worker are chunked and kept within ``EXPERT_WINDOW_BYTES`` in
flight; each reply has ``message_timeout_s`` and the whole layer ``layer_timeout_s``. A worker that fails
is dropped and its items are retried on the next live holder; items nobody live holds are computed here in
``prefer`` mode (counted, logged) or raise :class:`ExpertsUnavailable` in ``on`` mode. Requests are
protocol v1 (raw pairs, combined by the caller).

``GeneralPath`` is mixed into ``engine.experts.coordinator.RemoteExecutor`` and uses its links, config and
counters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import structlog

from engine.experts import planning, rpc
from engine.experts.link import ExpertsUnavailable, WorkerFailed
from engine.experts.ownership import OwnershipMap
from engine.moe import WorkItem, expert_ffn_many
from engine import limits

log = structlog.get_logger(__name__)


class GeneralPath:
    """Retries, size splits and the local fallback of a layer (mixed into ``RemoteExecutor``)."""

    def _run_general(self, layer: int, x: np.ndarray, work: list[WorkItem], omap: OwnershipMap,
                     budget_s: float) -> tuple[list[np.ndarray | None], list[int]]:
        if budget_s <= 0:  # the fast attempt used the layer's time up: no retry round
            self._timed_out(layer)
            return [None] * len(work), list(range(len(work)))
        fut = asyncio.run_coroutine_threadsafe(self._run_layer(layer, x, work, omap, budget_s), self.loop)
        try:
            return fut.result(timeout=budget_s + 1.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self._timed_out(layer)
            return [None] * len(work), list(range(len(work)))

    def _timed_out(self, layer: int) -> None:
        """The layer's time is up with work unanswered: ``on`` mode raises (counted), ``prefer`` returns and
        the caller computes that work here."""
        if self.config.mode == "on":
            self._count_unavailable()
            raise ExpertsUnavailable(f"layer {layer}: expert workers did not answer within "
                                     f"{self.config.layer_timeout_s}s")

    def _fallback(self, layer: int, x: np.ndarray, work: Sequence[WorkItem], results: list[np.ndarray | None],
                  local: list[int]) -> None:
        if self._local_weights is None:
            raise ExpertsUnavailable(f"layer {layer}: no local expert weights to fall back on")
        weights = self._local_weights
        outs = expert_ffn_many([(x[work[i][1]], *weights(layer, work[i][0])) for i in local])  # as the local executor
        for i, out in zip(local, outs):
            results[i] = out
        with self._stats_lock:
            self.stats.items_local += len(local)
            self.stats.local_fallback_layers += 1
            n = self.stats.local_fallback_layers
        now = time.monotonic()
        if now - self._last_fallback_log >= 1.0:
            self._last_fallback_log = now
            log.warning("experts_local_fallback", layer=layer, items=len(local), fallback_layers_total=n)

    async def _run_layer(self, layer: int, x: np.ndarray, work: list[WorkItem], omap: OwnershipMap,
                         budget_s: float | None = None) -> tuple[list[np.ndarray | None], list[int]]:
        """On the loop: results per item (None where computed locally) and the items left for local compute.
        The layer has ``budget_s`` (default: the layer timeout) for all its attempts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.layer_timeout_s if budget_s is None else budget_s)
        results: list[np.ndarray | None] = [None] * len(work)
        remaining = list(range(len(work)))
        local: list[int] = []
        excluded: set[str] = set()
        first = True
        while remaining:
            by_worker: dict[str, list[int]] = {}
            unplaced: list[int] = []
            for i in remaining:
                expert = work[i][0]
                holder = next((h for h in omap.holders(layer, expert) if h not in excluded
                               and h in self.links and not self.links[h].closed), None)
                if holder is None:
                    holder = self._any_live_holder(layer, expert, excluded)
                if holder is None:
                    unplaced.append(i)
                else:
                    by_worker.setdefault(holder, []).append(i)
            if not first:
                with self._stats_lock:
                    self.stats.retries += len(remaining) - len(unplaced)
            first = False
            if unplaced:
                if self.config.mode == "on":
                    self._count_unavailable()
                    missing = sorted({(layer, work[i][0]) for i in unplaced})
                    names = ", ".join(f"{la}/{e}" for la, e in missing[:8])
                    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
                    raise ExpertsUnavailable(f"no live expert worker holds layer/expert {names}{more}", missing)
                local += unplaced
            # Every worker's first request goes out before any reply is awaited. More requests for the
            # same worker (a layer split by the size limits) follow while at most EXPERT_WINDOW_BYTES are
            # in flight to it: a worker does not read while it computes, and its transport resets a
            # stream with too much unread data.
            failed: list[int] = []
            queues: dict[str, list[tuple[list[int], rpc.ExpertRequest]]] = {
                node: [(chunk, planning.request(layer, x, work, chunk))
                       for chunk in planning.chunks(self.links[node], x, work, items)]
                for node, items in by_worker.items()}
            window: dict[str, deque[tuple[list[int], asyncio.Future[rpc.Message], float, int]]] = {
                node: deque() for node in queues}

            def fail_worker(node: str, why: str, drop: bool = True, error: bool = True) -> None:
                nonlocal failed
                if error:
                    self.link_stats[node].errors += 1
                if drop:
                    self._drop(node, why)
                excluded.add(node)
                failed += [i for chunk, *_ in window[node] for i in chunk]
                failed += [i for chunk, _ in queues[node] for i in chunk]
                window[node].clear()
                queues[node].clear()

            async def send_more(node: str) -> None:
                link, q, win = self.links.get(node), queues[node], window[node]
                if link is None:  # its link closed meanwhile (and was forgotten): retry its items elsewhere
                    if q:
                        fail_worker(node, "link closed", drop=False, error=False)
                    return
                while q:
                    size = q[0][1].x.nbytes + q[0][1].pairs.nbytes
                    if win and sum(w[3] for w in win) + size > limits.EXPERT_WINDOW_BYTES:
                        return
                    chunk, req = q.pop(0)
                    try:
                        fut = await link.submit(req)
                    except WorkerFailed as e:
                        q.insert(0, (chunk, req))
                        fail_worker(node, str(e))
                        return
                    link.stats.rows += req.x.shape[0]
                    link.stats.pairs += req.pairs.shape[0]
                    win.append((chunk, fut, time.perf_counter(), size))

            async def drain(node: str) -> None:
                nonlocal failed
                win, link_stats = window[node], self.link_stats[node]
                while win:
                    chunk, fut, t0, _ = win[0]
                    message_left = self.config.message_timeout_s - (time.perf_counter() - t0)
                    layer_left = deadline - loop.time()
                    try:
                        reply = await asyncio.wait_for(asyncio.shield(fut), max(0.0, min(message_left, layer_left)))
                    except (TimeoutError, WorkerFailed) as e:
                        # a worker is dropped for its own silence, not for a wait the layer's deadline cut short
                        cut = isinstance(e, TimeoutError) and layer_left < message_left
                        fail_worker(node, f"layer {layer}: {e}" if str(e) else f"layer {layer}: timeout",
                                    drop=not cut, error=not cut)
                        return
                    win.popleft()
                    if isinstance(reply, rpc.ExpertReply) and planning.fill(layer, work, chunk, reply, results):
                        link_stats.answered(reply.compute_us, time.perf_counter() - t0)
                        await send_more(node)
                        continue
                    why = reply.text if isinstance(reply, rpc.ErrorMsg) else f"bad reply {type(reply).__name__}"
                    log.warning("experts_worker_error", worker=node, layer=layer, reason=why)
                    failed += chunk
                    fail_worker(node, why, drop=not (isinstance(reply, rpc.ErrorMsg)
                                                     and reply.code == rpc.ErrorCode.NOT_HELD))
                    return

            for node in queues:
                await send_more(node)
            await asyncio.gather(*(drain(node) for node in queues))
            remaining = sorted(failed)
            if remaining and loop.time() >= deadline:
                break
        if remaining:
            self._timed_out(layer)
            local += remaining
        return results, sorted(local)

    def _any_live_holder(self, layer: int, expert: int, excluded: set[str]) -> str | None:
        # A worker that joined after this forward's map was pinned is used only when no pinned holder is left.
        for node_id, link in sorted(self.links.items()):
            if node_id not in excluded and not link.closed and (layer, expert) in link.holds:
                return node_id
        return None
