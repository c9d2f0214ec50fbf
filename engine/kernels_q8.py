"""The Q8_0 decode kernel on AVX-512 (imported by engine/kernel_pool.py when numba is there): the bits of
``engine.kernels._q8_0``, written as explicit 16-lane vector code.

A Q8_0 weight is ``d * q`` (``d`` an IEEE half, ``q`` an int8): the product has at most 11 + 8 significant bits,
so it is exact in float32 however it is computed, and each lane then takes ``fma(d * q, x, acc)`` in block order:
the even block of a pair into lanes 0-31, the odd one into 32-63 (a last odd block: 0-31), then the pairwise sum
of ``kernels._total``. That is ``_q8_0``'s arithmetic; what differs is the work around it:

- **Weights shared by activation rows.** ``_q8_0`` loops over the activation rows outside the blocks, so with
  ``t`` rows it widens, converts and scales every weight ``t`` times; here each block's weights are computed
  once per pass and multiplied into every row's lanes (per 16 weights and row one fused multiply-add, plus
  three operations shared by the rows).
- **The lanes in registers for the whole row.** One intrinsic per block pair loads and stores them from a stack
  array that aliases nothing, so LLVM keeps them in registers across the row's loop; they are zeroed by vector
  stores (a loop of scalar stores became a ``memset`` call per row) and summed by one intrinsic.
- The half ``d`` is widened by ``vcvtph2ps`` (exact), not read from the 256 KiB table.

tests/test_gguf_kernels_q8.py checks the bits against ``_q8_0`` (1-8 activation rows, odd and even block
counts, row ranges, every finite half as a scale, through the kernel threads, a whole decode). ``AVAILABLE``: numba compiling
for this host, AVX-512F there, and ``MESHD_KERNELS_Q8`` not ``0`` (the A/B switch; the bits are the same, so the
numerics tag does not name it).
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

AVAILABLE = (kernels.AVAILABLE and bool(binding.get_host_cpu_features().get("avx512f"))
             and numba.config.CPU_NAME in (None, "host") and not numba.config.CPU_FEATURES
             and os.environ.get("MESHD_KERNELS_Q8", "1") != "0")

_F = ir.FloatType()
_H = ir.HalfType()
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F, 16)
_V16I8 = ir.VectorType(_I8, 16)
_V16I32 = ir.VectorType(_I32, 16)
ROWS = 4  # activation rows one pass takes (engine.limits.KERNEL_MAX_ROWS); more are taken four at a time


def _fn(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _at(builder: ir.IRBuilder, addr: ir.Value, off: ir.Value | int, ty: ir.Type) -> ir.Value:
    """``<ty>*`` at byte ``off`` (a constant or an int64 value) of the int64 address ``addr``."""
    if isinstance(off, int):
        a = builder.add(addr, ir.Constant(addr.type, off)) if off else addr
    else:
        a = builder.add(addr, off)
    return builder.inttoptr(a, ty.as_pointer())


def _lanes(builder: ir.IRBuilder, accp: ir.Value, j: int) -> ir.Value:
    """``<16 x float>*`` of lanes 16j..16j+15 of the float pointer ``accp``."""
    return builder.bitcast(builder.gep(accp, [ir.Constant(_I32, 16 * j)]), _V16F.as_pointer())


def _splat(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    one = builder.insert_element(ir.Constant(_V16F, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V16F, ir.Undefined), ir.Constant(_V16I32, [0] * 16))


def _half(builder: ir.IRBuilder, addr: ir.Value, off: ir.Value) -> ir.Value:
    """The IEEE half at byte ``off`` of ``addr`` as a float (``vcvtph2ps``: exact, every pattern)."""
    h = builder.load(_at(builder, addr, off, _I16), align=1)
    return builder.fpext(builder.bitcast(h, _H), _F)


@intrinsic
def _zero(typingctx, accp, nact):  # noqa: ANN001, ANN202
    """The lanes of ``nact`` activation rows (``accp[0:64 nact]``, ``nact`` a literal) = 0, by vector stores (a
    loop of scalar stores becomes a ``memset`` call per row, with a ``vzeroupper`` before it)."""
    if not isinstance(nact, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        zero = ir.Constant(_V16F, [0.0] * 16)
        for j in range(4 * nact.literal_value):
            builder.store(zero, _lanes(builder, args[0], j), align=4)
        return context.get_dummy_value()

    return types.none(accp, nact), codegen


@intrinsic
def _blocks(typingctx, accp, nact, pair, ra, o, xa, k, xo):  # noqa: ANN001, ANN202, PLR0913
    """One block pair (``pair`` true: the 68 bytes at ``ra + o`` into lanes 0-63) or one block (the 34 bytes at
    ``ra + o`` into lanes 0-31) of a weight row for ``nact`` activation rows (floats ``xo``.. of the rows at
    ``xa``, ``xa + 4k``, ...; row s's lanes: ``accp[64 s:64 s + 64]``). Each weight ``d * q`` once, then
    ``fma(w, x, acc)`` per activation row."""
    if not isinstance(nact, types.IntegerLiteral) or not isinstance(pair, types.BooleanLiteral):
        return None
    na, two = nact.literal_value, bool(pair.literal_value)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        accp, _, _, ra, o, xa, k, xo = args
        fma = _fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3)
        i64 = ir.IntType(64)
        ws = []
        for b in range(2 if two else 1):
            d = _splat(builder, _half(builder, ra, builder.add(o, ir.Constant(i64, 34 * b))))
            for h in range(2):
                q = builder.load(_at(builder, ra, builder.add(o, ir.Constant(i64, 34 * b + 2 + 16 * h)), _V16I8),
                                 align=1)
                ws.append(builder.fmul(d, builder.sitofp(builder.sext(q, _V16I32), _V16F)))
        for s in range(na):
            xs = builder.add(xa, builder.mul(builder.add(builder.mul(k, ir.Constant(i64, s)), xo), ir.Constant(i64, 4)))
            for g, w in enumerate(ws):
                x = builder.load(_at(builder, xs, 64 * g, _V16F), align=4)
                p = _lanes(builder, accp, 4 * s + g)
                builder.store(builder.call(fma, [w, x, builder.load(p, align=4)]), p, align=4)
        return context.get_dummy_value()

    return types.none(accp, nact, pair, ra, o, xa, k, xo), codegen


@intrinsic
def _total(typingctx, accp, at):  # noqa: ANN001, ANN202
    """``kernels._total`` of the 64 lanes ``accp[at:at+64]``, in its order: [0:32] += [32:64], [0:16] += [16:32],
    [0:8] += [8:16], [0:4] += [4:8], then (a0 + a2) + (a1 + a3)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        base = builder.gep(args[0], [args[1]])
        v = [builder.load(builder.bitcast(builder.gep(base, [ir.Constant(_I32, 16 * j)]), _V16F.as_pointer()),
                          align=4) for j in range(4)]
        c = builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))
        und = ir.Constant(_V16F, ir.Undefined)
        v8 = ir.VectorType(_F, 8)
        e = builder.fadd(builder.shuffle_vector(c, und, ir.Constant(ir.VectorType(_I32, 8), list(range(8)))),
                         builder.shuffle_vector(c, und, ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16)))))
        u8 = ir.Constant(v8, ir.Undefined)
        f = builder.fadd(builder.shuffle_vector(e, u8, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3])),
                         builder.shuffle_vector(e, u8, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7])))
        el = [builder.extract_element(f, ir.Constant(_I32, i)) for i in range(4)]
        return builder.fadd(builder.fadd(el[0], el[2]), builder.fadd(el[1], el[3]))

    return types.float32(accp, at), codegen


