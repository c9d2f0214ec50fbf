"""A layer's expert requests: which work items one request to a worker carries (``chunks``,
``limits_of``, ``request_bytes``), the request itself (``token_rows``, ``request``, and
``combine_request`` when the worker combines whole tokens, ``whole_rows``), and the outputs its reply
gives back (``fill``); plus the fast path's record of one request in flight (``FastSend``) and of the
layer call waiting on them all (``FastCall``). Decode-sized requests are built with lists (numpy calls
dominate their cost); property tests pin those paths to the numpy ones.

Pure functions over arrays; ``engine.experts.coordinator`` decides where the requests go and sends them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.experts import rpc
from engine.experts.link import WorkerLink
from engine.moe import Routing, WorkItem, slot_positions, weighted_sum
from engine import limits
from transport.poll import Poller


def limits_of(link: WorkerLink) -> tuple[int, int]:
    """(bytes, rows) one request to ``link``'s worker may carry: ours and the worker's, whichever is lower."""
    ack = link.ack
    return (min(limits.EXPERT_MAX_MESSAGE_BYTES, ack.max_message_bytes if ack else 0),
            min(limits.EXPERT_MAX_ROWS, ack.max_rows if ack else 0))


def request_bytes(d: int, rows: int, pairs: int) -> int:
    """An upper bound of a request's (and its v1 reply's) encoded size."""
    return 64 + 4 * d * (rows + pairs) + 8 * pairs


def chunks(link: WorkerLink, x: np.ndarray, work: list[WorkItem], items: list[int]) -> list[list[int]]:
    """Split a worker's items (whole work items only) so each request and reply fits its limits."""
    max_bytes, max_rows = limits_of(link)
    d = x.shape[1]
    out: list[list[int]] = []
    cur: list[int] = []
    seen = np.zeros(x.shape[0], dtype=bool)  # rows already in the current request
    n_rows = pairs = 0
    for i in items:
        r = work[i][1]
        fresh = int(np.count_nonzero(~seen[r]))
        size = request_bytes(d, n_rows + fresh, pairs + len(r))
        if cur and (size > max_bytes or n_rows + fresh > max_rows):
            out.append(cur)
            cur, n_rows, pairs = [], 0, 0
            seen[:] = False
            fresh = len(r)
        cur.append(i)
        seen[r] = True
        n_rows += fresh
        pairs += len(r)
    if cur:
        out.append(cur)
    return out


