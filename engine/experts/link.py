"""A coordinator's channel to one expert worker: the hello, requests matched to replies by id, and the
link's counters (``LinkStats``). ``engine.experts.coordinator`` owns the links and drops failed ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.experts import rpc
from engine.experts.channel import ByteChannel
from engine.experts.layout import MoeLayout
from engine.latency import LATENCY_BUCKETS_S, empty_buckets, observe  # noqa: F401 - buckets re-exported
from engine import limits, numerics



class ExpertsUnavailable(Exception):
    """``on`` mode: some routed experts have no live worker. The API answers 503 with this message."""

    def __init__(self, reason: str, missing: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__(reason)
        self.missing = list(missing)


class WorkerRefused(Exception):
    """A worker's hello failed: different checkpoint, no common version, or a bad answer; or, with ``code``
    ``LOADING``, the worker is up but its experts are still loading (ask again soon; not an error)."""

    def __init__(self, node_id: str, reason: str, code: rpc.ErrorCode | None = None) -> None:
        if code == rpc.ErrorCode.LOADING:  # not a refusal: it answers once its experts are in
            super().__init__(f"expert worker {node_id} is still loading: {reason}")
        else:
            super().__init__(f"expert worker {node_id} refused: {reason}")
        self.node_id = node_id
        self.code = code


class NotAWorker(WorkerRefused):
    """The peer serves no expert stream at all (its transport reset the stream with NO_HANDLER): a plain mesh
    member, not a worker. Not an error and not a refusal; it is asked again only later or when it advertises
    expert shards."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id, "serves no expert stream (not an expert worker)")


def _no_handler(error: Exception | None) -> bool:
    """True when the channel ended because the peer has no handler for expert streams."""
    from transport.errors import StreamReset
    from transport.framing import ErrorCode as StreamErrorCode

    return isinstance(error, StreamReset) and error.code == StreamErrorCode.NO_HANDLER


class WorkerFailed(Exception):
    """One call on a worker link failed (timeout, typed error, broken channel)."""

@dataclass
class LinkStats:
    calls: int = 0
    rows: int = 0
    pairs: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    errors: int = 0
    latency_sum_s: float = 0.0
    latency_max_s: float = 0.0
    compute_sum_s: float = 0.0  # the worker's own compute time, from its replies
    direct_calls: int = 0  # of ``calls``, answered over the direct channel (engine.experts.direct)
    latency_buckets: list[int] = field(default_factory=empty_buckets)

    def answered(self, compute_us: int, latency_s: float) -> None:
        """One call answered: the worker's reported compute time and the round trip seen here."""
        self.calls += 1
        self.compute_sum_s += compute_us / 1e6
        self.latency_sum_s += latency_s
        self.latency_max_s = max(self.latency_max_s, latency_s)
        observe(self.latency_buckets, latency_s)

    def as_dict(self) -> dict[str, object]:
        avg = self.latency_sum_s / self.calls if self.calls else 0.0
        return {"calls": self.calls, "rows": self.rows, "pairs": self.pairs, "bytes_out": self.bytes_out,
                "bytes_in": self.bytes_in, "errors": self.errors, "latency_ms_avg": round(avg * 1e3, 3),
                "compute_ms_avg": round(self.compute_sum_s / self.calls * 1e3 if self.calls else 0.0, 3),
                "latency_ms_max": round(self.latency_max_s * 1e3, 3), "direct_calls": self.direct_calls}


Sink = Callable[["rpc.Message | WorkerFailed"], None]  # gets a request's reply, or why it has none


