"""Compiled decode kernels (optional: ``pip install meshd[fast]`` brings numba).

For a product with few rows of activations (decode: ``T <= KERNEL_MAX_ROWS``) numpy must widen every
weight into an fp32 tile and then read the tile again; these kernels read each stored block once and
accumulate its dot product with the activations directly, both cores splitting the weight rows. A block's
scale is applied to the block's partial sum (``d * sum(q * x)``, as llama.cpp does), so results differ from
the numpy path in rounding only (~1e-7 relative), and are the same on every machine that runs the same
kernel: workers and stages use this module too, so distributed stays byte-identical to local when both
ends have (or both lack) numba. ``MESHD_KERNELS=numpy`` turns the kernels off.

The kernels run on the calling thread (numba's ``parallel=True`` measured 10x slower on this 2-core,
shared VM: waking its worker threads costs more than a decode-sized product). Types: BF16, Q8_0, Q4_0,
Q4_K, Q5_K, Q6_K; fp32 and F16 weights go to BLAS / the numpy tiles.
"""

from __future__ import annotations

import os

import numpy as np

try:  # the optional extra
    if os.environ.get("MESHD_KERNELS", "").lower() == "numpy":
        raise ImportError("disabled by MESHD_KERNELS=numpy")
    import numba
    from numba import njit
except ImportError:  # pragma: no cover - exercised when numba is absent
    numba = None

AVAILABLE = numba is not None
F32 = np.float32

