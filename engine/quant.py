"""Weights kept in their stored type (fp32, fp16, bf16, GGUF Q8_0/Q4_0/Q4_K/Q5_K/Q6_K) and the matmul
over them.

A :class:`Packed` matrix holds the stored bytes (a read-only view of the file mapping: nothing is
widened at load) and multiplies by dequantizing ``TILE_WEIGHTS`` weights at a time into a small fp32 tile
that stays in the CPU cache, then one BLAS product per tile. Every product in the engine goes through
:func:`matmul` (``x @ w.T`` for a plain fp32 array, the tiled product for a :class:`Packed`), so the
local forward pass, expert workers and pipeline stages run the same kernels and give the same bits.

Dequantization is bit for bit what ``gguf.quants.dequantize`` gives (same fp32 operations in the same
order; only the integer unpacking differs). Block layouts (``QK_K = 256``):

* Q8_0 (34 B / 32): f16 d, 32 x int8 q; ``d * q``.
* Q4_0 (18 B / 32): f16 d, 16 B of nibbles (low nibbles = elements 0-15, high = 16-31); ``d * (q - 8)``.
* Q4_K (144 B / 256): f16 d, f16 dmin, 12 B of 6-bit scales/mins, 128 B of nibbles;
  ``(d * sc) * q - dmin * m`` per 32-element sub-block.
* Q5_K (176 B / 256): as Q4_K plus 32 B of fifth bits before the nibbles.
* Q6_K (210 B / 256): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, f16 d;
  ``(d * sc) * (q - 32)`` per 16-element sub-block.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from . import products
from .limits import KERNEL_MAX_ROWS, MATMUL_TILE_WEIGHTS

F32 = np.float32
QK_K = 256

# type name -> (elements per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
QUANTIZED = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = tuple(BLOCKS)

# Types whose compiled decode kernel measured >= 2x the numpy tiles (engine.kernels; bench/kernels.py, figures in
# docs/kernels.md): all of them, 3-30x on one core.
KERNEL_TYPES = ("BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
# Types whose compiled dequantization (prefill tiles) is faster than numpy's (bench/kernels.py, 1 Mi-weight
# tile): Q4_0 4.1x, Q4_K 22x, Q5_K 22x, Q6_K 56x, Q8_0 1.7-2.7x (numpy's takes three passes over the tile: 0.54 ->
# 0.29 ms per tile, ~0.25 ms per Mi weights of every prefill). Other types never import the kernels (numba) to
# dequantize.
DEQUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")

_NIBBLE_SHIFT = np.array([0, 4], dtype=np.uint8)
_BIT_SHIFT = np.arange(8, dtype=np.uint8)
_PAIR_SHIFT = np.array([0, 2, 4, 6], dtype=np.uint8)


class QuantTypeError(ValueError):
    """A tensor's stored type is not one this engine computes with (the message names it)."""


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one stored row of ``k`` elements. Raises :class:`QuantTypeError`."""
    if qtype not in BLOCKS:
        raise QuantTypeError(f"type {qtype} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    bs, ts = BLOCKS[qtype]
    if k % bs:
        raise QuantTypeError(f"a row of {k} elements is not a whole number of {qtype} blocks ({bs})")
    return k // bs * ts


def _f16(raw: np.ndarray) -> np.ndarray:
    # [n, 2] uint8 -> [n, 1] fp32
    return np.ascontiguousarray(raw).view(np.float16).astype(F32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins: [n, 12] uint8 -> sc, m [n, 8] uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def dequantize_blocks(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """[n, bytes per block] uint8 -> [n, elements per block] fp32, bit for bit as gguf-py."""
    n = blocks.shape[0]
    if qtype == "Q8_0":
        d = _f16(blocks[:, :2])  # [n, 1]
        return d * blocks[:, 2:].view(np.int8).astype(F32)
    if qtype == "Q4_0":
        d = _f16(blocks[:, :2])
        q = (blocks[:, None, 2:] >> _NIBBLE_SHIFT[None, :, None]) & np.uint8(0x0F)  # [n, 2, 16]
        return d * (q.reshape(n, 32).astype(np.int8) - np.int8(8)).astype(F32)
    if qtype in ("Q4_K", "Q5_K"):
        d = _f16(blocks[:, 0:2])
        dmin = _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        dl = (d * sc.astype(F32))[:, :, None]  # [n, 8, 1]
        ml = (dmin * mn.astype(F32))[:, :, None]
        qs = blocks[:, -128:].reshape(n, 4, 1, 32)
        q = ((qs >> _NIBBLE_SHIFT[None, None, :, None]) & np.uint8(0x0F)).reshape(n, 8, 32)
        if qtype == "Q5_K":
            qh = blocks[:, 16:48].reshape(n, 1, 32)
            q = q | (((qh >> _BIT_SHIFT[None, :, None]) & np.uint8(1)) << np.uint8(4))
        return (dl * q.astype(F32) - ml).reshape(n, QK_K)
    if qtype == "Q6_K":
        ql = blocks[:, :128].reshape(n, 2, 1, 64)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(F32)  # [n, 16]
        d = _f16(blocks[:, 208:210])
        dl = (d * sc).reshape(n, 16, 1)
        lo = ((ql >> _NIBBLE_SHIFT[None, None, :, None]) & np.uint8(0x0F)).reshape(n, 8, 32)
        hi = ((qh >> _PAIR_SHIFT[None, None, :, None]) & np.uint8(3)).reshape(n, 8, 32)
        q = ((lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(F32)
        return (dl * q).reshape(n, QK_K)
    raise QuantTypeError(f"type {qtype} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")


def dequantize(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored data of any supported type -> fp32 array of ``shape`` (a copy, except fp32 storage)."""
    if qtype == "F32":
        return data.reshape(shape)
    if qtype == "F16":
        return data.view(np.float16).astype(F32).reshape(shape)
    if qtype == "BF16":
        out = np.empty(data.shape, dtype=np.uint32)
        np.left_shift(data.view(np.uint16), np.uint32(16), out=out)
        return out.view(F32).reshape(shape)
    bs, ts = BLOCKS[qtype] if qtype in BLOCKS else (0, 0)
    if not bs:
        dequantize_blocks(data[:0], qtype)  # raises naming the type
    blocks = np.ascontiguousarray(data).reshape(-1, ts)
    # the same bits, compiled (4-56x: prefill tiles)
    fast = _kernels().dequantize_blocks(blocks, qtype) if qtype in DEQUANT_TYPES else None
    return (dequantize_blocks(blocks, qtype) if fast is None else fast).reshape(shape)


