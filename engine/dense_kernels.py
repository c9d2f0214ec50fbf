"""Compiled decode-step kernels for the work outside the packed products (numba: the optional ``[fast]``
extra; ``engine.dense`` imports this module only when numba is there and ``MESHD_KERNELS`` is not ``numpy``).

``f32_rows``: rows ``r0:r1`` of ``x @ W.T`` for an fp32 weight and a few activation rows (decode). BLAS'
sgemv streams the weights at ~28 GB/s on this VM with one or two threads; this loop, eight weight rows per
pass with one accumulator each, reads them at ~37 GB/s on one thread (a core's read bandwidth here is ~40
GB/s: bench/engine.py's probe). Every output element is computed by the same loop over ``k`` whatever T
is (the T rows of activations run one after the other over the same eight weight rows, which stay in L1),
and which loop computes a weight row depends only on its index and N, so a row's bits never depend on how
many activation rows are in the call. fastmath lets LLVM split each dot product into SIMD lanes (results
differ from BLAS by rounding, ~1e-7 relative), the same on every machine running the same compiled code.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit
from numba.core import cgutils, types
from numba.extending import intrinsic

_OPTS = dict(cache=True, fastmath=True, nogil=True, boundscheck=False, error_model="numpy")
PREFETCH_AHEAD = 32  # attention: cached rows requested this many positions ahead of the row being read


@intrinsic
def _prefetch(typingctx, addr):  # noqa: ANN001, ANN202 - numba intrinsic: a read hint, changes no value
    """LLVM's ``llvm.prefetch`` of the cache line at ``addr`` (read, keep in all levels): the next cached keys
    and values are requested while the current ones are computed on (a no-op where the CPU has none)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(types.int64), codegen


