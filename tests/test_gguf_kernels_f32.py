"""fp32 decode products in the kernel threads' pool (engine.kernel_pool's F32 entry, engine.dense): the same bits
as the fp32 row kernel called alone, whatever the thread count, the chunking, the other products of the round
(fp32 and packed mixed) or the number of activation rows; a decode of an fp32 model whose bytes do not depend on
the kernel thread count. Skipped without numba."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from engine import dense, kernels, quant
from engine.gguf_export import quantize
from engine.limits import DENSE_KERNEL_MIN_WEIGHTS
from gguf_helpers import decode_hash

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE or dense._kernels() is None,
                                reason="numba (the fast extra) not installed")


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _alone(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The fp32 row kernel called directly, all rows, this thread."""
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    dense._kernels().f32_rows(x, w, out, 0, w.shape[0])  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("helpers", [1, 2])
def test_pool_rounds_give_the_row_kernels_bits(helpers: int) -> None:
    from engine import kernel_pool

    w, x = _rand((1203, 520), 1), _rand((3, 520), 2)  # 1203: a tail of 3 rows after the 8-row groups
    one = _alone(x, w)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(one, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    tbl, total, _, _ = kernel_pool.table([(x, "F32", w, one)])
    assert total > 2 and np.all(tbl[:, 9] % kernels.F32_ROW_ALIGN == 0)  # chunks of whole 8-row groups
    serial = np.full_like(one, np.nan)
    kernel_pool.run_serial([(x, "F32", w, serial)])
    assert serial.tobytes() == one.tobytes()
    pool = kernel_pool.Pool(helpers)
    out = np.full_like(one, np.nan)
    for i in range(200):  # many rounds, some after a pause (helpers asleep): none may lose or repeat work
        out[:] = np.nan
        pool.run([(x, "F32", w, out)])
        assert out.tobytes() == one.tobytes()
        if i % 50 == 49:
            time.sleep(0.002)


@pytest.mark.parametrize("rows", [1203, 1024, 96, 88])
def test_a_rounds_last_chunks_are_finer_and_change_no_bit(rows: int) -> None:
    """kernel_pool.table cuts the last product's last chunk's worth of rows into KERNEL_TAIL_SPLIT finer chunks
    (one more table row), each starting on a whole 8-row group: the pool's and the serial results keep the row
    kernel's bits, with and without the tail."""
    from engine import kernel_pool
    from engine.limits import KERNEL_TAIL_SPLIT

    w, w2, x = _rand((rows, 520), 12), _rand((rows, 520), 13), _rand((1, 520), 14)
    ref = (_alone(x, w), _alone(x, w2))
    outs = (np.full_like(ref[0], np.nan), np.full_like(ref[1], np.nan))
    prods = [(x, "F32", w, outs[0]), (x, "F32", w2, outs[1])]
    tbl, total, _, _ = kernel_pool.table(prods)
    plain, plain_total, _, _ = kernel_pool.table(prods, tail=False)
    step = int(plain[0, 9])
    if rows > step:  # the tail: rows of the last product, finer chunks, on 8-row groups, ending where it ends
        assert tbl.shape[0] == 3 and tbl[2, 9] == step // KERNEL_TAIL_SPLIT // 8 * 8 < step
        assert tbl[1, 11] == tbl[2, 10] and tbl[2, 11] == rows and tbl[2, 10] % 8 == 0
        assert total > plain_total
    else:
        assert tbl.shape == plain.shape and total == plain_total
    pool = kernel_pool.Pool(1)
    for t, n in ((tbl, total), (plain, plain_total)):
        for on_pool in (False, True):
            for o in outs:
                o[:] = np.nan
            if on_pool:
                pool.run_table(t, n, prods)
            else:
                kernel_pool.run_table_serial(t, n)
            assert outs[0].tobytes() == ref[0].tobytes() and outs[1].tobytes() == ref[1].tobytes()


def test_f32_rows_must_start_on_a_group() -> None:
    w, x = _rand((64, 32), 3), _rand((1, 32), 4)
    out = np.empty((1, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="multiples of 8"):
        kernels.run(x, "F32", w, out, 3, 64)


def test_a_mixed_round_gives_each_products_bits() -> None:
    """dense.matmul_many puts fp32 and packed kernel products in one round: each equals its product alone
    (dense.matmul), and a small fp32 weight (BLAS) and an fp16 one (tiles) among them keep their own path."""
    side = 512
    big = _rand((side, side), 5)
    assert big.size >= DENSE_KERNEL_MIN_WEIGHTS
    big.setflags(write=False)  # as a file mapping's view
    wide = _rand((2 * side, side), 6)
    q4 = quant.packed(quantize(_rand((side, side), 7), "Q4_K"), "Q4_K", (side, side))
    small = _rand((8, side), 8)
    f16 = quant.packed(_rand((side, side), 9).astype(np.float16).view(np.uint8).reshape(-1), "F16", (side, side))
    x1, x2 = _rand((1, side), 10), _rand((2, side), 11)
    pairs = [(x1, big), (x2, q4), (x1, small), (x2, wide), (x1, f16), (x2, big)]
    got = dense.matmul_many(pairs)
    for (x, w), g in zip(pairs, got):
        assert g.tobytes() == dense.matmul(x, w).tobytes()
    assert got[0].tobytes() == _alone(x1, big).tobytes()
    assert got[3].tobytes() == _alone(x2, wide).tobytes()
    assert got[5][1:].tobytes() == _alone(x2[1:], big).tobytes()  # a row's bits do not depend on the other rows
    assert got[2].tobytes() == (x1 @ small.T).tobytes()


def test_fp32_decode_bytes_do_not_depend_on_the_kernel_thread_count(tmp_path: Path) -> None:
    from experts_util import make_moe_checkpoint

    src = make_moe_checkpoint(tmp_path / "src", family="qwen3_moe", layers=2, experts=4, hidden=1024, inter=512,
                              top_k=2, vocab=256)
    one = decode_hash(src, True, MESHD_KERNEL_THREADS="1")
    assert decode_hash(src, True, MESHD_KERNEL_THREADS="2") == one
    assert decode_hash(src, True, MESHD_KERNEL_THREADS="3") == one


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_prefill_tiles_write_the_result_in_place(qtype: str) -> None:
    """More rows than the kernels take: dequantized tiles, each tile's GEMM writing its columns of the [T, N]
    result (no transpose afterwards); several tiles here (3 Mi weights), the same values as one product."""
    from engine.limits import KERNEL_MAX_ROWS, MATMUL_PREFILL_TILE_WEIGHTS

    n, k = 3072, 1024
    assert n * k > 2 * MATMUL_PREFILL_TILE_WEIGHTS
    p = quant.packed(quantize(_rand((n, k), 12), qtype), qtype, (n, k))
    x = _rand((KERNEL_MAX_ROWS + 3, k), 13)
    got = p.matmul(x)
    assert got.shape == (x.shape[0], n) and got.flags.c_contiguous
    ref = x.astype(np.float64) @ p.widen().astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    step = MATMUL_PREFILL_TILE_WEIGHTS // k  # the second tile's columns are its own GEMM's
    np.testing.assert_array_equal(got[:, step:2 * step], x @ p.rows(step, 2 * step).T)


def test_single_threaded_keeps_a_threads_products_off_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.single_threaded(): no pool round from this thread inside the block (the same bits), rounds
    again after it; fp32 and packed products alike."""
    from engine import kernel_pool

    w, x = _rand((1024, 1024), 14), _rand((1, 1024), 15)
    want = dense.matmul(x, w)
    if kernels._get_pool() is None:
        pytest.skip("one kernel thread here: there is no pool to stay off")
    rounds = []
    orig = kernel_pool.Pool.run_table
    monkeypatch.setattr(kernel_pool.Pool, "run_table", lambda self, *a: (rounds.append(1), orig(self, *a))[1])
    with kernels.single_threaded():
        with kernels.single_threaded():
            assert dense.matmul(x, w).tobytes() == want.tobytes()
        assert dense.matmul_many([(x, w), (x, w)])[1].tobytes() == want.tobytes()
    assert rounds == []
    assert dense.matmul(x, w).tobytes() == want.tobytes()
    assert rounds == [1]
