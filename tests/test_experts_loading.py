"""An expert worker whose daemon is in the mesh before its ``--experts`` are loaded answers hellos with
LOADING: the coordinator shows it as loading (status, 503 reason), counts no error and no refusal, asks
again soon, and uses it as soon as the shards are in. Before, the hello went unanswered ("no handler"):
an error, a refusal "no hello answer" and a back-off of up to 30 s."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from experts_util import make_moe_checkpoint

from engine.experts import rpc
from engine.experts.channel import LoopThread, SocketChannel, socketpair_channels
from engine.experts.coordinator import CoordinatorConfig, RemoteExecutor, WorkerRefused
from engine.experts.fingerprint import model_fingerprint
from engine.experts.layout import layout_from_config, read_config
from engine.experts.rpc import ErrorCode
from meshd.commands.status import format_status
from meshd.experts_service import ExpertsService

EXPERT_STREAM = 4  # transport.streams.StreamType.EXPERT


class _Transport:
    """The registration surface ExpertsService touches; peers open real socket-pair channels."""

    def __init__(self) -> None:
        self.on_peer_up: list[object] = []
        self.on_peer_down: list[object] = []
        self.handlers: dict[int, Any] = {}
        self.peer_list: list[Any] = []

    def on_stream(self, stream_type: int, handler: Any) -> None:
        self.handlers[int(stream_type)] = handler

    def peers(self) -> list[Any]:
        return self.peer_list


class _Peer:
    """A connected peer whose EXPERT streams are served by ``worker_transport``'s handler."""

    def __init__(self, node_id: str, worker_transport: _Transport) -> None:
        self.node_id = node_id
        self.connected = True
        self._wt = worker_transport

    async def open_stream(self, stream_type: int) -> SocketChannel:
        a, b = await socketpair_channels()
        handler = self._wt.handlers.get(int(stream_type))
        if handler is None:  # what the transport does without a handler: reset the stream
            b.reset(20)
        else:
            asyncio.get_running_loop().create_task(handler(type("P", (), {"node_id": "c" * 32})(), b))
        return a


@pytest.fixture()
def lt():
    t = LoopThread()
    yield t
    t.stop()


def _slow_worker(ck: Path) -> tuple[ExpertsService, threading.Event]:
    svc = ExpertsService([str(ck)])
    gate = threading.Event()
    load = svc._load_all

    def slow() -> Any:
        assert gate.wait(30)
        return load()

    svc._load_all = slow  # type: ignore[method-assign]  # the checkpoint takes a while to map and check
    return svc, gate


def test_hello_while_loading_is_answered_loading(tmp_path: Path, lt: LoopThread) -> None:
    ck = make_moe_checkpoint(tmp_path / "m", layers=2, experts=4)
    worker, gate = _slow_worker(ck)
    wt = _Transport()
    started = asyncio.run_coroutine_threadsafe(worker.start(wt), lt.loop)
    try:
        deadline = time.monotonic() + 10
        while EXPERT_STREAM not in wt.handlers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert EXPERT_STREAM in wt.handlers, "no expert handler while loading"
        ex = RemoteExecutor(lt.loop, model_fingerprint(ck), layout_from_config(read_config(ck)),
                            CoordinatorConfig(mode="on", connect_timeout_s=10.0))

        async def hello() -> Any:
            a, b = await socketpair_channels()
            asyncio.get_running_loop().create_task(wt.handlers[EXPERT_STREAM](_Peer("x", wt), b))
            return await ex.add_worker("w" * 32, a)

        with pytest.raises(WorkerRefused) as info:
            lt.run(hello())
        assert info.value.code == ErrorCode.LOADING and "still loading" in str(info.value)
        assert ex.loading == {"w" * 32: str(info.value)} and ex.refused == {}
        assert "w" * 32 not in ex.link_stats  # no worker row, no error counted
        assert "(loading: expert worker " + "w" * 32 + " is still loading" in (ex.unavailable_reason() or "")
        gate.set()
        started.result(30)
        lt.run(hello())  # loaded: the same worker is taken
        assert ex.loading == {} and ex.unavailable_reason() is None
        assert ex.link_stats["w" * 32].errors == 0
    finally:
        gate.set()
        started.exception(30)  # waits for the start to end, whatever it raised
        lt.run(worker.stop())