@njit(**_OPTS)
def f32_rows(x: np.ndarray, w: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """out[:, r0:r1] = x @ w[r0:r1].T; x [T, K], w [N, K], out [T, N], all fp32 C-contiguous. ``r0`` must be a
    multiple of 8 (so a row's loop depends on its index only)."""
    t, k = x.shape
    r = r0
    while r + 8 <= r1:
        for i in range(t):
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
            for j in range(k):
                xj = x[i, j]
                s0 += w[r, j] * xj
                s1 += w[r + 1, j] * xj
                s2 += w[r + 2, j] * xj
                s3 += w[r + 3, j] * xj
                s4 += w[r + 4, j] * xj
                s5 += w[r + 5, j] * xj
                s6 += w[r + 6, j] * xj
                s7 += w[r + 7, j] * xj
            out[i, r] = s0
            out[i, r + 1] = s1
            out[i, r + 2] = s2
            out[i, r + 3] = s3
            out[i, r + 4] = s4
            out[i, r + 5] = s5
            out[i, r + 6] = s6
            out[i, r + 7] = s7
        r += 8
    while r < r1:
        for i in range(t):
            s = np.float32(0.0)
            for j in range(k):
                s += w[r, j] * x[i, j]
            out[i, r] = s
        r += 1


@njit(**_OPTS)
def swiglu(g: np.ndarray, u: np.ndarray) -> None:
    """In place: g [T, I] = silu(g) * u = ``g / (1 + exp(-g)) * u``, exp as attention's softmax computes it (a
    polynomial in two loops LLVM vectorises, see ``_softmax_rows``; numba's ``np.exp`` is a scalar libm call,
    ~3 us of a 384-wide expert's 3.3), with -g clamped to [-87, 88] (2^k stays a normal float; beyond, silu is
    g or 0 to far below fp32's resolution of the output)."""
    t, n = g.shape
    e = np.empty(n, dtype=np.float32)
    kbits = np.empty(n, dtype=np.int32)
    kf = kbits.view(np.float32)
    for r in range(t):
        for i in range(n):
            x = min(max(-g[r, i], np.float32(-87.0)), np.float32(88.0))
            k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
            f = x - k * np.float32(0.693359375)
            f = f - k * np.float32(-2.12194440e-4)
            p = np.float32(1.9875691500e-4)
            p = p * f + np.float32(1.3981999507e-3)
            p = p * f + np.float32(8.3334519073e-3)
            p = p * f + np.float32(4.1665795894e-2)
            p = p * f + np.float32(1.6666665459e-1)
            p = p * f + np.float32(5.0000001201e-1)
            e[i] = p * f * f + f + np.float32(1.0)
            kbits[i] = (np.int32(k) + np.int32(127)) << 23
        for i in range(n):
            a = g[r, i]
            g[r, i] = a / (np.float32(1.0) + e[i] * kf[i]) * u[r, i]


@njit(**_OPTS)
def swiglu_sel(g: np.ndarray, u: np.ndarray, sel: np.ndarray) -> None:
    """``swiglu(g[e], u[e])`` for each e of sel in order (g, u [E, T, I]): a decode step's routed experts in
    one call (the same kernel: the same bits)."""
    for j in range(sel.shape[0]):
        swiglu(g[sel[j]], u[sel[j]])


@njit(**_OPTS)
def add_rmsnorm(x: np.ndarray, o: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """``x += o`` (each element one fp32 add, as numpy's), then ``rmsnorm_rows(x, w, eps, out)``: the residual
    add after attention and the MLP's norm in one call."""
    t, n = x.shape
    for r in range(t):
        for i in range(n):
            x[r, i] = x[r, i] + o[r, i]
    rmsnorm_rows(x, w, eps, out)


# route_one's sums in the order written: with reassociation (fastmath=True) LLVM vectorises ``tot += p[i]``
# behind a run-time check that the scratch ``p`` does not overlap ``logits`` (``p - logits >= 256`` bytes), and
# keeps a sequential copy of the loop for when it might: which copy runs, so the sum's order and its last bit,
# depended on where malloc put ``p`` next to the caller's logits (a planned step's bits changed with the heap
# layout: docs/engine-model.md). Without ``reassoc`` both copies add in index order.
_ROUTE_OPTS = dict(_OPTS, fastmath={"nnan", "ninf", "nsz", "contract", "arcp", "afn"})


@njit(**_ROUTE_OPTS)
def route_into(logits: np.ndarray, norm: bool, experts: np.ndarray, weights: np.ndarray, p: np.ndarray) -> None:
    """:func:`route_one` with its scratch ``p`` [E] fp32 given (tests place it against ``logits``)."""
    e = logits.shape[0]
    m = logits[0]
    for i in range(1, e):
        m = max(m, logits[i])
    tot = np.float32(0.0)
    for i in range(e):
        p[i] = np.exp(logits[i] - m)
        tot += p[i]
    taken = np.zeros(e, dtype=np.bool_)
    wsum = np.float32(0.0)
    for j in range(experts.shape[0]):
        best = -1
        for i in range(e):
            if not taken[i] and (best < 0 or p[i] > p[best]):
                best = i
        taken[best] = True
        experts[j] = best
        weights[j] = p[best] / tot
        wsum += weights[j]
    if norm:
        for j in range(experts.shape[0]):
            weights[j] = weights[j] / wsum


@njit(**_ROUTE_OPTS)
def route_one(logits: np.ndarray, norm: bool, experts: np.ndarray, weights: np.ndarray) -> None:
    """Softmax routing of one token: logits [E] -> its top-k experts [k] by descending probability (ties to the
    lower index) and their weights [k] (divided by their sum if ``norm``), as ``engine.moe.route``; every sum
    in index order, whatever the arrays' addresses."""
    route_into(logits, norm, experts, weights, np.empty(logits.shape[0], dtype=np.float32))


@njit(**_OPTS)
def _head_norm(x: np.ndarray, r0: int, r1: int, w: np.ndarray, eps: float) -> None:
    """In place: rows r0..r1-1 of x [n, hd] -> ``w * x / sqrt(mean(x**2) + eps)``."""
    hd = x.shape[1]
    for h in range(r0, r1):
        ss = np.float32(0.0)
        for i in range(hd):
            ss += x[h, i] * x[h, i]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(hd) + np.float32(eps))
        for i in range(hd):
            x[h, i] = x[h, i] * r * w[i]


@njit(**_OPTS)
def rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out [T, n] = ``w * x / sqrt(mean(x**2) + eps)`` per row of x [T, n] (each row on its own)."""
    t, n = x.shape
    for r in range(t):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[r, i] * x[r, i]
        d = np.sqrt(ss / np.float32(n) + np.float32(eps))
        for i in range(n):
            out[r, i] = x[r, i] / d * w[i]


@njit(**_OPTS)
def _rope(x: np.ndarray, r0: int, r1: int, cos: np.ndarray, sin: np.ndarray) -> None:
    """In place, rotate-half over the first ``2 * len(cos)`` dims of rows r0..r1-1 of x [n, hd]."""
    half = cos.shape[0]
    for h in range(r0, r1):
        for i in range(half):
            a, b = x[h, i], x[h, i + half]
            x[h, i] = a * cos[i] - b * sin[i]
            x[h, i + half] = b * cos[i] + a * sin[i]


# attend_one's arguments as one block of int64 words (addresses, sizes, and eps and scale as float64 bits): the
# argument of the compiled per-KV-head kernel ``_c_attend``, which the serial call and the kernel threads' rounds
# (engine/kernel_pool.py: one chunk per KV head) both call through its address, so that every path runs one
# machine-code instance (a compiled function inlined into two callers may be scheduled, and round, differently)
(A_Q, A_K, A_V, A_QN, A_KN, A_COS, A_SIN, A_KC, A_VC, A_OUT, A_NH, A_NKV, A_HD, A_VD, A_CAP, A_HALF, A_NQN, A_NKN,
 A_POS, A_LO, A_EPS, A_SCALE) = range(22)
ATTEND_WORDS = 22


@intrinsic
def _f32ptr(typingctx, addr):  # noqa: ANN001, ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))

    return types.CPointer(types.float32)(types.int64), codegen


@intrinsic
def _f64ptr(typingctx, addr):  # noqa: ANN001, ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float64)))

    return types.CPointer(types.float64)(types.int64), codegen


@intrinsic
def _i64ptr(typingctx, addr):  # noqa: ANN001, ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.int64)))

    return types.CPointer(types.int64)(types.int64), codegen


@intrinsic
def _call_heads(typingctx, fn, prm, h0, h1):  # noqa: ANN001, ANN202
    """Call the C function at ``fn`` (``_c_attend``'s signature: ten int64) on the block ``prm`` for KV heads
    ``h0..h1-1``: an indirect call, never inlined."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        i64 = ir.IntType(64)
        f = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [i64] * 10).as_pointer())
        z = ir.Constant(i64, 0)
        builder.call(f, [args[1], z, z, z, z, z, z, args[2], args[3], z])
        return context.get_dummy_value()

    return types.none(types.int64, types.int64, types.int64, types.int64), codegen


