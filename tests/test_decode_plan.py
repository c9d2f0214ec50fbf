"""engine.decode_plan: the planned one-token decode step gives the general pass's bits (logits and KV cache) on
every weight form it plans differently (fp32 kernel rounds, packed kernel-pool tables, a dense MLP layer), and
models it does not cover keep the general pass; a prefill's routed experts run in bounded groups with the same
bits."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from engine import dense
from engine.decode_plan import DecodePlan
from engine.model import KVCache, Model

needs_numba = pytest.mark.skipif(dense._kernels() is None, reason="numba not installed (the [fast] extra)")


def _make(path: Path, dense_layers: tuple[int, ...]) -> Path:
    from experts_util import make_moe_checkpoint

    # big enough for the compiled step (q 512x512) and the fp32/packed kernels
    return make_moe_checkpoint(path, family="qwen3_moe", layers=3, experts=8, hidden=512, inter=512, top_k=4,
                               vocab=96, seed=5, dense_layers=dense_layers)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp("plan") / "src", (0,))  # layer 0 a dense MLP


@pytest.fixture(scope="module")
def sparse_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp("plan") / "sparse", ())  # what the GGUF export writes: every layer routed


def _decode(model: Model, steps: int) -> tuple[list[bytes], list[bytes]]:
    cache = model.new_cache(4)  # grows during the decode: the plan follows the cache's arrays
    out = [model.forward([3, 17, 40, 2, 88], cache).tobytes()]
    tok = 11
    for _ in range(steps):
        lg = model.forward(np.array([tok]), cache)
        out.append(lg.tobytes())
        tok = int(np.argmax(lg[-1]))
    kv = [a[:, : cache.length].tobytes() for a in (*cache.k, *cache.v)]
    return out, kv


def _both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Model, Model]:
    planned = Model.load(path)
    monkeypatch.setenv("MESHD_DECODE_PLAN", "0")
    general = Model.load(path)
    monkeypatch.delenv("MESHD_DECODE_PLAN")
    assert general._plan is False
    return planned, general


@needs_numba
@pytest.mark.parametrize("form", ["F32", "Q8_0", "Q4_K_M", "BF16"])
def test_plan_gives_the_general_pass_bits(form: str, checkpoint: Path, sparse_checkpoint: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoint
    if form != "F32":
        from engine.gguf_export import export_gguf

        path = tmp_path / f"m-{form}.gguf"
        export_gguf(sparse_checkpoint, path, form)
    planned, general = _both(path, monkeypatch)
    got_logits, got_kv = _decode(planned, 12)
    assert isinstance(planned._plan, DecodePlan)  # the decode steps above took the plan
    sparse = [lp for lp in planned._plan.layers if not lp.dense_mlp]
    assert not any(lp.general_experts for lp in sparse)  # experts on the fp32 rounds or prebuilt table rows
    if form == "F32":
        assert len(sparse) == 2 and planned._plan.layers[0].dense_mlp
        assert planned._plan.program is None  # (a dense MLP layer: the Python loop; test_program_... below)
    else:
        assert planned._plan.packed
        assert planned._plan.program is not None  # every step in engine.plan_kernels' compiled calls
    want_logits, want_kv = _decode(general, 12)
    assert general._plan is False
    assert got_logits == want_logits
    assert got_kv == want_kv


@needs_numba
def test_plan_is_not_taken_for_batches_executors_or_test_sized_models(checkpoint: Path, tmp_path: Path) -> None:
    from experts_util import make_moe_checkpoint

    model = Model.load(checkpoint)
    c1, c2 = model.new_cache(), model.new_cache()
    model.forward([1, 2], c1)
    assert model._plan is True  # a prefill does not make the plan
    calls = []

    def executor(layer: int, x: np.ndarray, work: list) -> list[np.ndarray]:
        calls.append(layer)
        return model.local_executor(layer, x, work)

    a = model.forward([4], c1, executor=executor)
    assert calls == [1, 2] and model._plan is True  # another executor: the general pass, every routed layer
    model.forward_batch([4, 5], [c1, c2])
    assert model._plan is True
    from engine.generate import forward_last

    b = forward_last(model, [4], _fresh_after(model, [1, 2]))  # what generate and the scheduler call
    assert isinstance(model._plan, DecodePlan) and b.tobytes() == a[-1].tobytes()
    small = Model.load(make_moe_checkpoint(tmp_path / "small", hidden=64, inter=32))
    small.forward([1], small.new_cache())
    assert small._plan is False  # test-sized: no compiled step, no plan


def _fresh_after(model: Model, prompt: list[int]) -> KVCache:
    cache = model.new_cache()
    model.forward(prompt, cache)
    return cache


def test_prefill_experts_in_groups_give_the_same_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without prefill threads the local executor runs a prefill's work list in groups of EXPERT_GROUP_ROWS rows
    (bounded activations); every item is computed on the same rows as in one call, so the logits are the same
    bits. (With them, each item is one piece: tests/test_prefill_threads.py.)"""
    from experts_util import make_moe_checkpoint

    from engine import moe, prefill_threads

    monkeypatch.setattr(prefill_threads, "_pool", None)
    monkeypatch.setattr(prefill_threads, "_decided", True)

    model = Model.load(make_moe_checkpoint(tmp_path / "m", layers=2, experts=8, top_k=3, vocab=64))
    prompt = list(np.random.default_rng(0).integers(0, 64, 40))
    calls: list[int] = []
    many = moe.expert_ffn_many

    def counted(items: list) -> list:
        calls.append(len(items))
        return many(items)

    monkeypatch.setattr(moe, "expert_ffn_many", counted)
    monkeypatch.setattr(moe, "EXPERT_GROUP_ROWS", 1 << 30)
    whole = model.forward(prompt, model.new_cache())
    assert calls == [8, 8]  # one call per layer
    calls.clear()
    monkeypatch.setattr(moe, "EXPERT_GROUP_ROWS", 20)
    grouped = model.forward(prompt, model.new_cache())
    assert len(calls) > 2 and sum(calls) == 16
    assert grouped.tobytes() == whole.tobytes()