def token_rows(work: list[WorkItem], items: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(the token of each pair of a request for ``items``, in pair order; the request's x rows: those
    tokens, ascending and once each)."""
    parts = [work[i][1] for i in items]
    if sum(len(p) for p in parts) <= rpc.SMALL_PAIRS:  # a decode step: lists beat numpy calls
        rows_all = [r for p in parts for r in p.tolist()]
        return np.array(rows_all, dtype=np.int64), np.array(sorted(set(rows_all)), dtype=np.int64)
    rows_all = np.concatenate(parts)
    return rows_all, np.unique(rows_all)


def request(layer: int, x: np.ndarray, work: list[WorkItem], items: list[int],
            tokens: tuple[np.ndarray, np.ndarray] | None = None) -> rpc.ExpertRequest:
    """The request carrying ``items`` (``tokens``: their ``token_rows``, if already worked out)."""
    if x.shape[0] == 1 and tokens is None:  # one token (a decode step): every pair is (row 0, expert)
        pairs = np.array([(0, work[i][0]) for i in items], dtype=np.uint32)
        return rpc.ExpertRequest(layer=layer, x=x, pairs=pairs.reshape(-1, 2))
    rows_all, uniq = token_rows(work, items) if tokens is None else tokens
    rows = x if len(uniq) == x.shape[0] else x[uniq]  # every token used: uniq is 0..T-1, x as it is
    if len(rows_all) <= rpc.SMALL_PAIRS:
        index = {r: j for j, r in enumerate(uniq.tolist())}
        experts = [work[i][0] for i in items for _ in range(len(work[i][1]))]  # each pair's, in pair order
        pairs = np.array([(index[r], e) for r, e in zip(rows_all.tolist(), experts)], dtype=np.uint32)
        return rpc.ExpertRequest(layer=layer, x=rows, pairs=pairs.reshape(-1, 2))
    local = np.searchsorted(uniq, rows_all)
    experts = np.concatenate([np.full(len(work[i][1]), work[i][0], dtype=np.int64) for i in items])
    pairs = np.stack([local, experts], axis=1).astype(np.uint32)  # [m, 2]
    return rpc.ExpertRequest(layer=layer, x=rows, pairs=pairs)


def fill(layer: int, work: list[WorkItem], items: list[int], reply: rpc.ExpertReply,
         results: list[np.ndarray | None]) -> bool:
    n = sum(len(work[i][1]) for i in items)
    if reply.layer != layer or reply.out.shape[0] != n:
        return False
    pos = 0
    for i in items:
        k = len(work[i][1])
        results[i] = np.array(reply.out[pos:pos + k], dtype=np.float32, copy=True)
        pos += k
    return True


def whole_rows(work: list[WorkItem], by_worker: dict[str, list[int]], routing: Routing) -> np.ndarray:
    """[T] int: for each token, the index (in ``by_worker`` order) of the worker all its experts went
    to, or -1 if they are spread over several or its weights are not all finite (a worker refuses
    non-finite weights from a peer; such a token is combined here, as the local path would)."""
    if routing.experts.size <= rpc.SMALL_PAIRS:  # a decode step: lists beat numpy calls
        owner = {work[i][0]: w for w, items in enumerate(by_worker.values()) for i in items}
        out = []
        for experts, weights in zip(routing.experts.tolist(), routing.weights.tolist()):
            w = owner.get(experts[0], -1)
            whole = all(owner.get(e, -1) == w for e in experts) and all(math.isfinite(v) for v in weights)
            out.append(w if whole else -1)
        return np.array(out, dtype=np.int64)
    worker_of = np.full(max(e for e, _ in work) + 1, -1, dtype=np.int64)  # expert -> worker index
    for w, items in enumerate(by_worker.values()):
        worker_of[[work[i][0] for i in items]] = w
    slots = worker_of[routing.experts]  # [T, k]
    whole = np.all(slots == slots[:, :1], axis=1) & np.all(np.isfinite(routing.weights), axis=1)
    return np.where(whole, slots[:, 0], -1)


def combine_request(req: rpc.ExpertRequest, tokens: tuple[np.ndarray, np.ndarray] | None, routing: Routing,
                    rows: np.ndarray) -> tuple[rpc.ExpertCombineRequest, np.ndarray]:
    """``req`` (built from ``tokens``) also asking the worker to combine token ``rows``; the mask of its
    pairs sent back raw. ``tokens`` None: a one-token request (its only row is combined)."""
    if tokens is None:
        creq = rpc.ExpertCombineRequest(layer=req.layer, x=req.x, pairs=req.pairs, rows=np.zeros(1, dtype=np.uint32),
                                        experts=routing.experts.astype(np.uint32), weights=routing.weights)
        return creq, np.zeros(req.pairs.shape[0], dtype=bool)
    rows_all, uniq = tokens
    here = np.zeros(routing.experts.shape[0], dtype=bool)
    here[rows] = True
    creq = rpc.ExpertCombineRequest(layer=req.layer, x=req.x, pairs=req.pairs,
                                    rows=np.searchsorted(uniq, rows).astype(np.uint32),
                                    experts=routing.experts[rows].astype(np.uint32),
                                    weights=routing.weights[rows])
    return creq, ~here[rows_all]


@dataclass(eq=False)
class FastSend:
    """One worker's request in a fast-path layer call."""

    node: str
    link: WorkerLink
    rid: int
    data: bytes
    items: list[int]
    rows: int
    pairs: int
    dim: int
    combined: np.ndarray | None = None  # token rows (into the layer's x) the worker combines, ascending
    raw_mask: np.ndarray | None = None  # [pairs] bool: request pairs whose outputs come back raw
    reply: rpc.ExpertReply | rpc.ExpertCombinedReply | None = None
    t0: float = 0.0  # sent (perf_counter)
    t1: float = 0.0  # its reply read

    def answers(self, reply: rpc.Message, layer: int) -> bool:
        """Whether ``reply`` is a well-formed answer to this request."""
        if self.combined is None:
            return (isinstance(reply, rpc.ExpertReply) and reply.layer == layer
                    and reply.out.shape == (self.pairs, self.dim))
        assert self.raw_mask is not None  # noqa: S101 - set together with combined
        return (isinstance(reply, rpc.ExpertCombinedReply) and reply.layer == layer
                and reply.combined.shape == (len(self.combined), self.dim)
                and reply.out.shape == (int(np.count_nonzero(self.raw_mask)), self.dim))


class FastCall:
    """A layer whose requests are sent by one loop callback and whose replies are taken as they are read.

    It settles once, on the loop thread (:meth:`settle`): every reply arrived (``error`` None) or the call
    gave up (``error`` says why) and the layer takes the general path instead. By default an engine thread
    waits on ``lock``, which settling releases; a call made on the loop (a loop-driven pass) passes
    ``on_settle`` instead, called with the call in place of the release (and it has no lock). With a
    ``poller``, the loop polls for the replies once they are sent (until the call settles, or the poll's
    time is up) and the requests carry ``FLAG_POLL``.
    """

    def __init__(self, layer: int, sends: list[FastSend],
                 on_settle: Callable[[FastCall], None] | None = None, poller: Poller | None = None) -> None:
        self.layer = layer
        self.sends = sends
        self.left = len(sends)
        self.error: str | None = None
        self.settled = False
        self.counted = False  # its layer's counters are updated (a loop-driven layer's, once)
        self.on_settle = on_settle
        self.poller = poller
        self.lock: threading.Lock | None = None
        if on_settle is None:
            self.lock = threading.Lock()
            self.lock.acquire()

    def settle(self, error: str | None = None) -> None:
        if self.settled:
            return
        self.settled = True
        self.error = error
        if self.poller is not None:
            self.poller.release(self)
        if error is not None:
            for s in self.sends:
                if s.reply is None:
                    s.link.forget(s.rid)
        if self.on_settle is not None:
            self.on_settle(self)
        else:
            assert self.lock is not None  # noqa: S101 - made with the call when there is no on_settle
            self.lock.release()


def assemble(routing: Routing, sends: list[FastSend], t: int, d: int) -> np.ndarray:
    """A fast-path layer's output [T, D] from its replies: combined rows as the workers sent them, the
    other tokens combined here from raw outputs (``weighted_sum``, slot order)."""
    k = routing.experts.shape[1]
    raw = all(snd.combined is None for snd in sends)
    if t == 1 and raw and routing.positions is not None:  # one token sent raw (a decode step on loopback)
        slot: list[np.ndarray] = [None] * k  # type: ignore[list-item]  # slot j's output row [1, D]
        for snd in sends:
            assert snd.reply is not None  # noqa: S101 - settled without error: every reply is in
            rows = snd.reply.out
            for r, i in enumerate(snd.items):
                slot[int(routing.positions[i][0])] = rows[r:r + 1]
        acc = np.zeros((1, d), dtype=np.float32)  # weighted_sum's operations, without gathering Y
        for j in range(k):
            acc += routing.weights[:, j, None] * slot[j]
        return acc
    y = np.empty((t * k, d), dtype=np.float32)  # [T * k, D]: row t * k + j is token t's slot j output
    if raw:  # no worker combined
        for snd in sends:
            assert snd.reply is not None  # noqa: S101 - settled without error: every reply is in
            y[np.concatenate([slot_positions(routing, i) for i in snd.items])] = snd.reply.out
        return weighted_sum(routing.weights, y.reshape(t, k, d))
    if len(sends) == 1 and len(sends[0].combined) == t:  # one worker combined every token (a decode step)
        assert sends[0].reply is not None  # noqa: S101 - settled without error: every reply is in
        return np.array(sends[0].reply.combined, dtype=np.float32)  # rows 0..T-1 in order; a writable copy
    out = np.empty((t, d), dtype=np.float32)  # [T, D]
    split = np.ones(t, dtype=bool)  # tokens combined here, from raw outputs
    for snd in sends:
        assert snd.reply is not None  # noqa: S101 - settled without error: every reply is in
        pos = np.concatenate([slot_positions(routing, i) for i in snd.items])  # request pair order
        if snd.combined is not None:
            assert isinstance(snd.reply, rpc.ExpertCombinedReply)  # noqa: S101 - checked by answers()
            out[snd.combined] = snd.reply.combined
            split[snd.combined] = False
            pos = pos[snd.raw_mask]
        y[pos] = snd.reply.out
    rows = np.flatnonzero(split)
    if len(rows):
        out[rows] = weighted_sum(routing.weights[rows], y.reshape(t, k, d)[rows])
    return out