@njit(inline="always")
def _dense3(a: np.ndarray) -> bool:
    return a.strides[2] == 4 and a.strides[1] == 4 * a.shape[2] and a.strides[0] == a.strides[1] * a.shape[1]


@njit(**_OPTS)
def attend_params(prm: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray,
                  k_norm: np.ndarray, eps: float, cos: np.ndarray, sin: np.ndarray, kc: np.ndarray, vc: np.ndarray,
                  pos: int, lo: int, scale: float, out: np.ndarray) -> None:
    """Write :func:`attend_one`'s arguments into the block ``prm`` (int64 [ATTEND_WORDS]); the arrays must be
    C-contiguous fp32 (ValueError otherwise) and stay alive, unmoved, until the kernel has run."""
    nh, hd = q.shape
    nkv, vd = k.shape[0], v.shape[1]
    cap = kc.shape[1]
    if (q.strides[1] != 4 or q.strides[0] != 4 * hd or k.strides[1] != 4 or k.strides[0] != 4 * hd
            or v.strides[1] != 4 or v.strides[0] != 4 * vd or not _dense3(kc) or not _dense3(vc)
            or (q_norm.size and q_norm.strides[0] != 4) or (k_norm.size and k_norm.strides[0] != 4)
            or cos.strides[0] != 4 or sin.strides[0] != 4 or out.strides[0] != 4):
        raise ValueError("attend_one: arrays must be C-contiguous")
    if (nkv == 0 or nh % nkv or k.shape[1] != hd or v.shape[0] != nkv or kc.shape[0] != nkv or kc.shape[2] != hd
            or vc.shape[0] != nkv or vc.shape[1] != cap or vc.shape[2] != vd or out.shape[0] != nh * vd
            or not 0 <= lo <= pos < cap or 2 * cos.shape[0] > hd or sin.shape[0] != cos.shape[0]
            or (q_norm.size and q_norm.shape[0] != hd) or (k_norm.size and k_norm.shape[0] != hd)):
        raise ValueError("attend_one: shapes or positions do not fit")
    prm[A_Q], prm[A_K], prm[A_V] = q.ctypes.data, k.ctypes.data, v.ctypes.data
    prm[A_QN], prm[A_KN] = q_norm.ctypes.data, k_norm.ctypes.data
    prm[A_COS], prm[A_SIN] = cos.ctypes.data, sin.ctypes.data
    prm[A_KC], prm[A_VC], prm[A_OUT] = kc.ctypes.data, vc.ctypes.data, out.ctypes.data
    prm[A_NH], prm[A_NKV], prm[A_HD], prm[A_VD], prm[A_CAP] = nh, nkv, hd, vd, cap
    prm[A_HALF], prm[A_NQN], prm[A_NKN] = cos.shape[0], q_norm.size, k_norm.size
    prm[A_POS], prm[A_LO] = pos, lo
    f = prm.view(np.float64)
    f[A_EPS], f[A_SCALE] = eps, scale