_kmod = None


def _kernels():  # noqa: ANN202
    """``engine.kernels``, imported on first use (numba's import costs ~0.5 s and tens of MB, paid only by
    processes that multiply packed weights)."""
    global _kmod
    if _kmod is None:
        from . import kernels

        _kmod = kernels
    return _kmod


def _kernel_gemm(x: np.ndarray, qtype: str, data: np.ndarray) -> np.ndarray | None:
    return _kernels().gemm(x, qtype, data)


def _uses_kernel(x: np.ndarray, w: object) -> bool:
    return type(w) is Packed and x.shape[0] <= KERNEL_MAX_ROWS and w.qtype in KERNEL_TYPES


@dataclass(frozen=True, slots=True)
class Packed:
    """A 2-D weight [N, K] in its stored type. ``data``: [N, row_bytes] uint8 (quantized), [N, K] uint16
    (bf16) or float16 (f16); a view of the file mapping, never widened as a whole."""

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def T(self) -> _Transposed:  # noqa: N802 - lets ``x @ w.T`` keep working for a Packed w
        return _Transposed(self)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as fp32 [stop - start, K] (a new array)."""
        return dequantize(self.data[start:stop], self.qtype, (stop - start, self.shape[1]))

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (any order, repeats allowed) as fp32 [len(ids), K] (embedding lookup)."""
        return dequantize(self.data[ids], self.qtype, (len(ids), self.shape[1]))

    def widen(self) -> np.ndarray:
        """The whole matrix as fp32 (tests and tools only: the engine never widens a whole matrix)."""
        return self.rows(0, self.shape[0])

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: [T, K] fp32 -> [T, N] fp32, one cache-sized tile of rows at a time (or, for a few
        rows of a type with a compiled kernel, ``engine.kernels``: the choice depends only on T and the
        type, so every process computing the same rows makes the same choice)."""
        if _uses_kernel(x, self):
            out = _kernel_gemm(x, self.qtype, self.data)
            if out is not None:
                return out
        return self.tiled(x)

    def tiled(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T`` through the numpy tiles only (what a process without the compiled kernels computes)."""
        if x.shape[0] > KERNEL_MAX_ROWS:  # a prefill's: column pieces on the prefill threads (engine.products)
            return products.matmul(x, self)
        n, k = self.shape
        step = max(1, MATMUL_TILE_WEIGHTS // k)  # decode-sized products: small tiles that stay in L2
        if step >= n:
            return x @ self.rows(0, n).T
        out = np.empty((n, x.shape[0]), dtype=F32)  # [N, T]: each tile writes contiguous rows
        for a in range(0, n, step):
            b = min(n, a + step)
            np.matmul(self.rows(a, b), x.T, out=out[a:b])
        return out.T if x.shape[0] == 1 else np.ascontiguousarray(out.T)


@dataclass(frozen=True, slots=True)
class _Transposed:
    w: Packed

    __array_ufunc__ = None  # numpy defers ``x @ w.T`` to __rmatmul__

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return self.w.matmul(x)


Weight = np.ndarray | Packed


def matmul(x: np.ndarray, w: Weight) -> np.ndarray:
    """``x @ w.T`` for an fp32 array or a :class:`Packed` weight: [T, K] -> [T, N] fp32."""
    if isinstance(w, Packed):
        return w.matmul(x)
    if x.shape[0] > KERNEL_MAX_ROWS and isinstance(w, np.ndarray):
        return products.matmul(x, w)
    return x @ w.T


def warm_kernels(weights: Iterable[object]) -> None:
    """If any of ``weights`` is packed in a type with a compiled kernel, load the kernels now (numba's import
    and on-disk cache, or the one-time compile): the first request then does not stall on them, and their
    memory is the runtime's, paid before any activation. A model without such weights never imports numba."""
    if any(isinstance(w, Packed) and w.qtype in KERNEL_TYPES for w in weights):
        _kernels().warm()


def matmul_many(pairs: list[tuple[np.ndarray, Weight]]) -> list[np.ndarray]:
    """``[matmul(x, w) for x, w in pairs]``, bit for bit, with the compiled-kernel products among them run in
    one round of the kernel threads (``engine.kernels.gemm_many``): q/k/v of a layer, gate/up of an expert."""
    big = [i for i, (x, w) in enumerate(pairs) if x.shape[0] > KERNEL_MAX_ROWS and isinstance(w, (np.ndarray, Packed))]
    if big:  # a prefill's: every such product's column pieces in one run of the prefill threads
        outs: list[np.ndarray | None] = [None] * len(pairs)
        for i, y in zip(big, products.matmul_many([pairs[i] for i in big])):
            outs[i] = y
        rest = [i for i in range(len(pairs)) if outs[i] is None]
        for i, y in zip(rest, matmul_many([pairs[i] for i in rest]) if rest else []):
            outs[i] = y
        return outs  # type: ignore[return-value]
    prods = [(x, w.qtype, w.data) for x, w in pairs if _uses_kernel(x, w)]  # type: ignore[union-attr]
    if len(prods) < 2 or not _kernels().AVAILABLE:
        return [matmul(x, w) for x, w in pairs]
    done = _kernels().gemm_many(prods)
    if len(prods) == len(pairs):
        return done
    it = iter(done)
    return [next(it) if _uses_kernel(x, w) else matmul(x, w) for x, w in pairs]


def packed(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> Weight:
    """The engine's form of a stored 2-D (or stacked 3-D) weight: fp32 storage as the array itself (zero
    copy), anything else as :class:`Packed` (3-D: a list is not returned; callers slice per expert)."""
    if qtype == "F32":
        return data.reshape(shape)
    if len(shape) != 2:
        raise ValueError(f"packed weights are 2-D, got shape {list(shape)}")
    n, k = shape
    if qtype in ("BF16", "F16"):
        view = data.view(np.uint16 if qtype == "BF16" else np.float16).reshape(n, k)
    else:
        view = data.reshape(n, row_bytes(qtype, k))
    return Packed(qtype, (n, k), view)


def weight_nbytes(w: Weight) -> int:
    return int(w.nbytes)
