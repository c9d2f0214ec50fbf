"""The prefill threads (engine/prefill_threads.py): pieces of a prefill run concurrently, each with single-threaded
BLAS, and every result is the same bits as the one-thread pass."""

from __future__ import annotations

import threading
import time
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest

from engine import kernels, moe, ops, prefill_threads
from engine.limits import ATTENTION_QUERY_BLOCK
from engine.model import Model
from engine.tiny import create_tiny

F32 = np.float32
BLAS = prefill_threads._openblas()
needs_local_threads = pytest.mark.skipif(BLAS is None, reason="numpy's BLAS has no per-thread thread count")


@pytest.fixture(scope="module")
def _one_helper() -> prefill_threads._Pool:
    assert BLAS is not None
    return prefill_threads._Pool(1)  # its thread lives on, idle, like the process's own pool


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch, _one_helper: prefill_threads._Pool) -> prefill_threads._Pool:
    """This process's prefill threads made two (a caller and one helper), whatever BLAS's count is."""
    pool = _one_helper
    prefill_threads.threads()  # decided once: BLAS's functions and own count read
    monkeypatch.setattr(prefill_threads, "_pool", pool)
    monkeypatch.setattr(prefill_threads, "_decided", True)
    return pool


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_threads, "_pool", None)
    monkeypatch.setattr(prefill_threads, "_decided", True)


def _stacked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, scale: float,
                       window: int | None) -> np.ndarray:
    """Attention as one stacked computation over every KV group (the form before the pieces), per block of
    ``ATTENTION_QUERY_BLOCK`` queries: what the pieces must equal bit for bit."""
    t, h, hd = q.shape
    if t > ATTENTION_QUERY_BLOCK:
        out = np.empty((t, h * hd), dtype=F32)
        for a in range(0, t, ATTENTION_QUERY_BLOCK):
            b = min(t, a + ATTENTION_QUERY_BLOCK)
            out[a:b] = _stacked_attention(q[a:b], k[:, : past + b], v[:, : past + b], past + a, scale, window)
        return out
    kv, length, _ = k.shape
    g = h // kv
    qg = q.reshape(t, kv, g, hd).transpose(1, 2, 0, 3).reshape(kv, g * t, hd)
    scores = np.matmul(qg, k.transpose(0, 2, 1))
    scores *= F32(scale)
    scores = scores.reshape(kv, g, t, length)
    scores += ops.causal_mask(past, t, window)
    scores = scores.reshape(kv, g * t, length)
    ops.softmax_(scores)
    out = np.matmul(scores, v)
    return out.reshape(kv, g, t, hd).transpose(2, 0, 1, 3).reshape(t, h * hd)


@needs_local_threads
def test_blas_stays_on_one_thread_on_every_thread(two_threads: prefill_threads._Pool) -> None:
    """OpenBLAS is held at one thread for the process from the engine's import on, in the caller and on a
    helper, during and after ``run`` (before, BLAS's own count came back outside the pieces: the products there
    followed ``OPENBLAS_NUM_THREADS``, and one and two threads give other bits on some CPUs)."""
    get = BLAS[1]  # type: ignore[index]
    assert prefill_threads.pinned() and get() == 1
    counts: list[int] = []
    started = threading.Event()

    def first() -> None:
        counts.append(get())
        started.wait(10)

    def second() -> None:
        started.set()
        counts.append(get())

    prefill_threads.run([first, second])
    assert counts == [1, 1] and get() == 1


CASES = [  # t, past, heads, kv heads, head dim, window
    (2, 0, 4, 2, 16, None), (9, 3, 4, 1, 8, None), (40, 0, 6, 3, 16, None), (ATTENTION_QUERY_BLOCK + 45, 7, 4, 2, 16, None),
    (2 * ATTENTION_QUERY_BLOCK + 1, 0, 2, 2, 8, None), (30, 12, 4, 2, 16, 5),
]