@njit(**_OPTS)
def attend_cache(prm: np.ndarray, kc: np.ndarray, vc: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: int,
                 lo: int) -> None:
    """Point a block written by :func:`attend_params` at another layer's cache, position and rotary angles
    (a decode plan's per-step part; the same checks on what changes)."""
    if (not _dense3(kc) or not _dense3(vc) or kc.shape[0] != prm[A_NKV] or kc.shape[2] != prm[A_HD]
            or vc.shape[0] != prm[A_NKV] or vc.shape[1] != kc.shape[1] or vc.shape[2] != prm[A_VD]
            or not 0 <= lo <= pos < kc.shape[1] or cos.shape[0] != prm[A_HALF] or sin.shape[0] != prm[A_HALF]
            or cos.strides[0] != 4 or sin.strides[0] != 4):
        raise ValueError("attend_cache: shapes or positions do not fit")
    prm[A_COS], prm[A_SIN] = cos.ctypes.data, sin.ctypes.data
    prm[A_KC], prm[A_VC], prm[A_CAP] = kc.ctypes.data, vc.ctypes.data, kc.shape[1]
    prm[A_POS], prm[A_LO] = pos, lo


@njit(**_OPTS)
def _attend_heads(pa: int, h0: int, h1: int) -> None:
    """KV heads ``h0..h1-1`` of the attention the block at ``pa`` describes: each head's g query heads and its
    key get their head norms and rotary embedding, its key and value are written into the cache at ``pos``, and
    its g output heads get softmax(q k^T * scale) v over the cached positions ``lo..pos``. Every head reads and
    writes its own rows only, so heads may run on different threads at once."""
    prm = numba.carray(_i64ptr(pa), (ATTEND_WORDS,))
    f = numba.carray(_f64ptr(pa), (ATTEND_WORDS,))
    nh, nkv, hd, vd, cap, half = prm[A_NH], prm[A_NKV], prm[A_HD], prm[A_VD], prm[A_CAP], prm[A_HALF]
    pos, lo = prm[A_POS], prm[A_LO]
    eps, scale = f[A_EPS], f[A_SCALE]
    q = numba.carray(_f32ptr(prm[A_Q]), (nh, hd))
    k = numba.carray(_f32ptr(prm[A_K]), (nkv, hd))
    v = numba.carray(_f32ptr(prm[A_V]), (nkv, vd))
    q_norm = numba.carray(_f32ptr(prm[A_QN]), (prm[A_NQN],))
    k_norm = numba.carray(_f32ptr(prm[A_KN]), (prm[A_NKN],))
    cos = numba.carray(_f32ptr(prm[A_COS]), (half,))
    sin = numba.carray(_f32ptr(prm[A_SIN]), (half,))
    kc = numba.carray(_f32ptr(prm[A_KC]), (nkv, cap, hd))
    vc = numba.carray(_f32ptr(prm[A_VC]), (nkv, cap, vd))
    out = numba.carray(_f32ptr(prm[A_OUT]), (nh * vd,))
    g = nh // nkv
    ks = kc.strides[1]
    ka = kc.ctypes.data + h0 * kc.strides[0]
    for j in range(lo, min(lo + PREFETCH_AHEAD, pos + 1), 4):  # the first head's first keys
        _prefetch_rows(ka + j * ks, ks)
    n = pos + 1 - lo
    # one scratch block at fixed offsets (scores [g, n], then acc [g, vd], tot [g], the exponents [n]): where
    # one lies from another decides a vectorised loop's run-time overlap check, so it must not depend on the
    # heap (a helper thread allocates from another arena)
    scratch = np.empty(g * n + g * vd + g + n, dtype=np.float32)
    sc = scratch[:g * n].reshape(g, n)
    acc = scratch[g * n:g * n + g * vd].reshape(g, vd)
    tot = scratch[g * n + g * vd:g * n + g * vd + g]
    kbits = scratch[g * n + g * vd + g:].view(np.int32)
    for h in range(h0, h1):
        if q_norm.size:
            _head_norm(q, h * g, (h + 1) * g, q_norm, eps)
        if k_norm.size:
            _head_norm(k, h, h + 1, k_norm, eps)
        _rope(q, h * g, (h + 1) * g, cos, sin)
        _rope(k, h, h + 1, cos, sin)
        for i in range(hd):
            kc[h, pos, i] = k[h, i]
        for i in range(vd):
            vc[h, pos, i] = v[h, i]
        _scores(q, kc, vc, h, g, lo, n, scale, sc)
        _softmax_rows(sc, g, n, tot, kbits)
        _weighted_values(vc, kc, h, g, lo, n, sc, acc, h + 1 < h1)
        _divide_rows(out, h * g * vd, acc, tot)


