"""Coordinator and workers in one process over real byte channels (kernel socket pairs, real codec).

The reference is ``engine.moe.local_executor`` over the same checkpoint: every layer output must be equal
byte for byte, for 1, 2 and 3 workers, for both families and for fp32 and bf16 checkpoints.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path

import numpy as np
import pytest
from experts_util import make_moe_checkpoint, router_weights

from engine.experts.channel import LoopThread, socketpair_channels
from engine.experts.coordinator import CoordinatorConfig, ExpertsUnavailable, RemoteExecutor, WorkerRefused
from engine.experts.fingerprint import model_fingerprint
from engine.experts.shard import ExpertShard, load_shard
from engine.experts.worker import ExpertWorker
from engine.moe import ExpertExecutor, ForwardSteps, drive, local_executor, route


_TASKS: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones


def _spawn(coro: object) -> None:
    task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    t = LoopThread()
    yield t
    t.stop()


class Fixture:
    def __init__(self, path: Path, family: str) -> None:
        self.path = path
        self.family = family
        self.full = load_shard(str(path))
        self.layout = self.full.layout
        self.fp = model_fingerprint(path)
        self.routers = {la: router_weights(path, la, family) for la in self.layout.sparse_layers}

    def forward(self, x: np.ndarray, executor: ExpertExecutor) -> list[np.ndarray]:
        """A residual stack of MoE blocks; returns every layer's output. [T, D] -> [[T, D]].

        Driven like the engine's forward passes (``engine.moe.drive``): the remote executor runs a pass of
        up to ``LOOP_STEP_MAX_ROWS`` rows on its loop thread, a larger one layer by layer."""
        return drive(self.steps(x), executor)  # type: ignore[no-any-return]

    def steps(self, x: np.ndarray) -> ForwardSteps:
        h = x
        outs = []
        for layer in self.layout.sparse_layers:
            y = yield (layer, h, route(h @ self.routers[layer].T, self.layout.top_k, self.layout.norm_topk_prob))
            outs.append(y)
            h = h + y
        return outs  # type: ignore[return-value]


def _inputs(d: int, seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((t, d)).astype(np.float32) for t in (1, 2, 3, 5, 8, 37)]


def _connect(lt: LoopThread, ex: RemoteExecutor, worker: ExpertWorker, node_id: str) -> None:
    async def go() -> None:
        a, b = await socketpair_channels()
        _spawn(worker.serve(b, "coordinator"))
        await ex.add_worker(node_id, a)

    lt.run(go())


def _one_worker(tmp_path: Path, lt: LoopThread) -> tuple[Fixture, RemoteExecutor, np.ndarray]:
    """A Qwen3-MoE fixture, an executor with one worker holding everything ("w0"), and a one-token input."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    _connect(lt, ex, _worker(fx), "w0")
    return fx, ex, _inputs(fx.layout.hidden_size)[0]


def _worker(fx: Fixture, spec: str = "", **kw: object) -> ExpertWorker:
    shard = load_shard(str(fx.path) + spec)
    return ExpertWorker([shard], [fx.fp], **kw)  # type: ignore[arg-type]


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def _failing_call(real: Callable[..., Any], n: int, error: BaseException) -> Callable[..., Any]:
    """``real``, except that its ``n``-th call raises ``error`` (a bug, no memory)."""
    calls = 0

    def call(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise error
        return real(*args)

    return call


@pytest.mark.parametrize("family,dtype", [("qwen3_moe", "F32"), ("mixtral", "F32"), ("qwen3_moe", "BF16")])
def test_parity_local_vs_1_2_3_workers(tmp_path: Path, lt: LoopThread, family: str, dtype: str) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", family=family, dtype=dtype, experts=8, top_k=2), family)
    local = local_executor(fx.full.weights)
    refs = [fx.forward(x, local) for x in _inputs(fx.layout.hidden_size)]
    for n in (1, 2, 3):
        ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(mode="on"))
        workers = [_worker(fx) for _ in range(n)]
        for i, w in enumerate(workers):
            _connect(lt, ex, w, f"w{i}")
        for x, ref in zip(_inputs(fx.layout.hidden_size), refs):
            assert _equal(fx.forward(x, ex), ref), f"{n} workers differ"
        st = ex.status()
        assert st["items_local"] == 0 and st["layers_delegated"] == st["layers"] > 0
        assert all(w.stats.requests > 0 for w in workers), "every worker should own some experts"
        assert sum(w.stats.pairs for w in workers) == st["expert_hits"]
        lt.run(ex.close())


def test_negative_control_perturbed_output_breaks_parity(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1]
    ref = fx.forward(x, local_executor(fx.full.weights))
    hits = []

    def perturb(layer: int, out: np.ndarray) -> None:
        if not hits:
            out[0, 0] += np.float32(1e-6) * max(1.0, abs(float(out[0, 0])))
            hits.append(layer)

    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    _connect(lt, ex, _worker(fx, reply_hook=perturb), "w0")
    assert not _equal(fx.forward(x, ex), ref) and hits
    assert _equal(fx.forward(x, ex), ref)  # only that one reply was perturbed


