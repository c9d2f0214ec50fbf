"""The worker's compute (``engine.experts.worker.compute_request``) against the engine's own calls.

A worker must compute exactly what the local executor computes, and as cheaply: all experts of a request
go through one ``expert_ffn_many`` (two rounds of the compiled kernels' threads, as the local pass), not
one ``expert_ffn`` per expert (two rounds each). Experts here are model-sized (a gate of at least
``DENSE_KERNEL_MIN_WEIGHTS``), so with numba the compiled SwiGLU and kernel rounds run; without it the numpy
path does.
"""

from __future__ import annotations

import numpy as np
import pytest
from experts_util import make_moe_checkpoint

import engine.moe
from engine.experts import planning, worker
from engine.experts.shard import ExpertShard, load_shard
from engine.moe import expert_ffn, local_executor

HIDDEN, INTER, EXPERTS = 512, 384, 8  # a gate of 196,608 weights: the compiled decode path


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> ExpertShard:
    path = make_moe_checkpoint(tmp_path_factory.mktemp("ck"), layers=1, experts=EXPERTS, hidden=HIDDEN,
                               inter=INTER, top_k=4)
    s = load_shard(str(path))
    s.warm()
    return s


def _request(x: np.ndarray, work: list[tuple[int, np.ndarray]]) -> object:
    return planning.request(0, x, work, list(range(len(work))))


def _one_by_one(shard: ExpertShard, x: np.ndarray, work: list[tuple[int, np.ndarray]]) -> bytes:
    """Each item alone, as the local pass computes it (``expert_ffn``: an item of more than ``KERNEL_MAX_ROWS``
    rows on single-threaded BLAS, whatever other items a call holds; one and two BLAS threads differ in the last
    bits on some CPUs)."""
    return b"".join(expert_ffn(x[rows], *shard.weights(0, e)).tobytes() for e, rows in work)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = engine.moe.matmul_many

    def counted(products):  # type: ignore[no-untyped-def]
        calls.append(len(products))
        return real(products)

    monkeypatch.setattr(engine.moe, "matmul_many", counted)
    return calls


def test_decode_request_is_two_rounds_and_the_local_bits(shard: ExpertShard, monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(1).standard_normal((1, HIDDEN), dtype=np.float32)
    work = [(e, np.zeros(1, dtype=np.int64)) for e in (1, 3, 4, 6)]  # one token, top-4
    want = _one_by_one(shard, x, work)
    local = b"".join(y.tobytes() for y in local_executor(shard.weights)(0, x, work))
    calls = _counting(monkeypatch)
    got = worker.compute_request(shard.weights, _request(x, work))  # type: ignore[arg-type]
    assert got.tobytes() == want == local
    assert calls == [8, 4]  # every gate/up in one round, every down in another (was 2 calls per expert)


def test_prefill_request_and_its_batches_keep_the_bits(shard: ExpertShard, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import prefill_threads

    # the rounds counted below are the one-thread path's (with prefill threads each item is its own piece, the
    # same bits: tests/test_prefill_threads.py)
    monkeypatch.setattr(prefill_threads, "_pool", None)
    monkeypatch.setattr(prefill_threads, "_decided", True)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, HIDDEN), dtype=np.float32)
    work = [(e, np.sort(rng.choice(9, size=n, replace=False)).astype(np.int64))
            for e, n in ((0, 3), (2, 9), (5, 1), (7, 4))]
    want = _one_by_one(shard, x, work)
    calls = _counting(monkeypatch)
    assert worker.compute_request(shard.weights, _request(x, work)).tobytes() == want  # type: ignore[arg-type]
    assert calls == [6, 3, 2, 1]  # the decode-sized items in two rounds, then expert 2's 9 rows alone
    calls.clear()
    monkeypatch.setattr(worker, "BATCH_MAX_ROWS", 4)  # batches: (0, 2) 12 rows, (5, 7) 5 rows
    out = np.full((17, HIDDEN), np.nan, dtype=np.float32)
    worker.compute_request(shard.weights, _request(x, work), out=out)  # type: ignore[arg-type]
    assert out.tobytes() == want
    assert calls == [2, 1, 2, 1, 4, 2]