class WorkerLink:
    """One hello'd channel to a worker; many requests may be in flight (matched by request id).

    Replies are read by callback on the loop as their packets arrive (``set_receiver``) and handed to the
    sink registered for their request id: an asyncio future's for :meth:`submit`, the layer call's for the
    engine thread's fast path.
    """

    def __init__(self, node_id: str, channel: ByteChannel, stats: LinkStats) -> None:
        self.node_id = node_id
        self.channel = channel
        self.stats = stats
        self.ack: rpc.HelloAck | None = None
        self.holds: frozenset[tuple[int, int]] = frozenset()
        self.closed = False
        self.close_reason = ""
        self._pending: dict[int, Sink] = {}
        self._ids = itertools.count(1)  # next() is atomic: ids may be taken on the engine thread
        self._send_lock = asyncio.Lock()
        self._decoder = rpc.MessageDecoder()
        self.on_close: Callable[[WorkerLink, str], None] | None = None  # the executor forgets a closed link
        self.end_error: Exception | None = None  # why the channel ended, as the channel said
        self._retiring = ""  # replaced by another link: close once the replies in flight are in
        self.direct: Any = None  # engine.experts.direct.DirectLink beside the stream, while one is up

    def next_id(self) -> int:
        return (next(self._ids) - 1) % 0xFFFFFFFF + 1

    async def hello(self, fingerprint: bytes, layout: MoeLayout, timeout_s: float,
                    numerics_tag: str | None = None) -> rpc.HelloAck:
        """Hello the worker; raises :class:`WorkerRefused` for another checkpoint, no common version, or
        (``numerics_tag``: ours, default this process's, engine/numerics.py) a v4 ack with another numerics
        tag. A worker acking v1-v3 says no tag (an older meshd) and is used as before: nothing to check."""
        self.channel.set_receiver(self._on_data, self._on_end)
        try:
            fut = await self.submit(rpc.Hello(fingerprint=fingerprint))
            reply = await asyncio.wait_for(fut, timeout_s)
        except (WorkerFailed, TimeoutError) as e:
            self.close(f"hello failed: {e or 'timeout'}")
            if _no_handler(self.end_error):
                raise NotAWorker(self.node_id) from None
            raise WorkerRefused(self.node_id, f"no hello answer ({e or 'timeout'})") from None
        if isinstance(reply, rpc.ErrorMsg):
            self.close("refused")
            raise WorkerRefused(self.node_id, reply.text, reply.code)
        if not isinstance(reply, rpc.HelloAck):
            self.close("bad hello answer")
            raise WorkerRefused(self.node_id, f"answered hello with {type(reply).__name__}", rpc.ErrorCode.PROTOCOL)
        if reply.fingerprint != fingerprint:
            self.close("fingerprint mismatch")
            raise WorkerRefused(self.node_id, f"holds checkpoint {reply.fingerprint.hex()[:16]}, expected "
                                f"{fingerprint.hex()[:16]}", rpc.ErrorCode.FINGERPRINT_MISMATCH)
        if not rpc.PROTOCOL_MIN <= reply.version <= rpc.PROTOCOL_MAX:
            self.close("bad protocol version")
            raise WorkerRefused(self.node_id, f"acked expert protocol {reply.version}, we offered "
                                f"{rpc.PROTOCOL_MIN}-{rpc.PROTOCOL_MAX}", rpc.ErrorCode.VERSION_UNSUPPORTED)
        mine = numerics.tag() if numerics_tag is None else numerics_tag
        if reply.numerics and reply.numerics != mine:
            self.close("numerics mismatch")
            raise WorkerRefused(self.node_id, "computes with other numerics: " + numerics.difference(
                mine, reply.numerics, "on the coordinator", "on the worker"), rpc.ErrorCode.NUMERICS_MISMATCH)
        self.ack = reply
        self.holds = frozenset((layer, e) for layer in layout.sparse_layers for e in range(layout.num_experts)
                               if reply.holds(layer, e))
        return reply

    def expect(self, rid: int, sink: Sink) -> None:
        """Route the reply to request ``rid`` to ``sink`` (loop thread)."""
        if self.closed:
            raise WorkerFailed(f"link closed ({self.close_reason})")
        if len(self._pending) >= limits.EXPERT_MAX_INFLIGHT_PER_WORKER:
            raise WorkerFailed("too many requests in flight")
        self._pending[rid] = sink

    def retire(self, reason: str) -> None:
        """Another link to the same worker took over (e.g. a data lane came up): close this one once the
        replies already in flight on it have arrived, so a layer in progress is not failed by the swap."""
        if not self._pending:
            self.close(reason)
        else:
            self._retiring = reason

    def forget(self, rid: int) -> None:
        """A reply to ``rid`` is no longer wanted (it is dropped when it comes). Loop thread."""
        self._pending.pop(rid, None)
        if self._retiring and not self._pending:
            self.close(self._retiring)

    def send_now(self, data: bytes) -> bool:
        """Send one encoded message at once (loop thread); False if the channel's send buffer is full."""
        try:
            sent = self.channel.send_now(data)
        except Exception as e:  # noqa: BLE001 - any send failure means the link is gone
            self.close(f"send failed: {e!r}")
            raise WorkerFailed(f"send failed: {e!r}") from None
        if sent:
            self.stats.bytes_out += len(data)
        return sent

    async def submit(self, msg: rpc.Message) -> asyncio.Future[rpc.Message]:
        """Send one message; the returned future resolves to the reply (or fails with WorkerFailed)."""
        rid = self.next_id()
        fut: asyncio.Future[rpc.Message] = asyncio.get_running_loop().create_future()

        def sink(reply: rpc.Message | WorkerFailed) -> None:
            if fut.done():
                return
            if isinstance(reply, WorkerFailed):
                fut.set_exception(reply)
                fut.exception()  # nobody may await it any more (timed out): not an unretrieved error
            else:
                fut.set_result(reply)

        self.expect(rid, sink)
        data = rpc.encode(msg, rid)
        step = limits.EXPERT_SEND_CHUNK_BYTES
        try:
            async with self._send_lock:
                for i in range(0, len(data), step):
                    await self.channel.send(data[i:i + step])
        except Exception as e:  # noqa: BLE001 - any send failure means the link is gone
            self.close(f"send failed: {e!r}")
            raise WorkerFailed(f"send failed: {e!r}") from None
        self.stats.bytes_out += len(data)
        return fut

    def _on_data(self, data: bytes) -> None:
        if self.closed:
            return
        self.stats.bytes_in += len(data)
        try:
            for env in self._decoder.feed(data):
                sink = self._pending.pop(env.request_id, None)
                if sink is not None:
                    sink(env.message)
                    if self._retiring and not self._pending:
                        self.close(self._retiring)
                        return
                elif isinstance(env.message, rpc.ErrorMsg) and env.request_id == 0:
                    self.close(f"worker error: {env.message.text}")
                    return
        except rpc.ExpertProtocolError as e:
            self.close(f"protocol error: {e}")

    def _on_end(self, error: Exception | None) -> None:
        self.end_error = error
        self.close("stream ended" if error is None else f"stream broke: {error!r}")

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        pending, self._pending = self._pending, {}
        for sink in pending.values():
            sink(WorkerFailed(reason))
        with contextlib.suppress(Exception):
            self.channel.reset(0)
        direct, self.direct = self.direct, None
        if direct is not None:
            direct.close(f"link closed: {reason}")
        if self.on_close is not None:
            self.on_close(self, reason)