if AVAILABLE:
    _opts = dict(cache=True, fastmath=True, nogil=True)

    @njit(inline="always")
    def _half(lo: np.uint8, hi: np.uint8) -> np.float32:
        """IEEE half (little-endian bytes) -> float32, exact."""
        h = np.uint32(lo) | (np.uint32(hi) << np.uint32(8))
        sign = (h >> np.uint32(15)) & np.uint32(1)
        exp = (h >> np.uint32(10)) & np.uint32(0x1F)
        man = h & np.uint32(0x3FF)
        if exp == 0:
            v = np.float32(man) * np.float32(2.0**-24)
        elif exp == 31:
            v = np.float32(np.inf) if man == 0 else np.float32(np.nan)
        else:
            v = np.float32(1.0 + man / 1024.0) * np.float32(2.0 ** (int(exp) - 15))
        return -v if sign else v

    @njit(**_opts)
    def _q8_0(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        t, k = x.shape
        n = w.shape[0]
        nb = k // 32
        for r in range(n):
            row = w[r]
            for s in range(t):
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 34
                    d = _half(row[o], row[o + 1])
                    p = np.float32(0.0)
                    for i in range(32):
                        p += np.float32(np.int8(row[o + 2 + i])) * x[s, b * 32 + i]
                    acc += d * p
                out[s, r] = acc

    @njit(**_opts)
    def _q4_0(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        t, k = x.shape
        n = w.shape[0]
        nb = k // 32
        for r in range(n):
            row = w[r]
            for s in range(t):
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 18
                    d = _half(row[o], row[o + 1])
                    p = np.float32(0.0)
                    for i in range(16):
                        v = row[o + 2 + i]
                        p += np.float32(np.int32(v & 15) - 8) * x[s, b * 32 + i]
                        p += np.float32(np.int32(v >> 4) - 8) * x[s, b * 32 + 16 + i]
                    acc += d * p
                out[s, r] = acc

    @njit(inline="always")
    def _k_scale(sc: np.ndarray, o: int, j: int) -> tuple[np.int32, np.int32]:
        # 6-bit scale and min of sub-block j from the 12 bytes at sc[o:o+12]
        if j < 4:
            return np.int32(sc[o + j] & 63), np.int32(sc[o + 4 + j] & 63)
        a = sc[o + 8 + j - 4]
        return (np.int32((a & 15) | ((sc[o + j - 4] >> 6) << 4)),
                np.int32((a >> 4) | ((sc[o + 4 + j - 4] >> 6) << 4)))

    @njit(**_opts)
    def _q45_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, five: bool) -> None:
        t, k = x.shape
        n = w.shape[0]
        nb = k // 256
        bsz = 176 if five else 144
        qs0 = 48 if five else 16
        # per 32-element sub-block sums of x (for the mins)
        xs = np.zeros((t, k // 32), dtype=np.float32)
        for s in range(t):
            for j in range(k // 32):
                a = np.float32(0.0)
                for i in range(32):
                    a += x[s, j * 32 + i]
                xs[s, j] = a
        for r in range(n):
            row = w[r]
            for s in range(t):
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * bsz
                    d = _half(row[o], row[o + 1])
                    dmin = _half(row[o + 2], row[o + 3])
                    for c in range(4):
                        for h in range(2):
                            j = c * 2 + h
                            sc, mn = _k_scale(row, o + 4, j)
                            p = np.float32(0.0)
                            base = b * 256 + j * 32
                            for i in range(32):
                                q = np.int32((row[o + qs0 + c * 32 + i] >> (4 * h)) & 15)
                                if five:
                                    q |= np.int32((row[o + 16 + i] >> j) & 1) << 4
                                p += np.float32(q) * x[s, base + i]
                            acc += d * np.float32(sc) * p - dmin * np.float32(mn) * xs[s, base // 32]
                out[s, r] = acc

    @njit(**_opts)
    def _q6_k(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        t, k = x.shape
        n = w.shape[0]
        nb = k // 256
        for r in range(n):
            row = w[r]
            for s in range(t):
                acc = np.float32(0.0)
                for b in range(nb):
                    o = b * 210
                    d = _half(row[o + 208], row[o + 209])
                    # element e = half*128 + q4*32 + l: lo nibble from ql, two high bits from qh
                    for sub in range(16):
                        sc = np.float32(np.int8(row[o + 192 + sub]))
                        p = np.float32(0.0)
                        for i in range(16):
                            e = sub * 16 + i
                            half = e // 128
                            rem = e % 128
                            q4 = rem // 32
                            l = rem % 32  # noqa: E741
                            lo = (row[o + half * 64 + (q4 % 2) * 32 + l] >> (4 * (q4 // 2))) & 15
                            hi = (row[o + 128 + half * 32 + l] >> (2 * q4)) & 3
                            q = np.int32(lo | (hi << 4)) - 32
                            p += np.float32(q) * x[s, b * 256 + e]
                        acc += d * sc * p
                out[s, r] = acc

    @njit(**_opts)
    def _bf16(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        t, k = x.shape
        n = w.shape[0]
        wide = np.empty(k, dtype=np.uint32)
        for r in range(n):
            row = w[r]
            for i in range(k):
                wide[i] = np.uint32(row[i]) << np.uint32(16)
            f = wide.view(np.float32)
            for s in range(t):
                acc = np.float32(0.0)
                for i in range(k):
                    acc += f[i] * x[s, i]
                out[s, r] = acc



def gemm(x: np.ndarray, qtype: str, data: np.ndarray) -> np.ndarray | None:
    """``x @ W.T`` for stored ``data`` of ``qtype``: [T, K] fp32 -> [T, N] fp32, or None (no kernel)."""
    if not AVAILABLE:
        return None
    x = np.ascontiguousarray(x, dtype=F32)
    out = np.empty((x.shape[0], data.shape[0]), dtype=F32)
    if qtype == "Q8_0":
        _q8_0(x, data, out)
    elif qtype == "Q4_0":
        _q4_0(x, data, out)
    elif qtype == "Q4_K":
        _q45_k(x, data, out, False)
    elif qtype == "Q5_K":
        _q45_k(x, data, out, True)
    elif qtype == "Q6_K":
        _q6_k(x, data, out)
    elif qtype == "BF16":
        _bf16(x, data, out)
    else:
        return None
    return out
