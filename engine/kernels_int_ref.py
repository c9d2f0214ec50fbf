"""The integer decode kernels' numerics (engine/kernels_int.py) in numpy: constants, buffer sizes, and the
references (``q4_k_ref``, ``q6_k_ref``, ``q8_0_ref``) whose bits the compiled kernels give. Pure numpy: CI checks
the references against the exact product without numba (tests/test_gguf_kernels_int.py)."""

from __future__ import annotations

import numpy as np

ACT_BITS = 20  # |X| <= 2**20: three signed bytes (a0 within +-65), and Q4_K's |T| < 32 * 15 * 2**20 < 2**29
TYPES = ("Q4_K", "Q6_K", "Q8_0")  # the types with an integer kernel
# the ones the kernel threads use: Q8_0's integer kernel measured 0.66-0.87x engine/kernels.py's float one for one
# activation row (1.0-1.2x for four), so decode keeps the float kernel (docs/kernels.md)
POOL_TYPES = ("Q4_K", "Q6_K")
SUB_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # sub-block of each float64 lane (the order the integer sums come out)
LAYOUT_Q4_K = 1  # the activation buffers' layouts (engine/kernel_pool.py's table column 13)
LAYOUT_Q6_K = 2
LAYOUT_Q8_0 = 3  # unsigned limbs: X = (u0 - 64) * 2**14 + u1 * 2**7 + u2, |X| <= 2**20 - 1
LAYOUTS = {"Q4_K": LAYOUT_Q4_K, "Q6_K": LAYOUT_Q6_K, "Q8_0": LAYOUT_Q8_0}


def limb_stride(k: int) -> int:
    """Limb bytes per activation row: three per element, K rounded up to whole 256-element groups."""
    return (k + 255) // 256 * 768


