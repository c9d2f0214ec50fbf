"""Planned decode with remote experts: the coordinator's one-token pass on the decode plan's pieces
(``engine.experts.decode_steps``) and the worker's prebuilt kernel rows for a one-token request
(``engine.experts.worker_plan``) give the local planned step's bits (logits and KV cache), in one process over
real socket channels. Model-sized weights (the compiled step and kernels), so numba only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from experts_util import make_moe_checkpoint

from engine import dense
from engine.experts import decode_steps, passes
from engine.experts.channel import LoopThread, socketpair_channels
from engine.experts.coordinator import RemoteExecutor
from engine.experts.fingerprint import model_fingerprint
from engine.experts.shard import load_shard
from engine.experts.worker import ExpertWorker
from engine.model import Model

pytestmark = pytest.mark.skipif(dense._kernels() is None, reason="numba not installed (the [fast] extra)")

PROMPT = [3, 17, 40, 2, 88]
STEPS = 10
_TASKS: set[asyncio.Task[None]] = set()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # layer 0 a dense MLP, layers 1-2 routed; big enough for the compiled step (q 512x512) and the kernels
    return make_moe_checkpoint(tmp_path_factory.mktemp("plan") / "m", family="qwen3_moe", layers=3, experts=8,
                               hidden=512, inter=512, top_k=4, vocab=96, seed=5, dense_layers=(0,))


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    t = LoopThread()
    yield t
    t.stop()


def _decode(model: Model, executor: object = None) -> tuple[list[bytes], list[bytes]]:
    kw = {} if executor is None else {"executor": executor}
    cache = model.new_cache(4)  # grows during the decode: the plans follow the cache's arrays
    out = [model.forward(PROMPT, cache, **kw).tobytes()]
    tok = 11
    for _ in range(STEPS):
        lg = model.forward(np.array([tok]), cache, **kw)
        out.append(lg.tobytes())
        tok = int(np.argmax(lg[-1]))
    return out, [a[:, : cache.length].tobytes() for a in (*cache.k, *cache.v)]


def _executor(lt: LoopThread, path: Path, packet: int | None = None) -> tuple[RemoteExecutor, ExpertWorker]:
    """An executor with one in-process worker over a socket pair; ``packet``: the channel's datagram size (as
    the lane's or QUIC's; a decode reply then comes back raw, as on loopback), else it combines every token."""
    fp = model_fingerprint(path)
    shard = load_shard(str(path))
    worker = ExpertWorker([shard], [fp])
    ex = RemoteExecutor(lt.loop, fp, shard.layout)

    async def go() -> None:
        a, b = await socketpair_channels()
        if packet is not None:
            a.max_datagram_bytes = packet  # type: ignore[attr-defined]
        task = asyncio.get_running_loop().create_task(worker.serve(b, "coordinator"))
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)
        await ex.add_worker("w0", a)

    lt.run(go())
    return ex, worker


@pytest.mark.parametrize("on_loop", [True, False], ids=["loop", "engine"])
@pytest.mark.parametrize("packet", [None, 16384])
def test_remote_decode_runs_the_plan_and_gives_the_local_bits(checkpoint: Path, lt: LoopThread,
                                                              monkeypatch: pytest.MonkeyPatch, packet: int | None,
                                                              on_loop: bool) -> None:
    # Where ``drive`` runs a decode pass depends on the wall clock (its compute up to the first routed layer
    # within LOOP_STEP_MAX_COMPUTE_S, 5 ms: a loaded machine takes longer, and the pass stays on the engine
    # thread). Both places must give the local bits; the bound is set here so each run takes the one it names.
    monkeypatch.setattr(passes, "LOOP_STEP_MAX_COMPUTE_S", 3600.0 if on_loop else 0.0)
    model = Model.load(checkpoint)
    want = _decode(model)  # the local planned step (itself the general pass's bits: tests/test_decode_plan.py)
    ex, worker = _executor(lt, checkpoint, packet)
    runs: list[int] = []
    real = decode_steps.RemoteDecodePlan.steps

    def counted(self, token, cache):  # type: ignore[no-untyped-def]
        runs.append(int(token[0]))
        return real(self, token, cache)

    monkeypatch.setattr(decode_steps.RemoteDecodePlan, "steps", counted)
    got = _decode(model, ex)
    assert len(runs) == STEPS  # every one-token step took the planned steps, the prompt the general pass
    assert got[0] == want[0]  # logits, byte for byte
    assert got[1] == want[1]  # the KV cache
    st = ex.status()
    assert st["passes_on_loop"] == (1 + STEPS if on_loop else 0) and st["items_local"] == 0
    # one-token layers combined by the worker (no packet size), or sent raw and combined here (16 KiB packets:
    # combining saves no packet); the prompt's rows are combined by the worker either way
    assert st["rows_combined"] == 2 * len(PROMPT) + (0 if packet else STEPS * 2)
    assert worker.stats.requests == (1 + STEPS) * 2  # 2 routed layers per pass, all delegated
    assert next(iter(worker._plans.values())).used == STEPS * 2  # each one-token request on prebuilt rows
    lt.run(ex.close())


def test_a_busy_plan_or_a_model_it_does_not_cover_takes_the_general_pass(checkpoint: Path, lt: LoopThread,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model.load(checkpoint)
    want = _decode(model)
    ex, _ = _executor(lt, checkpoint)
    cache = model.new_cache(4)
    model.forward(PROMPT, cache, executor=ex)
    first = decode_steps.decode_steps(model, np.array([11]), cache)
    assert first is not None
    next(first)  # the plan's buffers are taken: a second pass now runs the general steps, same bits
    other = model.new_cache(4)
    model.forward(PROMPT, other, executor=ex)
    assert model.forward(np.array([11]), other, executor=ex).tobytes() == want[0][1]
    first.close()  # gives the buffers back
    assert decode_steps._plans[model].busy.acquire(blocking=False)
    decode_steps._plans[model].busy.release()
    assert decode_steps.decode_steps(model, np.array([1, 2]), cache) is None  # not one token
    monkeypatch.setenv("MESHD_DECODE_PLAN", "0")
    assert decode_steps.RemoteDecodePlan.make(model) is None
    lt.run(ex.close())


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_the_worker_plan_gives_compute_requests_bits(tmp_path: Path, dtype: str) -> None:
    from engine.experts import planning, worker

    path = make_moe_checkpoint(tmp_path / "m", layers=2, experts=8, hidden=512, inter=384, top_k=4, dtype=dtype)
    shard = load_shard(str(path) + "@0-1/0-5")  # experts 6 and 7 not held: such a request is not planned
    w = ExpertWorker([shard], [model_fingerprint(path)])
    plan = next(iter(w._plans.values()))
    rng = np.random.default_rng(3)
    for layer, experts in ((0, (1, 3, 4, 5)), (1, (0, 2, 3, 5)), (1, (0, 1)), (0, (2, 3, 4, 5))):
        x = rng.standard_normal((1, 512), dtype=np.float32)
        work = [(e, np.zeros(1, dtype=np.int64)) for e in experts]
        req = planning.request(layer, x, work, list(range(len(work))))
        want = worker.compute_request(shard.weights, req)
        out = np.full_like(want, np.nan)
        used = plan.used
        assert plan.compute(layer, req.x, req.groups(), out) and plan.used == used + 1
        assert out.tobytes() == want.tobytes()
    x = rng.standard_normal((2, 512), dtype=np.float32)  # two rows: not planned
    req = planning.request(0, x, [(1, np.array([0, 1]))], [0])
    assert not plan.compute(0, req.x, req.groups(), np.empty((2, 512), dtype=np.float32))
    req = planning.request(0, x[:1], [(6, np.zeros(1, dtype=np.int64))], [0])  # not held here
    assert not plan.compute(0, req.x, req.groups(), np.empty((1, 512), dtype=np.float32))