@njit(**_OPTS)
def _divide_rows(out: np.ndarray, o: int, acc: np.ndarray, tot: np.ndarray) -> None:
    """out[o + a * vd + i] = acc[a, i] / tot[a]: divided in place in acc (one array: no run-time overlap check),
    then copied. Written straight into out, LLVM vectorised the loop behind a check of where out lies from acc
    (the heap) and, with ``arcp``, multiplied by the reciprocal in the vector copy and divided in the scalar
    one: the bits depended on the heap (numba compiles a callee with its caller's fastmath, so no flag can be
    turned off here)."""
    g, vd = acc.shape
    for a in range(g):
        t = tot[a]
        for i in range(vd):
            acc[a, i] = acc[a, i] / t
    for a in range(g):
        for i in range(vd):
            out[o + a * vd + i] = acc[a, i]


@njit(inline="always")
def _prefetch_rows(addr: int, stride: int) -> None:
    """Request four consecutive cached rows (``stride`` bytes apart) starting at ``addr``, line by line."""
    for r in range(4):
        for b in range(0, stride, 64):
            _prefetch(addr + r * stride + b)


@njit(**_OPTS)
def _scores(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, h: int, g: int, lo: int, n: int, scale: float,
            sc: np.ndarray) -> None:
    """sc[a, j] = q[h * g + a] . kc[h, lo + j] * scale for the g query heads of KV head h: four cached keys
    per pass (four independent sums per query head; each key row read once for the g heads)."""
    hd = q.shape[1]
    ka, va = kc.ctypes.data + h * kc.strides[0], vc.ctypes.data + h * vc.strides[0]
    ks, vs = kc.strides[1], vc.strides[1]
    cap = kc.shape[1]
    j = 0
    while j + 4 <= n:
        if lo + j + PREFETCH_AHEAD + 4 <= cap:  # the keys a few passes ahead, this pass's values (read next)
            _prefetch_rows(ka + (lo + j + PREFETCH_AHEAD) * ks, ks)
        _prefetch_rows(va + (lo + j) * vs, vs)
        for a in range(g):
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for i in range(hd):
                qa = q[h * g + a, i]
                s0 += qa * kc[h, lo + j, i]
                s1 += qa * kc[h, lo + j + 1, i]
                s2 += qa * kc[h, lo + j + 2, i]
                s3 += qa * kc[h, lo + j + 3, i]
            sc[a, j] = s0 * np.float32(scale)
            sc[a, j + 1] = s1 * np.float32(scale)
            sc[a, j + 2] = s2 * np.float32(scale)
            sc[a, j + 3] = s3 * np.float32(scale)
        j += 4
    while j < n:
        for a in range(g):
            s = np.float32(0.0)
            for i in range(hd):
                s += q[h * g + a, i] * kc[h, lo + j, i]
            sc[a, j] = s * np.float32(scale)
        j += 1


