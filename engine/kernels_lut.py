"""Table-lookup decode kernels for K-quant weights on AVX-512 (imported by engine/kernel_pool.py when numba is
there; the kernels in engine/kernels.py compute the same bits everywhere else).

A Q4_K weight is ``dl * q - ml`` with ``q`` one of 16 nibble values and ``dl``/``ml`` fixed for its 32-element
sub-block. engine/kernels.py's ``_q45_k`` widens each nibble to an int32, converts it to float and computes that
fused multiply-subtract per weight (three vector operations, then the multiply-add into the lanes). Here each
sub-block first gets its 16 possible weights as one table (one vector ``fma(dl, [0..15], -ml)``, the same single
rounding as the per-weight fused operation), and a weight is a ``vpermps`` of that table by its nibble: per 16
weights one widening, one permute and the multiply-add, where ``_q45_k`` had the widening, a conversion and two
fused operations. The lanes, their block order and the final pairwise sum are ``_q45_k``'s, and every weight and
product has the same single rounding, so the bits are ``_q45_k``'s (tests/test_gguf_kernels_lut.py checks that
bit for bit). The block's sixteen 6-bit scales and mins become ``d * scale`` / ``dmin * min`` in one vector
multiply instead of sixteen scalar conversions and multiplies.

``vpermps`` over a 16-entry table is an AVX-512 instruction: ``AVAILABLE`` is False on other CPUs, when numba
compiles for a named CPU (``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``), or with ``MESHD_KERNELS_LUT=0``; the pool
then keeps ``_q45_k``/``_q6_k``.
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
from .kernels import _bits

# numba compiles for this host's CPU unless NUMBA_CPU_NAME says otherwise (a portable cache: then no AVX-512)
AVAILABLE = (kernels.AVAILABLE and bool(binding.get_host_cpu_features().get("avx512f"))
             and numba.config.CPU_NAME in (None, "host") and not numba.config.CPU_FEATURES
             and os.environ.get("MESHD_KERNELS_LUT", "1") != "0")

_F = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F, 16)
_V16I8 = ir.VectorType(_I8, 16)
_V16I32 = ir.VectorType(_I32, 16)


def _fn(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _vptr(builder: ir.IRBuilder, base: ir.Value, off: ir.Value, vty: ir.Type) -> ir.Value:
    """``<vty>*`` at element ``off`` of the float pointer ``base``."""
    return builder.bitcast(builder.gep(base, [off]), vty.as_pointer())


def _splat(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    one = builder.insert_element(ir.Constant(_V16F, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V16F, ir.Undefined), ir.Constant(_V16I32, [0] * 16))


def _lut_fma_intrinsic(shift: int):  # noqa: ANN202
    @intrinsic
    def lut_fma(typingctx, acc, lane, lut, at, qa, xa):  # noqa: ANN001, ANN202
        """acc[lane:lane+16] = fma(lut[at + (q_i >> shift & 15)], x_i, acc[lane + i]) for the 16 bytes q at
        address ``qa`` and the 16 floats x at address ``xa``."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            accp = _vptr(builder, args[0], args[1], _V16F)
            tbl = builder.load(_vptr(builder, args[2], args[3], _V16F), align=4)
            q = builder.load(builder.inttoptr(args[4], _V16I8.as_pointer()), align=1)
            if shift:
                q = builder.lshr(q, ir.Constant(_V16I8, [shift] * 16))
            idx = builder.zext(q, _V16I32)  # vpermps reads the low 4 bits of each index
            w = builder.call(_fn(builder, "llvm.x86.avx512.permvar.sf.512", _V16F, [_V16F, _V16I32]), [tbl, idx])
            x = builder.load(builder.inttoptr(args[5], _V16F.as_pointer()), align=4)
            a = builder.load(accp, align=4)
            builder.store(builder.call(_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3), [w, x, a]), accp,
                          align=4)
            return context.get_dummy_value()

        return types.none(acc, lane, lut, at, qa, xa), codegen

    return lut_fma


