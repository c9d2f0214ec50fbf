"""A pipeline stage's decode hop over a direct channel (``transport.lane_direct``): no event loop either side.

Beside the PIPELINE stream of a stage reached over a data lane, the serving node dials a direct channel to the
same stage (``SERVICE_PIPELINE``): a blocking TLS socket, authenticated as the lane is. A decode step the
scheduler thread waits for next (a lone sequence's; a batched step of every live sequence when they step as one
group, ``Run.groups == 1``) is then sent by that thread itself (``DirectHop.call``: the FORWARD written and
its RESULT read on that thread, one hop after the other for 3 stages) and the stage computes it in the
channel's own thread (``serve``: read a frame, ``StageHost.direct_step``, write the reply). The frames are the
stream's (``engine.pipeline.wire``, one per channel message) and the stage computes with the same functions,
caches and locks as its stream's inline steps, so the bits are the same either way.

The channel only carries decode steps (a row a sequence): OPEN, prefill chunks, FREE, steps of rolling decode or
of several groups (their scheduler computes while they are out) and recovery stay on the stream, and a step is only taken for a run the same node opened on its stream (``StageHost.owners``), so the
stage's sequence table has one owner. Anything unusual (a closed, broken or slow channel, a frame that does
not fit, an ERROR) sends that step on the stream instead, from the hop that failed; a channel that failed is
closed and dialled again later (``meshd.pipeline_direct``). A step whose reply was lost may already be in
the stage's cache: the stage then rewinds it and computes it again (``StageHost._caches``), so the output is
the same. ``MESHD_PIPELINE_DIRECT=0`` (in the serving node's process) never dials one.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import structlog

from engine.pipeline import limits, trace, wire
from transport.errors import TransportError

log = structlog.get_logger(__name__)


def enabled() -> bool:
    return os.environ.get("MESHD_PIPELINE_DIRECT", "1") != "0"


class DirectHop:
    """The serving node's end of a direct channel to one stage node (shared by every run's link to it).
    ``call`` from one thread at a time (a busy channel answers None: the caller uses the stream)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.channel.max_record_bytes = min(self.channel.max_record_bytes, limits.DIRECT_MAX_MESSAGE_BYTES)
        self._step = 0
        self._pinged = 0.0  # perf_counter of the last ping
        self.calls = 0
        self.fallbacks = 0

    @property
    def closed(self) -> bool:
        return bool(self.channel.closed)

    def close(self, reason: str) -> None:
        if not self.channel.closed:
            log.info("pipeline_direct_closed", stage=self.channel.peer_id[:12], reason=reason)
        self.channel.close(reason)

    def _next(self) -> int:
        self._step = self._step % 0xFFFFFFFE + 1
        return self._step

    def call(self, link: Any, frame: wire.Forward, last: bool) -> wire.Result | None:
        """One hop of a decode step (a row a sequence) to ``link``'s stage (the caller's thread, blocking) -> the stage's RESULT
        (logits when ``last``), or None: the channel could not take it (busy, closed, broken, slow, an ERROR,
        a reply that does not fit), and the caller sends this hop on the stream. Never raises."""
        ch = self.channel
        if ch.closed or not ch.lock.acquire(blocking=False):
            return None
        try:
            timeout = limits.DIRECT_TIMEOUT_S
            now = time.perf_counter()
            if now - self._pinged >= limits.PING_EVERY_S:  # the channel's round trip, just ahead of a step
                self._pinged = now
                pid = self._next()
                ch.send(wire.encode(wire.Keepalive(pid)), timeout)
                echo = ch.recv(timeout)
                if echo is None or wire.decode_one(echo, limits.DIRECT_MAX_MESSAGE_BYTES) != wire.Keepalive(pid):
                    raise TransportError("bad ping echo")
                link.stats.add_ping(time.perf_counter() - now)
            step = self._next()
            parts = wire.step_parts(frame, step)  # the frame with this channel's step number, not copied yet
            if parts is None:  # a batched step (several spans): the general codec
                data = wire.encode(wire.Forward(frame.run, step, frame.spans, frame.x, frame.last_only))
                parts = (data,), len(data)
            tracing = trace.ON and frame.x.shape[0] == 1
            t0 = time.perf_counter()
            if tracing:
                trace.mark("S.dsend")
            ch.send_parts(parts[0], parts[1], timeout)
            if tracing:
                trace.mark("S.dwrote")
            back = ch.recv_owned(timeout, wire.RESULT_LEAD)  # the rows land 16-byte aligned: viewed, not copied
            if tracing:
                trace.mark("S.drx")
            if back is None:
                raise TransportError("the stage closed the direct channel")
            reply = wire.decode_one(back, limits.DIRECT_MAX_MESSAGE_BYTES, owned=True, at=wire.RESULT_LEAD)
            if isinstance(reply, wire.Error) and reply.step == step:
                self.fallbacks += 1  # the channel is in step; the stream's answer is the one that counts
                log.debug("pipeline_direct_error", stage=ch.peer_id[:12], code=reply.code, text=reply.text)
                return None
            if (not isinstance(reply, wire.Result) or reply.step != step or reply.run != frame.run
                    or reply.logits != last or reply.x.shape[0] != frame.x.shape[0]):
                raise TransportError(f"the reply does not fit the step ({type(reply).__name__})")
            link.stats.add(time.perf_counter() - t0, reply.compute_us / 1e6)
            link.stats.direct_calls += 1
            self.calls += 1
            return reply
        except (TransportError, wire.RemoteProtocolError) as e:
            self.fallbacks += 1
            self.close(str(e) if isinstance(e, TransportError) else f"protocol error: {e.reason}")
            return None
        finally:
            ch.lock.release()