@njit(**_OPTS)
def _softmax_rows(sc: np.ndarray, g: int, n: int, tot: np.ndarray, kbits: np.ndarray) -> None:
    """In place, rows 0..g-1 of sc [g, >= n]: ``exp(s - max)`` over the first n, and each row's sum into tot.

    exp in two loops LLVM vectorises (numba's ``np.exp`` is a scalar libm call per score here, ~3 ns): 2^k * p(r)
    with k = round(x / ln 2), r = x - k ln 2 (Cody-Waite, two constants) and Cephes' degree-7 polynomial
    for expf, 2^k assembled as float bits in ``kbits`` (int32 [>= n]); x is clamped at -87 (2^k stays a normal
    float; exp(-87) ~ 1.6e-38 next to a row sum of at least 1). Relative error ~3e-7 over [-87, 0]."""
    kf = kbits.view(np.float32)
    for a in range(g):
        m = sc[a, 0]
        for j in range(1, n):
            m = max(m, sc[a, j])
        for j in range(n):
            x = max(sc[a, j] - m, np.float32(-87.0))
            k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
            r = x - k * np.float32(0.693359375)
            r = r - k * np.float32(-2.12194440e-4)
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            sc[a, j] = p * r * r + r + np.float32(1.0)
            kbits[j] = (np.int32(k) + np.int32(127)) << 23
        t = np.float32(0.0)
        for j in range(n):
            e = sc[a, j] * kf[j]
            sc[a, j] = e
            t += e
        tot[a] = t


@njit(**_OPTS)
def _weighted_values(vc: np.ndarray, kc: np.ndarray, h: int, g: int, lo: int, n: int, p: np.ndarray,
                     acc: np.ndarray, nxt: bool) -> None:
    """acc[a] = sum_j p[a, j] * vc[h, lo + j] for the g query heads of KV head h, four cached values per pass
    (a quarter of the accumulator loads and stores); ``nxt``: the next KV head's keys are read next (prefetch)."""
    vd = acc.shape[1]
    acc[:] = 0.0
    ka, ks = kc.ctypes.data + (h + 1) * kc.strides[0], kc.strides[1]
    j = 0
    while j + 4 <= n:
        if nxt:  # the next KV head's keys, read right after these values
            _prefetch_rows(ka + (lo + j) * ks, ks)
        for a in range(g):
            p0, p1, p2, p3 = p[a, j], p[a, j + 1], p[a, j + 2], p[a, j + 3]
            for i in range(vd):
                acc[a, i] += ((p0 * vc[h, lo + j, i] + p1 * vc[h, lo + j + 1, i])
                              + (p2 * vc[h, lo + j + 2, i] + p3 * vc[h, lo + j + 3, i]))
        j += 4
    while j < n:
        for a in range(g):
            pa = p[a, j]
            for i in range(vd):
                acc[a, i] += pa * vc[h, lo + j, i]
        j += 1


@cfunc(types.void(*([types.int64] * 10)), cache=True, nogil=True, boundscheck=False, error_model="numpy")
def _c_attend(pa, t, k, wa, n, rb, oa, h0, h1, ha):  # noqa: ANN001, ANN202 - the kernel threads' signature
    _attend_heads(pa, h0, h1)


ATTEND_ADDR = int(_c_attend.address)  # a kernel-pool table row's kernel (engine/kernel_pool.attend_table)


@njit(**_OPTS)
def _attend_serial(fn: int, prm: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray,
                   k_norm: np.ndarray, eps: float, cos: np.ndarray, sin: np.ndarray, kc: np.ndarray,
                   vc: np.ndarray, pos: int, lo: int, scale: float, out: np.ndarray) -> None:
    attend_params(prm, q, k, v, q_norm, k_norm, eps, cos, sin, kc, vc, pos, lo, scale, out)
    _call_heads(fn, prm.ctypes.data, 0, k.shape[0])  # (prm is the caller's: alive through the call)