@pytest.mark.parametrize("threads", ["one_thread", pytest.param("two_threads", marks=needs_local_threads)])
def test_attention_pieces_equal_the_stacked_computation(threads: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(threads)
    rng = np.random.default_rng(1)
    for t, past, h, kv, hd, window in CASES:
        q = rng.standard_normal((t, h, hd), dtype=F32)
        k = rng.standard_normal((kv, past + t + 11, hd), dtype=F32)[:, : past + t]  # a cache's strided view
        v = rng.standard_normal((kv, past + t + 11, hd), dtype=F32)[:, : past + t]
        want = _stacked_attention(q, k, v, past, hd**-0.5, window)
        got = ops.attention(q, k, v, past, hd**-0.5, window)
        assert got.tobytes() == want.tobytes(), (t, past, h, kv, hd, window)
        np.testing.assert_allclose(got, ops.naive_attention(q, k, v, past, hd**-0.5, window), rtol=1e-4, atol=1e-5)


@needs_local_threads
def test_prefill_with_threads_equals_one_thread(tmp_path: Path, two_threads: prefill_threads._Pool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny MoE model's prefill (every position's logits, a chunk after it, and the cache) is the same bits with
    the prefill threads as on the calling thread alone, and the helper did compute pieces."""
    m = Model.load(create_tiny(tmp_path / "m"))
    ids = list(range(3, 3 + 90))
    ran_on: set[str] = set()
    helper_ran = threading.Event()
    real = ops.softmax_

    def spy(x: np.ndarray) -> np.ndarray:  # an attention piece; the caller's first waits for the helper's
        name = threading.current_thread().name
        ran_on.add(name)
        if name.startswith("meshd-prefill-"):
            helper_ran.set()
        else:
            helper_ran.wait(10)
        return real(x)

    monkeypatch.setattr(ops, "softmax_", spy)
    c2 = m.new_cache()
    got = np.concatenate([m.forward(ids[:70], c2), m.forward(ids[70:], c2)])
    monkeypatch.setattr(prefill_threads, "_pool", None)
    c1 = m.new_cache()
    want = np.concatenate([m.forward(ids[:70], c1), m.forward(ids[70:], c1)])
    assert got.tobytes() == want.tobytes()
    for a, b in zip((*c1.k, *c1.v), (*c2.k, *c2.v)):
        assert a[:, : len(ids)].tobytes() == b[:, : len(ids)].tobytes()
    assert any(name.startswith("meshd-prefill-") for name in ran_on), ran_on


@needs_local_threads
def test_run_uses_the_helpers_and_returns_when_all_are_done(two_threads: prefill_threads._Pool) -> None:
    """Two tasks that need each other finish only if they run at once; every task has run when ``run``
    returns."""
    first, second = threading.Event(), threading.Event()
    seen: list[bool] = []
    done: list[int] = []

    def a() -> None:
        first.set()
        seen.append(second.wait(10))
        done.append(0)

    def b() -> None:
        second.set()
        seen.append(first.wait(10))
        done.append(1)

    prefill_threads.run([a, b] + [lambda i=i: done.append(i) for i in range(2, 20)])
    assert seen == [True, True]
    assert sorted(done) == list(range(20))


@needs_local_threads
def test_a_runs_tasks_keep_their_compiled_kernels_on_their_own_thread(two_threads: prefill_threads._Pool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a run on the pool, on the caller and on the helper, a task's compiled-kernel products skip the
    kernel threads (``kernels.single_threaded``: their helpers would spin on the cores the run's threads use);
    outside it, and in a run without a pool (the run's threads idle then), they do not."""
    first, second = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def a() -> None:
        first.set()
        second.wait(10)
        seen["a"] = kernels.is_single_threaded()

    def b() -> None:
        second.set()
        first.wait(10)
        seen["b"] = kernels.is_single_threaded()

    prefill_threads.run([a, b])  # they wait for each other: one ran on the helper
    assert seen == {"a": True, "b": True}
    assert not kernels.is_single_threaded()
    monkeypatch.setattr(prefill_threads, "_pool", None)
    prefill_threads.run([a, b])
    assert seen == {"a": False, "b": False}


@needs_local_threads
def test_a_task_error_is_raised_in_the_caller_after_the_others_ran(two_threads: prefill_threads._Pool) -> None:
    done: list[int] = []

    def bad() -> None:
        raise ValueError("piece failed")

    with pytest.raises(ValueError, match="piece failed"):
        prefill_threads.run([lambda i=i: done.append(i) for i in range(5)] + [bad])
    assert sorted(done) == list(range(5))
    prefill_threads.run([lambda: done.append(9), lambda: done.append(10)])  # the pool still works
    assert done[-2:] in ([9, 10], [10, 9])


@needs_local_threads
def test_callers_on_several_threads_share_the_pool(two_threads: prefill_threads._Pool) -> None:
    results: dict[int, list[int]] = {}

    def caller(c: int) -> None:
        out = [0] * 50

        def task(i: int) -> None:
            out[i] = c * 1000 + i

        for _ in range(20):
            prefill_threads.run([lambda i=i: task(i) for i in range(50)])
        results[c] = out

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert results == {c: [c * 1000 + i for i in range(50)] for c in range(3)}


@needs_local_threads
def test_a_job_the_helper_took_late_holds_none_of_its_tasks() -> None:
    """A helper that had not woken before the caller ran every task takes the job off the queue only later (in a
    prefill: when it next gets the GIL, with the next layer running). The tasks are closures over a routed layer's
    expert outputs and gathered slots (~6 MiB at 256 tokens), so the job must no longer hold them once ``run``
    has returned: the peak RSS of the next layer counted them."""
    pool = prefill_threads._Pool(1)
    busy, release = threading.Event(), threading.Event()
    pool._jobs.put(prefill_threads._Job([lambda: (busy.set(), release.wait(10))]))  # the helper is held here
    try:
        assert busy.wait(10)

        class Big:
            pass

        big = Big()
        gone = weakref.ref(big)
        done: list[int] = []
        pool.run([lambda b=big: done.append(1), lambda b=big: done.append(2)])  # both on this thread
        del big
        assert done == [1, 2]
        assert gone() is None, "the job still on the helper's queue keeps its tasks' closures alive"
    finally:
        release.set()


@pytest.mark.parametrize("threads", ["one_thread", pytest.param("two_threads", marks=needs_local_threads)])
def test_a_prefills_combination_is_the_whole_gathers_bits_without_the_whole_y(threads: str,
                                                                               request: pytest.FixtureRequest) -> None:
    """``moe.combine`` of a prefill gathers Y [T, k, D] block by block: the same bytes as gathering all of Y and one
    ``weighted_sum`` (the module contract's step 4 as written), while never holding the whole Y (3 MiB of a
    256-token prefill of the bench model, on top of the layer's expert outputs)."""
    request.getfixturevalue(threads)
    rng = np.random.default_rng(4)
    t, e, k, d = 600, 16, 4, 256  # 600: blocks and thread ranges that do not divide evenly
    routing = moe.route(rng.standard_normal((t, e), dtype=F32), k, True)
    outs = [rng.standard_normal((len(rows), d), dtype=F32) for _, rows in routing.work]
    y = np.empty((t, k, d), dtype=F32)
    for i, out in enumerate(outs):
        y.reshape(t * k, d)[moe.slot_positions(routing, i)] = out
    want = moe.weighted_sum(routing.weights, y).tobytes()
    del y
    tracemalloc.start()
    try:
        got = moe.combine(routing, outs, t, d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.tobytes() == want
    whole_y = t * k * d * 4
    assert peak < got.nbytes + whole_y // 2, f"combine held {peak} bytes: the whole Y is {whole_y}"


def test_thread_count_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_threads, "_decided", False)
    monkeypatch.setattr(prefill_threads, "_pool", None)
    monkeypatch.setenv("MESHD_PREFILL_THREADS", "1")
    assert prefill_threads.threads() == 1
    if BLAS is not None:
        monkeypatch.setattr(prefill_threads, "_decided", False)
        monkeypatch.setenv("MESHD_PREFILL_THREADS", "3")
        assert prefill_threads.threads() == 3


@needs_local_threads
def test_expert_ffn_many_on_the_threads_equals_one_thread(two_threads: prefill_threads._Pool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What an expert worker computes for a prefill request: items of 1 to 90 rows, spread over the threads,
    the same bits as on one thread."""
    rng = np.random.default_rng(2)
    w = [tuple(rng.standard_normal(s, dtype=F32) * F32(0.1) for s in ((48, 32), (48, 32), (32, 48))) for _ in range(6)]
    items = [(rng.standard_normal((n, 32), dtype=F32), *w[i % 6]) for i, n in enumerate((90, 1, 7, 33, 4, 60, 12))]
    got = moe.expert_ffn_many(items)
    monkeypatch.setattr(prefill_threads, "_pool", None)
    want = moe.expert_ffn_many(items)
    assert [g.tobytes() for g in got] == [x.tobytes() for x in want]
    assert [g.tobytes() for g in got] == [moe.expert_ffn(*it).tobytes() for it in items]


@needs_local_threads
def test_an_expert_workers_lone_prefill_item_gets_the_pieces_bits(two_threads: prefill_threads._Pool) -> None:
    """An expert worker asked for one prefill-sized item (or running without helpers) computes it on
    single-threaded BLAS, as the local pass's piece does: with BLAS's own threads, a model-sized expert's
    products differ in their last bits on CPUs where one and two OpenBLAS threads disagree (an AMD EPYC VM with
    the Haswell kernels; where they agree the test cannot tell)."""
    rng = np.random.default_rng(3)
    gate, up = (rng.standard_normal((384, 768), dtype=F32) * F32(0.05) for _ in range(2))
    down = rng.standard_normal((768, 384), dtype=F32) * F32(0.05)
    x = rng.standard_normal((64, 768), dtype=F32)
    want = moe.expert_ffn(x, gate, up, down).tobytes()
    assert moe.expert_ffn_many([(x, gate, up, down)])[0].tobytes() == want
    assert moe.expert_ffn_many([(x, gate, up, down), (x[:7], gate, up, down)])[0].tobytes() == want

_REPEAT = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from engine.model import Model
model = Model.load(Path(sys.argv[2]))
outs = []
for _ in range(4):
    cache = model.new_cache(4)
    outs.append(model.forward([3, 17, 40, 2, 88], cache).tobytes() + cache.k[1][:, :5].tobytes())
print(sum(o == outs[0] for o in outs))
"""


def test_repeated_prefills_in_a_fresh_process_give_the_same_bits(tmp_path: Path) -> None:
    """The same 5-token prefill four times in a new process (the pool made on first use): the same logits and
    cache each time. Before (session 9), the helpers' ``set_num_threads_local(1)`` set every thread's OpenBLAS
    count (scipy-openblas 0.3.31), so the caller's products ran on one or two BLAS threads depending on timing,
    and the first prefill or two differed from the rest: 5 of 5 processes; tests/test_experts_plan.py's first test
    in a process failed 19 of 20 runs. (From the robust helper's branch, kept with the prefill2 fix.)"""
    import subprocess
    import sys

    from experts_util import make_moe_checkpoint

    ck = make_moe_checkpoint(tmp_path / "m", family="qwen3_moe", layers=3, experts=8, hidden=512, inter=512,
                             top_k=4, vocab=96, seed=5, dense_layers=(0,))
    tests = str(Path(__file__).resolve().parent)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("MESHD_", "OPENBLAS_"))}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _REPEAT, tests, str(ck)], capture_output=True, text=True,
                             timeout=300, env=env, check=True).stdout.split()
        assert out[-1] == "4", out


