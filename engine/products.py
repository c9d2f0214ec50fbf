"""Products of more than ``KERNEL_MAX_ROWS`` activation rows (a prefill's, a batch's): ``x @ W.T`` cut into
column pieces by a rule of the shape alone, each piece one single-threaded BLAS product, the pieces spread over
the prefill threads (``engine.prefill_threads``).

Why: BLAS's own threads split a product their own way, and one and two OpenBLAS threads give other last bits for
most prefill-sized shapes on some CPUs (OpenBLAS's ``Haswell`` kernels: an AMD EPYC VM, and a Zen 4 VM with them
forced), so a 2-core node and an 8-core node in one pipeline or expert split computed other bits for the same
prompt. engine/prefill_threads.py holds OpenBLAS at one thread for the whole process; the parallelism comes from
here instead. Bits: ``cuts(m, k, n)`` depends on the product's shape only, and each piece is the same BLAS call
on the same arrays whichever thread runs it and however many threads there are, so every node computes the same
pieces, hence the same bits, whatever its core count, ``OPENBLAS_NUM_THREADS`` or ``MESHD_PREFILL_THREADS``.

A piece of a packed weight (``engine.quant.Packed``) dequantizes its rows of the weight and multiplies them: the
pieces also bound the transient fp32 tile (``MATMUL_PREFILL_TILE_WEIGHTS``) and spread the dequantization.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from . import prefill_threads
from .limits import (
    MATMUL_PREFILL_TILE_WEIGHTS,
    PRODUCT_PIECE_COLUMNS,
    PRODUCT_PIECE_MACS,
    PRODUCT_TRANSPOSED_MAX_ROWS,
    PRODUCT_TRANSPOSED_MIN_COLUMNS,
)

F32 = np.float32


class RowsWeight(Protocol):
    """A weight [N, K] that yields rows of itself as fp32 (``engine.quant.Packed``)."""

    @property
    def shape(self) -> tuple[int, int]: ...

    def rows(self, start: int, stop: int) -> np.ndarray: ...


def cuts(m: int, k: int, n: int) -> list[tuple[int, int]]:
    """Column ranges of an [m, k] @ [k, n] product, covering 0..n in order: about ``PRODUCT_PIECE_MACS``
    multiply-adds and at most ``MATMUL_PREFILL_TILE_WEIGHTS`` weights per piece, widths a multiple of
    ``PRODUCT_PIECE_COLUMNS`` (the last may be narrower). A function of the shape alone: the bits."""
    pieces = max(-(-m * k * n // PRODUCT_PIECE_MACS), -(-k * n // MATMUL_PREFILL_TILE_WEIGHTS), 1)
    step = -(-n // pieces)
    step = max(PRODUCT_PIECE_COLUMNS, -(-step // PRODUCT_PIECE_COLUMNS) * PRODUCT_PIECE_COLUMNS)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def transposed(m: int, n: int) -> bool:
    """Whether an [m, k] @ [k, n] product's pieces run as ``w @ x.T`` (few rows, wide output: OpenBLAS packs and
    blocks that way round much better, ``PRODUCT_TRANSPOSED_MAX_ROWS``). A function of the shape alone: the bits."""
    return m <= PRODUCT_TRANSPOSED_MAX_ROWS and n >= PRODUCT_TRANSPOSED_MIN_COLUMNS


def _piece(x: np.ndarray, w: np.ndarray | RowsWeight, a: int, b: int, out: np.ndarray) -> None:
    rows = w[a:b] if isinstance(w, np.ndarray) else w.rows(a, b)  # [b - a, K] fp32
    np.matmul(x, rows.T, out=out[:, a:b])


def _piece_t(x: np.ndarray, w: np.ndarray | RowsWeight, a: int, b: int, out: np.ndarray) -> None:
    rows = w[a:b] if isinstance(w, np.ndarray) else w.rows(a, b)  # [b - a, K] fp32
    out[:, a:b] = np.matmul(rows, x.T).T  # [b - a, m] computed, written transposed


def tasks(x: np.ndarray, w: np.ndarray | RowsWeight) -> tuple[np.ndarray, list[Callable[[], None]]]:
    """``x @ w.T``'s output [m, n] (filled when every task has run) and its pieces as tasks."""
    if x.dtype != F32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=F32)
    n, k = w.shape
    out = np.empty((x.shape[0], n), dtype=F32)
    piece = _piece_t if transposed(x.shape[0], n) else _piece
    return out, [functools.partial(piece, x, w, a, b, out) for a, b in cuts(x.shape[0], k, n)]


def matmul_many(pairs: Sequence[tuple[np.ndarray, np.ndarray | RowsWeight]]) -> list[np.ndarray]:
    """``[x @ w.T for x, w in pairs]`` in pieces (``cuts``), every pair's pieces in one ``prefill_threads.run``
    (q/k/v of a layer share the threads). Each result's bits depend on its own shape only."""
    outs: list[np.ndarray] = []
    todo: list[Callable[[], None]] = []
    for x, w in pairs:
        out, ts = tasks(x, w)
        outs.append(out)
        todo += ts
    prefill_threads.run(todo)
    return outs


def matmul(x: np.ndarray, w: np.ndarray | RowsWeight) -> np.ndarray:
    """``x @ w.T`` in pieces (``matmul_many`` of one pair)."""
    return matmul_many([(x, w)])[0]