def attend_one(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, eps: float,
               cos: np.ndarray, sin: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: int, lo: int, scale: float,
               out: np.ndarray) -> None:
    """Attention of one new position ``pos`` (decode): q [H, hd], k [KV, hd], v [KV, vd] before their head
    norms (``q_norm``/``k_norm`` [hd], or empty: none) and rotary embedding (cos/sin [r/2] of ``pos``); both
    are applied in place, k and v are written into the cache kc [KV, cap, hd] / vc [KV, cap, vd] at ``pos``,
    and out [H * vd] gets softmax(q k^T * scale) v over the cached positions ``lo..pos``. All C-contiguous fp32
    (ValueError otherwise). On this thread, KV head after KV head, by the same compiled kernel as the kernel
    threads' attention rounds (``engine.kernel_pool.attend_table``): the same bits."""
    _attend_serial(ATTEND_ADDR, np.empty(ATTEND_WORDS, dtype=np.int64), q, k, v, q_norm, k_norm, eps, cos, sin,
                   kc, vc, pos, lo, scale, out)


@njit(cache=True, nogil=True, boundscheck=False)  # no fastmath: engine.moe.combine's roundings exactly
def combine_add(x: np.ndarray, weights: np.ndarray, experts: np.ndarray, y: np.ndarray) -> None:
    """One token's routed-experts output added to its residual, as ``engine.moe.combine`` and the pass's
    ``x += out`` compute it: ``acc = 0; acc += weights[j] * y[experts[j]]`` for slots j = 0..k-1 in order, then
    ``x += acc``. x [1, D], weights [k] fp32, experts [k] int64, y [E, 1, D] (expert e's output in y[e])."""
    d = x.shape[1]
    for i in range(d):
        acc = np.float32(0.0)
        for j in range(experts.shape[0]):
            acc = acc + weights[j] * y[experts[j], 0, i]
        x[0, i] = x[0, i] + acc


def warm() -> None:
    """Load (or compile once into numba's cache) every kernel here."""
    x = np.zeros((1, 16), dtype=np.float32)
    out = np.empty((1, 9), dtype=np.float32)
    f32_rows(x, np.zeros((9, 16), dtype=np.float32), out, 0, 9)
    q, k, c = np.zeros((2, 4), dtype=np.float32), np.zeros((1, 4), dtype=np.float32), np.zeros((1, 2, 4), dtype=np.float32)
    cs = q[0, :2]
    swiglu(x, x.copy())
    swiglu_sel(x.reshape(1, 1, 16), x.reshape(1, 1, 16).copy(), np.zeros(1, dtype=np.int64))
    combine_add(x, np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.int64), np.zeros((1, 1, 16), dtype=np.float32))
    route_one(x[0], True, np.empty(2, dtype=np.int64), np.empty(2, dtype=np.float32))
    # norm weights: read-only views of a file mapping (fp32 and GGUF), or widened copies (bf16/f16), or none
    for ro in (True, False):
        v = np.zeros(16, dtype=np.float32)
        v.setflags(write=not ro)
        rmsnorm_rows(x, v, 1e-6, np.empty_like(x))
        add_rmsnorm(x, x.copy(), v, 1e-6, np.empty_like(x))
        attend_one(q, k, k.copy(), v[:4], v[:4], 1e-6, cs, cs, c, c.copy(), 0, 0, 0.5, np.empty(8, np.float32))
        attend_one(q, k, k.copy(), v[:4], v[:0], 1e-6, cs, cs, c, c.copy(), 0, 0, 0.5, np.empty(8, np.float32))
        prm = np.zeros(ATTEND_WORDS, dtype=np.int64)  # a decode plan's blocks (engine.decode_plan)
        attend_params(prm, q, k, k.copy(), v[:4], v[:4], 1e-6, cs, cs, c, c.copy(), 0, 0, 0.5, np.empty(8, np.float32))
        attend_cache(prm, c, c.copy(), cs, cs, 0, 0)
