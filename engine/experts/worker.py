"""The worker side of expert RPC: answers HELLO, EXPERT_REQUEST and ECHO on one channel.

:meth:`ExpertWorker.serve` runs one channel to its end. The first message must be HELLO: the worker
picks the shard whose fingerprint matches (else answers FINGERPRINT_MISMATCH naming the checkpoints it
holds and ends the channel). Each EXPERT_REQUEST is computed off the event loop with the shared
``expert_ffn`` on exactly the rows of each expert in the request, and answered in request order. Errors in
a request are answered with a typed ERROR; a protocol violation ends the channel.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from engine.experts import rpc
from engine.experts.channel import ByteChannel
from engine.experts.shard import ExpertShard
from engine.moe import ExpertWeightsFn, expert_ffn
from transport import limits

log = structlog.get_logger(__name__)

INLINE_MAX_FLOPS = 20_000_000  # requests below this (~1-2 ms of BLAS) run on the loop: decode latency
#   is dominated by wake-ups, and a worker thread hop is one more under CPU contention

# A test hook: mutate a reply's outputs before they are sent (negative controls). Never set in production.
ReplyHook = Callable[[int, np.ndarray], None]


@dataclass
class WorkerStats:
    """What this worker served (merged into status and /metrics)."""

    channels: int = 0
    requests: int = 0
    rows: int = 0
    pairs: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    compute_s: float = 0.0
    expert_rows: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, expert) -> rows

    def as_dict(self) -> dict[str, object]:
        return {"channels": self.channels, "requests": self.requests, "rows": self.rows, "pairs": self.pairs,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "errors": self.errors,
                "compute_s": round(self.compute_s, 6), "experts_hit": len(self.expert_rows)}


def compute_request(weights: ExpertWeightsFn, req: rpc.ExpertRequest) -> np.ndarray:
    """[n_pairs, D] outputs in request order: ``expert_ffn(x[rows_e], W_e)`` for each expert's rows."""
    out = np.empty((req.pairs.shape[0], req.x.shape[1]), dtype=np.float32)
    pos = 0
    for expert, rows in req.groups():
        y = expert_ffn(req.x[rows], *weights(req.layer, expert))  # [n, D]
        out[pos:pos + len(rows)] = y
        pos += len(rows)
    return out


