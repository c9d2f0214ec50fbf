"""Workers combining whole rows (protocol v2): exact, smaller replies, mixed rows, v1 interoperability.

Same in-process setup as ``test_experts_inproc.py`` (real codec over kernel socket pairs); the reference is
``engine.moe.local_executor``, every layer output equal byte for byte.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from experts_util import make_moe_checkpoint
from test_experts_inproc import Fixture, _connect, _equal, _inputs, _worker, lt  # noqa: F401 - lt: fixture

from engine.experts import rpc
from engine.experts.channel import LoopThread, socketpair_channels
from engine.experts.coordinator import RemoteExecutor
from engine.experts.worker import ExpertWorker
from engine.moe import Routing, combine, local_executor


class Recorder:
    """The local executor, offering ``run_routed`` so it sees (and records) every layer's routing."""

    def __init__(self, fx: Fixture) -> None:
        self.inner = local_executor(fx.full.weights)
        self.routings: list[Routing] = []

    def __call__(self, layer: int, x: np.ndarray, work: list) -> list[np.ndarray]:  # type: ignore[type-arg]
        return self.inner(layer, x, work)

    def run_routed(self, layer: int, x: np.ndarray, routing: Routing) -> np.ndarray:
        self.routings.append(routing)
        return combine(routing, self.inner(layer, x, routing.work), x.shape[0], x.shape[1])


def _whole_rows(routings: list[Routing], experts: set[int]) -> int:
    """Tokens (over all layers) whose every slot expert is in ``experts``."""
    return sum(int(np.all(np.isin(r.experts, sorted(experts)), axis=1).sum()) for r in routings)


def test_one_worker_combines_every_row_and_replies_shrink_by_top_k(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8, top_k=4), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1]  # 37 rows: one request per layer, the fast path
    rec = Recorder(fx)
    ref = fx.forward(x, rec)
    bytes_in = {}
    for version in (2, 1):
        ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
        w = _worker(fx, protocol_max=version)
        _connect(lt, ex, w, "w0")
        assert _equal(fx.forward(x, ex), ref)
        st = ex.status()
        bytes_in[version] = st["workers"]["w0"]["bytes_in"]  # type: ignore[index]
        combined = len(x) * len(fx.layout.sparse_layers) if version == 2 else 0
        assert st["rows_combined"] == w.stats.rows_combined == combined
        assert st["workers"]["w0"]["protocol"] == version  # type: ignore[index]
        assert w.stats.pairs == st["expert_hits"]  # pairs are counted as before
        lt.run(ex.close())
    # k = 4 rows per token become one: the replies are about a quarter of their v1 size
    assert bytes_in[2] < 0.3 * bytes_in[1], bytes_in


def test_rows_split_across_workers_stay_raw_and_the_mix_is_exact(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8, top_k=2), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    lo, hi = _worker(fx, "@0-2/0-3"), _worker(fx, "@0-2/4-7")
    _connect(lt, ex, lo, "lo")
    _connect(lt, ex, hi, "hi")
    total = expected = 0
    for x in _inputs(fx.layout.hidden_size):
        rec = Recorder(fx)
        assert _equal(fx.forward(x, ex), fx.forward(x, rec))
        total += len(x) * len(rec.routings)
        expected += _whole_rows(rec.routings, {0, 1, 2, 3}) + _whole_rows(rec.routings, {4, 5, 6, 7})
    assert 0 < expected < total  # some tokens combined on a worker, some split over both
    assert ex.status()["rows_combined"] == lo.stats.rows_combined + hi.stats.rows_combined == expected


def test_a_v1_worker_gets_v1_requests_and_results_stay_exact(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8, top_k=2), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    old, new = _worker(fx, "@0-2/0-3", protocol_max=1), _worker(fx, "@0-2/4-7")
    _connect(lt, ex, old, "old")
    _connect(lt, ex, new, "new")
    assert ex.links["old"].ack.version == 1 and ex.links["new"].ack.version == rpc.PROTOCOL_MAX  # type: ignore[union-attr]
    expected = 0
    for x in _inputs(fx.layout.hidden_size):
        rec = Recorder(fx)
        assert _equal(fx.forward(x, ex), fx.forward(x, rec))
        expected += _whole_rows(rec.routings, {4, 5, 6, 7})
    assert old.stats.requests > 0 and old.stats.rows_combined == 0 and old.stats.errors == 0
    assert expected > 0 and new.stats.rows_combined == ex.status()["rows_combined"] == expected