def test_split_shards_cover_and_stay_exact(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    lo, hi = _worker(fx, "@0-2/0-3"), _worker(fx, "@0-2/4-7")
    _connect(lt, ex, lo, "lo")
    _connect(lt, ex, hi, "hi")
    assert ex.coverage() == []
    for x in _inputs(fx.layout.hidden_size):
        assert _equal(fx.forward(x, ex), fx.forward(x, local_executor(fx.full.weights)))
    assert {e for _, e in lo.stats.expert_rows} <= {0, 1, 2, 3}
    assert {e for _, e in hi.stats.expert_rows} <= {4, 5, 6, 7}


def test_on_mode_without_cover_is_unavailable_naming_experts(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1]
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(mode="on"))
    with pytest.raises(ExpertsUnavailable, match=r"no live expert worker holds layer/expert 0/\d"):
        fx.forward(x, ex)
    _connect(lt, ex, _worker(fx, "@0-2/0-3"), "half")
    with pytest.raises(ExpertsUnavailable) as e:
        fx.forward(x, ex)
    assert e.value.missing and all(exp >= 4 for _, exp in e.value.missing)
    assert ex.status()["unavailable"] == 2


def test_prefer_mode_falls_back_locally_counted_and_exact(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    xs = _inputs(fx.layout.hidden_size)
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(mode="prefer"), local_weights=fx.full.weights)
    assert _equal(fx.forward(xs[-1], ex), fx.forward(xs[-1], local_executor(fx.full.weights)))
    st = ex.status()
    assert st["local_fallback_layers"] == 3 and st["items_delegated"] == 0 and st["items_local"] > 0
    _connect(lt, ex, _worker(fx, "@0-2/0-3"), "half")
    assert _equal(fx.forward(xs[-1], ex), fx.forward(xs[-1], local_executor(fx.full.weights)))
    st = ex.status()
    assert st["items_delegated"] > 0 and st["local_fallback_layers"] == 6


def test_mismatched_checkpoint_is_refused_by_name(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", seed=1), "qwen3_moe")
    other = make_moe_checkpoint(tmp_path / "other-ckpt", seed=2)
    w = ExpertWorker([load_shard(str(other))], [model_fingerprint(other)])
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    with pytest.raises(WorkerRefused, match=r"expert worker bad refused: worker holds a different checkpoint: .*other-ckpt"):
        _connect(lt, ex, w, "bad")
    assert "bad" not in ex.links and ex.status()["workers"]["bad"]["errors"] == 1  # type: ignore[index]


def test_on_mode_503_names_the_refused_worker_and_why(tmp_path: Path, lt: LoopThread) -> None:
    """A worker refused at hello (here another checkpoint; other numerics alike) is named with its reason in
    the on-mode unavailable reason (the API's 503), which before said only that no worker holds the experts."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", seed=1), "qwen3_moe")
    other = make_moe_checkpoint(tmp_path / "other-ckpt", seed=2)
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(mode="on"))
    assert ex.unavailable_reason() == "no expert workers hold this model's routed experts"
    with pytest.raises(WorkerRefused):
        _connect(lt, ex, ExpertWorker([load_shard(str(other))], [model_fingerprint(other)]), "bad")
    reason = ex.unavailable_reason()
    assert reason is not None and reason.startswith("no expert workers hold this model's routed experts (refused: ")
    assert "expert worker bad refused: worker holds a different checkpoint" in reason and "other-ckpt" in reason
    _connect(lt, ex, _worker(fx, "@0-2/0-3"), "half")
    reason = ex.unavailable_reason()
    assert reason is not None and reason.startswith("no live expert worker holds layer/expert ") and "(refused: " in reason
    _connect(lt, ex, _worker(fx, "@0-2/4-7"), "bad")  # the same node greeted again with the right checkpoint
    assert ex.refused == {} and ex.unavailable_reason() is None


class _Gate:
    """Blocks a worker's replies until released (a hung worker)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, layer: int, out: np.ndarray) -> None:
        self.entered.set()
        self.release.wait(10)


def test_hung_worker_times_out_and_layer_retries_on_another_holder(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1]
    gate = _Gate()
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(message_timeout_s=0.5, layer_timeout_s=5.0))
    _connect(lt, ex, _worker(fx, reply_hook=gate), "hung")
    _connect(lt, ex, _worker(fx), "ok")
    t0 = time.monotonic()
    out = fx.forward(x, ex)
    dt = time.monotonic() - t0
    gate.release.set()
    assert _equal(out, fx.forward(x, local_executor(fx.full.weights)))
    assert gate.entered.is_set() and dt < 3.0
    st = ex.status()
    assert st["retries"] > 0 and "hung" not in ex.links
    assert st["workers"]["hung"]["errors"] >= 1  # type: ignore[index]


def test_worker_killed_mid_request_fails_fast_in_on_mode(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1]
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(message_timeout_s=30, layer_timeout_s=60))
    chans = {}

    def kill(layer: int, out: np.ndarray) -> None:
        lt.loop.call_soon_threadsafe(chans["b"].reset, 0)  # the worker's end breaks mid-request

    async def go() -> None:
        a, b = await socketpair_channels()
        chans["b"] = b
        _spawn(_worker(fx, reply_hook=kill).serve(b))
        await ex.add_worker("dies", a)

    lt.run(go())
    t0 = time.monotonic()
    with pytest.raises(ExpertsUnavailable, match="no live expert worker"):
        fx.forward(x, ex)
    assert time.monotonic() - t0 < 5.0  # not the 30 s message timeout: the broken stream is noticed


