"""The worker side of expert RPC: answers HELLO, EXPERT_REQUEST and ECHO on one channel.

:meth:`ExpertWorker.serve` runs one channel to its end. The first message must be HELLO: the worker
picks the shard whose fingerprint matches (else answers FINGERPRINT_MISMATCH naming the checkpoints it
holds and ends the channel); it acks the highest protocol version both sides speak. Each EXPERT_REQUEST
(and, from v2, EXPERT_REQUEST_COMBINE) is computed with the shared ``expert_ffn`` on exactly the rows of
each expert in the request (decode-sized ones inline, as their packet is read, and the reply flushed at
once; larger ones in a thread, the input paused meanwhile) and answered in request order; a combine
request's whole rows are then summed in slot order by the engine's own ``weighted_sum``. Errors in a
request are answered with a typed ERROR; a protocol violation ends the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import structlog

from engine.experts import rpc
from engine.experts.channel import ByteChannel
from engine.experts.shard import ExpertShard
from engine.experts.worker_plan import WorkerPlan
from engine.moe import ExpertWeightsFn, expert_ffn_many, weighted_sum
from engine import limits, numerics
from transport import poll
from transport.framing import ErrorCode as StreamErrorCode

log = structlog.get_logger(__name__)

_NO_HANDLER = int(StreamErrorCode.NO_HANDLER)  # the stream reset a transport gives a stream type nobody serves

INLINE_MAX_FLOPS = 20_000_000  # requests below this (~1-2 ms of BLAS) run on the loop: decode latency
#   is dominated by wake-ups, and a worker thread hop is one more under CPU contention

BATCH_MAX_ROWS = 2048  # expert rows computed per expert_ffn_many call (a decode request: all of it in one); bounds
#   the gate/up intermediates of a big prefill request to ~2048 x 2I floats

PUMP_BATCH = 8  # messages answered in one read callback before the loop gets a turn (each inline one <~2 ms)

# A test hook: mutate a reply's outputs before they are sent (negative controls). Never set in production.
ReplyHook = Callable[[int, np.ndarray], None]

AnyRequest = rpc.ExpertRequest | rpc.ExpertCombineRequest


@dataclass
class WorkerStats:
    """What this worker served (merged into status and /metrics)."""

    channels: int = 0
    requests: int = 0
    rows: int = 0
    pairs: int = 0
    rows_combined: int = 0  # rows summed here (combine requests) and sent as one row instead of k
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    polls: int = 0  # answers after which the worker polled for the next request (FLAG_POLL)
    compute_s: float = 0.0
    expert_rows: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, expert) -> rows

    def as_dict(self) -> dict[str, object]:
        return {"channels": self.channels, "requests": self.requests, "rows": self.rows, "pairs": self.pairs,
                "rows_combined": self.rows_combined, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "errors": self.errors, "polls": self.polls,
                "compute_s": round(self.compute_s, 6), "experts_hit": len(self.expert_rows)}


def compute_request(weights: ExpertWeightsFn, req: AnyRequest, groups: list[tuple[int, np.ndarray]] | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """[n_pairs, D] outputs in request order: ``expert_ffn(x[rows_e], W_e)`` for each expert's rows
    (written into ``out`` if given), computed as the local executor computes them: ``expert_ffn_many`` over
    the experts (bit for bit ``expert_ffn`` of each; the products of up to ``BATCH_MAX_ROWS`` rows share the
    kernel threads' rounds). One call per expert cost a decode layer 8 rounds instead of 2."""
    if out is None:
        out = np.empty((req.pairs.shape[0], req.x.shape[1]), dtype=np.float32)
    pos = 0
    batch: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    batch_rows = 0
    for expert, rows in (req.groups() if groups is None else groups):
        batch.append((req.x[rows], *weights(req.layer, expert)))
        batch_rows += len(rows)
        if batch_rows >= BATCH_MAX_ROWS:
            pos = _ffn_into(out, pos, batch)
            batch, batch_rows = [], 0
    if batch:
        _ffn_into(out, pos, batch)
    return out


def _ffn_into(out: np.ndarray, pos: int, batch: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> int:
    """The experts of ``batch`` in one ``expert_ffn_many`` (the local executor's call: two rounds of the
    compiled kernels for all of them, not two per expert), written to ``out`` from row ``pos``; -> the next row."""
    for y in expert_ffn_many(batch):  # [n, D] each, in batch order
        out[pos:pos + y.shape[0]] = y
        pos += y.shape[0]
    return pos


def combine_rows(req: rpc.ExpertCombineRequest, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 4 of ``engine.moe`` for a combine request's rows, from ``compute_request``'s ``out``:
    (combined [n_combined, D] in ``req.rows`` order, the other pairs' outputs [m, D] in request order)."""
    y = out[req.slot_pairs()]  # [n_combined, k, D]
    return weighted_sum(req.weights, y), out[req.raw_mask()]


class ExpertWorker:
    """Serves the shards it was given (one per checkpoint fingerprint)."""

    def __init__(self, shards: list[ExpertShard], fingerprints: list[bytes], capacity: float = 1.0,
                 reply_hook: ReplyHook | None = None,
                 max_message_bytes: int = limits.EXPERT_MAX_MESSAGE_BYTES,
                 protocol_max: int = rpc.PROTOCOL_MAX, poll_s: float = limits.EXPERT_POLL_S,
                 numerics_tag: str | None = None) -> None:
        """``protocol_max``: the highest expert protocol version to ack (1 serves like a v1-only worker).
        ``numerics_tag``: what its v4 hello ack says (default this process's, engine/numerics.py).
        ``poll_s``: how long to poll for a coordinator's next request after answering one that carried
        ``FLAG_POLL`` (0: never poll)."""
        if not 0 <= poll_s <= limits.EXPERT_MAX_POLL_S:
            raise ValueError(f"poll_s must be between 0 and {limits.EXPERT_MAX_POLL_S}")
        if len(shards) != len(fingerprints):
            raise ValueError("one fingerprint per shard")
        self._by_fp: dict[bytes, list[ExpertShard]] = {}
        self._held: dict[bytes, dict[tuple[int, int], ExpertShard]] = {}  # (layer, expert) -> its first holder
        for s, fp in zip(shards, fingerprints):
            self._by_fp.setdefault(fp, []).append(s)
            held = self._held.setdefault(fp, {})
            for key in s.tensors:
                held.setdefault(key, s)
        self._weights = {fp: self._make_weights(held) for fp, held in self._held.items()}
        # one-token requests on prebuilt kernel rows (engine.experts.worker_plan); MESHD_DECODE_PLAN=0: never
        self._plans: dict[bytes, WorkerPlan] = {}
        if os.environ.get("MESHD_DECODE_PLAN", "1") != "0":
            for fp, held in self._held.items():
                lay = self._by_fp[fp][0].layout
                self._plans[fp] = WorkerPlan(self._weights[fp], lay.hidden_size, lay.intermediate_size,
                                             lay.num_experts, partial(_holds, held), partial(_fp8, held))
        self.capacity = capacity
        self.max_message_bytes = max_message_bytes
        self.protocol_max = min(protocol_max, rpc.PROTOCOL_MAX)
        self.numerics = numerics.tag() if numerics_tag is None else numerics_tag
        self.poll_s = poll_s
        self.stats = WorkerStats()
        self._reply_hook = reply_hook
        self._closing = False
        # one computation at a time: the worker plans' buffers and the kernel pool are shared by every
        # channel, and a direct channel computes on its own thread (engine.experts.direct)
        self.compute_lock = threading.Lock()

    def fingerprints(self) -> list[bytes]:
        return list(self._by_fp)

    def close(self) -> None:
        self._closing = True

    def _ack(self, fp: bytes, version: int) -> rpc.HelloAck:
        ranges = tuple(r for s in self._by_fp[fp] for r in s.ranges)
        return rpc.HelloAck(version=version, fingerprint=fp, capacity=self.capacity, ranges=ranges,
                            max_message_bytes=self.max_message_bytes, numerics=self.numerics)

    def _holder(self, fp: bytes, layer: int, expert: int) -> ExpertShard | None:
        return self._held[fp].get((layer, expert))

    def _weights_for(self, fp: bytes) -> ExpertWeightsFn:
        return self._weights[fp]

    @staticmethod
    def _make_weights(held: dict[tuple[int, int], ExpertShard]) -> ExpertWeightsFn:
        def weights(layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            shard = held.get((layer, expert))
            if shard is None:
                raise KeyError((layer, expert))
            return shard.weights(layer, expert)

        return weights

    async def serve(self, channel: ByteChannel, peer: str = "") -> None:
        """Serve one channel until it ends, breaks or violates the protocol. Never raises."""
        self.stats.channels += 1
        session = _Session(self, channel, peer)
        try:
            await session.run()
        finally:
            session.close()

    def hello_reply(self, msg: rpc.Hello, peer: str) -> tuple[rpc.Message, int]:
        """(the answer to a coordinator's hello, the protocol version acked, or 0 when it is refused)."""
        version = min(msg.max_version, self.protocol_max)
        if version < max(msg.min_version, rpc.PROTOCOL_MIN):
            speaks = f"worker speaks expert protocol {rpc.PROTOCOL_MIN}-{self.protocol_max}"
            return rpc.ErrorMsg(rpc.ErrorCode.VERSION_UNSUPPORTED, speaks), 0
        if msg.fingerprint not in self._by_fp:
            held = ", ".join(f"{s.path} ({f.hex()[:16]})" for f, ss in self._by_fp.items() for s in ss)
            self.stats.errors += 1
            log.info("experts_worker_refused_fingerprint", peer=peer, wanted=msg.fingerprint.hex()[:16])
            return rpc.ErrorMsg(
                rpc.ErrorCode.FINGERPRINT_MISMATCH,
                f"worker holds a different checkpoint: {held or 'none'}; "
                f"asked for {msg.fingerprint.hex()[:16]}"), 0
        return self._ack(msg.fingerprint, version), version

    def answer(self, fp: bytes, req: AnyRequest, rid: int, peer_max_bytes: int) -> bytes | bytearray:
        """The encoded answer to one request, computed on this thread (a direct channel's,
        ``engine.experts.direct``): the reply, or a typed error. Holds ``compute_lock`` while computing."""
        groups = req.groups()
        error = self._check_request(fp, req, groups, peer_max_bytes)
        if error is not None:
            if error.code != rpc.ErrorCode.SHUTTING_DOWN:
                self.stats.errors += 1
            return rpc.encode(error, rid)
        try:
            buf, result, dt = self.compute_now(self._weights_for(fp), fp, req, groups, rid)
        except Exception as e:  # noqa: BLE001 - answered as a typed error
            self.stats.errors += 1
            log.warning("experts_worker_compute_failed", layer=req.layer, error=repr(e))
            return rpc.encode(rpc.ErrorMsg(rpc.ErrorCode.INTERNAL, "compute failed", req.layer), rid)
        self._served(req, groups, dt)
        data = buf.finish(int(dt * 1e6)) if buf is not None else rpc.encode(self._reply(req, result, dt), rid)
        self.stats.bytes_out += len(data)
        return data

    def compute_now(self, weights: ExpertWeightsFn, fp: bytes, req: AnyRequest,
                    groups: list[tuple[int, np.ndarray]], rid: int
                    ) -> tuple[rpc.ReplyBuffer | None, Any, float]:
        """``req`` computed on this thread under ``compute_lock`` -> (its reply message with the outputs
        written in place, or None and the result for ``_reply``: a combining request, or a reply hook),
        seconds."""
        buf, result = None, None
        with self.compute_lock:
            t0 = time.perf_counter()
            if isinstance(req, rpc.ExpertRequest) and self._reply_hook is None:
                buf = rpc.ReplyBuffer(req.layer, req.pairs.shape[0], req.x.shape[1], rid)
                plan = self._plans.get(fp)
                if plan is None or not plan.compute(req.layer, req.x, groups, buf.out):
                    compute_request(weights, req, groups, buf.out)
            else:
                result = self._compute(weights, req, groups, self._plans.get(fp))
            return buf, result, time.perf_counter() - t0

    def _check_request(self, fp: bytes, req: AnyRequest, groups: list[tuple[int, np.ndarray]],
                       peer_max_bytes: int) -> rpc.ErrorMsg | None:
        """The typed error a request gets instead of a reply, if any."""
        if self._closing:
            return rpc.ErrorMsg(rpc.ErrorCode.SHUTTING_DOWN, "worker is stopping")
        missing = [e for e, _ in groups if self._holder(fp, req.layer, e) is None]
        if missing:
            return rpc.ErrorMsg(rpc.ErrorCode.NOT_HELD, f"layer {req.layer} expert {missing[0]} is not held here",
                                req.layer, missing[0])
        hidden = self._by_fp[fp][0].layout.hidden_size
        # Every pair's output is computed (and, in a v1 reply, sent) before any combining: bound that by
        # what the peer may receive and what we accept, whichever the request's kind.
        out_bytes = rpc.HEADER_BYTES + 20 + 4 * req.pairs.shape[0] * hidden + rpc.CRC_BYTES
        if out_bytes > min(peer_max_bytes, self.max_message_bytes):
            return rpc.ErrorMsg(rpc.ErrorCode.TOO_LARGE, f"the outputs would take {out_bytes} bytes", req.layer)
        if req.x.shape[1] != hidden:
            return rpc.ErrorMsg(rpc.ErrorCode.BAD_REQUEST, f"hidden size {req.x.shape[1]} != {hidden}", req.layer)
        return None

    def _inline(self, fp: bytes, req: AnyRequest) -> bool:
        layout = self._by_fp[fp][0].layout
        flops = req.pairs.shape[0] * layout.hidden_size * layout.intermediate_size * 6
        return flops <= INLINE_MAX_FLOPS and self._reply_hook is None

    def _compute(self, weights: ExpertWeightsFn, req: AnyRequest, groups: list[tuple[int, np.ndarray]],
                 plan: WorkerPlan | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """(outputs of the pairs sent raw, the combined rows or None for a v1 request). ``plan``: try its
        prebuilt rows first (a one-token request)."""
        out = np.empty((req.pairs.shape[0], req.x.shape[1]), dtype=np.float32)
        if plan is None or not plan.compute(req.layer, req.x, groups, out):
            compute_request(weights, req, groups, out)
        if self._reply_hook is not None:
            self._reply_hook(req.layer, out)  # runs in the compute thread, like the computation
        if isinstance(req, rpc.ExpertCombineRequest):
            combined, raw = combine_rows(req, out)
            return raw, combined
        return out, None

    def _compute_locked(self, weights: ExpertWeightsFn, req: AnyRequest,
                        groups: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray | None]:
        with self.compute_lock:
            return self._compute(weights, req, groups)

    @staticmethod
    def _reply(req: AnyRequest, result: tuple[np.ndarray, np.ndarray | None], dt: float) -> rpc.Message:
        out, combined = result
        if combined is None:
            return rpc.ExpertReply(layer=req.layer, out=out, compute_us=int(dt * 1e6))
        return rpc.ExpertCombinedReply(layer=req.layer, combined=combined, out=out, compute_us=int(dt * 1e6))

    def _served(self, req: AnyRequest, groups: list[tuple[int, np.ndarray]], dt: float) -> None:
        st = self.stats
        st.requests += 1
        st.rows += req.x.shape[0]
        st.pairs += req.pairs.shape[0]
        if isinstance(req, rpc.ExpertCombineRequest):
            st.rows_combined += len(req.rows)
        st.compute_s += dt
        for expert, rows in groups:
            st.expert_rows[(req.layer, expert)] = st.expert_rows.get((req.layer, expert), 0) + len(rows)


def _holds(held: dict[tuple[int, int], ExpertShard], layer: int, expert: int) -> bool:
    return (layer, expert) in held


def _fp8(held: dict[tuple[int, int], ExpertShard], layer: int, expert: int) -> bool:
    """Whether a held expert is FP8 with block scales (dequantized per use: not for prebuilt rows)."""
    return (layer, expert) in held[(layer, expert)].scales


async def answer_loading(channel: ByteChannel, reason: str, timeout_s: float = 10.0) -> None:
    """Answer a coordinator's hello on ``channel`` while this node's experts are still loading (the
    daemon joins its mesh before ``--experts`` checkpoints are mapped and checked): ``ERROR(LOADING,
    reason)``, then end the channel, when the hello offers ``rpc.LOADING_VERSION`` or later. An older
    coordinator's parser refuses an error code it does not know (a malformed answer): its hello gets what
    a worker with no expert handler yet gives, a reset with ``NO_HANDLER``, which it takes for "no worker
    here (yet)" and asks again when the worker advertises its shards. Anything but a hello, or nothing
    within ``timeout_s``, resets the channel. Never raises."""
    decoder = rpc.MessageDecoder(limits.EXPERT_MAX_MESSAGE_BYTES)
    try:
        async with asyncio.timeout(timeout_s):
            while (data := await channel.recv()) is not None:
                envelopes = decoder.feed(data)
                if not envelopes:
                    continue
                env = envelopes[0]
                if not isinstance(env.message, rpc.Hello):
                    break
                if env.message.max_version < rpc.LOADING_VERSION:
                    with contextlib.suppress(Exception):
                        channel.reset(_NO_HANDLER)
                    return
                error = rpc.ErrorMsg(rpc.ErrorCode.LOADING, reason[: limits.EXPERT_MAX_ERROR_TEXT_BYTES // 4])
                await channel.send(rpc.encode(error, env.request_id), end=True)
                return
    except Exception as e:  # noqa: BLE001 - a bad or silent peer: reset below
        log.debug("experts_loading_answer_failed", error=repr(e))
    with contextlib.suppress(Exception):
        channel.reset(0)


class _Session:
    """One coordinator's channel on a worker.

    Input is taken by callback as packets are read; a message that can be answered at once (a hello, an
    echo, a decode-sized request computed inline) is answered in the same callback and its reply flushed
    to the network there. Anything that must wait (a request computed in a thread, a reply larger than the
    send buffer takes) pauses the input until it is done, so replies keep request order and a
    coordinator that sends too much meets the transport's flow control, as before.
    """

    def __init__(self, worker: ExpertWorker, channel: ByteChannel, peer: str) -> None:
        self.w = worker
        self.ch = channel
        self.peer = peer
        self.decoder = rpc.MessageDecoder(worker.max_message_bytes)
        self.fp: bytes | None = None
        self.version = 0  # the protocol version acked in the hello (0 before it)
        self.peer_max_bytes = limits.EXPERT_MAX_MESSAGE_BYTES
        self.inbox: deque[rpc.Envelope] = deque()
        self.task: asyncio.Task[None] | None = None
        self._rest: Coroutine[Any, Any, None] | None = None
        self.input_ended = False
        self.finished = False
        self.poller = poll.poller()
        self._answered_error = False  # the message being handled was answered with an ERROR
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run(self) -> None:
        self.ch.set_receiver(self._on_data, self._on_end)
        try:
            await self.done
        except asyncio.CancelledError:
            self._stop(reset=True)
            raise

    def close(self) -> None:
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
        if self._rest is not None and inspect.getcoroutinestate(self._rest) == inspect.CORO_CREATED:
            self._rest.close()  # its task was cancelled before it ran: nothing will await it

    def _start(self, rest: Coroutine[Any, Any, None]) -> None:
        """Carry on in a task with ``rest`` (the input stays paused, or ends, until it is done)."""
        self._rest = rest
        self.task = asyncio.get_running_loop().create_task(self._carry_on(rest))

    # -- input (loop callbacks) ------------------------------------------------------------------

    def _on_data(self, data: bytes) -> None:
        self.poller.release(self)  # the next request is here (a hold is only ever ours to end)
        if self.finished:
            return
        self.w.stats.bytes_in += len(data)
        try:
            self.inbox.extend(self.decoder.feed(data))
        except rpc.ExpertProtocolError as e:
            self._protocol_error(e)
            return
        self._pump()

    def _on_end(self, error: Exception | None) -> None:
        if error is not None:
            log.debug("experts_worker_channel_ended", peer=self.peer, error=repr(error))
            self._stop(reset=True)
            return
        self.input_ended = True
        self._pump()

    def _pump(self) -> None:
        """Answer queued messages in order until one needs to wait (then a task carries on). At most
        ``PUMP_BATCH`` in one callback: a backlog of small requests must not hold the loop for long."""
        budget = PUMP_BATCH
        while self.inbox and self.task is None and not self.finished:
            if budget == 0:
                self.ch.pause_receiving()
                self._start(asyncio.sleep(0))
                return
            budget -= 1
            env = self.inbox.popleft()
            self._answered_error = False
            try:
                rest = self._handle(env)
            except rpc.ExpertProtocolError as e:
                self._protocol_error(e)
                return
            if rest is not None:
                self.ch.pause_receiving()
                self._start(rest)
            elif (env.flags & rpc.FLAG_POLL and not self.inbox and self.w.poll_s
                  and not self._answered_error):  # answered, and the coordinator's next request is due
                if self.poller.hold(self, self.w.poll_s):  # (after an error it takes another path)
                    self.w.stats.polls += 1
        if self.input_ended and not self.inbox and self.task is None and not self.finished:
            self._end_cleanly()

    async def _carry_on(self, rest: Coroutine[Any, Any, None]) -> None:
        try:
            await rest
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a network handler never lets an exception escape
            log.debug("experts_worker_channel_ended", peer=self.peer, error=repr(e))
            self._stop(reset=True)
            return
        self.task = None
        if self.finished:
            return
        self.ch.resume_receiving()
        self._pump()

    # -- messages --------------------------------------------------------------------------------

    def _handle(self, env: rpc.Envelope) -> Coroutine[Any, Any, None] | None:
        """Answer one message; None when done, else a coroutine that finishes the answer."""
        msg, rid = env.message, env.request_id
        if env.flags and self.version < 3:
            raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL,
                                          f"flags {env.flags:#x} in protocol {self.version}")
        if isinstance(msg, rpc.Echo):
            return self._emit(rpc.EchoReply(msg.payload), rid)
        if isinstance(msg, rpc.Hello):
            return self._hello(msg, rid)
        if isinstance(msg, rpc.ExpertRequest | rpc.ExpertCombineRequest):
            if self.fp is None:
                raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, "expert_request before hello")
            if isinstance(msg, rpc.ExpertCombineRequest) and self.version < 2:
                raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL,
                                              f"combine request in protocol {self.version}")
            return self._request(self.fp, msg, rid)
        raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, f"unexpected {type(msg).__name__}")

    def _hello(self, msg: rpc.Hello, rid: int) -> Coroutine[Any, Any, None] | None:
        if self.fp is not None:
            raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, "second hello")
        reply, version = self.w.hello_reply(msg, self.peer)
        if version == 0:
            return self._emit(reply, rid, last=True)
        self.peer_max_bytes = min(msg.max_message_bytes, limits.EXPERT_MAX_MESSAGE_BYTES)
        self.fp = msg.fingerprint
        self.version = version
        return self._emit(reply, rid)

    def _request(self, fp: bytes, req: AnyRequest, rid: int) -> Coroutine[Any, Any, None] | None:
        w = self.w
        groups = req.groups()
        error = w._check_request(fp, req, groups, self.peer_max_bytes)
        if error is not None:
            if error.code != rpc.ErrorCode.SHUTTING_DOWN:
                w.stats.errors += 1
            return self._emit(error, rid)
        weights = w._weights_for(fp)
        if not w._inline(fp, req):
            return self._threaded(weights, req, groups, rid)
        # Small (decode): computed here, as a thread hop would cost more than the compute. A plain request's
        # outputs go straight into its reply message.
        try:
            buf, result, dt = w.compute_now(weights, fp, req, groups, rid)
        except Exception as e:  # noqa: BLE001 - answered as a typed error
            return self._compute_failed(req, e, rid)
        if buf is not None:
            rest = self._emit_bytes(buf.finish(int(dt * 1e6)))
        else:
            rest = self._emit(w._reply(req, result, dt), rid)
        w._served(req, groups, dt)  # counted once the reply is on its way
        return rest

    async def _threaded(self, weights: ExpertWeightsFn, req: AnyRequest,
                        groups: list[tuple[int, np.ndarray]], rid: int) -> None:
        t0 = time.perf_counter()
        try:
            result = await asyncio.to_thread(self.w._compute_locked, weights, req, groups)
        except Exception as e:  # noqa: BLE001 - answered as a typed error
            rest = self._compute_failed(req, e, rid)
        else:
            dt = time.perf_counter() - t0
            self.w._served(req, groups, dt)
            rest = self._emit(self.w._reply(req, result, dt), rid)
        if rest is not None:
            await rest

    def _compute_failed(self, req: AnyRequest, e: Exception, rid: int) -> Coroutine[Any, Any, None] | None:
        self.w.stats.errors += 1
        log.warning("experts_worker_compute_failed", layer=req.layer, error=repr(e))
        return self._emit(rpc.ErrorMsg(rpc.ErrorCode.INTERNAL, "compute failed", req.layer), rid)

    # -- output ----------------------------------------------------------------------------------

    def _emit(self, msg: rpc.Message, rid: int, last: bool = False) -> Coroutine[Any, Any, None] | None:
        """Send a reply now if the channel takes it at once; else a coroutine that sends it."""
        if isinstance(msg, rpc.ErrorMsg):
            self._answered_error = True
        return self._emit_bytes(rpc.encode(msg, rid), last)

    def _emit_bytes(self, data: bytes | bytearray, last: bool = False) -> Coroutine[Any, Any, None] | None:
        self.w.stats.bytes_out += len(data)
        if not last and len(data) <= limits.EXPERT_SEND_CHUNK_BYTES and self.ch.send_now(data):
            return None
        return self._send_slowly(data, last)

    async def _send_slowly(self, data: bytes | bytearray, last: bool) -> None:
        step = limits.EXPERT_SEND_CHUNK_BYTES
        for i in range(0, len(data), step):
            await self.ch.send(data[i:i + step])
        if last:
            await self.ch.send(b"", end=True)
            self._stop(reset=False)

    def _end_cleanly(self) -> None:
        self._start(self._send_slowly(b"", last=True))

    def _protocol_error(self, e: rpc.ExpertProtocolError) -> None:
        self.w.stats.errors += 1
        log.info("experts_worker_protocol_error", peer=self.peer, reason=str(e))
        with contextlib.suppress(Exception):  # the channel is being dropped anyway
            self.ch.send_now(rpc.encode(rpc.ErrorMsg(e.code, e.reason), 0))
        self._stop(reset=True, code=1)

    def _stop(self, reset: bool, code: int = 0) -> None:
        if self.finished:
            return
        self.finished = True
        self.inbox.clear()
        self.poller.release(self)
        if reset:
            with contextlib.suppress(Exception):
                self.ch.reset(code)
        if not self.done.done():
            self.done.set_result(None)