def test_product_cuts_depend_on_the_shape_only() -> None:
    """The column pieces of a product (engine/products.py): a table of the rule, every range covered once."""
    from engine import products

    assert products.cuts(256, 768, 768) == [(0, 192), (192, 384), (384, 576), (576, 768)]  # q, o of the bench model
    assert products.cuts(64, 768, 384) == [(0, 384)]  # a typical expert item: one piece
    assert products.cuts(5, 64, 96) == [(0, 96)]
    assert products.cuts(256, 768, 16) == [(0, 16)]
    assert len(products.cuts(8, 768, 32000)) == 24  # the 1 Mi-weight tile bound (a packed weight's fp32 tile)
    for m, k, n in ((256, 768, 768), (300, 512, 1000), (5, 4096, 151936), (512, 2048, 64)):
        got = products.cuts(m, k, n)
        assert got[0][0] == 0 and got[-1][1] == n and all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert all((b - a) % 64 == 0 for a, b in got[:-1])


def test_few_row_products_run_the_other_way_round() -> None:
    """Products of 5-64 rows into at least 128 columns (a prefill's lightly routed experts) run as ``w @ x.T``
    (OpenBLAS's SkylakeX sgemm 1.2-2x faster that way, docs/engine-model.md), by the shape alone: their pieces
    are those products' bits, transposed into place; more rows or a narrow output (a router) stay ``x @ w.T``."""
    from engine import products

    assert products.transposed(5, 384) and products.transposed(64, 768) and products.transposed(64, 128)
    assert not products.transposed(65, 768) and not products.transposed(256, 768)
    assert not products.transposed(32, 16) and not products.transposed(64, 127)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((1000, 768), dtype=F32)
    for m in (5, 37, 64, 65, 200):
        x = rng.standard_normal((m, 768), dtype=F32)
        got = products.matmul(x, w)
        assert got.flags.c_contiguous and got.shape == (m, 1000)
        cuts = products.cuts(m, 768, 1000)
        want = np.concatenate([(w[a:b] @ x.T).T if m <= 64 else x @ w[a:b].T for a, b in cuts], axis=1)
        assert got.tobytes() == want.tobytes(), m
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-3)


