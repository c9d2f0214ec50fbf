"""Expert RPC over a direct channel (``transport.lane_direct``): no event loop on either side.

A worker reached over a data lane is also dialled a direct channel: a blocking TLS socket, authenticated as
the lane is. The coordinator's engine thread then makes a decode layer's call itself (``DirectLink.call``:
each worker's request written, each reply read, on that thread) and the worker answers in the channel's
own thread (``serve``: read a request, compute, write the reply). The messages are the expert protocol's
own (``engine.experts.rpc``, one per channel message), starting with a hello that binds the channel to the
checkpoint as the stream's does; the worker computes with the same functions (``ExpertWorker.answer``),
so the bits are the same as over the stream.

The channel is an accelerator beside the link's stream, never instead of it: anything unusual on it (a
broken or slow socket, a reply that does not fit) closes it, and that layer, like every later one, takes
the stream's path (the loop's fast path, or the general path with its retries). The experts service dials
it again at its next probe. ``MESHD_EXPERTS_DIRECT=0`` (in the coordinator's process) never dials one.
"""

from __future__ import annotations

import os
import time

import structlog

from engine.experts import rpc
from engine.experts.layout import MoeLayout
from engine.experts.planning import FastCall, FastSend
from engine import limits
from transport.errors import TransportError
from transport.lane_direct import DirectChannel

log = structlog.get_logger(__name__)


def enabled() -> bool:
    return os.environ.get("MESHD_EXPERTS_DIRECT", "1") != "0"


class DirectFailed(Exception):
    """The direct channel cannot answer this call (it is closed now, or was not usable)."""


class DirectLink:
    """The coordinator's end of a direct channel to one worker (engine threads only, one at a time)."""

    def __init__(self, channel: DirectChannel) -> None:
        self.channel = channel
        self.ack: rpc.HelloAck | None = None
        self._rid = 0
        self.calls = 0

    @property
    def closed(self) -> bool:
        return self.channel.closed

    @property
    def on_loopback(self) -> bool:
        return self.channel.on_loopback

    def next_id(self) -> int:
        self._rid = self._rid % 0xFFFFFFFF + 1
        return self._rid

    def hello(self, fingerprint: bytes, layout: MoeLayout, expect_version: int,
              timeout_s: float) -> rpc.HelloAck:
        """Blocking (a thread): bind the channel to ``fingerprint``; the worker must ack ``expect_version``
        (what the stream's link acked, which requests are built for). Raises ``DirectFailed``."""
        rid = self.next_id()
        try:
            self.channel.send(rpc.encode(rpc.Hello(fingerprint=fingerprint), rid), timeout_s)
            data = self.channel.recv(timeout_s)
            if data is None:
                raise DirectFailed("the worker closed the direct channel")
            env = rpc.decode(data)
        except (TransportError, rpc.ExpertProtocolError) as e:
            self.close(f"hello failed: {e}")
            raise DirectFailed(str(e)) from None
        ack = env.message
        if (not isinstance(ack, rpc.HelloAck) or env.request_id != rid or ack.fingerprint != fingerprint
                or ack.version != expect_version):
            self.close("hello refused")
            raise DirectFailed(f"hello answered with {type(ack).__name__}")
        self.ack = ack
        return ack

    def send(self, snd: FastSend, timeout_s: float) -> None:
        """Write one fast-path request (its ``rid`` is this channel's). Raises ``DirectFailed``."""
        try:
            self.channel.send(snd.data, timeout_s)
        except TransportError as e:
            raise DirectFailed(str(e)) from None
        snd.t0 = time.perf_counter()

    def reply(self, snd: FastSend, layer: int, timeout_s: float) -> rpc.Message:
        """Read the reply to ``snd``: a well-formed answer, or an ``ErrorMsg`` (the channel stays in step).
        Anything else closes the channel and raises ``DirectFailed``."""
        try:
            data = self.channel.recv(timeout_s)
            if data is None:
                raise DirectFailed("the worker closed the direct channel")
            snd.link.stats.bytes_in += len(data)
            env = rpc.decode(data)
        except (TransportError, rpc.ExpertProtocolError) as e:
            self.close(str(e))
            raise DirectFailed(str(e)) from None
        snd.t1 = time.perf_counter()
        if env.request_id != snd.rid:
            self.close("reply out of step")
            raise DirectFailed(f"reply to request {env.request_id}, expected {snd.rid}")
        msg = env.message
        if isinstance(msg, rpc.ErrorMsg):
            return msg
        if not snd.answers(msg, layer):
            self.close("reply does not match the request")
            raise DirectFailed(f"layer {layer}: reply does not match the request ({type(msg).__name__})")
        self.calls += 1
        return msg

    def echo(self, payload: bytes, timeout_s: float) -> float:
        """Seconds for one ECHO of ``payload`` there and back on this thread (benchmarks)."""
        rid = self.next_id()
        data = rpc.encode(rpc.Echo(payload), rid)
        t0 = time.perf_counter()
        try:
            self.channel.send(data, timeout_s)
            back = self.channel.recv(timeout_s)
        except TransportError as e:
            raise DirectFailed(str(e)) from None
        t1 = time.perf_counter()
        if back is None:
            raise DirectFailed("the worker closed the direct channel")
        env = rpc.decode(back)
        msg = env.message
        if not isinstance(msg, rpc.EchoReply) or msg.payload != payload or env.request_id != rid:
            self.close("bad echo reply")
            raise DirectFailed("bad echo reply")
        return t1 - t0

    def close(self, reason: str) -> None:
        if not self.channel.closed:
            log.info("experts_direct_closed", worker=self.channel.peer_id, reason=reason)
        self.channel.close(reason)


