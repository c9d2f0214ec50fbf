"""Compiled decode kernels (optional: ``pip install meshd[fast]`` brings numba).

For a product with few rows of activations (decode: ``T <= KERNEL_MAX_ROWS``) numpy must widen every
weight into an fp32 tile and then read the tile again; these kernels read each stored block once and
multiply it into the activations directly. Every kernel has the same shape, which LLVM turns into
AVX2/AVX-512 code: per block, ``acc[i] += w(i) * x[i]`` over a fixed 32 lanes (``w(i)``: the stored
weight dequantized exactly as ``engine.quant.dequantize_blocks`` does, ``d * q`` or ``(d * sc) * q - dmin * m``),
and one ``acc.sum()`` per output. Summation order differs from the numpy tiles (BLAS), so results differ
by rounding (~1e-7 relative), and are the same on every machine that runs the same kernel: workers and
stages use this module too, so distributed stays byte-identical to local when both ends have (or both lack)
numba. ``MESHD_KERNELS=numpy`` turns the kernels off.

Each kernel computes output rows ``r0:r1`` only, so a product is split into row chunks that the calling
thread and ``threads() - 1`` helper threads claim one at a time (:func:`run_products`, engine/kernel_pool.py:
the claiming and waiting happen in compiled code with the GIL released). Every row is computed the same way
whichever thread computes it, so the thread count never changes a bit. Claiming rather than assigning keeps a
loaded machine safe: a helper that has not been scheduled yet simply gets nothing, and the caller never waits
for work it could do itself. IEEE halves (block scales) are read through a 65536-entry
table (``HALF``, 256 KiB: stays in L2), exact for every pattern. On AVX-512 CPUs the kernel threads run
engine/kernels_lut.py's Q4_K/Q5_K/Q6_K kernels instead of ``_q45_k``/``_q6_k``: the same bits, fewer operations,
and engine/kernels_q8.py's Q8_0 kernel instead of ``_q8_0`` (the same bits, a block's weights shared by the
activation rows) (on AVX2 CPUs without AVX-512, engine/kernels_avx2.py's Q4_K/Q6_K/Q8_0 ones: the same bits, no
spilled lanes);
with AVX-512 VNNI (and ``MESHD_KERNELS_INT`` not 0) Q4_K and Q6_K take engine/kernels_int.py's integer dot products
instead (other bits: those of its numpy reference, on every CPU that runs them).
"""

from __future__ import annotations

import os
import threading

import numpy as np

from .limits import KERNEL_MAX_THREADS, KERNEL_POOL_MIN_WEIGHTS
from .quant import DEQUANT_TYPES  # quant imports this module only on first use: no cycle at import

try:  # the optional extra
    if os.environ.get("MESHD_KERNELS", "").lower() == "numpy":
        raise ImportError("disabled by MESHD_KERNELS=numpy")
    import numba
    from llvmlite import ir
    from numba import njit
    from numba.core import cgutils, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised when numba is absent
    numba = None

AVAILABLE = numba is not None
F32 = np.float32
TYPES = ("BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
# plus fp32 weights (engine.dense's decode products: [N, K] float32 arrays, not Packed), computed by
# engine.dense_kernels.f32_rows (eight weight rows per pass: ~30-35 GB/s on one core, where one row per pass streamed
# 17-23) in the same pool and rounds; its chunks start on multiples of 8 rows (F32_ROW_ALIGN)
ROW_TYPES = (*TYPES, "F32")
F32_ROW_ALIGN = 8
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# every IEEE half bit pattern (little-endian uint16) -> its float32 value
HALF = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)