def serve(hosts: list[Any], peer_id: str, channel: Any) -> None:
    """The stage's end, in the channel's own thread, until the channel ends or breaks: each FORWARD answered
    in order (``StageHost.direct_step`` of the host where ``peer_id`` opened that run), pings echoed; anything
    else closes the channel. Never raises."""
    channel.max_record_bytes = min(channel.max_record_bytes, limits.DIRECT_MAX_MESSAGE_BYTES)
    try:
        while not channel.closed:
            data = channel.recv_owned(None, wire.FORWARD_LEAD)  # its rows land 16-byte aligned: viewed in place
            if data is None:
                return
            t_rx = time.monotonic_ns() if trace.ON else 0
            f = wire.decode_one(data, limits.DIRECT_MAX_MESSAGE_BYTES, owned=True, at=wire.FORWARD_LEAD)
            if type(f) is not wire.Forward:
                if not isinstance(f, wire.Keepalive):
                    raise wire.RemoteProtocolError(wire.ErrorCode.PROTOCOL, f"a direct channel does not take "
                                                   f"{type(f).__name__}")
                channel.send(wire.encode(f))
                continue
            reply: wire.Frame | None = None
            for host in hosts:
                if host.owners.get(f.run) == peer_id:
                    if trace.ON and f.x.shape[0] == 1:
                        trace.mark_at("T.drx", t_rx)
                    reply = host.direct_step(f, peer_id)
                    break
            if reply is None:
                reply = wire.Error(f.step, wire.ErrorCode.UNKNOWN_RUN, f"run {f.run:016x} is not open here")
            parts = wire.step_parts(reply)  # a RESULT: its header and its rows, joined once on the way out
            one = trace.ON and parts is not None and reply.x.shape[0] == 1  # type: ignore[union-attr]
            if one:
                trace.mark("T.dsend")
            if parts is not None:
                channel.send_parts(*parts)
            else:
                channel.send(wire.encode(reply))
            if one:
                trace.mark("T.dwrote")
    except wire.RemoteProtocolError as e:
        log.info("pipeline_direct_protocol_error", peer=peer_id[:12], reason=e.reason)
    except TransportError as e:
        log.debug("pipeline_direct_ended", peer=peer_id[:12], error=str(e))
    finally:
        with contextlib.suppress(Exception):
            channel.close("served")