def serve(worker: object, peer_id: str, channel: DirectChannel) -> None:
    """The worker's end, in the channel's own thread, until the channel ends or breaks: a hello first, then
    each request answered in order (``ExpertWorker.answer``), echoes, nothing else. Never raises."""
    from engine.experts.worker import ExpertWorker

    assert isinstance(worker, ExpertWorker)  # noqa: S101 - the service passes its worker
    w = worker
    fp: bytes | None = None
    version = 0
    peer_max = limits.EXPERT_MAX_MESSAGE_BYTES
    w.stats.channels += 1
    try:
        while not channel.closed:
            data = channel.recv()
            if data is None:
                return
            w.stats.bytes_in += len(data)
            env = rpc.decode(data, w.max_message_bytes)
            msg, rid = env.message, env.request_id
            if isinstance(msg, rpc.Echo):
                channel.send(rpc.encode(rpc.EchoReply(msg.payload), rid))
            elif isinstance(msg, rpc.Hello):
                if fp is not None:
                    raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, "second hello")
                reply, version = w.hello_reply(msg, peer_id)
                channel.send(rpc.encode(reply, rid))
                if version == 0:
                    return
                fp, peer_max = msg.fingerprint, min(msg.max_message_bytes, limits.EXPERT_MAX_MESSAGE_BYTES)
            elif isinstance(msg, rpc.ExpertRequest | rpc.ExpertCombineRequest):
                if fp is None:
                    raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, "expert_request before hello")
                if isinstance(msg, rpc.ExpertCombineRequest) and version < 2:
                    raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL,
                                                  f"combine request in protocol {version}")
                # a reply goes out as one channel message: a v1 reply (every pair's output) that cannot fit is
                # refused (TOO_LARGE, before computing) instead of computed and then closing the channel
                # when it cannot be sent; a combined reply is smaller than the bound the worker checks
                cap = peer_max if isinstance(msg, rpc.ExpertCombineRequest) else min(peer_max,
                                                                                     channel.max_record_bytes)
                channel.send(w.answer(fp, msg, rid, cap))
            else:
                raise rpc.ExpertProtocolError(rpc.ErrorCode.PROTOCOL, f"unexpected {type(msg).__name__}")
    except rpc.ExpertProtocolError as e:
        w.stats.errors += 1
        log.info("experts_worker_protocol_error", peer=peer_id, reason=str(e), path="direct")
    except TransportError as e:
        log.debug("experts_worker_direct_ended", peer=peer_id, error=str(e))
    finally:
        channel.close("served")


class DirectPath:
    """The direct path of ``RemoteExecutor`` (mixed in; uses its links, counters and fast-path timeout).

    When every worker of a fast-path call has a direct channel, the engine thread writes each request and
    reads each reply itself: no loop callback, no loop wake-up, no thread hand-off, and TLS on a blocking
    socket instead of asyncio's. Anything unusual closes the channel that saw it, and the layer takes the
    general path over the links' streams, as a fast-path call that gives up does."""

    def _direct_for(self, call: FastCall) -> bool:
        return bool(call.sends) and all(snd.link.direct is not None and not snd.link.direct.closed
                                        for snd in call.sends)

    def all_direct(self) -> bool:
        """Whether every live link has a direct channel now (a decode pass then stays on its engine
        thread)."""
        links = [link for link in self.links.values() if not link.closed]
        return bool(links) and all(link.direct is not None and not link.direct.closed for link in links)

    def _run_direct(self, call: FastCall) -> list[FastSend] | None:
        """Engine thread: the answered requests, or None (the general path runs the layer)."""
        directs: list[DirectLink] = []
        try:
            for snd in call.sends:
                d = snd.link.direct
                if d is None or not d.channel.lock.acquire(blocking=False):
                    return None  # another engine thread is using it: the general path (rare)
                directs.append(d)
            timeout = self._fast_timeout_s
            for snd, d in zip(call.sends, directs):
                d.send(snd, timeout)
                snd.link.stats.rows += snd.rows
                snd.link.stats.pairs += snd.pairs
                snd.link.stats.bytes_out += len(snd.data)
            failed = ""
            for snd, d in zip(call.sends, directs):
                reply = d.reply(snd, call.layer, timeout)
                if isinstance(reply, rpc.ErrorMsg):
                    failed = failed or f"worker {snd.node}: {reply.text}"
                    continue
                snd.reply = reply  # type: ignore[assignment]  # answers() checked its type
            if failed:
                self._count_failed(call)
                return None
        except DirectFailed as e:
            log.info("experts_direct_failed", layer=call.layer, error=str(e))
            for snd, d in zip(call.sends, directs):  # a reply left unread: that channel is out of step
                if snd.reply is None:
                    d.close(f"layer {call.layer} abandoned")
            self._count_failed(call)
            return None
        finally:
            for d in directs:
                d.channel.lock.release()
        for snd in call.sends:
            snd.link.stats.direct_calls += 1
        self._observe(call)
        return call.sends

    def _count_failed(self, call: FastCall) -> None:
        for snd in call.sends:
            if snd.reply is None:
                self.link_stats[snd.node].errors += 1
        self._count_retries(sum(len(snd.items) for snd in call.sends if snd.reply is None))