def buffer_bytes(t: int, k: int) -> int:
    """Bytes of one activation buffer of t rows of k (any layout): k/16 doubles, k/16 int32, the limbs."""
    return t * (k // 16 * 12 + limb_stride(k))


def quantize_rows(x: np.ndarray, clamp: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference quantization of fp32 rows ``x`` [T, K] (K a multiple of 32): the integers X [T, K] (int64),
    the power of two ``2**(E - ACT_BITS)`` of each 32-block [T, K/32] (float64; NaN for a non-finite block).
    ``clamp`` (Q8_0): |X| <= 2**ACT_BITS - 1, so sixteen products with int8 codes stay below 2**31."""
    t, k = x.shape
    xb = x.astype(np.float64).reshape(t, k // 32, 32)
    m = np.abs(xb).max(axis=2)
    finite = np.isfinite(xb).all(axis=2)
    _, e = np.frexp(np.where(finite, m, 0.0))
    e = e.astype(np.int64)
    with np.errstate(invalid="ignore"):
        xq = np.rint(np.ldexp(np.where(finite[..., None], xb, 0.0), (ACT_BITS - e)[..., None]))
    if clamp:
        xq = np.clip(xq, 1 - (1 << ACT_BITS), (1 << ACT_BITS) - 1)
    p = np.ldexp(1.0, e - ACT_BITS)
    p[~finite] = np.nan
    return xq.reshape(t, k).astype(np.int64), p, finite


def _total8(acc: np.ndarray) -> np.ndarray:
    h = acc[..., 0:4] + acc[..., 4:8]
    return ((h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])).astype(np.float32)


def q6_k_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for Q6_K rows ``w`` [N, K/256 * 210] (uint8), with the kernel's numerics, in numpy: [T, N].
    Per 16-element sub-block ``(T - 32 * S) * 2**(E - ACT_BITS) * (d * sc)`` (``q`` the 6-bit codes 0..63, so
    ``q - 32`` is the weight's integer) into float64 lane ``j`` of sixteen, in block order."""
    t, k = x.shape
    n = w.shape[0]
    nb = k // 256
    blk = w.reshape(n, nb, 210).astype(np.int64)
    ql = blk[:, :, 0:128].reshape(n, nb, 2, 64)
    qh = blk[:, :, 128:192].reshape(n, nb, 2, 32)
    q = np.empty((n, nb, 2, 4, 32), dtype=np.int64)
    q[:, :, :, 0] = (ql[..., :32] & 15) | ((qh & 3) << 4)
    q[:, :, :, 1] = (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4)
    q[:, :, :, 2] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q[:, :, :, 3] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = q.reshape(n, nb, 16, 16)
    sc = w.reshape(n, nb, 210)[:, :, 192:208].view(np.int8).astype(np.float64)
    d = w.reshape(n, nb, 210)[:, :, 208:210].copy().view(np.float16)[..., 0].astype(np.float64)
    dsc = d[..., None] * sc  # exact
    xq, p, _ = quantize_rows(x)
    xs = xq.reshape(t, nb, 16, 16)
    tt = np.einsum("nbjl,sbjl->snbj", q, xs) - 32 * xs.sum(axis=3)[:, None]  # exact int64
    p16 = np.repeat(p, 2, axis=1).reshape(t, nb, 16)
    acc = np.zeros((t, n, 16), dtype=np.float64)
    with np.errstate(invalid="ignore"):
        for b in range(nb):
            acc = acc + (tt[:, :, b].astype(np.float64) * p16[:, None, b]) * dsc[None, :, b]
    return _total8(acc[..., 0:8] + acc[..., 8:16])


def q8_0_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for Q8_0 rows ``w`` [N, K/32 * 34] (uint8), with the kernel's numerics, in numpy: [T, N].
    Per 16 elements ``T * 2**(E - ACT_BITS) * d`` into float64 lane ``j`` of sixteen per 256-element group (K
    padded to whole groups with zero weights, activations, scales), in group order."""
    t, k = x.shape
    n = w.shape[0]
    nb = k // 32
    kp = (k + 255) // 256 * 256
    blk = w.reshape(n, nb, 34)
    q = np.zeros((n, kp), dtype=np.int64)
    q[:, :k] = blk[:, :, 2:].view(np.int8).reshape(n, k)
    d = np.zeros((n, kp // 32), dtype=np.float64)
    d[:, :nb] = blk[:, :, 0:2].copy().view(np.float16)[..., 0]
    xq, p, _ = quantize_rows(x, clamp=True)
    xs = np.zeros((t, kp), dtype=np.int64)
    xs[:, :k] = xq
    pp = np.zeros((t, kp // 32))
    pp[:, :nb] = p
    tt = np.einsum("njl,sjl->snj", q.reshape(n, kp // 16, 16), xs.reshape(t, kp // 16, 16))  # exact int64
    p16 = np.repeat(pp, 2, axis=1)
    d16 = np.repeat(d, 2, axis=1)
    acc = np.zeros((t, n, 16), dtype=np.float64)
    with np.errstate(invalid="ignore"):
        for g in range(kp // 256):
            sl = slice(16 * g, 16 * g + 16)
            acc = acc + (tt[:, :, sl].astype(np.float64) * p16[:, None, sl]) * d16[None, :, sl]
    return _total8(acc[..., 0:8] + acc[..., 8:16])


def q4_k_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for Q4_K rows ``w`` [N, K/256 * 144] (uint8), with the kernel's numerics, in numpy: [T, N]."""
    t, k = x.shape
    n = w.shape[0]
    nb = k // 256
    blk = w.reshape(n, nb, 144)
    d = blk[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = blk[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    s12 = blk[:, :, 4:16].astype(np.int64)
    sc = np.empty((n, nb, 8), dtype=np.int64)
    mn = np.empty((n, nb, 8), dtype=np.int64)
    sc[..., :4] = s12[..., 0:4] & 63
    mn[..., :4] = s12[..., 4:8] & 63
    sc[..., 4:] = (s12[..., 8:12] & 15) | ((s12[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s12[..., 8:12] >> 4) | ((s12[..., 4:8] >> 6) << 4)
    qs = blk[:, :, 16:144].reshape(n, nb, 4, 32).astype(np.int64)
    q = np.empty((n, nb, 8, 32), dtype=np.int64)
    q[:, :, 0::2] = qs & 15  # sub-block 2c: low nibbles of chunk c; 2c+1: high nibbles
    q[:, :, 1::2] = qs >> 4
    xq, p, _ = quantize_rows(x)
    xs = xq.reshape(t, nb, 8, 32)
    tt = np.einsum("nbjl,sbjl->snbj", q, xs)  # exact int64
    ss = xs.sum(axis=3)  # [t, nb, 8]
    pp = p.reshape(t, nb, 8)
    dsc = d[..., None] * sc  # exact
    dm = dmin[..., None] * mn
    order = list(SUB_ORDER)
    acc = np.zeros((t, n, 8), dtype=np.float64)
    with np.errstate(invalid="ignore"):
        for b in range(nb):
            v = tt[:, :, b, order].astype(np.float64) * pp[:, None, b, order]
            sv = ss[:, None, b, order].astype(np.float64) * pp[:, None, b, order]
            acc = acc + v * dsc[None, :, b, order]
            acc = acc - sv * dm[None, :, b, order]
    return _total8(acc)