_lut_lo = _lut_fma_intrinsic(0)
_lut_hi = _lut_fma_intrinsic(4)


def _lut32_fma_intrinsic(shift: int):  # noqa: ANN202
    @intrinsic
    def lut32_fma(typingctx, acc, lane, lut, at, qa, ha, hs, xa):  # noqa: ANN001, ANN202
        """As ``_lut_lo``/``_lut_hi`` over a 32-entry table (Q5_K): the index of byte i is its nibble
        (``q_i >> shift & 15``) plus 16 times bit ``hs`` of the byte at ``ha + i``."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            accp = _vptr(builder, args[0], args[1], _V16F)
            lo = builder.load(_vptr(builder, args[2], args[3], _V16F), align=4)
            hi = builder.load(_vptr(builder, args[2], builder.add(args[3], ir.Constant(args[3].type, 16)), _V16F),
                              align=4)
            q = builder.load(builder.inttoptr(args[4], _V16I8.as_pointer()), align=1)
            q = builder.and_(builder.lshr(q, ir.Constant(_V16I8, [shift] * 16)) if shift else q,
                             ir.Constant(_V16I8, [15] * 16))
            h = builder.load(builder.inttoptr(args[5], _V16I8.as_pointer()), align=1)
            sh = hs.literal_value  # bit sh of h, moved to bit 4
            bit = builder.and_(builder.shl(h, ir.Constant(_V16I8, [4 - sh] * 16)) if sh <= 4
                               else builder.lshr(h, ir.Constant(_V16I8, [sh - 4] * 16)), ir.Constant(_V16I8, [16] * 16))
            idx = builder.zext(builder.or_(q, bit), _V16I32)
            w = builder.call(_fn(builder, "llvm.x86.avx512.vpermi2var.ps.512", _V16F, [_V16F, _V16I32, _V16F]),
                             [lo, idx, hi])
            x = builder.load(builder.inttoptr(args[7], _V16F.as_pointer()), align=4)
            a = builder.load(accp, align=4)
            builder.store(builder.call(_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3), [w, x, a]), accp,
                          align=4)
            return context.get_dummy_value()

        if not isinstance(hs, types.IntegerLiteral):
            return None
        return types.none(acc, lane, lut, at, qa, ha, hs, xa), codegen

    return lut32_fma


_lut32_lo = _lut32_fma_intrinsic(0)
_lut32_hi = _lut32_fma_intrinsic(4)


def _lut_build_intrinsic(first: int):  # noqa: ANN202
    @intrinsic
    def lut_build(typingctx, lut, at, dl, ml):  # noqa: ANN001, ANN202
        """lut[at + i] = fma(dl, first + i, -ml) for i = 0..15: weights of a sub-block, each rounded once."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            iota = ir.Constant(_V16F, [float(first + q) for q in range(16)])
            v = builder.call(_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3),
                             [_splat(builder, args[2]), iota, builder.fneg(_splat(builder, args[3]))])
            builder.store(v, _vptr(builder, args[0], args[1], _V16F), align=4)
            return context.get_dummy_value()

        return types.none(lut, at, dl, ml), codegen

    return lut_build


_lut_build = _lut_build_intrinsic(0)
_lut_build16 = _lut_build_intrinsic(16)