def test_join_mid_forward_changes_ownership_only_between_forwards(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=16), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[-1]
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    a, late = _worker(fx), _worker(fx)
    _connect(lt, ex, a, "a")
    joined = []

    def join_then_run(layer: int, xx: np.ndarray, work: list) -> list[np.ndarray]:  # type: ignore[type-arg]
        if layer == 1 and not joined:
            _connect(lt, ex, late, "late")  # joins while this forward is between layers
            joined.append(True)
        return ex(layer, xx, work)

    ref = fx.forward(x, local_executor(fx.full.weights))
    assert _equal(fx.forward(x, join_then_run), ref)
    assert joined and late.stats.requests == 0  # the pinned map of this forward did not include it
    assert _equal(fx.forward(x, ex), ref)
    assert late.stats.requests > 0  # the next forward uses the new map
    with ex.pinned():
        _connect(lt, ex, _worker(fx), "later")
        before = dict(ex.current_map.ranked)
        assert _equal(fx.forward(x, ex), ref)
    assert before == dict(ex.current_map.ranked)


def test_all_requests_of_a_layer_go_out_before_any_reply_is_read(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=16, top_k=4), "qwen3_moe")
    events: list[tuple[str, str]] = []

    class Spy:
        def __init__(self, inner: object, name: str) -> None:
            self.inner, self.name = inner, name

        async def send(self, payload: bytes, end: bool = False) -> None:
            events.append(("send", self.name))
            await self.inner.send(payload, end)  # type: ignore[attr-defined]

        def send_now(self, payload: bytes) -> bool:
            events.append(("send", self.name))
            return self.inner.send_now(payload)  # type: ignore[attr-defined,no-any-return]

        def set_receiver(self, on_data: Any, on_end: Any) -> None:
            def spied(data: bytes) -> None:
                events.append(("recv", self.name))
                on_data(data)

            self.inner.set_receiver(spied, on_end)  # type: ignore[attr-defined]

        def reset(self, code: int) -> None:
            self.inner.reset(code)  # type: ignore[attr-defined]

    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    for i in range(3):
        async def go(i: int = i) -> None:
            a, b = await socketpair_channels()
            _spawn(_worker(fx, reply_hook=lambda la, o: time.sleep(0.01)).serve(b))
            await ex.add_worker(f"w{i}", Spy(a, f"w{i}"))  # type: ignore[arg-type]
        lt.run(go())
    events.clear()
    x = _inputs(fx.layout.hidden_size)[-1]
    ex(0, x, moe_route_work(fx, x, 0))
    first_recv = next(i for i, e in enumerate(events) if e[0] == "recv")
    sends = [i for i, e in enumerate(events) if e[0] == "send"]
    assert len({events[i][1] for i in sends}) == 3 and max(sends) < first_recv


def moe_route_work(fx: Fixture, x: np.ndarray, layer: int) -> list:  # type: ignore[type-arg]
    from engine.moe import route

    return route(x @ fx.routers[layer].T, fx.layout.top_k, fx.layout.norm_topk_prob).work


def test_executor_refuses_the_loop_thread(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)

    async def call() -> None:
        ex(0, np.zeros((1, fx.layout.hidden_size), np.float32), [(0, np.array([0]))])

    with pytest.raises(RuntimeError, match="event loop thread"):
        lt.run(call())


async def _talk(worker: ExpertWorker, msgs: list[tuple[Any, int]]) -> list[Any]:
    """Send each (message, header flags) to ``worker`` on a fresh channel, reading its answer before the
    next: the answers (``rpc.Envelope``), fewer if the worker ends the channel."""
    from engine.experts import rpc

    a, b = await socketpair_channels()
    _spawn(worker.serve(b))
    dec = rpc.MessageDecoder()
    out: list[rpc.Envelope] = []
    for i, (m, flags) in enumerate(msgs):
        await a.send(rpc.encode(m, i + 1, flags))
        while len(out) <= i:
            data = await asyncio.wait_for(a.recv(), 5)
            if data is None:
                return out
            out += dec.feed(data)
    return out


def _unused(_: ExpertShard) -> None:
    pass


def test_worker_answers_typed_errors(tmp_path: Path, lt: LoopThread) -> None:
    from engine.experts import rpc

    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    w = ExpertWorker([load_shard(f"{fx.path}@0/0-3"), load_shard(f"{fx.path}@0/4-5")], [fx.fp, fx.fp])

    def talk(msgs: list[rpc.Message]) -> Coroutine[Any, Any, list[rpc.Envelope]]:
        return _talk(w, [(m, 0) for m in msgs])

    d = fx.layout.hidden_size
    x = np.ones((2, d), np.float32)
    req = lambda layer, experts, xx=x: rpc.ExpertRequest(  # noqa: E731
        layer, xx, np.array([[r, e] for e in experts for r in range(2)], dtype=np.uint32))
    got = lt.run(talk([rpc.Hello(fx.fp), req(0, [3, 5]), req(0, [6]), req(1, [0]),
                       req(0, [0], np.ones((2, d + 1), np.float32))]))
    assert isinstance(got[0].message, rpc.HelloAck) and len(got[0].message.ranges) == 2
    assert isinstance(got[1].message, rpc.ExpertReply)  # experts from both shards in one request
    kinds = [(g.message.code, g.message.layer, g.message.expert) for g in got[2:]]  # type: ignore[union-attr]
    assert kinds == [(rpc.ErrorCode.NOT_HELD, 0, 6), (rpc.ErrorCode.NOT_HELD, 1, 0),
                     (rpc.ErrorCode.BAD_REQUEST, 0, rpc.NONE)]
    before_hello = lt.run(talk([req(0, [0])]))
    assert isinstance(before_hello[0].message, rpc.ErrorMsg) and before_hello[0].message.code == rpc.ErrorCode.PROTOCOL
    small = lt.run(talk([rpc.Hello(fx.fp, max_message_bytes=100), req(0, [0])]))
    assert isinstance(small[1].message, rpc.ErrorMsg) and small[1].message.code == rpc.ErrorCode.TOO_LARGE
    wrong = lt.run(talk([rpc.Hello(bytes(32))]))
    assert isinstance(wrong[0].message, rpc.ErrorMsg)
    assert wrong[0].message.code == rpc.ErrorCode.FINGERPRINT_MISMATCH and str(fx.path) in wrong[0].message.text


