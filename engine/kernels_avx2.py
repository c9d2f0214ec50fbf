"""Decode kernels for Q4_K, Q6_K and Q8_0 weights on AVX2 CPUs without AVX-512 (imported by
engine/kernel_pool.py when numba is there): the bits of the generic kernels in engine/kernels.py, written as
explicit 8-lane vector code.

On an AVX2 CPU LLVM compiles the generic kernels' 64 (Q6_K: 128) float lanes into 8 (16) of the 16 ymm
registers and then spills most of them: the whole block's weights were computed, stored to the stack and
reloaded around every multiply-add (``_q45_k`` measured ~2.9 G weights/s on one core of this VM's AVX2 EPYC, Q6_K
~2.6, Q8_0 ~3.7). Here one block of one activation row is one intrinsic over SSA vectors: the lanes are loaded
from the stack once per block and stored back once, and per 8 weights there is one widening of 8 code bytes
(straight from memory), the nibble cut, one conversion and the two fused operations that give the bits.

Same bits as the generic kernels: every lane takes the same weights in the same order with the same roundings.
Q4_K: weight ``fma(d * sc, q, -(dmin * m))`` (the generic ``dl * q - ml``, which LLVM contracts to one fused
operation), then ``fma(w, x, acc)``; Q6_K and Q8_0: ``w = (d * sc) * q`` (Q8_0: ``d * q``) rounded, then
``fma(w, x, acc)``; the lanes are summed by ``kernels._total``. Q6_K's 128 lanes are two passes of 64 over the row
(lanes 0-63: the low nibbles; 64-127: the high ones), each lane still in block order.
tests/test_gguf_kernels_avx2.py checks the bits against the generic kernels.

``AVAILABLE``: numba compiling for this host, AVX2 and FMA there, no AVX-512F (those CPUs run
engine/kernels_lut.py and engine/kernels_int.py), and ``MESHD_KERNELS_AVX2`` not ``0``.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import kernels

_FEATURES = binding.get_host_cpu_features()
AVAILABLE = (kernels.AVAILABLE and bool(_FEATURES.get("avx2")) and bool(_FEATURES.get("fma"))
             and not _FEATURES.get("avx512f")
             and numba.config.CPU_NAME in (None, "host") and not numba.config.CPU_FEATURES
             and os.environ.get("MESHD_KERNELS_AVX2", "1") != "0")

_F = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F, 8)
_V8I8 = ir.VectorType(_I8, 8)
_V8I32 = ir.VectorType(_I32, 8)
_V16F = ir.VectorType(_F, 16)
_V16I8 = ir.VectorType(_I8, 16)
_V16I32 = ir.VectorType(_I32, 16)


def _fn(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _ptr(builder: ir.IRBuilder, addr: ir.Value, off: int, ty: ir.Type) -> ir.Value:
    """``<ty>*`` at byte ``off`` of the int64 address ``addr``."""
    a = builder.add(addr, ir.Constant(addr.type, off)) if off else addr
    return builder.inttoptr(a, ty.as_pointer())


def _splat8(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    one = builder.insert_element(ir.Constant(_V8F, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V8F, ir.Undefined), ir.Constant(_V8I32, [0] * 8))


def _lane(builder: ir.IRBuilder, accp: ir.Value, j: int) -> ir.Value:
    """``<8 x float>*`` of lanes 8j..8j+7 of the float pointer ``accp``."""
    return builder.bitcast(builder.gep(accp, [ir.Constant(_I32, 8 * j)]), _V8F.as_pointer())


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    return builder.call(_fn(builder, "llvm.fma.v8f32", _V8F, [_V8F] * 3), [a, b, c])


def _codes(builder: ir.IRBuilder, addr: ir.Value, off: int, signed: bool = False) -> ir.Value:
    """The 8 code bytes at ``addr + off`` widened to <8 x i32> (one ``vpmovzxbd``/``vpmovsxbd`` from memory)."""
    b = builder.load(_ptr(builder, addr, off, _V8I8), align=1)
    return builder.sext(b, _V8I32) if signed else builder.zext(b, _V8I32)


def _barrier(builder: ir.IRBuilder) -> None:
    """An empty asm statement that may touch memory: no load after it is moved before it, so the next group's
    codes (and weights) are not computed early, ahead of the lanes' updates, and spilled (what LLVM's schedulers
    did with one block's 32 weights)."""
    builder.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], side_effect=True)