@needs_numba
@pytest.mark.parametrize("form", ["F32", "Q4_K_M"])
def test_program_gives_the_loop_and_general_bits(form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.plan_kernels' compiled layer calls give the Python loop's and the general pass's bits (logits and
    cache), on the kernel threads and inside ``single_threaded()``, with the kernel threads' helper asleep
    before a step (woken by the step), and across a cache that grows (moves) during the decode. (Hidden 576:
    k [288, 576] is on the fp32 kernel, so every F32 round is a kernel-pool table; the head [96, 576] is not,
    so the program ends before it.)"""
    import time

    from experts_util import make_moe_checkpoint

    from engine import kernels

    path = make_moe_checkpoint(tmp_path / "src", family="qwen3_moe", layers=3, experts=8, hidden=576, inter=512,
                               top_k=4, vocab=96, seed=6)
    if form != "F32":
        from engine.gguf_export import export_gguf

        export_gguf(path, tmp_path / f"m-{form}.gguf", form)
        path = tmp_path / f"m-{form}.gguf"
    import engine.decode_plan as dp

    loop = Model.load(path)
    planned, general = _both(path, monkeypatch)
    runs = []
    for m in (planned, loop, general):
        monkeypatch.setattr(dp, "MESHD_PLAN_PARTS", "0" if m is loop else "1")  # (read when the plan is made)
        cache = m.new_cache(4)
        out = [m.forward([3, 17, 40, 2, 88], cache).tobytes()]
        tok = 11
        for n in range(10):
            if n == 4:
                time.sleep(0.01)  # the helper spins 200 us, then sleeps: the next step's round wakes it
            with kernels.single_threaded() if n in (2, 7) else contextlib.nullcontext():
                lg = m.forward(np.array([tok]), cache)
            out.append(lg.tobytes())
            tok = int(np.argmax(lg[-1]))
        runs.append((out, [a[:, : cache.length].tobytes() for a in (*cache.k, *cache.v)]))
    assert isinstance(planned._plan, DecodePlan) and planned._plan.program is not None
    assert isinstance(loop._plan, DecodePlan) and loop._plan.program is None
    assert general._plan is False
    assert runs[0] == runs[1]
    assert runs[0] == runs[2]
    pool = kernels._get_pool()
    if pool is not None:  # the compiled calls kept the kernel threads' round count
        from engine.kernel_pool import GEN_SHIFT

        assert int(pool._ctl[0]) >> GEN_SHIFT == pool._gen


@needs_numba
@pytest.mark.parametrize("form", ["F32", "Q4_K_M"])
def test_layer_range_plan_gives_span_steps_bits(form: str, checkpoint: Path, sparse_checkpoint: Path,
                                                tmp_path: Path) -> None:
    """The plan's layer-range form (a pipeline stage's one-token step, the serving node's own range): hidden
    rows through layers first..last, ending in the hidden state or (the part with the head) the logits, with
    the bits of ``span_steps`` (+ ``logits``) and the same KV cache; also inside ``single_threaded()``."""
    from engine import kernels
    from engine.decode_plan import forward_span
    from engine.moe import drive

    path = checkpoint
    if form != "F32":
        from engine.gguf_export import export_gguf

        path = tmp_path / f"m-{form}.gguf"
        export_gguf(sparse_checkpoint, path, form)
    full = Model.load(path)
    rng = np.random.default_rng(3)
    d = full.config.hidden_size
    rows = [rng.standard_normal((1, d)).astype(np.float32) for _ in range(6)]
    prompt = rng.standard_normal((4, d)).astype(np.float32)
    for first, last, own in [(0, 0, False), (1, 2, False), (0, 2, False), (1, 2, True)]:  # own: a stage's
        planned, general = ((Model.load(path, layers=(first, last)) if own else full.part(first, last))
                            for _ in range(2))
        general._plan = False
        head = planned.lm_head is not None
        caches = [m.new_cache(4) for m in (planned, general)]
        for m, c in zip((planned, general), caches):  # a prefill chunk first (general pass on both)
            c.reserve(4)
            drive(m.span_steps(prompt, c, 0), m.local_executor, m.warm)
            c.length = 4
        for n, x in enumerate(rows):
            with kernels.single_threaded() if n % 2 else contextlib.nullcontext():
                got = forward_span(planned, x, caches[0], None, head)
            assert got is not None and isinstance(planned._plan, DecodePlan)
            assert (planned._plan.program is not None) == (form != "F32")  # (F32 here: k is not on the kernel)
            c = caches[1]
            c.reserve(c.length + 1)
            want = drive(general.span_steps(x, c, c.length), general.local_executor, general.warm)
            if head:
                want = general.logits(want)
            for cc in caches:
                cc.length += 1
            assert got.tobytes() == want.tobytes(), (first, last, own, n)
        got_kv, want_kv = ([a[:, : cc.length].tobytes() for a in (*cc.k, *cc.v)] for cc in caches)
        assert got_kv == want_kv
    assert forward_span(planned, rows[0], caches[0], executor=lambda *a: None) is None  # another executor


@needs_numba
def test_program_round_with_the_helper_asleep_runs_on_the_caller_and_says_so() -> None:
    """engine.plan_kernels' rounds cannot wake a sleeping helper (that needs Python): the caller computes every
    chunk itself and the round number comes back as ``~number``, so that ``DecodePlan._parts`` wakes it."""
    import time

    from engine import kernel_pool as kp
    from engine import plan_kernels as pk

    pool = kp.Pool(1)
    deadline = time.monotonic() + 5
    while not pool._ctl[5] and time.monotonic() < deadline:  # the helper spins 200 us, then sleeps
        time.sleep(0.005)
    assert pool._ctl[5] == 1
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    out = np.zeros((1, 512), dtype=np.float32)
    tbl, total, _keep, _ = kp.table([(x, "F32", w, out)])
    with pool._round:
        got = pk._run(pool._addr, kp._HALF_ADDR, tbl.ctypes.data, tbl.shape[0], total, 1, pool._gen, 0)
        assert got == ~(pool._gen + 1)  # asleep: said so, as the next round's number
        pool._gen = ~got
        pool.wake()
    want = np.zeros_like(out)
    kp.run_serial([(x, "F32", w, want)])
    assert out.tobytes() == want.tobytes()