def test_layers_split_by_size_limits_and_window_stay_exact(tmp_path: Path, lt: LoopThread,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import limits

    monkeypatch.setattr(limits, "EXPERT_WINDOW_BYTES", 2048)  # forces one request in flight per worker
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    workers = [_worker(fx, max_message_bytes=3000), _worker(fx, max_message_bytes=3000)]
    for i, w in enumerate(workers):
        _connect(lt, ex, w, f"w{i}")
    local = local_executor(fx.full.weights)
    for x in _inputs(fx.layout.hidden_size):
        assert _equal(fx.forward(x, ex), fx.forward(x, local))
    st = ex.status()
    assert sum(w.stats.requests for w in workers) > st["layers"] * 2  # layers were split
    assert st["items_local"] == 0


def test_worker_survives_arbitrary_bytes(tmp_path: Path, lt: LoopThread) -> None:
    """Garbage from a peer ends that channel (with a PROTOCOL error when parsable) and nothing else."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from engine.experts import rpc

    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    w = _worker(fx)
    hello = rpc.encode(rpc.Hello(fx.fp), 1)

    async def feed(data: bytes) -> None:
        a, b = await socketpair_channels()
        task = asyncio.get_running_loop().create_task(w.serve(b))
        await a.send(data)
        await a.send(b"", end=True)
        await asyncio.wait_for(task, 5)  # serve returns; it never raises

    @settings(max_examples=60, deadline=None)
    @given(st.binary(max_size=200), st.booleans())
    def check(junk: bytes, after_hello: bool) -> None:
        lt.run(feed((hello if after_hello else b"") + junk))

    check()
    _connect(lt, RemoteExecutor(lt.loop, fx.fp, fx.layout), w, "still-fine")  # the worker still serves


def test_decode_steps_take_the_fast_path_and_larger_layers_the_general_one(
        tmp_path: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer that fits one request per worker never schedules the general coroutine; one that must be
    split does; both are exact."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    small, big = _worker(fx), _worker(fx, max_message_bytes=3000)
    _connect(lt, ex, small, "w0")
    general: list[int] = []

    def count_general(ex: RemoteExecutor) -> None:
        run_layer = ex._run_layer

        async def counted(layer: int, *a: object) -> object:
            general.append(layer)
            return await run_layer(layer, *a)  # type: ignore[arg-type]

        monkeypatch.setattr(ex, "_run_layer", counted)

    count_general(ex)
    local = local_executor(fx.full.weights)
    x = _inputs(fx.layout.hidden_size)[-1]  # 37 rows: still one request for a worker with the default limits
    assert _equal(fx.forward(x, ex), fx.forward(x, local))
    assert general == [] and small.stats.requests == len(fx.layout.sparse_layers)
    lt.run(ex.close())

    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    count_general(ex)
    _connect(lt, ex, big, "w1")  # its 3000-byte limit forces a 37-row layer into several requests
    assert _equal(fx.forward(x, ex), fx.forward(x, local))
    assert general == list(fx.layout.sparse_layers) and big.stats.requests > len(fx.layout.sparse_layers)


def test_fast_path_gives_a_failed_layer_to_the_general_path(tmp_path: Path, lt: LoopThread) -> None:
    """A worker that answers a typed error (here: it stops) makes the fast path give up: on the loop, the
    layer (and the rest of the pass) goes back to the calling thread, whose general path moves it to the
    other holder, exactly; the next pass runs on the loop again."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    a, b = _worker(fx), _worker(fx)
    _connect(lt, ex, a, "a")
    _connect(lt, ex, b, "b")
    a.close()  # answers SHUTTING_DOWN from now on
    x = _inputs(fx.layout.hidden_size)[0]
    ref = fx.forward(x, local_executor(fx.full.weights))
    assert _equal(fx.forward(x, ex), ref)
    st = ex.status()
    assert st["retries"] > 0 and st["items_local"] == 0 and b.stats.requests >= len(fx.layout.sparse_layers)
    assert st["passes_on_loop"] == 1 and st["passes_handed_back"] == 1, st
    assert "a" not in ex.links  # a stopping worker is dropped by the general path
    assert st["workers"]["a"]["errors"] >= 1 and st["workers"]["b"]["errors"] == 0, st  # type: ignore[index]
    assert _equal(fx.forward(x, ex), ref)
    st = ex.status()
    assert st["passes_on_loop"] == 2 and st["passes_handed_back"] == 1, st


def test_echo_rtt_goes_the_layer_calls_way(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    before = w.stats.bytes_in
    rtt = ex.echo_rtt("w0", b"x" * 4096)
    assert 0 < rtt < 5 and w.stats.bytes_in - before > 4096
    ex.remove_worker("w0", "test")
    with pytest.raises(KeyError):
        ex.echo_rtt("w0", b"x")


def test_layer_timeout_bounds_fast_and_general_attempts_together(tmp_path: Path, lt: LoopThread) -> None:
    """Two hung holders: the fast path waits one message timeout on the owner, the general path retries on
    the other holder with only what is left of the layer timeout (not a fresh one)."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[0]
    owner, spare = _Gate(), _Gate()
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout,
                        CoordinatorConfig(mode="on", message_timeout_s=1.0, layer_timeout_s=1.3))
    _connect(lt, ex, _worker(fx, reply_hook=owner), "owner")
    _connect(lt, ex, _worker(fx, reply_hook=spare, capacity=1e-9), "spare")  # holds all, owns nothing
    t0 = time.monotonic()
    try:
        with pytest.raises(ExpertsUnavailable, match="did not answer within"):
            fx.forward(x, ex)
        dt = time.monotonic() - t0
    finally:
        owner.release.set()
        spare.release.set()
    assert owner.entered.is_set() and spare.entered.is_set()  # both were tried
    assert dt < 1.8, dt  # 1.0 + 1.0 with a fresh layer timeout for the retry


def test_a_request_too_big_for_one_write_takes_the_general_path(tmp_path: Path, lt: LoopThread,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path sends a request as one frame; one larger than a send slice goes the general way (in
    slices) and the link stays in use."""
    from engine import limits

    monkeypatch.setattr(limits, "EXPERT_SEND_CHUNK_BYTES", 2048)
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    local = local_executor(fx.full.weights)
    for x in _inputs(fx.layout.hidden_size):  # 1..37 rows: small ones fit 2048 bytes, large ones do not
        assert _equal(fx.forward(x, ex), fx.forward(x, local))
    assert "w0" in ex.links and not ex.links["w0"].closed and ex.status()["retries"] == 0


def test_a_link_that_breaks_by_itself_is_forgotten_and_coverage_says_so(tmp_path: Path, lt: LoopThread) -> None:
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(mode="on"))
    chans = {}

    async def go() -> None:
        a, b = await socketpair_channels()
        chans["b"] = b
        _spawn(_worker(fx).serve(b))
        await ex.add_worker("w0", a)

    lt.run(go())
    assert ex.coverage() == []
    lt.loop.call_soon_threadsafe(chans["b"].reset, 0)  # the worker's end of the stream breaks
    deadline = time.monotonic() + 5
    while "w0" in ex.links and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "w0" not in ex.links and ex.coverage() and ex.unavailable_reason()
    _connect(lt, ex, _worker(fx), "w0")  # greeted again, it is used again
    x = _inputs(fx.layout.hidden_size)[0]
    assert _equal(fx.forward(x, ex), fx.forward(x, local_executor(fx.full.weights)))


def test_a_layer_out_of_time_does_not_drop_the_holders_it_did_not_wait_for(tmp_path: Path, lt: LoopThread) -> None:
    """message timeout == layer timeout: the fast attempt on a hung owner uses the layer's time up; the
    healthy spare holder is not tried with no time left, so it is not blamed (dropped) for it."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    gate = _Gate()
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout,
                        CoordinatorConfig(mode="on", message_timeout_s=0.5, layer_timeout_s=0.5))
    _connect(lt, ex, _worker(fx, reply_hook=gate), "hung")
    _connect(lt, ex, _worker(fx, capacity=1e-9), "spare")  # holds all, owns nothing
    try:
        with pytest.raises(ExpertsUnavailable, match="did not answer within"):
            fx.forward(_inputs(fx.layout.hidden_size)[0], ex)
    finally:
        gate.release.set()
    deadline = time.monotonic() + 5
    while "hung" in ex.links and time.monotonic() < deadline:  # dropped on the loop, just after
        time.sleep(0.01)
    assert "hung" not in ex.links and "spare" in ex.links
    assert ex.status()["workers"]["spare"]["errors"] == 0  # type: ignore[index]


def test_worker_answers_a_burst_of_small_messages_in_order(tmp_path: Path, lt: LoopThread) -> None:
    """Many messages in one write: answered in order, a batch per loop turn (input paused in between)."""
    from engine.experts import rpc

    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    w = _worker(fx)

    async def burst() -> list[int]:
        a, b = await socketpair_channels()
        _spawn(w.serve(b))
        data = rpc.encode(rpc.Hello(fx.fp), 1) + b"".join(rpc.encode(rpc.Echo(bytes([i])), 100 + i) for i in range(40))
        await a.send(data)
        dec, ids = rpc.MessageDecoder(), []
        while len(ids) < 41:
            chunk = await asyncio.wait_for(a.recv(), 5)
            assert chunk is not None
            ids += [env.request_id for env in dec.feed(chunk)]
        a.reset(0)
        return ids

    assert lt.run(burst()) == [1] + [100 + i for i in range(40)]


def test_small_passes_run_on_the_loop_and_larger_ones_layer_by_layer(tmp_path: Path, lt: LoopThread,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``drive`` hands a pass of up to LOOP_STEP_MAX_ROWS rows to the loop thread (no hand-off per layer);
    a larger one runs here; both are exact."""
    import engine.experts.passes as passes_mod
    from engine.experts.passes import LOOP_STEP_MAX_ROWS

    # the rows decide here, not the wall clock: a loaded machine can take longer than LOOP_STEP_MAX_COMPUTE_S
    # (5 ms) up to a pass's first routed layer, and that pass would stay on this thread
    monkeypatch.setattr(passes_mod, "LOOP_STEP_MAX_COMPUTE_S", 3600.0)

    fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    local = local_executor(fx.full.weights)
    inputs = _inputs(fx.layout.hidden_size)
    for x in inputs:
        assert _equal(fx.forward(x, ex), fx.forward(x, local))
    st = ex.status()
    small = sum(1 for x in inputs if x.shape[0] <= LOOP_STEP_MAX_ROWS)
    assert 0 < small < len(inputs)
    assert st["passes_on_loop"] == small and st["passes_handed_back"] == 0, st
    assert st["layers"] == len(inputs) * len(fx.layout.sparse_layers) and st["items_local"] == 0


def test_an_error_inside_a_loop_driven_pass_is_raised_to_its_caller(tmp_path: Path, lt: LoopThread) -> None:
    fx, ex, x = _one_worker(tmp_path, lt)
    ran_on: list[str] = []

    def failing() -> ForwardSteps:
        first = fx.layout.sparse_layers[0]
        yield (first, x, route(x @ fx.routers[first].T, fx.layout.top_k, fx.layout.norm_topk_prob))
        ran_on.append(threading.current_thread().name)
        raise ValueError("broken pass")

    with pytest.raises(ValueError, match="broken pass"):
        ex.drive(failing())
    assert ran_on == ["experts-loop"]  # resumed on the loop thread, raised on this one
    assert _equal(fx.forward(x, ex), fx.forward(x, local_executor(fx.full.weights)))  # the executor is fine


def test_a_loop_driven_pass_warms_each_next_layer_once_that_layers_requests_are_out(
        tmp_path: Path, lt: LoopThread) -> None:
    """While a layer's experts are out, the pass warms what runs next (``Model.warm(layer + 1)``), on the
    loop, after the layer's request was sent; the outputs are the local run's. ``warm=False`` turns it off."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[0]  # one token: a loop-driven pass
    ref = fx.forward(x, local_executor(fx.full.weights))
    for on in (True, False):
        ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(warm=on))
        _connect(lt, ex, _worker(fx), "w0")
        seen: list[tuple[int, str, int]] = []

        def warm(layer: int, ex: RemoteExecutor = ex, seen: list[tuple[int, str, int]] = seen) -> None:
            seen.append((layer, threading.current_thread().name, ex.link_stats["w0"].rows))

        assert _equal(ex.drive(fx.steps(x), warm), ref)
        assert ex.status()["passes_on_loop"] == 1
        if not on:
            assert seen == []
            continue
        sparse = fx.layout.sparse_layers
        assert [layer for layer, _, _ in seen] == [la + 1 for la in sparse]
        assert {name for _, name, _ in seen} == {"experts-loop"}
        assert [rows for _, _, rows in seen] == [i + 1 for i in range(len(sparse))]  # its row already sent


def test_a_pass_does_not_warm_when_its_worker_is_on_this_machine_or_its_send_failed(
        tmp_path: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass asks ``_may_warm`` (here: one worker on this machine's loopback, whatever the cores), and a
    layer whose send failed (handed back to the engine thread) warms nothing."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    worker = _worker(fx)

    async def go() -> None:
        a, b = await socketpair_channels()
        a.on_loopback = True  # type: ignore[attr-defined]  # as a QUIC stream to 127.0.0.1 says
        _spawn(worker.serve(b, "coordinator"))
        await ex.add_worker("w0", a)

    lt.run(go())
    x = _inputs(fx.layout.hidden_size)[0]
    ref = fx.forward(x, local_executor(fx.full.weights))
    seen: list[int] = []
    for cores in (1, 2, 64):
        ex._cores = cores
        assert _equal(ex.drive(fx.steps(x), seen.append), ref) and seen == []
    link = ex.links["w0"]
    link.channel.on_loopback = False  # type: ignore[attr-defined]  # a worker on another machine: warms
    assert _equal(ex.drive(fx.steps(x), seen.append), ref)
    assert seen == [la + 1 for la in fx.layout.sparse_layers]
    seen.clear()
    monkeypatch.setattr(link, "send_now", lambda data: False)  # "send buffer full": the pass is handed back
    assert _equal(ex.drive(fx.steps(x), seen.append), ref) and seen == []
    assert ex.status()["passes_handed_back"] == 1


def test_a_failing_warm_is_logged_and_the_pass_goes_on(tmp_path: Path, lt: LoopThread) -> None:
    """Warming is optional: an error in it ends warming for that pass, never the pass."""
    fx, ex, x = _one_worker(tmp_path, lt)
    calls: list[int] = []

    def broken(layer: int) -> None:
        calls.append(layer)
        raise MemoryError("no room to warm")

    assert _equal(ex.drive(fx.steps(x), broken), fx.forward(x, local_executor(fx.full.weights)))
    assert calls == [fx.layout.sparse_layers[0] + 1]  # tried once, then off for the pass
    st = ex.status()
    assert st["passes_on_loop"] == 1 and st["passes_handed_back"] == 0 and st["unavailable"] == 0


def test_warming_waits_while_a_worker_of_the_layer_is_on_this_machine(tmp_path: Path, lt: LoopThread) -> None:
    """Warming reads memory a worker on this machine reads too (the same memory bus and last-level
    cache): only with every worker of the layer elsewhere."""
    from types import SimpleNamespace

    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    ex._cores = 2

    def call(*loopback: bool) -> Any:
        links = [SimpleNamespace(channel=SimpleNamespace(on_loopback=lb)) for lb in loopback]
        return SimpleNamespace(sends=[SimpleNamespace(link=link) for link in links])

    assert not ex._may_warm(call(True))  # one worker here: it shares our memory bus, whatever the cores
    assert not ex._may_warm(call(True, True))
    assert ex._may_warm(call(False, False, False))  # workers on other machines
    assert not ex._may_warm(call(True, False))
    ex._cores = 64
    assert not ex._may_warm(call(True)) and ex._may_warm(call(False))


def test_drive_from_the_loop_thread_is_refused(tmp_path: Path, lt: LoopThread) -> None:
    fx, ex, x = _one_worker(tmp_path, lt)

    async def on_loop() -> None:
        fx.forward(x, ex)

    with pytest.raises(RuntimeError, match="event loop thread"):
        lt.run(on_loop())


def test_a_pass_with_long_compute_stays_on_the_engine_thread(tmp_path: Path, lt: LoopThread,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-sized pass whose compute up to its first routed layer is long (a long context, say) would
    hold the loop that long at every layer: it runs layer by layer on the calling thread instead."""
    import engine.experts.passes as passes_mod

    fx, ex, x = _one_worker(tmp_path, lt)
    ref = fx.forward(x, local_executor(fx.full.weights))

    def slow(x: np.ndarray) -> ForwardSteps:
        time.sleep(0.02)  # the compute before the first routed layer
        return (yield from fx.steps(x))

    monkeypatch.setattr(passes_mod, "LOOP_STEP_MAX_COMPUTE_S", 0.01)
    assert _equal(ex.drive(slow(x)), ref)
    assert ex.status()["passes_on_loop"] == 0
    assert _equal(ex.drive(fx.steps(x)), ref)
    assert ex.status()["passes_on_loop"] == 1


def test_an_error_sending_a_later_layer_on_the_loop_reaches_the_caller_at_once(
        tmp_path: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building or sending a layer on the loop can fail too (a bug, no memory): the pass ends with that
    error on its engine thread, not with a wait for the loop's timeouts."""
    import engine.experts.coordinator as coord_mod

    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(message_timeout_s=5.0, layer_timeout_s=5.0))
    _connect(lt, ex, _worker(fx), "w0")
    x = _inputs(fx.layout.hidden_size)[0]
    real, requests = coord_mod.rpc.encode, []

    def encode(msg: object, rid: int, flags: int = 0) -> bytes:
        if isinstance(msg, coord_mod.rpc.ExpertRequest | coord_mod.rpc.ExpertCombineRequest):
            requests.append(msg)
            if len(requests) == 2:  # the second layer, built on the loop thread
                raise MemoryError("encode failed")
        return real(msg, rid, flags)  # type: ignore[arg-type]

    monkeypatch.setattr(coord_mod.rpc, "encode", encode)
    t0 = time.monotonic()
    with pytest.raises(MemoryError, match="encode failed"):
        fx.forward(x, ex)
    assert time.monotonic() - t0 < 1.0
    monkeypatch.setattr(coord_mod.rpc, "encode", real)
    assert _equal(fx.forward(x, ex), fx.forward(x, local_executor(fx.full.weights)))  # the executor is fine


def test_a_pass_the_loop_stops_moving_is_given_up_and_never_resumed(
        tmp_path: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread gives up on a loop-run pass that makes no progress for a layer's timeout plus a
    margin (here: the loop is held by the pass's own compute), waits for that compute to end, and the
    loop then leaves the pass alone: it is not resumed after the caller was told it failed."""
    import engine.experts.passes as passes_mod

    monkeypatch.setattr(passes_mod, "LOOP_STALL_MARGIN_S", 0.2)
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", layers=3), "qwen3_moe")
    # a layer may take 1 s (a loaded CI machine), the pass may stall for 1.2 s before it is given up
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(message_timeout_s=1.0, layer_timeout_s=5.0))
    _connect(lt, ex, _worker(fx), "w0")
    x = _inputs(fx.layout.hidden_size)[0]
    segments: list[str] = []

    def stalling() -> ForwardSteps:
        h = x
        for i, layer in enumerate(fx.layout.sparse_layers):
            if i == 1:
                time.sleep(2.0)  # on the loop thread: nothing else moves meanwhile
            segments.append(threading.current_thread().name)
            h = h + (yield (layer, h, route(h @ fx.routers[layer].T, fx.layout.top_k, fx.layout.norm_topk_prob)))
        return h

    with pytest.raises(ExpertsUnavailable, match="stopped running the forward pass"):
        ex.drive(stalling())
    time.sleep(0.5)  # the loop had the next layer's reply by now, had it gone on
    assert segments == [threading.current_thread().name, "experts-loop"], segments
    assert ex.status()["unavailable"] == 1


def test_a_loop_driven_pass_times_each_layer_not_the_whole_pass(tmp_path: Path, lt: LoopThread) -> None:
    """A loop-driven pass has one watchdog timer, re-armed per layer: layers that each take most of the
    message timeout (together well over it) run on the loop to the end, and a layer that hangs is handed
    back after the timeout and retried on the other holder, exactly."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    x = _inputs(fx.layout.hidden_size)[0]  # one row: the pass runs on the loop
    ref = fx.forward(x, local_executor(fx.full.weights))
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout, CoordinatorConfig(message_timeout_s=0.5, layer_timeout_s=5.0))
    _connect(lt, ex, _worker(fx, reply_hook=lambda la, o: time.sleep(0.3)), "slow")
    t0 = time.monotonic()
    assert _equal(fx.forward(x, ex), ref)
    assert len(fx.layout.sparse_layers) * 0.3 > 0.5 and time.monotonic() - t0 > 0.5  # over one timeout in all
    st = ex.status()
    assert st["passes_on_loop"] == 1 and st["passes_handed_back"] == 0 and st["retries"] == 0, st
    assert st["workers"]["slow"]["calls"] == len(fx.layout.sparse_layers), st  # type: ignore[index]

    gate = _Gate()
    lt.run(_remove(ex, "slow"))
    _connect(lt, ex, _worker(fx, reply_hook=gate), "hung")
    _connect(lt, ex, _worker(fx, capacity=1e-9), "spare")  # holds all, owns nothing
    t0 = time.monotonic()
    out = fx.forward(x, ex)
    dt = time.monotonic() - t0
    gate.release.set()
    assert _equal(out, ref) and 0.5 <= dt < 3.0
    st = ex.status()
    assert st["passes_on_loop"] == 2 and st["passes_handed_back"] == 1 and st["retries"] > 0, st
    assert "hung" not in ex.links and st["workers"]["hung"]["errors"] >= 1  # type: ignore[index]


async def _remove(ex: RemoteExecutor, node_id: str) -> None:
    ex.remove_worker(node_id)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_pass_whose_bookkeeping_fails_ends_at_once_and_is_not_resumed_by_later_replies(
        tmp_path: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    """The loop counts a layer after the next layer's requests are out (or, for the last, before the pass
    ends); if that fails (a bug, no memory), the pass ends with the error at once, and replies still on
    their way do not run the pass on."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m", layers=3), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    x = _inputs(fx.layout.hidden_size)[0]
    real = ex._account
    monkeypatch.setattr(ex, "_account", _failing_call(real, fail_at, MemoryError("account failed")))
    resumed: list[int] = []

    def steps() -> ForwardSteps:
        h = x
        for layer in fx.layout.sparse_layers:
            y = yield (layer, h, route(h @ fx.routers[layer].T, fx.layout.top_k, fx.layout.norm_topk_prob))
            resumed.append(layer)
            h = h + y
        return h  # type: ignore[return-value]

    t0 = time.monotonic()
    with pytest.raises(MemoryError, match="account failed"):
        ex.drive(steps())
    assert time.monotonic() - t0 < 1.0
    sent = min(fail_at + 1, len(fx.layout.sparse_layers))  # layers whose requests went out
    link = ex.links["w0"]
    deadline = time.monotonic() + 5.0
    while (w.stats.requests < sent or link._pending) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the last request's reply has been read
    assert not link._pending and w.stats.requests == sent
    assert resumed == list(fx.layout.sparse_layers[:fail_at]), resumed
    monkeypatch.setattr(ex, "_account", real)
    assert _equal(fx.forward(x, ex), fx.forward(x, local_executor(fx.full.weights)))  # the executor is fine


def test_a_layer_answered_and_used_is_counted_when_the_pass_then_fails(tmp_path: Path, lt: LoopThread) -> None:
    """A loop-driven layer is counted once the next layer is out; when the pass's own code raises after
    taking a layer's output, that layer still counts (calls, layers), as the worker served it."""
    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    w = _worker(fx)
    _connect(lt, ex, w, "w0")
    x = _inputs(fx.layout.hidden_size)[0]

    def failing() -> ForwardSteps:
        first = fx.layout.sparse_layers[0]
        yield (first, x, route(x @ fx.routers[first].T, fx.layout.top_k, fx.layout.norm_topk_prob))
        raise ValueError("broken pass")

    with pytest.raises(ValueError, match="broken pass"):
        ex.drive(failing())
    st = ex.status()
    assert st["layers"] == 1 and st["workers"]["w0"]["calls"] == w.stats.requests == 1, st  # type: ignore[index]


def test_a_layer_answered_and_used_is_counted_when_the_next_one_fails_to_build(
        tmp_path: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.experts.coordinator as coord_mod

    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    _connect(lt, ex, _worker(fx, protocol_max=1), "w0")  # v1: decode requests take encode_row_request
    x = _inputs(fx.layout.hidden_size)[0]
    monkeypatch.setattr(coord_mod.rpc, "encode_row_request",
                        _failing_call(coord_mod.rpc.encode_row_request, 2, MemoryError("encode failed")))
    with pytest.raises(MemoryError, match="encode failed"):
        fx.forward(x, ex)
    st = ex.status()
    assert st["layers"] == 1 and st["workers"]["w0"]["calls"] == 1, st  # type: ignore[index]


def test_a_worker_out_of_memory_for_a_reply_answers_a_typed_error_and_keeps_the_link(
        tmp_path: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a decode reply can fail (no memory): the worker answers INTERNAL for that request, the
    coordinator runs the layer again (general path), and the worker's channel is not reset."""
    import engine.experts.worker as worker_mod

    fx = Fixture(make_moe_checkpoint(tmp_path / "m"), "qwen3_moe")
    ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
    a = _worker(fx, protocol_max=1)  # v1: decode replies are built in place (ReplyBuffer)
    _connect(lt, ex, a, "a")
    monkeypatch.setattr(worker_mod.rpc, "ReplyBuffer",
                        _failing_call(worker_mod.rpc.ReplyBuffer, 1, MemoryError("no memory for the reply")))
    x = _inputs(fx.layout.hidden_size)[0]
    assert _equal(fx.forward(x, ex), fx.forward(x, local_executor(fx.full.weights)))
    assert a.stats.errors == 1 and ex.status()["retries"] > 0 and "a" in ex.links