def test_coordinator_shows_loading_retries_soon_and_takes_the_worker(tmp_path: Path, lt: LoopThread) -> None:
    ck = make_moe_checkpoint(tmp_path / "m", layers=2, experts=4)
    worker, gate = _slow_worker(ck)
    wt, ct = _Transport(), _Transport()
    node = "w" * 32
    ct.peer_list = [_Peer(node, wt)]
    coord = ExpertsService([], "on", coordinator_config=CoordinatorConfig(connect_timeout_s=10.0),
                           probe_interval_s=60.0)
    started = asyncio.run_coroutine_threadsafe(worker.start(wt), lt.loop)
    try:
        deadline = time.monotonic() + 10
        while EXPERT_STREAM not in wt.handlers and time.monotonic() < deadline:
            time.sleep(0.01)
        lt.run(coord.start(ct))
        ex = lt.run(coord.coordinator(ck, None, "on"))  # probes the connected peer now
        st = coord.status()["coordinators"][0]
        assert st["loading"] and node in st["loading"] and st["refused"] == {}, st
        assert node not in st["workers"], st  # no errors row for it
        text = format_status({"node_id": "c" * 32, "state": "running", "services": {"experts": coord.status()}})
        assert f"loading {node}: its experts are not loaded yet" in text and "refused" not in text, text
        assert "still loading" in (ex.unavailable_reason() or "")
        t0 = time.monotonic()
        gate.set()
        started.result(30)
        deadline = time.monotonic() + 10  # asked again after 0.5 s, 1 s, ... (at most 5 s): well within 10
        while node not in ex.links and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node in ex.links, coord.status()
        took = time.monotonic() - t0
        assert took < 10, took
        st = coord.status()["coordinators"][0]
        assert st["loading"] == {} and st["refused"] == {} and st["workers"][node]["errors"] == 0, st
        assert ex.unavailable_reason() is None
    finally:
        gate.set()
        started.exception(30)
        lt.run(coord.stop())
        lt.run(worker.stop())


class _Recording:
    """A real socket-pair channel that remembers the stream reset code it was asked for (a socket pair has
    no reset codes: the transport's streams carry them)."""

    def __init__(self, inner: SocketChannel) -> None:
        self._inner = inner
        self.reset_codes: list[int] = []

    async def recv(self) -> bytes | None:
        return await self._inner.recv()

    async def send(self, data: bytes, end: bool = False) -> None:
        await self._inner.send(data, end)

    def reset(self, code: int) -> None:
        self.reset_codes.append(code)
        self._inner.reset(code)


@pytest.mark.parametrize("offered", [4, rpc.PROTOCOL_MAX])
def test_loading_is_said_only_to_a_coordinator_that_parses_it(lt: LoopThread, offered: int) -> None:
    """Protocol v5 introduced LOADING: a v4 coordinator's parser refuses an unknown error code (a malformed
    answer). So a hello offering at most v4 gets what a worker without an expert handler gives (a reset with
    NO_HANDLER: "no worker here yet", asked again when the worker advertises its shards), never the code."""
    from engine.experts.worker import answer_loading
    from transport.framing import ErrorCode as StreamErrorCode

    async def ask() -> tuple[list[Any], list[int]]:
        a, b = await socketpair_channels()
        rec = _Recording(b)
        task = asyncio.get_running_loop().create_task(answer_loading(rec, "experts of m are not loaded yet"))
        await a.send(rpc.encode(rpc.Hello(bytes(32), max_version=offered), 1))
        dec = rpc.MessageDecoder(1 << 20)
        got: list[Any] = []
        while True:
            try:
                data = await asyncio.wait_for(a.recv(), 10)
            except Exception:  # noqa: BLE001 - the reset breaks the pair
                break
            if data is None:
                break
            got += [env.message for env in dec.feed(data)]
        await task
        return got, rec.reset_codes

    got, resets = lt.run(ask())
    assert rpc.PROTOCOL_MAX >= rpc.LOADING_VERSION == 5
    if offered >= rpc.LOADING_VERSION:
        assert len(got) == 1 and isinstance(got[0], rpc.ErrorMsg) and got[0].code == rpc.ErrorCode.LOADING, got
        assert resets == []
    else:
        assert got == [] and resets == [int(StreamErrorCode.NO_HANDLER)], (got, resets)
