"""Polling for expert replies and requests (protocol v3, ``FLAG_POLL``, ``transport.poll``).

Same in-process setup as ``test_experts_inproc.py`` (real codec over kernel socket pairs, one loop for the
coordinator and its workers). The loop's poller is wrapped to record every hold and release, so the tests
see who polled, for how long and until what, without timing anything.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from experts_util import make_moe_checkpoint
from test_experts_inproc import (  # noqa: F401 - lt: fixture
    Fixture, _connect, _equal, _inputs, _spawn, _talk, _worker, lt)

from engine.experts import rpc
from engine.experts.channel import LoopThread, socketpair_channels
from engine.experts.coordinator import CoordinatorConfig, RemoteExecutor
from engine.experts.planning import FastCall
from engine.experts.worker import ExpertWorker, _Session
from engine.moe import local_executor
from engine import limits
from transport import poll


def _record(lt: LoopThread) -> list[tuple[str, object, float]]:
    """Every hold (key, seconds) and release (key, 0) on ``lt``'s poller from now on. The poller never
    yields here (its CPU clock is the wall clock): these tests count holds, and a busy CI machine must not
    make it back off (yielding has its own tests in test_transport_poll.py)."""
    p = poll.poller(lt.loop)
    p._cpu_clock = p._clock
    p._backoff_until = 0.0
    events: list[tuple[str, object, float]] = []
    hold, release = p.hold, p.release

    def rec_hold(key: object, seconds: float) -> bool:
        events.append(("hold", key, seconds))
        return hold(key, seconds)

    def rec_release(key: object) -> None:
        if key in p._holds:
            events.append(("release", key, 0.0))
        release(key)

    p.hold, p.release = rec_hold, rec_release  # type: ignore[method-assign]
    return events


def _holds(events: list[tuple[str, object, float]]) -> int:
    return sum(1 for e in events if e[0] == "hold")


def _request(fx: Fixture) -> rpc.ExpertRequest:
    x = np.ones((1, fx.layout.hidden_size), np.float32)
    return rpc.ExpertRequest(0, x, np.array([[0, 1], [0, 2]], dtype=np.uint32))


def test_a_worker_polls_after_answering_a_flagged_request_until_its_next_message(tmp_path: Path,
                                                                                 lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    w = _worker(fx, poll_s=0.05)
    events = _record(lt)
    req = _request(fx)
    got = lt.run(_talk(w, [(rpc.Hello(fx.fp), 0), (req, rpc.FLAG_POLL), (req, 0),
                           (rpc.Echo(b"x"), rpc.FLAG_POLL), (req, 0)]))
    assert isinstance(got[0].message, rpc.HelloAck) and got[0].message.version == rpc.PROTOCOL_MAX
    assert [type(g.message) for g in got[1:]] == [rpc.ExpertReply, rpc.ExpertReply, rpc.EchoReply,
                                                 rpc.ExpertReply]
    same = got[1].message.out.tobytes() == got[2].message.out.tobytes()  # type: ignore[union-attr]
    assert same  # polling changes no answer
    # A hold of the worker's poll time after each flagged answer, ended by the next message; none otherwise.
    assert [(e, type(k), s) for e, k, s in events] == [
        ("hold", _Session, 0.05), ("release", _Session, 0.0),
        ("hold", _Session, 0.05), ("release", _Session, 0.0)]
    assert w.stats.polls == 2 and w.stats.as_dict()["polls"] == 2
    p = poll.poller(lt.loop)
    p._backoff_until = float("inf")  # the poller yielded its core a moment ago
    try:
        got = lt.run(_talk(w, [(rpc.Hello(fx.fp), 0), (req, rpc.FLAG_POLL)]))
    finally:
        p._backoff_until = 0.0
    assert isinstance(got[1].message, rpc.ExpertReply) and w.stats.polls == 2  # asked, but it did not poll


def test_a_worker_that_did_not_ack_v3_refuses_the_flag_and_one_with_poll_0_never_polls(tmp_path: Path,
                                                                                     lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    events = _record(lt)
    req = _request(fx)
    old = _worker(fx, protocol_max=2)
    got = lt.run(_talk(old, [(rpc.Hello(fx.fp), 0), (req, rpc.FLAG_POLL)]))
    assert got[0].message.version == 2  # type: ignore[union-attr]
    err = got[1].message
    assert isinstance(err, rpc.ErrorMsg) and err.code == rpc.ErrorCode.PROTOCOL and "flags" in err.text
    before_hello = lt.run(_talk(_worker(fx), [(req, rpc.FLAG_POLL)]))
    assert isinstance(before_hello[0].message, rpc.ErrorMsg) and "protocol 0" in before_hello[0].message.text
    off = _worker(fx, poll_s=0.0)
    got = lt.run(_talk(off, [(rpc.Hello(fx.fp), 0), (req, rpc.FLAG_POLL), (req, rpc.FLAG_POLL)]))
    assert [type(g.message) for g in got] == [rpc.HelloAck, rpc.ExpertReply, rpc.ExpertReply]
    assert off.stats.polls == 0 and old.stats.polls == 0 and events == []


def test_no_poll_after_an_error_answer_or_with_more_requests_already_queued(tmp_path: Path,
                                                                           lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    w = _worker(fx, "@0-2/0-3", poll_s=0.05)
    events = _record(lt)
    req = _request(fx)  # experts 1 and 2: held
    not_held = rpc.ExpertRequest(0, req.x, np.array([[0, 7]], dtype=np.uint32))

    async def go() -> list[rpc.Envelope]:
        a, b = await socketpair_channels()
        _spawn(w.serve(b))
        dec = rpc.MessageDecoder()
        out: list[rpc.Envelope] = []

        async def read(n: int) -> None:
            while len(out) < n:
                out.extend(dec.feed(await asyncio.wait_for(a.recv(), 5)))

        await a.send(rpc.encode(rpc.Hello(fx.fp), 1))
        await read(1)
        await a.send(rpc.encode(not_held, 2, rpc.FLAG_POLL))  # answered with NOT_HELD
        await read(2)
        # two flagged requests in one write: the first finds the second queued, only the second polls
        await a.send(rpc.encode(req, 3, rpc.FLAG_POLL) + rpc.encode(req, 4, rpc.FLAG_POLL))
        await read(4)
        return out

    got = lt.run(go())
    assert isinstance(got[1].message, rpc.ErrorMsg) and got[1].message.code == rpc.ErrorCode.NOT_HELD
    assert [type(g.message) for g in got[2:]] == [rpc.ExpertReply, rpc.ExpertReply]
    assert [type(k) for e, k, _ in events if e == "hold"] == [_Session] and w.stats.polls == 1


def test_a_session_that_ends_while_polling_releases_its_hold(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    w = _worker(fx, poll_s=0.1)
    events = _record(lt)

    async def go() -> bool:
        a, b = await socketpair_channels()
        task = asyncio.get_running_loop().create_task(w.serve(b))
        dec = rpc.MessageDecoder()
        for i, (m, flags) in enumerate([(rpc.Hello(fx.fp), 0), (_request(fx), rpc.FLAG_POLL)]):
            await a.send(rpc.encode(m, i + 1, flags))
            while not dec.feed(await asyncio.wait_for(a.recv(), 5)):
                pass
        held = poll.poller().polling
        a.reset(0)  # the coordinator goes away while the worker polls for its next request
        await asyncio.wait_for(task, 5)
        return held

    assert lt.run(go())
    assert [(e, type(k)) for e, k, _ in events] == [("hold", _Session), ("release", _Session)]


@pytest.mark.parametrize("poll_s", [-0.001, limits.EXPERT_MAX_POLL_S * 2, float("nan")])
def test_poll_times_out_of_range_are_refused(tmp_path: Path, poll_s: float) -> None:
    with pytest.raises(ValueError, match="poll_s"):
        CoordinatorConfig(poll_s=poll_s)
    with pytest.raises(ValueError, match="poll_s"):
        ExpertWorker([], [], poll_s=poll_s)


def _forward_events(fx: Fixture, ex: RemoteExecutor, x: np.ndarray, lt: LoopThread,
                    ) -> tuple[list[np.ndarray], list[tuple[str, object, float]]]:
    events = _record(lt)
    out = fx.forward(x, ex)
    return out, [e for e in events if isinstance(e[1], FastCall)]  # the coordinator's (workers share the loop)


def test_a_decode_pass_polls_for_each_layers_replies_and_asks_its_worker_to_poll(tmp_path: Path,
                                                                                lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(poll_s=0.05))
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    ex._cores = 2  # a socket pair is no loopback QUIC stream: the worker counts as elsewhere
    assert ex._polling and ex.status()["polling"] is True
    x = _inputs(fx.layout.hidden_size)[0]
    out, events = _forward_events(fx, ex, x, lt)
    layers = len(fx.layout.sparse_layers)
    # each layer: a hold of the coordinator's poll time once its request is out, released by its reply
    assert [(e, s) for e, _, s in events] == [("hold", 0.05), ("release", 0.0)] * layers
    assert all(events[i][1] is events[i + 1][1] and events[i][1].settled for i in range(0, len(events), 2))
    assert w.stats.polls == layers - 1  # every request but the last layer's carried FLAG_POLL
    assert _equal(out, fx.forward(x, local_executor(fx.full.weights)))


def test_no_polling_with_poll_0_a_v2_worker_or_loopback_workers_needing_every_core(tmp_path: Path,
                                                                                  lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[0]
    want = fx.forward(x, local_executor(fx.full.weights))
    layers = len(fx.layout.sparse_layers)

    off = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(poll_s=0.0))
    w = _worker(fx)
    _connect(lt, off, w, "w0")
    out, events = _forward_events(fx, off, x, lt)
    assert _equal(out, want) and events == [] and w.stats.polls == 0 and off.status()["polling"] is False

    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    old = _worker(fx, protocol_max=2)
    _connect(lt, ex, old, "old")
    ex._cores = 2
    out, events = _forward_events(fx, ex, x, lt)
    assert _equal(out, want) and old.stats.polls == 0  # a v2 worker gets no FLAG_POLL...
    # ...while the coordinator still holds a poll for each layer's reply (a hold that expires before its reply,
    # on a loaded machine, is never released, so count the holds)
    assert _holds(events) == layers

    here = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    ws = [_worker(fx), _worker(fx)]

    async def on_loopback(node: str, worker: ExpertWorker) -> None:
        a, b = await socketpair_channels()
        a.on_loopback = True  # type: ignore[attr-defined]  # what a QUIC stream to 127.0.0.1 says
        _spawn(worker.serve(b, "coordinator"))
        await here.add_worker(node, a)

    here._cores = 2
    lt.run(on_loopback("l0", ws[0]))
    assert here._polling  # one loopback worker and this node: two cores
    lt.run(on_loopback("l1", ws[1]))
    assert not here._polling  # two loopback workers and this node: not on two cores
    out, events = _forward_events(fx, here, x, lt)
    assert _equal(out, want) and events == [] and sum(w.stats.polls for w in ws) == 0
    here._cores = 3
    out, events = _forward_events(fx, here, x, lt)
    assert _equal(out, want) and _holds(events) == layers and sum(w.stats.polls for w in ws) > 0
    here.remove_worker("l1")
    here._cores = 2
    assert here._polling  # the map rebuilt: one loopback worker again


def test_echo_polls_only_when_asked_and_the_executor_polls(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    ex._cores = 2
    events = _record(lt)
    assert ex.echo_rtt("w0", b"x" * 4096) > 0 and w.stats.polls == 0 and events == []
    assert ex.echo_rtt("w0", b"x" * 4096, polled=True) > 0 and w.stats.polls == 1
    mine: list[Any] = [e for e in events if not isinstance(e[1], _Session)]
    assert [(e, s) for e, _, s in mine] == [("hold", limits.EXPERT_POLL_S), ("release", 0.0)]
    ex.config = CoordinatorConfig(poll_s=0.0)
    assert ex.echo_rtt("w0", b"x", polled=True) > 0 and w.stats.polls == 1
    old = _worker(fx, protocol_max=2)  # a v2 worker: the coordinator polls, the echo carries no flag
    _connect(lt, ex, old, "old")
    ex.config = CoordinatorConfig()
    assert ex.echo_rtt("old", b"x" * 4096, polled=True) > 0 and "old" in ex.links and old.stats.errors == 0


# --- the daemon setting: --experts-poll / experts-poll --------------------------------------------------


def _load(argv: list[str], role: str = "serve") -> Any:
    from meshd.cli import build_parser
    from meshd.config import load_config

    return load_config(build_parser().parse_args([role, *argv]), {"HOME": "/home/someone"}, role)


def test_experts_poll_from_flag_or_file_and_its_default(tmp_path: Path) -> None:
    assert _load([]).experts_poll_s == limits.EXPERT_POLL_S == CoordinatorConfig().poll_s
    assert _load(["--experts-poll", "0"]).experts_poll_s == 0.0
    conf = tmp_path / "c.toml"
    conf.write_text("experts-poll = 0.005\n")
    assert _load(["--config", str(conf)]).experts_poll_s == 0.005
    assert _load(["--config", str(conf), "--experts-poll", "0.001"]).experts_poll_s == 0.001
    conf.write_text("experts-poll = 1\n")  # would be refused by `serve`
    cfg = _load(["--config", str(conf)], role="client")
    assert any("'experts-poll' ignored" in n for n in cfg.notes)


@pytest.mark.parametrize("value, match", [("-0.001", "must be 0 \\(off\\) to 0.1 seconds"),
                                          ("0.2", "0.1 seconds"), ("nan", "0.1 seconds"),
                                          ("fast", "expected a number of seconds")])
def test_bad_experts_poll_values_name_the_flag_or_key(tmp_path: Path, value: str, match: str) -> None:
    from meshd.errors import UsageError

    with pytest.raises(UsageError, match=f"^--experts-poll: .*{match}"):
        _load(["--experts-poll", value])
    conf = tmp_path / "c.toml"
    conf.write_text(f"experts-poll = {value if value != 'fast' else chr(34) + value + chr(34)}\n")
    with pytest.raises(UsageError, match=f"^config file {conf}: .*experts-poll"):
        _load(["--config", str(conf)])


def test_service_hands_experts_poll_to_its_coordinators_and_its_worker(tmp_path: Path) -> None:
    from test_experts_service import _FakeTransport

    from meshd.experts_service import ExpertsService

    ck = make_moe_checkpoint(tmp_path / "m", layers=2, experts=4)
    svc = ExpertsService.from_config(_load(["--remote-experts", "prefer", "--experts", str(ck),
                                            "--experts-poll", "0.004"]))
    t = LoopThread()
    try:
        t.run(svc.start(_FakeTransport()))
        assert svc.worker is not None and svc.worker.poll_s == 0.004
        ex = t.run(svc.coordinator(ck, None))
        assert ex.config.poll_s == 0.004 and ex.config.mode == "prefer"
        st = svc.status()
        assert st["poll_s"] == 0.004
        assert st["coordinators"][0]["polling"] is True  # no loopback worker needs a core
        assert st["worker"]["polls"] == 0
    finally:
        t.run(svc.stop())
        t.stop()