@njit(inline="always")
def _pass(accp, na, ra, nb, xa, k, out, s0, r):  # noqa: ANN001, ANN202
    """Weight row ``r`` (at ``ra``) against activation rows s0..s0+na-1 (``na`` a literal)."""
    _zero(accp, na)
    for p in range(nb // 2):
        _blocks(accp, na, True, ra, p * 68, xa, k, p * 64)
    if nb & 1:
        _blocks(accp, na, False, ra, (nb - 1) * 34, xa, k, (nb - 1) * 32)
    for s in range(na):
        out[s0 + s, r] = _total(accp, 64 * s)


@njit(**kernels._opts)
def q8_0(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
    """Rows ``r0:r1`` of ``x @ W.T`` for Q8_0, ``engine.kernels._q8_0`` bit for bit (``tab`` is not read)."""
    t, k = x.shape
    nb = k // 32
    rb = w.shape[1]
    accp = kernels._stack_f32(256)  # 64 lanes x ROWS
    for s0 in range(0, t, ROWS):
        na = min(ROWS, t - s0)
        xa = x.ctypes.data + s0 * k * 4
        for r in range(r0, r1):
            ra = w.ctypes.data + r * rb
            if na == 1:
                _pass(accp, 1, ra, nb, xa, k, out, s0, r)
            elif na == 2:
                _pass(accp, 2, ra, nb, xa, k, out, s0, r)
            elif na == 3:
                _pass(accp, 3, ra, nb, xa, k, out, s0, r)
            else:
                _pass(accp, 4, ra, nb, xa, k, out, s0, r)