@intrinsic
def _scale_floats(typingctx, words, d, dmin, f):  # noqa: ANN001, ANN202
    """f[0:8] = d * scale[j], f[8:16] = dmin * min[j] from the 16 bytes of ``words`` (8 scales, 8 mins)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        b = builder.load(builder.bitcast(args[0], _V16I8.as_pointer()), align=4)
        s = builder.uitofp(builder.zext(b, _V16I32), _V16F)
        both = builder.shuffle_vector(_splat(builder, args[1]), _splat(builder, args[2]),
                                      ir.Constant(_V16I32, [0] * 8 + [16] * 8))
        builder.store(builder.fmul(s, both), builder.bitcast(args[3], _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(words, d, dmin, f), codegen


@njit(inline="always")
def _q4_chunk(accp, lut, c: int, qa: int, xb: int) -> None:  # noqa: ANN001
    # chunk c of a block: low nibbles of its 32 bytes are sub-block 2c (lanes 0-31), high ones 2c+1 (32-63)
    _lut_lo(accp, 0, lut, 32 * c, qa, xb)
    _lut_lo(accp, 16, lut, 32 * c, qa + 16, xb + 64)
    _lut_hi(accp, 32, lut, 32 * c + 16, qa, xb + 128)
    _lut_hi(accp, 48, lut, 32 * c + 16, qa + 16, xb + 192)


@njit(**kernels._opts)
def q4_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
    """``engine.kernels._q45_k`` for Q4_K (five=False), bit for bit, through per-sub-block tables. Up to four
    activation rows share a block's tables (each row has its own lanes, updated as a lone row's would be)."""
    t, k = x.shape
    a0p = kernels._stack_f32(64)
    a1p = kernels._stack_f32(64)
    a2p = kernels._stack_f32(64)
    a3p = kernels._stack_f32(64)
    a0, a1, a2, a3 = (numba.carray(a0p, 64), numba.carray(a1p, 64), numba.carray(a2p, 64),
                      numba.carray(a3p, 64))
    lut = kernels._stack_f32(128)  # sub-block j's 16 weights at lut[16 j]
    fp = kernels._stack_f32(16)  # d * scale, then dmin * min
    f = numba.carray(fp, 16)
    wp = kernels._stack_u32(4)
    words = numba.carray(wp, 4)
    xa = x.ctypes.data
    xr = k * 4  # bytes per activation row
    rb = w.shape[1]
    for r in range(r0, r1):
        row = w[r]
        ra = w.ctypes.data + r * rb
        s0 = 0
        while s0 < t:
            g = min(4, t - s0)
            kernels._zero(a0, 64)
            kernels._zero(a1, 64)
            kernels._zero(a2, 64)
            kernels._zero(a3, 64)
            xs = xa + s0 * xr
            for b in range(k // 256):
                o = b * 144
                kernels._k_scale_words(row, o + 4, words)
                _scale_floats(wp, kernels._h(tab, row, o), kernels._h(tab, row, o + 2), fp)
                for j in range(8):
                    _lut_build(lut, 16 * j, f[j], f[8 + j])
                for c in range(4):
                    qa = ra + o + 16 + c * 32
                    xb = xs + (b * 256 + c * 64) * 4
                    _q4_chunk(a0p, lut, c, qa, xb)
                    if g > 1:
                        _q4_chunk(a1p, lut, c, qa, xb + xr)
                    if g > 2:
                        _q4_chunk(a2p, lut, c, qa, xb + 2 * xr)
                    if g > 3:
                        _q4_chunk(a3p, lut, c, qa, xb + 3 * xr)
            out[s0, r] = kernels._total(a0, 64)
            if g > 1:
                out[s0 + 1, r] = kernels._total(a1, 64)
            if g > 2:
                out[s0 + 2, r] = kernels._total(a2, 64)
            if g > 3:
                out[s0 + 3, r] = kernels._total(a3, 64)
            s0 += g


@njit(**kernels._opts)
def q5_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
    """``engine.kernels._q45_k`` for Q5_K (five=True), bit for bit, through 32-entry per-sub-block tables."""
    t, k = x.shape
    accp = kernels._stack_f32(64)
    acc = numba.carray(accp, 64)
    lut = kernels._stack_f32(256)  # sub-block j's 32 weights at lut[32 j]
    fp = kernels._stack_f32(16)
    f = numba.carray(fp, 16)
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
                o = b * 176
                kernels._k_scale_words(row, o + 4, words)
                _scale_floats(wp, kernels._h(tab, row, o), kernels._h(tab, row, o + 2), fp)
                for j in range(8):
                    _lut_build(lut, 32 * j, f[j], f[8 + j])
                    _lut_build16(lut, 32 * j + 16, f[j], f[8 + j])
                ha = ra + o + 16
                q0 = ra + o + 48
                x0 = xs + b * 1024
                _lut32_lo(accp, 0, lut, 0, q0 + 0, ha, 0, x0 + 0)
                _lut32_lo(accp, 16, lut, 0, q0 + 16, ha + 16, 0, x0 + 64)
                _lut32_hi(accp, 32, lut, 32, q0 + 0, ha, 1, x0 + 128)
                _lut32_hi(accp, 48, lut, 32, q0 + 16, ha + 16, 1, x0 + 192)
                _lut32_lo(accp, 0, lut, 64, q0 + 32, ha, 2, x0 + 256)
                _lut32_lo(accp, 16, lut, 64, q0 + 48, ha + 16, 2, x0 + 320)
                _lut32_hi(accp, 32, lut, 96, q0 + 32, ha, 3, x0 + 384)
                _lut32_hi(accp, 48, lut, 96, q0 + 48, ha + 16, 3, x0 + 448)
                _lut32_lo(accp, 0, lut, 128, q0 + 64, ha, 4, x0 + 512)
                _lut32_lo(accp, 16, lut, 128, q0 + 80, ha + 16, 4, x0 + 576)
                _lut32_hi(accp, 32, lut, 160, q0 + 64, ha, 5, x0 + 640)
                _lut32_hi(accp, 48, lut, 160, q0 + 80, ha + 16, 5, x0 + 704)
                _lut32_lo(accp, 0, lut, 192, q0 + 96, ha, 6, x0 + 768)
                _lut32_lo(accp, 16, lut, 192, q0 + 112, ha + 16, 6, x0 + 832)
                _lut32_hi(accp, 32, lut, 224, q0 + 96, ha, 7, x0 + 896)
                _lut32_hi(accp, 48, lut, 224, q0 + 112, ha + 16, 7, x0 + 960)
            out[s, r] = kernels._total(acc, 64)


@intrinsic
def _scales_i8(typingctx, qa, d, f):  # noqa: ANN001, ANN202
    """f[0:16] = d * scale[j] for the 16 signed bytes at address ``qa`` (a Q6_K block's scales)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        b = builder.load(builder.inttoptr(args[0], _V16I8.as_pointer()), align=1)
        s = builder.sitofp(builder.sext(b, _V16I32), _V16F)
        builder.store(builder.fmul(_splat(builder, args[1]), s), builder.bitcast(args[2], _V16F.as_pointer()),
                      align=4)
        return context.get_dummy_value()

    return types.none(qa, d, f), codegen


@njit(**kernels._opts)
def q6_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
    """``engine.kernels._q6_k`` bit for bit, with a block's sixteen ``d * scale`` in one vector multiply."""
    t, k = x.shape
    acc = numba.carray(kernels._stack_f32(128), 128)
    fp = kernels._stack_f32(16)
    f = numba.carray(fp, 16)
    ra = w.ctypes.data
    rb = w.shape[1]
    for r in range(r0, r1):
        row = w[r]
        for s in range(t):
            kernels._zero(acc, 128)
            for b in range(k // 256):
                o = b * 210
                _scales_i8(ra + r * rb + o + 192, kernels._h(tab, row, o + 208), fp)
                for half in range(2):
                    ql0 = o + half * 64
                    qh0 = o + 128 + half * 32
                    xb = b * 256 + half * 128
                    for hh in range(2):
                        d0 = f[half * 8 + hh]
                        d1 = f[half * 8 + 2 + hh]
                        d2 = f[half * 8 + 4 + hh]
                        d3 = f[half * 8 + 6 + hh]
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
            out[s, r] = kernels._total(acc, 128)