@needs_local_threads
def test_products_in_pieces_are_the_same_bits_on_any_thread_count(two_threads: prefill_threads._Pool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill product's pieces on the threads give the bits of the same pieces one after the other on one
    thread, for fp32 and packed (bf16, Q8_0) weights; the pieces did run on the helper."""
    from engine import products, quant

    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, 768), dtype=F32)
    w32 = rng.standard_normal((1000, 768), dtype=F32) * F32(0.05)
    bf = quant.packed((w32.view(np.uint32) >> 16).astype(np.uint16), "BF16", w32.shape)
    assert len(products.cuts(200, 768, 1000)) > 1
    names: set[str] = set()
    real = products._piece

    def spy(*a: object) -> None:
        names.add(threading.current_thread().name)
        real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(products, "_piece", spy)
    got = quant.matmul_many([(x, w32), (x, bf), (x[:7], w32)])
    assert any(n.startswith("meshd-prefill-") for n in names), names
    monkeypatch.setattr(prefill_threads, "_pool", None)

    def piece(xx: np.ndarray, ww: np.ndarray) -> np.ndarray:  # a few rows' pieces run the other way round
        return (ww @ xx.T).T if products.transposed(xx.shape[0], 1000) else xx @ ww.T

    want = [np.concatenate([piece(xx, ww[a:b]) for a, b in products.cuts(xx.shape[0], 768, 1000)], axis=1)
            for xx, ww in ((x, w32), (x, bf.widen()), (x[:7], w32))]
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    assert quant.matmul(x, bf).tobytes() == want[1].tobytes()