def _f(builder: ir.IRBuilder, fp: ir.Value, i: int) -> ir.Value:
    return builder.load(builder.gep(fp, [ir.Constant(_I32, i)]))


@intrinsic
def _q4k_block(typingctx, accp, qa, xa, fp):  # noqa: ANN001, ANN202
    """One Q4_K block of one activation row into the 64 lanes at ``accp``: ``qa`` the address of its 128 code
    bytes, ``xa`` of its 256 activations, ``fp`` 16 floats (d * scale, then dmin * min). Chunk c (32 bytes) holds
    sub-block 2c in its low nibbles (lanes 0-31) and 2c+1 in its high ones (lanes 32-63), as ``_q45_k``."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        accp, qa, xa, fp = args
        acc = [builder.load(_lane(builder, accp, j), align=4) for j in range(8)]
        fifteen = ir.Constant(_V8I32, [15] * 8)
        four = ir.Constant(_V8I32, [4] * 8)
        for c in range(4):
            dl0, dl1 = _splat8(builder, _f(builder, fp, 2 * c)), _splat8(builder, _f(builder, fp, 2 * c + 1))
            ml0 = builder.fneg(_splat8(builder, _f(builder, fp, 8 + 2 * c)))
            ml1 = builder.fneg(_splat8(builder, _f(builder, fp, 9 + 2 * c)))
            for g in range(4):
                q = _codes(builder, qa, 32 * c + 8 * g)
                lo = builder.sitofp(builder.and_(q, fifteen), _V8F)
                hi = builder.sitofp(builder.lshr(q, four), _V8F)
                x0 = builder.load(_ptr(builder, xa, 4 * (64 * c + 8 * g), _V8F), align=4)
                x1 = builder.load(_ptr(builder, xa, 4 * (64 * c + 32 + 8 * g), _V8F), align=4)
                acc[g] = _fma(builder, _fma(builder, dl0, lo, ml0), x0, acc[g])
                acc[4 + g] = _fma(builder, _fma(builder, dl1, hi, ml1), x1, acc[4 + g])
                _barrier(builder)
        for j in range(8):
            builder.store(acc[j], _lane(builder, accp, j), align=4)
        return context.get_dummy_value()

    return types.none(accp, qa, xa, fp), codegen


@intrinsic
def _k_scales(typingctx, words, d, dmin, fp):  # noqa: ANN001, ANN202
    """fp[0:8] = d * scale[j], fp[8:16] = dmin * min[j] from the 16 bytes at ``words`` (8 scales, 8 mins)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        b = builder.load(builder.bitcast(args[0], _V16I8.as_pointer()), align=4)
        s = builder.uitofp(builder.zext(b, _V16I32), _V16F)
        d = builder.insert_element(ir.Constant(_V16F, ir.Undefined), args[1], ir.Constant(_I32, 0))
        d = builder.insert_element(d, args[2], ir.Constant(_I32, 8))
        both = builder.shuffle_vector(d, d, ir.Constant(_V16I32, [0] * 8 + [8] * 8))
        builder.store(builder.fmul(s, both), builder.bitcast(args[3], _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(words, d, dmin, fp), codegen


@njit(**kernels._opts)
def q4_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
    """``engine.kernels._q45_k`` for Q4_K (five=False), bit for bit."""
    t, k = x.shape
    accp = kernels._stack_f32(64)
    acc = numba.carray(accp, 64)
    fp = kernels._stack_f32(16)  # d * scale, then dmin * min
    wp = kernels._stack_u32(4)
    words = numba.carray(wp, 4)
    xa = x.ctypes.data
    rb = w.shape[1]
    for r in range(r0, r1):
        row = w[r]
        ra = w.ctypes.data + r * rb
        for s in range(t):
            kernels._zero(acc, 64)
            xs = xa + s * k * 4
            for b in range(k // 256):
                o = b * 144
                kernels._k_scale_words(row, o + 4, words)
                _k_scales(wp, kernels._h(tab, row, o), kernels._h(tab, row, o + 2), fp)
                _q4k_block(accp, ra + o + 16, xs + b * 1024, fp)
            out[s, r] = kernels._total(acc, 64)


@intrinsic
def _q6_scales(typingctx, qa, d, fp):  # noqa: ANN001, ANN202
    """fp[0:16] = d * scale[j] for the 16 signed bytes at address ``qa`` (a Q6_K block's scales)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        b = builder.load(builder.inttoptr(args[0], _V16I8.as_pointer()), align=1)
        s = builder.sitofp(builder.sext(b, _V16I32), _V16F)
        one = builder.insert_element(ir.Constant(_V16F, ir.Undefined), args[1], ir.Constant(_I32, 0))
        d = builder.shuffle_vector(one, one, ir.Constant(_V16I32, [0] * 16))
        builder.store(builder.fmul(d, s), builder.bitcast(args[2], _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(qa, d, fp), codegen


_V32I8 = ir.VectorType(_I8, 32)


@intrinsic
def _q6k_pass(typingctx, accp, qa, xa, fp, high):  # noqa: ANN001, ANN202
    """One Q6_K block of one activation row into 64 of ``_q6_k``'s 128 lanes at ``accp``: ``high`` False: lanes
    0-63 (element ``half * 128 + p * 32 + l`` for p = 0, 1: the low nibbles), True: lanes 64-127 (p = 2, 3: the
    high nibbles); ``qa`` the block's address, ``xa`` its 256 activations, ``fp`` its 16 ``d * scale``. The
    6-bit codes minus 32 are assembled 32 bytes at a time, then widened 8 at a time."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        accp, qa, xa, fp, _ = args
        hi_pass = high.literal_value
        acc = [builder.load(_lane(builder, accp, j), align=4) for j in range(8)]

        def c8(v: int) -> ir.Constant:
            return ir.Constant(_V32I8, [v] * 32)

        for half in range(2):
            qh = builder.load(_ptr(builder, qa, 128 + 32 * half, _V32I8), align=1)
            for pp in range(2):
                p = pp + 2 * hi_pass
                ql = builder.load(_ptr(builder, qa, 64 * half + 32 * pp, _V32I8), align=1)
                lo = builder.lshr(ql, c8(4)) if hi_pass else builder.and_(ql, c8(15))
                # bits 2p, 2p+1 of qh as bits 4, 5
                hb = builder.shl(qh, c8(4 - 2 * p)) if p < 2 else (builder.lshr(qh, c8(2 * p - 4)) if p > 2 else qh)
                q = builder.sub(builder.or_(lo, builder.and_(hb, c8(48))), c8(32))
                for g in range(4):
                    q8 = builder.shuffle_vector(q, q, ir.Constant(_V8I32, list(range(8 * g, 8 * g + 8))))
                    dj = _splat8(builder, _f(builder, fp, half * 8 + 2 * p + g // 2))
                    x = builder.load(_ptr(builder, xa, 4 * (128 * half + 32 * p + 8 * g), _V8F), align=4)
                    j = 4 * pp + g
                    w = builder.fmul(dj, builder.sitofp(builder.sext(q8, _V8I32), _V8F))
                    acc[j] = _fma(builder, w, x, acc[j])
                _barrier(builder)
        for j in range(8):
            builder.store(acc[j], _lane(builder, accp, j), align=4)
        return context.get_dummy_value()

    if not isinstance(high, types.BooleanLiteral):
        return None
    return types.none(accp, qa, xa, fp, high), codegen


@njit(**kernels._opts)
def q6_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
    """``engine.kernels._q6_k`` bit for bit: lanes 0-63 in one pass over the row's blocks, 64-127 in a second
    (each lane still takes its weights in block order), then ``_total``'s pairwise sum of the 128."""
    t, k = x.shape
    lop = kernels._stack_f32(64)
    lo = numba.carray(lop, 64)
    hip = kernels._stack_f32(64)
    hi = numba.carray(hip, 64)
    fp = kernels._stack_f32(16)
    xa = x.ctypes.data
    rb = w.shape[1]
    for r in range(r0, r1):
        row = w[r]
        ra = w.ctypes.data + r * rb
        for s in range(t):
            kernels._zero(lo, 64)
            kernels._zero(hi, 64)
            xs = xa + s * k * 4
            for b in range(k // 256):
                o = b * 210
                _q6_scales(ra + o + 192, kernels._h(tab, row, o + 208), fp)
                _q6k_pass(lop, ra + o, xs + b * 1024, fp, False)
            for b in range(k // 256):
                o = b * 210
                _q6_scales(ra + o + 192, kernels._h(tab, row, o + 208), fp)
                _q6k_pass(hip, ra + o, xs + b * 1024, fp, True)
            for i in range(64):  # _total(acc, 128)'s first halving: lane i += lane 64 + i
                lo[i] += hi[i]
            out[s, r] = kernels._total(lo, 64)


@intrinsic
def _q80_block(typingctx, accp, lane, qa, xa, d):  # noqa: ANN001, ANN202
    """One Q8_0 block of one activation row into the 32 lanes at ``accp + lane`` (``lane`` 0 or 32, a literal):
    ``qa`` the address of its 32 signed codes, ``xa`` of its 32 activations, ``d`` its scale; lane i takes
    ``fma(d * q_i, x_i, acc)`` (the product rounded first, as ``_q8_0``)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        accp, _, qa, xa, d = args
        base = lane.literal_value // 8
        dv = _splat8(builder, d)
        for g in range(4):
            ap = _lane(builder, accp, base + g)
            w = builder.fmul(dv, builder.sitofp(_codes(builder, qa, 8 * g, signed=True), _V8F))
            x = builder.load(_ptr(builder, xa, 32 * g, _V8F), align=4)
            builder.store(_fma(builder, w, x, builder.load(ap, align=4)), ap, align=4)
        return context.get_dummy_value()

    if not isinstance(lane, types.IntegerLiteral):
        return None
    return types.none(accp, lane, qa, xa, d), codegen


@njit(**kernels._opts)
def q8_0(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
    """``engine.kernels._q8_0`` bit for bit: pairs of blocks, the even one into lanes 0-31, the odd one into 32-63
    (a last odd block: 0-31)."""
    t, k = x.shape
    nb = k // 32
    accp = kernels._stack_f32(64)
    acc = numba.carray(accp, 64)
    xa = x.ctypes.data
    rb = w.shape[1]
    for r in range(r0, r1):
        row = w[r]
        ra = w.ctypes.data + r * rb
        for s in range(t):
            kernels._zero(acc, 64)
            xs = xa + s * k * 4
            for p in range(nb // 2):
                o = p * 68
                _q80_block(accp, 0, ra + o + 2, xs + p * 256, kernels._h(tab, row, o))
                _q80_block(accp, 32, ra + o + 36, xs + p * 256 + 128, kernels._h(tab, row, o + 34))
            if nb & 1:
                o = (nb - 1) * 34
                _q80_block(accp, 0, ra + o + 2, xs + (nb - 1) * 128, kernels._h(tab, row, o))
            out[s, r] = kernels._total(acc, 64)