class ExpertWorker:
    """Serves the shards it was given (one per checkpoint fingerprint)."""

    def __init__(self, shards: list[ExpertShard], fingerprints: list[bytes], capacity: float = 1.0,
                 reply_hook: ReplyHook | None = None,
                 max_message_bytes: int = limits.EXPERT_MAX_MESSAGE_BYTES) -> None:
        if len(shards) != len(fingerprints):
            raise ValueError("one fingerprint per shard")
        self._by_fp: dict[bytes, list[ExpertShard]] = {}
        for s, fp in zip(shards, fingerprints):
            self._by_fp.setdefault(fp, []).append(s)
        self.capacity = capacity
        self.max_message_bytes = max_message_bytes
        self.stats = WorkerStats()
        self._reply_hook = reply_hook
        self._closing = False
        self._peer_max_bytes: dict[int, int] = {}  # per channel: the coordinator's message limit (hello)

    def fingerprints(self) -> list[bytes]:
        return list(self._by_fp)

    def close(self) -> None:
        self._closing = True

    def _ack(self, fp: bytes) -> rpc.HelloAck:
        ranges = tuple(r for s in self._by_fp[fp] for r in s.ranges)
        return rpc.HelloAck(version=rpc.PROTOCOL_VERSION, fingerprint=fp, capacity=self.capacity, ranges=ranges,
                            max_message_bytes=self.max_message_bytes)

    def _holder(self, fp: bytes, layer: int, expert: int) -> ExpertShard | None:
        for s in self._by_fp[fp]:
            if s.holds(layer, expert):
                return s
        return None

    def _weights_for(self, fp: bytes) -> ExpertWeightsFn:
        def weights(layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            shard = self._holder(fp, layer, expert)
            if shard is None:
                raise KeyError((layer, expert))
            return shard.weights(layer, expert)

        return weights

    async def _send(self, channel: ByteChannel, msg: rpc.Message, request_id: int) -> None:
        data = rpc.encode(msg, request_id)
        self.stats.bytes_out += len(data)
        step = limits.EXPERT_SEND_CHUNK_BYTES
        for i in range(0, len(data), step):
            await channel.send(data[i:i + step])

    async def serve(self, channel: ByteChannel, peer: str = "") -> None:
        """Serve one channel until it ends, breaks or violates the protocol. Never raises."""
        self.stats.channels += 1
        try:
            await self._serve(channel, peer)
        finally:
            self._peer_max_bytes.pop(id(channel), None)

    async def _serve(self, channel: ByteChannel, peer: str) -> None:
        decoder = rpc.MessageDecoder(self.max_message_bytes)
        fp: bytes | None = None
        try:
            while True:
                data = await channel.recv()
                if data is None:
                    await channel.send(b"", end=True)
                    return
                self.stats.bytes_in += len(data)
                for env in decoder.feed(data):
                    fp = await self._handle(channel, env, fp, peer)
                    if fp == b"":
                        await channel.send(b"", end=True)
                        return
        except rpc.ExpertProtocolError as e:
            self.stats.errors += 1
            log.info("experts_worker_protocol_error", peer=peer, reason=str(e))
            try:
                await self._send(channel, rpc.ErrorMsg(e.code, e.reason), 0)
            except Exception:  # noqa: BLE001 - the channel is being dropped anyway
                pass
            channel.reset(1)
        except asyncio.CancelledError:
            channel.reset(0)
            raise
        except Exception as e:  # noqa: BLE001 - a network handler never lets an exception escape
            log.debug("experts_worker_channel_ended", peer=peer, error=repr(e))
            channel.reset(0)

    async def _handle(self, channel: ByteChannel, env: rpc.Envelope, fp: bytes | None, peer: str) -> bytes | None:
        msg, rid = env.message, env.request_id
        if isinstance(msg, rpc.Echo):
            await self._send(channel, rpc.EchoReply(msg.payload), rid)
            return fp
        if isinstance(msg, rpc.Hello):
            if fp is not None:
                raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, "second hello")
            if not msg.min_version <= rpc.PROTOCOL_VERSION <= msg.max_version:
                await self._send(channel, rpc.ErrorMsg(rpc.ErrorCode.VERSION_UNSUPPORTED,
                                                       f"worker speaks expert protocol {rpc.PROTOCOL_VERSION}"), rid)
                return b""
            if msg.fingerprint not in self._by_fp:
                held = ", ".join(f"{s.path} ({f.hex()[:16]})" for f, ss in self._by_fp.items() for s in ss)
                self.stats.errors += 1
                log.info("experts_worker_refused_fingerprint", peer=peer, wanted=msg.fingerprint.hex()[:16])
                await self._send(channel, rpc.ErrorMsg(
                    rpc.ErrorCode.FINGERPRINT_MISMATCH,
                    f"worker holds a different checkpoint: {held or 'none'}; asked for {msg.fingerprint.hex()[:16]}"),
                    rid)
                return b""
            self._peer_max_bytes[id(channel)] = msg.max_message_bytes
            await self._send(channel, self._ack(msg.fingerprint), rid)
            return msg.fingerprint
        if isinstance(msg, rpc.ExpertRequest):
            if fp is None:
                raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, "expert_request before hello")
            await self._request(channel, fp, msg, rid)
            return fp
        raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, f"unexpected {type(msg).__name__}")

    def _compute(self, weights: ExpertWeightsFn, req: rpc.ExpertRequest) -> np.ndarray:
        out = compute_request(weights, req)
        if self._reply_hook is not None:
            self._reply_hook(req.layer, out)  # runs in the compute thread, like the computation
        return out

    async def _request(self, channel: ByteChannel, fp: bytes, req: rpc.ExpertRequest, rid: int) -> None:
        if self._closing:
            await self._send(channel, rpc.ErrorMsg(rpc.ErrorCode.SHUTTING_DOWN, "worker is stopping"), rid)
            return
        groups = req.groups()
        missing = [e for e, _ in groups if self._holder(fp, req.layer, e) is None]
        if missing:
            self.stats.errors += 1
            await self._send(channel, rpc.ErrorMsg(rpc.ErrorCode.NOT_HELD,
                                                   f"layer {req.layer} expert {missing[0]} is not held here",
                                                   req.layer, missing[0]), rid)
            return
        hidden = self._by_fp[fp][0].layout.hidden_size
        reply_bytes = rpc.HEADER_BYTES + 16 + 4 * req.pairs.shape[0] * hidden + rpc.CRC_BYTES
        if reply_bytes > self._peer_max_bytes.get(id(channel), limits.EXPERT_MAX_MESSAGE_BYTES):
            self.stats.errors += 1
            await self._send(channel, rpc.ErrorMsg(rpc.ErrorCode.TOO_LARGE,
                                                   f"the reply would be {reply_bytes} bytes", req.layer), rid)
            return
        if req.x.shape[1] != hidden:
            self.stats.errors += 1
            await self._send(channel, rpc.ErrorMsg(rpc.ErrorCode.BAD_REQUEST,
                                                   f"hidden size {req.x.shape[1]} != {hidden}", req.layer), rid)
            return
        t0 = time.perf_counter()
        weights = self._weights_for(fp)
        try:
            flops = req.pairs.shape[0] * hidden * self._by_fp[fp][0].layout.intermediate_size * 6
            if flops <= INLINE_MAX_FLOPS and self._reply_hook is None:
                out = self._compute(weights, req)  # small (decode): a thread hop would cost more than this
            else:
                out = await asyncio.to_thread(self._compute, weights, req)
        except Exception as e:  # noqa: BLE001 - answered as a typed error
            self.stats.errors += 1
            log.warning("experts_worker_compute_failed", layer=req.layer, error=repr(e))
            await self._send(channel, rpc.ErrorMsg(rpc.ErrorCode.INTERNAL, "compute failed", req.layer), rid)
            return
        dt = time.perf_counter() - t0
        st = self.stats
        st.requests += 1
        st.rows += req.x.shape[0]
        st.pairs += req.pairs.shape[0]
        st.compute_s += dt
        for expert, rows in groups:
            st.expert_rows[(req.layer, expert)] = st.expert_rows.get((req.layer, expert), 0) + len(rows)
        await self._send(channel, rpc.ExpertReply(layer=req.layer, out=out, compute_us=int(dt * 1e6)), rid)