def test_a_v1_session_refuses_a_combine_request(tmp_path: Path, lt: LoopThread) -> None:
    """A worker that acked v1 treats a v2 message as a protocol violation; one that acked v2 answers it."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    req = rpc.ExpertCombineRequest(layer=0, x=np.ones((1, fx.layout.hidden_size), dtype=np.float32),
                                   pairs=np.array([[0, 1], [0, 2]], dtype=np.uint32),
                                   rows=np.array([0], dtype=np.uint32),
                                   experts=np.array([[2, 1]], dtype=np.uint32),
                                   weights=np.array([[0.5, 0.5]], dtype=np.float32))

    async def exchange(w: ExpertWorker) -> list[rpc.Message]:
        a, b = await socketpair_channels()
        serving = asyncio.get_running_loop().create_task(w.serve(b))
        got: list[rpc.Message] = []
        dec = rpc.MessageDecoder()
        a.set_receiver(lambda data: got.extend(e.message for e in dec.feed(data)), lambda err: None)
        await a.send(rpc.encode(rpc.Hello(fingerprint=fx.fp), 1))
        await a.send(rpc.encode(req, 2))
        for _ in range(500):
            if len(got) >= 2:
                break
            await asyncio.sleep(0.01)
        a.reset(0)
        await serving
        return got

    for version, answer in ((1, rpc.ErrorMsg), (2, rpc.ExpertCombinedReply)):
        w = _worker(fx, protocol_max=version)
        got = lt.run(exchange(w))
        assert isinstance(got[0], rpc.HelloAck) and got[0].version == version
        assert isinstance(got[1], answer), got
        assert (w.stats.errors > 0) == (version == 1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the inf row makes NaNs on purpose
def test_a_token_with_non_finite_weights_is_combined_here_and_the_worker_kept(tmp_path: Path,
                                                                              lt: LoopThread) -> None:
    """An inf in a hidden row gives that token NaN weights; a worker refuses non-finite weights from a
    peer, so the coordinator keeps that token raw (combining it itself) instead of losing the worker."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8, top_k=4), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1].copy()
    x[3, 0] = np.inf
    ref = fx.forward(x, local_executor(fx.full.weights))
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    assert _equal(fx.forward(x, ex), ref)  # NaN rows included, bit for bit
    st = ex.status()
    assert "w0" in ex.links and w.stats.errors == 0 and st["retries"] == 0
    assert 0 < st["rows_combined"] < len(x) * len(fx.layout.sparse_layers)  # the bad token stayed raw


def test_a_worker_whose_combined_reply_does_not_fit_is_dropped(tmp_path: Path, lt: LoopThread,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply that does not match its request counts as the worker's error and the worker is dropped
    (the layer moves to the other holder), as the general path does; the output stays exact."""
    import engine.experts.worker as worker_mod

    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8, top_k=4), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1]
    ref = fx.forward(x, local_executor(fx.full.weights))
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    bad, good = _worker(fx), _worker(fx, capacity=1e-9)  # 'bad' owns everything, 'good' holds it too
    real = worker_mod.combine_rows

    calls = [0]

    def one_row_short(req: rpc.ExpertCombineRequest, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        combined, raw = real(req, out)
        calls[0] += 1
        return (combined[:-1] if calls[0] == 1 else combined), raw  # only the first reply (the owner's)

    _connect(lt, ex, bad, "bad")
    _connect(lt, ex, good, "good")
    monkeypatch.setattr(worker_mod, "combine_rows", one_row_short)  # both are in-process: patch, then stop
    assert _equal(fx.forward(x, ex), ref)
    st = ex.status()
    assert calls[0] > 1 and "bad" not in ex.links and st["workers"]["bad"]["errors"] == 1  # type: ignore[index]
    assert "good" in ex.links and good.stats.requests > 0 and st["retries"] > 0


def test_worker_bounds_what_a_combine_request_makes_it_compute(tmp_path: Path, lt: LoopThread) -> None:
    """The reply of a combine request is small, but every pair's output is computed first: a request whose
    outputs exceed what the peer may receive is TOO_LARGE, as its v1 form would be."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8, top_k=2), "qwen3_moe")
    d = fx.layout.hidden_size
    w = _worker(fx)
    x = np.ones((4, d), np.float32)
    pairs = np.array([[r, e] for e in (0, 1) for r in range(4)], dtype=np.uint32)  # 8 pairs, ascending
    creq = rpc.ExpertCombineRequest(layer=0, x=x, pairs=pairs, rows=np.arange(4, dtype=np.uint32),
                                    experts=np.array([[0, 1]] * 4, dtype=np.uint32),
                                    weights=np.full((4, 2), 0.5, dtype=np.float32))
    limit = 64 + 4 * 4 * d  # room for the 4 combined rows, not for the 8 outputs computed first

    async def talk() -> rpc.Message:
        a, b = await socketpair_channels()
        task = asyncio.get_running_loop().create_task(w.serve(b))
        await a.send(rpc.encode(rpc.Hello(fx.fp, max_version=2, max_message_bytes=limit), 1)
                     + rpc.encode(creq, 2))
        dec, got = rpc.MessageDecoder(), []
        while len(got) < 2:
            chunk = await asyncio.wait_for(a.recv(), 5)
            assert chunk is not None
            got += dec.feed(chunk)
        a.reset(0)
        await asyncio.wait_for(task, 5)
        return got[1].message

    reply = lt.run(talk())
    assert isinstance(reply, rpc.ErrorMsg) and reply.code == rpc.ErrorCode.TOO_LARGE, reply