if AVAILABLE:
    # fastmath without reassociation: LLVM may fuse a multiply and an add (contract) but keeps every sum in the
    # order written, so the bits do not depend on how a caller's compilation regroups them (and it measured
    # faster: 14 -> 17.5 G weights/s for Q4_K)
    FASTMATH = {"nnan", "ninf", "nsz", "contract", "arcp", "afn"}
    _opts = dict(cache=True, fastmath=FASTMATH, nogil=True, boundscheck=False, error_model="numpy")

    @intrinsic
    def _as_f32(typingctx, v):  # noqa: ANN001, ANN202 - numba intrinsic: uint32 bits -> float32, no arithmetic
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @njit(inline="always")
    def _h(tab: np.ndarray, row: np.ndarray, o: int) -> np.float32:
        return tab[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]

    @intrinsic
    def _bits(typingctx, v, sh, mask):  # noqa: ANN001, ANN202 - numba intrinsic
        """``(v >> sh) & mask`` of a byte, in 8 bits: numba would widen to int64, and LLVM then converts
        64-bit lanes to float (half the lanes per instruction)."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            i8 = ir.IntType(8)
            shift = builder.trunc(args[1], i8) if args[1].type != i8 else args[1]
            m = builder.trunc(args[2], i8) if args[2].type != i8 else args[2]
            return builder.and_(builder.lshr(args[0], shift), m)

        return types.uint8(types.uint8, sh, mask), codegen

    @intrinsic
    def _stack_f32(typingctx, n):  # noqa: ANN001, ANN202 - numba intrinsic: a float32[n] on the stack (n literal)
        """Accumulators on the stack rather than the heap: LLVM knows they alias nothing and keeps them in
        vector registers for a whole row (a heap array is loaded and stored around every multiply-add)."""
        if not isinstance(n, types.IntegerLiteral):
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=n.literal_value)

        return types.CPointer(types.float32)(n), codegen

    def ptr_intrinsic(nbty):  # noqa: ANN001, ANN202
        """An intrinsic turning an int64 address into a ``nbty*`` (engine/kernel_pool.py, engine/kernels_int.py)."""
        @intrinsic
        def ptr(typingctx, addr):  # noqa: ANN001, ANN202
            def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
                return builder.inttoptr(args[0], context.get_value_type(types.CPointer(nbty)))

            return types.CPointer(nbty)(types.int64), codegen

        return ptr

    # Every kernel: per output row and activation row, lanes acc[0:L] (L = 64 or 128, four or eight AVX-512
    # registers) each accumulate the products of one fixed element position of the row's blocks, in block
    # order; then one sum of the L lanes, in lane order. The same loop body runs for every activation row, so
    # a row's result depends neither on the other rows in the call nor on which thread computes it.

    @njit(inline="always")
    def _zero(acc: np.ndarray, n: int) -> None:
        for i in range(n):
            acc[i] = 0

    @intrinsic
    def _stack_u32(typingctx, n):  # noqa: ANN001, ANN202 - numba intrinsic: a uint32[n] on the stack
        if not isinstance(n, types.IntegerLiteral):
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return cgutils.alloca_once(builder, context.get_value_type(types.uint32), size=n.literal_value)

        return types.CPointer(types.uint32)(n), codegen

    @njit(inline="always")
    def _total(acc: np.ndarray, n: int) -> np.float32:
        # pairwise, as whole-register adds: lanes [0, n/2) += [n/2, n), halving down to 4 lanes
        h = n // 2
        while h >= 4:
            for i in range(h):
                acc[i] += acc[h + i]
            h //= 2
        return (acc[0] + acc[2]) + (acc[1] + acc[3])

    @njit(**_opts)
    def _q8_0(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
        # pairs of 32-blocks: the even one into lanes 0-31, the odd one into 32-63 (a last odd block: 0-31)
        t, k = x.shape
        nb = k // 32
        acc = numba.carray(_stack_f32(64), 64)
        for r in range(r0, r1):
            row = w[r]
            for s in range(t):
                _zero(acc, 64)
                for p in range(nb // 2):
                    o = p * 68
                    xb = p * 64
                    d0 = _h(tab, row, o)
                    d1 = _h(tab, row, o + 34)
                    for i in range(32):
                        acc[i] += (d0 * np.float32(np.int8(row[o + 2 + i]))) * x[s, xb + i]
                        acc[32 + i] += (d1 * np.float32(np.int8(row[o + 36 + i]))) * x[s, xb + 32 + i]
                if nb & 1:
                    o = (nb - 1) * 34
                    d0 = _h(tab, row, o)
                    for i in range(32):
                        acc[i] += (d0 * np.float32(np.int8(row[o + 2 + i]))) * x[s, (nb - 1) * 32 + i]
                out[s, r] = _total(acc, 64)

    @njit(**_opts)
    def _q4_0(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
        t, k = x.shape
        nb = k // 32
        acc = numba.carray(_stack_f32(64), 64)
        for r in range(r0, r1):
            row = w[r]
            for s in range(t):
                _zero(acc, 64)
                for p in range(nb // 2):
                    o = p * 36
                    xb = p * 64
                    d0 = _h(tab, row, o)
                    d1 = _h(tab, row, o + 18)
                    for i in range(16):
                        v0 = row[o + 2 + i]
                        v1 = row[o + 20 + i]
                        acc[i] += (d0 * (np.float32(_bits(v0, 0, 15)) - np.float32(8))) * x[s, xb + i]
                        acc[16 + i] += (d0 * (np.float32(_bits(v0, 4, 15)) - np.float32(8))) * x[s, xb + 16 + i]
                        acc[32 + i] += (d1 * (np.float32(_bits(v1, 0, 15)) - np.float32(8))) * x[s, xb + 32 + i]
                        acc[48 + i] += (d1 * (np.float32(_bits(v1, 4, 15)) - np.float32(8))) * x[s, xb + 48 + i]
                if nb & 1:
                    o = (nb - 1) * 18
                    xb = (nb - 1) * 32
                    d0 = _h(tab, row, o)
                    for i in range(16):
                        v0 = row[o + 2 + i]
                        acc[i] += (d0 * (np.float32(_bits(v0, 0, 15)) - np.float32(8))) * x[s, xb + i]
                        acc[16 + i] += (d0 * (np.float32(_bits(v0, 4, 15)) - np.float32(8))) * x[s, xb + 16 + i]
                out[s, r] = _total(acc, 64)

    @njit(inline="always")
    def _k_scales8(row: np.ndarray, o: int, c: int) -> tuple[np.int32, np.int32, np.int32, np.int32]:
        # 6-bit scales and mins of sub-blocks 2c and 2c+1 from the 12 bytes at row[o:o+12] (c a constant
        # after unrolling: no branch in the loop)
        if c < 2:
            j = 2 * c
            return (np.int32(row[o + j] & 63), np.int32(row[o + 4 + j] & 63),
                    np.int32(row[o + 1 + j] & 63), np.int32(row[o + 5 + j] & 63))
        j = 2 * c - 4
        a0 = row[o + 8 + j]
        a1 = row[o + 9 + j]
        return (np.int32((a0 & 15) | ((row[o + j] >> 6) << 4)), np.int32((a0 >> 4) | ((row[o + 4 + j] >> 6) << 4)),
                np.int32((a1 & 15) | ((row[o + 1 + j] >> 6) << 4)), np.int32((a1 >> 4) | ((row[o + 5 + j] >> 6) << 4)))

    @njit(inline="always")
    def _u32(row: np.ndarray, o: int) -> np.uint32:
        return (np.uint32(row[o]) | (np.uint32(row[o + 1]) << np.uint32(8)) | (np.uint32(row[o + 2]) << np.uint32(16))
                | (np.uint32(row[o + 3]) << np.uint32(24)))

    @njit(inline="always")
    def _k_scale_words(row: np.ndarray, o: int, words: np.ndarray) -> None:
        # the 8 6-bit scales then the 8 mins of a K-quant block, as the bytes of words[0:4], from the 12 bytes
        # at row[o:o+12] four at a time (llama.cpp's kmask unpacking; the same integers as _k_scales8)
        u0, u1, u2 = _u32(row, o), _u32(row, o + 4), _u32(row, o + 8)
        m1, m2, m3 = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
        words[0] = u0 & m1
        words[1] = (u2 & m2) | (((u0 >> np.uint32(6)) & m3) << np.uint32(4))
        words[2] = u1 & m1
        words[3] = ((u2 >> np.uint32(4)) & m2) | (((u1 >> np.uint32(6)) & m3) << np.uint32(4))

    @njit(**_opts)
    def _q45_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int,
               five: bool) -> None:
        # chunk c (32 bytes of nibbles) holds sub-blocks 2c (low nibbles: lanes 0-31) and 2c+1 (high nibbles:
        # lanes 32-63); Q5_K's fifth bit of element l of sub-block j is bit j of qh[l]
        t, k = x.shape
        bsz = 176 if five else 144
        qs0 = 48 if five else 16
        acc = numba.carray(_stack_f32(64), 64)
        words = numba.carray(_stack_u32(4), 4)
        scales = words.view(np.uint8)  # 8 scales, then 8 mins
        f = numba.carray(_stack_f32(16), 16)  # d * scale, then dmin * min
        for r in range(r0, r1):
            row = w[r]
            for s in range(t):
                _zero(acc, 64)
                for b in range(k // 256):
                    o = b * bsz
                    _k_scale_words(row, o + 4, words)
                    d = _h(tab, row, o)
                    dmin = _h(tab, row, o + 2)
                    for j in range(8):
                        f[j] = d * np.float32(scales[j])
                    for j in range(8):
                        f[8 + j] = dmin * np.float32(scales[8 + j])
                    for c in range(4):
                        dl0, ml0 = f[2 * c], f[8 + 2 * c]
                        dl1, ml1 = f[2 * c + 1], f[9 + 2 * c]
                        q0 = o + qs0 + c * 32
                        xb = b * 256 + c * 64
                        if five:
                            for i in range(32):
                                v = row[q0 + i]
                                h = row[o + 16 + i]
                                lo = np.float32(_bits(v, 0, 15)) + np.float32(16) * np.float32(_bits(h, 2 * c, 1))
                                hi = np.float32(_bits(v, 4, 15)) + np.float32(16) * np.float32(_bits(h, 2 * c + 1, 1))
                                acc[i] += (dl0 * lo - ml0) * x[s, xb + i]
                                acc[32 + i] += (dl1 * hi - ml1) * x[s, xb + 32 + i]
                        else:
                            for i in range(32):
                                v = row[q0 + i]
                                acc[i] += (dl0 * np.float32(_bits(v, 0, 15)) - ml0) * x[s, xb + i]
                                acc[32 + i] += (dl1 * np.float32(_bits(v, 4, 15)) - ml1) * x[s, xb + 32 + i]
                out[s, r] = _total(acc, 64)

    @njit(**_opts)
    def _q6_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
        # element half*128 + p*32 + l (p = 0..3): low nibble of ql[half*64 + (p%2)*32 + l] (high nibble for
        # p >= 2), two high bits (qh[half*32 + l] >> 2p) & 3, scale of its 16-element sub-block
        # half*8 + 2p + l//16; value (d * scale) * (q - 32). One pass over l reads each byte once for all four p,
        # into lanes p*32 + l.
        t, k = x.shape
        acc = numba.carray(_stack_f32(128), 128)
        for r in range(r0, r1):
            row = w[r]
            for s in range(t):
                _zero(acc, 128)
                for b in range(k // 256):
                    o = b * 210
                    d = _h(tab, row, o + 208)
                    for half in range(2):
                        ql0 = o + half * 64
                        qh0 = o + 128 + half * 32
                        sc0 = o + 192 + half * 8
                        xb = b * 256 + half * 128
                        for hh in range(2):
                            d0 = d * np.float32(np.int8(row[sc0 + hh]))
                            d1 = d * np.float32(np.int8(row[sc0 + 2 + hh]))
                            d2 = d * np.float32(np.int8(row[sc0 + 4 + hh]))
                            d3 = d * np.float32(np.int8(row[sc0 + 6 + hh]))
                            for i in range(16):
                                l = hh * 16 + i  # noqa: E741
                                v0 = row[ql0 + l]
                                v1 = row[ql0 + 32 + l]
                                h = row[qh0 + l]
                                q0 = (np.float32(_bits(v0, 0, 15)) + np.float32(16) * np.float32(_bits(h, 0, 3))
                                      - np.float32(32))
                                q1 = (np.float32(_bits(v1, 0, 15)) + np.float32(16) * np.float32(_bits(h, 2, 3))
                                      - np.float32(32))
                                q2 = (np.float32(_bits(v0, 4, 15)) + np.float32(16) * np.float32(_bits(h, 4, 3))
                                      - np.float32(32))
                                q3 = (np.float32(_bits(v1, 4, 15)) + np.float32(16) * np.float32(_bits(h, 6, 3))
                                      - np.float32(32))
                                acc[l] += (d0 * q0) * x[s, xb + l]
                                acc[32 + l] += (d1 * q1) * x[s, xb + 32 + l]
                                acc[64 + l] += (d2 * q2) * x[s, xb + 64 + l]
                                acc[96 + l] += (d3 * q3) * x[s, xb + 96 + l]
                out[s, r] = _total(acc, 128)

    @njit(**_opts)
    def _bf16(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
        # 64 elements at a time into lanes 0-63, the last k % 64 into lanes 0.. (k is even: whole pairs)
        t, k = x.shape
        acc = numba.carray(_stack_f32(64), 64)
        for r in range(r0, r1):
            row = w[r]
            for s in range(t):
                _zero(acc, 64)
                for b in range(k // 64):
                    xb = b * 64
                    for i in range(64):
                        acc[i] += _as_f32(np.uint32(row[xb + i]) << np.uint32(16)) * x[s, xb + i]
                xb = k // 64 * 64
                for i in range(k - xb):
                    acc[i] += _as_f32(np.uint32(row[xb + i]) << np.uint32(16)) * x[s, xb + i]
                out[s, r] = _total(acc, 64)

    # Dequantization into fp32 tiles (prefill: the numpy tiles' dequantize step), with exactly the fp32
    # operations of engine.quant.dequantize_blocks in the same order and no fastmath (no fused multiply-add),
    # so the values are bit for bit gguf.quants.dequantize's.
    _dq_opts = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")

    @njit(**_dq_opts)
    def _dq_q8_0(blocks: np.ndarray, out: np.ndarray, tab: np.ndarray) -> None:
        for n in range(blocks.shape[0]):
            row = blocks[n]
            d = _h(tab, row, 0)
            for i in range(32):
                out[n, i] = d * np.float32(np.int8(row[2 + i]))

    @njit(**_dq_opts)
    def _dq_q4_0(blocks: np.ndarray, out: np.ndarray, tab: np.ndarray) -> None:
        for n in range(blocks.shape[0]):
            row = blocks[n]
            d = _h(tab, row, 0)
            for i in range(16):
                v = row[2 + i]
                out[n, i] = d * (np.float32(_bits(v, 0, 15)) - np.float32(8))
                out[n, 16 + i] = d * (np.float32(_bits(v, 4, 15)) - np.float32(8))

    @njit(**_dq_opts)
    def _dq_q45_k(blocks: np.ndarray, out: np.ndarray, tab: np.ndarray, five: bool) -> None:
        qs0 = 48 if five else 16
        for n in range(blocks.shape[0]):
            row = blocks[n]
            d = _h(tab, row, 0)
            dmin = _h(tab, row, 2)
            for c in range(4):
                sc0, mn0, sc1, mn1 = _k_scales8(row, 4, c)
                dl0, ml0 = d * np.float32(sc0), dmin * np.float32(mn0)
                dl1, ml1 = d * np.float32(sc1), dmin * np.float32(mn1)
                for i in range(32):
                    v = row[qs0 + c * 32 + i]
                    lo = np.float32(_bits(v, 0, 15))
                    hi = np.float32(_bits(v, 4, 15))
                    if five:
                        h = row[16 + i]
                        lo = lo + np.float32(16) * np.float32(_bits(h, 2 * c, 1))
                        hi = hi + np.float32(16) * np.float32(_bits(h, 2 * c + 1, 1))
                    out[n, c * 64 + i] = dl0 * lo - ml0
                    out[n, c * 64 + 32 + i] = dl1 * hi - ml1

    @njit(**_dq_opts)
    def _dq_q6_k(blocks: np.ndarray, out: np.ndarray, tab: np.ndarray) -> None:
        for n in range(blocks.shape[0]):
            row = blocks[n]
            d = _h(tab, row, 208)
            for g in range(8):
                half = g // 4
                lo0 = half * 64 + (g % 2) * 32
                lsh = 4 * ((g % 4) // 2)
                hi0 = 128 + half * 32
                hsh = 2 * (g % 4)
                dla = d * np.float32(np.int8(row[192 + 2 * g]))
                dlb = d * np.float32(np.int8(row[193 + 2 * g]))
                for i in range(32):
                    q = (np.float32(_bits(row[lo0 + i], lsh, 15))
                         + np.float32(16) * np.float32(_bits(row[hi0 + i], hsh, 3)) - np.float32(32))
                    out[n, g * 32 + i] = (dla if i < 16 else dlb) * q

    _KERNELS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q6_K": _q6_k, "BF16": _bf16}


def threads() -> int:
    """Threads that compute kernel products: ``MESHD_KERNEL_THREADS``, else the CPUs this process may use (at
    most ``KERNEL_MAX_THREADS``: decode-sized products are too small to feed more)."""
    env = os.environ.get("MESHD_KERNEL_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return min(int(env), KERNEL_MAX_THREADS)
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, KERNEL_MAX_THREADS))


_pool = None  # engine.kernel_pool.Pool, made on first use
_pool_lock = threading.Lock()


_single = False  # threads() said 1: no pool, and no need to ask again


def _forget_pool() -> None:  # a forked child has none of the parent's helper threads (and maybe a held lock)
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _get_pool():  # noqa: ANN202 - engine.kernel_pool.Pool | None
    global _pool, _single
    if _pool is None and not _single:
        n = threads()
        with _pool_lock:
            if n < 2:
                _single = True
            elif _pool is None:
                from .kernel_pool import Pool

                _pool = Pool(n - 1)
    return _pool


_local = threading.local()  # .serial: single_threaded() depth of this thread


class single_threaded:  # noqa: N801 - used as ``with kernels.single_threaded():``
    """Within this block, this thread computes its kernel products alone (no pool round): for a process that
    runs several forward passes at once (a pipeline stage with sequences in flight) and would rather not
    hand chunks to a helper thread the other work needs. The bits are the same (a row's bits never depend on
    the threads); nestable; other threads are not affected."""

    def __enter__(self) -> None:
        _local.serial = getattr(_local, "serial", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.serial -= 1


def is_single_threaded() -> bool:
    """Whether this thread is inside :class:`single_threaded` (its products then skip the pool)."""
    return bool(getattr(_local, "serial", 0))


def run_products(products: list[tuple[np.ndarray, str, np.ndarray, np.ndarray]]) -> None:
    """Compute each (x, qtype, data, out) product into its ``out`` (x and out C-contiguous fp32): one round of
    the kernel threads (engine.kernel_pool), each product cut into row chunks, when the round is big enough to
    share (and the thread is not in :class:`single_threaded`); else every chunk on the caller's thread. Either
    way the same compiled code computes every row."""
    kp = _kernel_pool()
    tbl, total, keep, weights = kp.table(products)
    pool = _get_pool() if weights >= KERNEL_POOL_MIN_WEIGHTS and not is_single_threaded() else None
    if pool is None:
        kp.run_table_serial(tbl, total)
    else:
        pool.run_table(tbl, total, (products, keep))


_kp = None


def _kernel_pool():  # noqa: ANN202 - engine.kernel_pool, imported once (it compiles against this module)
    global _kp
    if _kp is None:
        from . import kernel_pool

        _kp = kernel_pool
    return _kp


def run(x: np.ndarray, qtype: str, data: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """Rows ``r0:r1`` of ``x @ W.T`` into ``out[:, r0:r1]`` (x: [T, K] fp32 C-contiguous, out: [T, N] fp32
    C-contiguous) on this thread, GIL released: the same compiled code as every other path (F32: ``r0`` a
    multiple of ``F32_ROW_ALIGN``)."""
    _kernel_pool().run_serial([(x, qtype, data, out)], (r0, r1))


def dequantize_blocks(blocks: np.ndarray, qtype: str) -> np.ndarray | None:
    """[n, bytes per block] uint8 (C-contiguous) -> [n, elements per block] fp32, bit for bit
    ``engine.quant.dequantize_blocks``; None when there is no kernel for ``qtype``."""
    if not AVAILABLE or qtype not in DEQUANT_TYPES:
        return None
    if blocks.flags.writeable:  # e.g. an embedding's gathered rows: the read-only specialization every
        blocks = blocks.view()  # mapped weight uses (see ``warm``), not a second one
        blocks.flags.writeable = False
    out = np.empty((blocks.shape[0], 32 if qtype in ("Q4_0", "Q8_0") else 256), dtype=F32)
    if qtype == "Q8_0":
        _dq_q8_0(blocks, out, HALF)
    elif qtype == "Q4_0":
        _dq_q4_0(blocks, out, HALF)
    elif qtype == "Q6_K":
        _dq_q6_k(blocks, out, HALF)
    else:
        _dq_q45_k(blocks, out, HALF, qtype == "Q5_K")
    return out


def gemm(x: np.ndarray, qtype: str, data: np.ndarray) -> np.ndarray | None:
    """``x @ W.T`` for stored ``data`` of ``qtype``: [T, K] fp32 -> [T, N] fp32, or None (no kernel)."""
    if not AVAILABLE or qtype not in ROW_TYPES:
        return None
    x = np.ascontiguousarray(x, dtype=F32)
    out = np.empty((x.shape[0], data.shape[0]), dtype=F32)
    run_products([(x, qtype, data, out)])
    return out


def gemm_many(products: list[tuple[np.ndarray, str, np.ndarray]]) -> list[np.ndarray]:
    """Several ``gemm`` products (x, qtype, data) in one round of the threads: the same bits as one
    ``gemm`` each, one hand-off instead of one per product."""
    todo = []
    outs = []
    for x, qtype, data in products:
        if x.dtype != F32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=F32)
        out = np.empty((x.shape[0], data.shape[0]), dtype=F32)
        todo.append((x, qtype, data, out))
        outs.append(out)
    run_products(todo)
    return outs


def warm() -> None:
    """Compile (or load from numba's on-disk cache) every kernel now, on tiny inputs: a process that wants
    its first request not to pay the compile (seconds) or its peak memory (LLVM) calls this at start.

    The weights are read-only arrays here, as every checkpoint's are (views of a read-only file mapping):
    numba compiles one specialization per writability, so warming on writable arrays loaded kernels no
    model uses, and the first prefill then loaded the read-only ones (~8 MiB per process, counted in the
    peak after loading)."""
    if not AVAILABLE:
        return
    x = np.zeros((1, 256), dtype=F32)
    out = np.empty((1, 1), dtype=F32)
    from .quant import row_bytes

    for qtype in ROW_TYPES:
        if qtype in ("BF16", "F32"):
            data = np.zeros((1, 256), dtype=np.uint16 if qtype == "BF16" else F32)
        else:
            data = np.zeros((1, row_bytes(qtype, 256)), dtype=np.uint8)
        data.setflags(write=False)
        run(x, qtype, data, out, 0, 1)
        if qtype in DEQUANT_TYPES:
            dequantize_blocks(data.reshape(-1, BLOCK_BYTES[qtype]), qtype)
    _kernel_pool().warm()
