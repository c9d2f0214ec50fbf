"""Integer dot products for Q4_K decode products on AVX-512 VNNI (``vpdpbusd``: 64 u8 x s8 products per
instruction), and their numpy reference (same bits).

Numerics (``MESHD_KERNELS_INT``, engine/kernel_pool.py): each activation row is cut into 32-element blocks; a
block with largest magnitude ``m = f * 2**E`` (``frexp``, ``0.5 <= f < 1``) becomes the integers
``X = rint(x * 2**(ACT_BITS - E))`` (``|X| <= 2**ACT_BITS``; the error is at most ``2**(E - ACT_BITS - 1)``, i.e.
``2**-20`` of the block's largest value), split into three signed bytes ``X = a0 * 2**14 + a1 * 2**7 + a2``. A
Q4_K sub-block's ``T = sum(q_i * X_i)`` (``q`` the 4-bit codes) is then an exact integer (``|T| < 2**29``), and
so is ``S = sum(X_i)``. The sub-block adds ``T * 2**(E - ACT_BITS) * (d * sc)`` and subtracts
``S * 2**(E - ACT_BITS) * (dmin * m)``: each product is exact in float64 (at most 46 significant bits), so the only
roundings are the two float64 additions per sub-block into one of eight float64 lanes (lane ``i`` of block ``b``
takes sub-block ``SUB_ORDER[i]``), in block order; then the lanes are summed pairwise and rounded once to float32.
Because every integer is exact and every float operation is written out (no contraction can change a product
that is already exact), the bits do not depend on how the integers are computed: :func:`q4_k_ref` (numpy,
int64 dot products) gives the same bits as the compiled kernel (tests/test_gguf_kernels_int.py), and a row's
bits depend on nothing but its own activation row and weight row.

These bits differ from the float kernels' (engine/kernels.py, engine/kernels_lut.py) by rounding: every node of
a mesh must make the same choice (``MESHD_KERNELS_INT``, and a CPU with AVX-512 VNNI: ``AVAILABLE``), as it must
for numba itself. A non-finite activation makes its block's scale NaN, so the row's outputs are NaN.
"""

from __future__ import annotations


import numpy as np

from . import numerics
from .kernels_int_ref import (ACT_BITS, LAYOUT_Q4_K, LAYOUT_Q6_K, LAYOUT_Q8_0, LAYOUTS, POOL_TYPES, SUB_ORDER,  # noqa: F401
                              TYPES, buffer_bytes, limb_stride, q4_k_ref, q6_k_ref, q8_0_ref, quantize_rows)

try:
    from . import kernels
    if not kernels.AVAILABLE:
        raise ImportError("no numba")
    if not numerics.int_kernels_usable():  # the CPU, LLVM, numba's target, MESHD_KERNELS_INT (one decision,
        raise ImportError("no VNNI, or MESHD_KERNELS_INT=0")  # also the numerics tag's)
    import numba
    from llvmlite import ir
    from numba import njit
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    AVAILABLE = True
except ImportError:
    AVAILABLE = False

if AVAILABLE:
    _I8 = ir.IntType(8)
    _I32 = ir.IntType(32)
    _D = ir.DoubleType()
    _V64I8 = ir.VectorType(_I8, 64)
    _V16I8 = ir.VectorType(_I8, 16)
    _V16I32 = ir.VectorType(_I32, 16)
    _V8I32 = ir.VectorType(_I32, 8)
    _V8D = ir.VectorType(_D, 8)
    _V16D = ir.VectorType(_D, 16)

    def _fn(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)

    def _at(builder: ir.IRBuilder, addr: ir.Value, off: int, vty: ir.Type) -> ir.Value:
        a = builder.add(addr, ir.Constant(addr.type, off)) if off else addr
        return builder.inttoptr(a, vty.as_pointer())

    def _idx(vals: list[int]) -> ir.Constant:
        return ir.Constant(ir.VectorType(_I32, len(vals)), vals)

    def _limbs_dot(builder: ir.IRBuilder, dp: ir.Function, acc: ir.Value, la: ir.Value, r: int, q: ir.Value,
                   codes_unsigned: bool) -> ir.Value:
        """``acc`` plus code register ``q`` dotted with its activations' three limbs at ``la`` (register ``r``;
        ``vpdpbusd``: X = a0 * 2**14 + a1 * 2**7 + a2, by Horner). ``codes_unsigned``: the codes are
        ``vpdpbusd``'s unsigned operand (K-quants), else the limbs are (Q8_0's signed codes)."""
        seven = ir.Constant(_V16I32, [7] * 16)
        for limb in range(3):
            a = builder.load(_at(builder, la, 192 * r + 64 * limb, _V64I8), align=1)
            if limb:
                acc = builder.shl(acc, seven)
            acc = builder.call(dp, [acc, q, a] if codes_unsigned else [acc, a, q])
        return acc

    def _pair_sums(builder: ir.IRBuilder, sums: list[ir.Value]) -> ir.Value:
        """Four registers' int32 lanes summed pairwise into one int32 per 32-code sub-block, in register order."""
        even16 = _idx(list(range(0, 32, 2)))
        odd16 = _idx(list(range(1, 32, 2)))

        def pair(a: ir.Value, b: ir.Value) -> ir.Value:
            return builder.add(builder.shuffle_vector(a, b, even16), builder.shuffle_vector(a, b, odd16))

        return pair(pair(sums[0], sums[1]), pair(sums[2], sums[3]))

    def _code_sums(builder: ir.IRBuilder, dp: ir.Function, regs: list[ir.Value], la: ir.Value) -> ir.Value:
        """The four code registers (64 unsigned codes each) dotted with their activations' three limbs at ``la``
        (``vpdpbusd``: X = a0 * 2**14 + a1 * 2**7 + a2, by Horner), then summed pairwise into one int32 per 32-code
        sub-block, in register order: a <16 x i32> (Q4_K uses its 16 lanes in pairs, Q6_K each)."""
        zero = ir.Constant(_V16I32, [0] * 16)
        return _pair_sums(builder, [_limbs_dot(builder, dp, zero, la, r, q, True) for r, q in enumerate(regs)])

    @intrinsic
    def _q4k_block(typingctx, accp, at, qa, la, scp, pa, sa):  # noqa: ANN001, ANN202
        """One Q4_K block into one activation row's eight float64 lanes at ``accp[at:at+8]``: ``qa`` the block's 128 bytes
        of codes, ``la`` its 768 limb bytes (4 registers x 3 limbs x 64), ``scp`` 16 doubles (d * sc, then
        dmin * m, in SUB_ORDER), ``pa``/``sa`` 8 doubles each (2**(E - ACT_BITS) and S times it, SUB_ORDER)."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            accp, at, qa, la, scp, pa, sa = args
            dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32, [_V16I32, _V64I8, _V64I8])
            lo = ir.Constant(_V64I8, [15] * 64)
            regs = []
            for h in range(2):
                v = builder.load(_at(builder, qa, 64 * h, _V64I8), align=1)
                regs.append(builder.and_(v, lo))
                regs.append(builder.and_(builder.lshr(v, ir.Constant(_V64I8, [4] * 64)), lo))
            f = _code_sums(builder, dp, regs, la)
            g = builder.add(builder.shuffle_vector(f, f, _idx(list(range(0, 16, 2)))),
                            builder.shuffle_vector(f, f, _idx(list(range(1, 16, 2)))))
            tv = builder.sitofp(g, _V8D)
            p = builder.load(builder.inttoptr(pa, _V8D.as_pointer()), align=8)
            s = builder.load(builder.inttoptr(sa, _V8D.as_pointer()), align=8)
            dsc = builder.load(builder.bitcast(scp, _V8D.as_pointer()), align=8)
            dm = builder.load(builder.bitcast(builder.gep(scp, [ir.Constant(_I32, 8)]), _V8D.as_pointer()), align=8)
            ap = builder.bitcast(builder.gep(accp, [at]), _V8D.as_pointer())
            acc = builder.load(ap, align=8)
            acc = builder.fadd(acc, builder.fmul(builder.fmul(tv, p), dsc))
            acc = builder.fsub(acc, builder.fmul(s, dm))
            builder.store(acc, ap, align=8)
            return context.get_dummy_value()

        return types.none(accp, at, qa, la, scp, pa, sa), codegen

    def _half_pair_f64(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
        """The two IEEE halves in the low 32 bits of the <4 x i32> ``v`` (low half first) as a <2 x double>:
        ``vcvtph2ps`` then a widening, both exact (the same values as engine/kernels.py's HALF table, without
        its two byte loads and a 256 KiB table lookup per half)."""
        h2 = ir.VectorType(ir.HalfType(), 2)
        return builder.fpext(builder.bitcast(builder.shuffle_vector(v, v, _idx([0])), h2), ir.VectorType(_D, 2))

    @intrinsic
    def _q4k_scales(typingctx, ba, out):  # noqa: ANN001, ANN202
        """out[0:8] = d * scale[SUB_ORDER], out[8:16] = dmin * min[SUB_ORDER] of the Q4_K block at address ``ba``
        (d, dmin, then the 12 scale bytes), in vector registers: llama.cpp's kmask unpacking of the three words
        (engine/kernels.py's ``_k_scale_words``, the same integers) as one <4 x i32> (a per-lane shift, masks, one
        shift and an or), the halves by ``vcvtph2ps``. Every value is the same as the scalar unpacking's, so the
        products are too (exact in float64)."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            v4 = ir.VectorType(_I32, 4)
            v = builder.load(builder.inttoptr(args[0], v4.as_pointer()), align=1)  # [d|dmin, u0, u1, u2]

            def c(vals: list[int]) -> ir.Constant:
                return ir.Constant(v4, vals)

            m1, m2, m3 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
            # words: [u0 & m1, (u2 & m2) | ((u0 >> 6) & m3) << 4, u1 & m1, ((u2 >> 4) & m2) | ((u1 >> 6) & m3) << 4]
            a = builder.shuffle_vector(v, v, _idx([1, 3, 2, 3]))
            b = builder.shuffle_vector(v, v, _idx([1, 1, 2, 2]))
            low = builder.and_(builder.lshr(a, c([0, 0, 0, 4])), c([m1, m2, m1, m2]))
            high = builder.shl(builder.and_(builder.lshr(b, c([6] * 4)), c([0, m3, 0, m3])), c([4] * 4))
            bts = builder.bitcast(builder.or_(low, high), _V16I8)  # 8 scales, then 8 mins
            order = list(SUB_ORDER) + [8 + j for j in SUB_ORDER]
            bts = builder.shuffle_vector(bts, bts, _idx(order))
            f = builder.uitofp(builder.zext(bts, _V16I32), _V16D)
            dd = _half_pair_f64(builder, v)
            both = builder.shuffle_vector(dd, dd, _idx([0] * 8 + [1] * 8))
            builder.store(builder.fmul(f, both), builder.bitcast(args[1], _V16D.as_pointer()), align=8)
            return context.get_dummy_value()

        return types.none(ba, out), codegen

    @intrinsic
    def _stack_f64(typingctx, n):  # noqa: ANN001, ANN202
        if not isinstance(n, types.IntegerLiteral):
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return cgutils.alloca_once(builder, _D, size=n.literal_value)

        return types.CPointer(types.float64)(n), codegen

    @intrinsic
    def _zero_f64(typingctx, p, n):  # noqa: ANN001, ANN202
        """p[0:n] = 0.0 by n / 8 vector stores (``n`` a literal multiple of 8). The loop of scalar stores it replaces
        became a call to ``memset`` per weight row, with a ``vzeroupper`` and the vector constants reloaded from
        the stack after it: per row of three 256-blocks (K = 768) that is not small."""
        if not isinstance(n, types.IntegerLiteral) or n.literal_value % 8:
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            zero = ir.Constant(_V8D, [0.0] * 8)
            for j in range(n.literal_value // 8):
                at = builder.gep(args[0], [ir.Constant(_I32, 8 * j)])
                builder.store(zero, builder.bitcast(at, _V8D.as_pointer()), align=8)
            return context.get_dummy_value()

        return types.none(p, n), codegen

    @intrinsic
    def _q6k_block(typingctx, accp, at, qa, la, scp, pa, sa):  # noqa: ANN001, ANN202
        """One Q6_K block into one activation row's sixteen float64 lanes at ``accp[at:at+16]``: ``qa`` the block (ql, qh),
        ``la`` its 768 limb bytes (natural order: 4 registers x 3 limbs x 64), ``scp`` 16 doubles (d * sc),
        ``pa`` 16 doubles (2**(E - ACT_BITS) of each sub-block's 32-block), ``sa`` 16 int32 (32 * S)."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            accp, at, qa, la, scp, pa, sa = args
            dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32, [_V16I32, _V64I8, _V64I8])
            v32 = ir.VectorType(_I8, 32)

            def c8(v: int) -> ir.Constant:
                return ir.Constant(_V64I8, [v] * 64)

            regs = []
            for h in range(2):
                v = builder.load(_at(builder, qa, 64 * h, _V64I8), align=1)
                q32 = builder.load(_at(builder, qa, 128 + 32 * h, v32), align=1)
                # bytes 0-31 take bits 0-1 (low nibbles) / 4-5 (high), bytes 32-63 bits 2-3 / 6-7 of qh
                qh = builder.shuffle_vector(q32, builder.lshr(q32, ir.Constant(v32, [2] * 32)), _idx(list(range(64))))
                regs.append(builder.or_(builder.and_(v, c8(15)), builder.and_(builder.shl(qh, c8(4)), c8(48))))
                regs.append(builder.or_(builder.and_(builder.lshr(v, c8(4)), c8(15)), builder.and_(qh, c8(48))))
            f = _code_sums(builder, dp, regs, la)  # sub-blocks 0..15
            f = builder.sub(f, builder.load(builder.inttoptr(sa, _V16I32.as_pointer()), align=4))
            tv = builder.sitofp(f, _V16D)
            p = builder.load(builder.inttoptr(pa, _V16D.as_pointer()), align=8)
            dsc = builder.load(builder.bitcast(scp, _V16D.as_pointer()), align=8)
            ap = builder.bitcast(builder.gep(accp, [at]), _V16D.as_pointer())
            builder.store(builder.fadd(builder.load(ap, align=8), builder.fmul(builder.fmul(tv, p), dsc)), ap,
                          align=8)
            return context.get_dummy_value()

        return types.none(accp, at, qa, la, scp, pa, sa), codegen

    @intrinsic
    def _q6_scales_f64(typingctx, qa, out):  # noqa: ANN001, ANN202
        """out[0:16] = d * scale[j] for the 16 signed bytes at address ``qa`` and the half d right after them
        (``vcvtph2ps``: the HALF table's value)."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            b = builder.load(builder.inttoptr(args[0], _V16I8.as_pointer()), align=1)
            i16 = ir.IntType(16)  # the half alone: the block's last two bytes (a wider load could pass the row's end)
            h = builder.load(builder.inttoptr(builder.add(args[0], ir.Constant(args[0].type, 16)), i16.as_pointer()),
                             align=1)
            one = builder.insert_element(ir.Constant(ir.VectorType(_D, 2), ir.Undefined),
                                         builder.fpext(builder.bitcast(h, ir.HalfType()), _D), ir.Constant(_I32, 0))
            v = builder.sitofp(builder.sext(b, _V16I32), _V16D)
            d = builder.shuffle_vector(one, one, _idx([0] * 16))
            builder.store(builder.fmul(v, d), builder.bitcast(args[1], _V16D.as_pointer()), align=8)
            return context.get_dummy_value()

        return types.none(qa, out), codegen

    @intrinsic
    def _q80_group(typingctx, accp, at, ga, la, scp, pa, nblk):  # noqa: ANN001, ANN202
        """Up to eight Q8_0 blocks (``nblk``, a literal) from address ``ga`` into one activation row's sixteen
        float64 lanes at ``accp[at:at+16]``: ``la`` the group's 768 unsigned limb bytes, ``scp`` 16 doubles (each
        block's d twice), ``pa`` 16 doubles (2**(E - ACT_BITS) per 16 elements). Missing blocks are zero weights
        (their scales must be zero too)."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            accp, at, ga, la, scp, pa, _ = args
            n = nblk.literal_value
            dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32, [_V16I32, _V64I8, _V64I8])
            v32 = ir.VectorType(_I8, 32)
            zero32 = ir.Constant(v32, [0] * 32)
            sums = []
            for r in range(4):
                if 2 * r >= n:
                    sums.append(ir.Constant(_V16I32, [0] * 16))
                    continue
                lo = builder.load(_at(builder, ga, 34 * 2 * r + 2, v32), align=1)
                hi = (builder.load(_at(builder, ga, 34 * (2 * r + 1) + 2, v32), align=1) if 2 * r + 1 < n
                      else zero32)
                q = builder.shuffle_vector(lo, hi, _idx(list(range(64))))
                # start at -64 * sum(q) per lane: u0 carries X's top digit plus 64
                acc = builder.sub(ir.Constant(_V16I32, [0] * 16),
                                  builder.call(dp, [ir.Constant(_V16I32, [0] * 16), ir.Constant(_V64I8, [64] * 64), q]))
                sums.append(_limbs_dot(builder, dp, acc, la, r, q, False))
            f = _pair_sums(builder, sums)  # 16-element sums, in order
            tv = builder.sitofp(f, _V16D)
            p = builder.load((builder.bitcast(pa, _V16D.as_pointer()) if isinstance(pa.type, ir.PointerType)
                              else builder.inttoptr(pa, _V16D.as_pointer())), align=8)
            d = builder.load(builder.bitcast(scp, _V16D.as_pointer()), align=8)
            ap = builder.bitcast(builder.gep(accp, [at]), _V16D.as_pointer())
            builder.store(builder.fadd(builder.load(ap, align=8), builder.fmul(builder.fmul(tv, p), d)), ap, align=8)
            return context.get_dummy_value()

        if not isinstance(nblk, types.IntegerLiteral):
            return None
        return types.none(accp, at, ga, la, scp, pa, nblk), codegen

    _nopts = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")

    _ptr_intrinsic = kernels.ptr_intrinsic

    _f32p = _ptr_intrinsic(types.float32)
    _f64p = _ptr_intrinsic(types.float64)
    _i32p = _ptr_intrinsic(types.int32)
    _i8p = _ptr_intrinsic(types.int8)

    @intrinsic
    def _pow2(typingctx, n):  # noqa: ANN001, ANN202
        """2.0 ** n as a float64 (n an int64 in the normal range: -1022..1023), by its bits."""
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            i64 = ir.IntType(64)
            bits = builder.shl(builder.add(args[0], ir.Constant(i64, 1023)), ir.Constant(i64, 52))
            return builder.bitcast(bits, _D)

        return types.float64(types.int64), codegen

    def _quant32_intrinsic(unsigned: bool):  # noqa: ANN202
        @intrinsic
        def quant32(typingctx, xa, sc, la, sa):  # noqa: ANN001, ANN202
            """The 32 floats at ``xa`` times ``sc``, rounded to the nearest integer (ties to even) X; its limbs to
            ``la``, ``la + 64``, ``la + 128`` (signed: X = a0 * 2**14 + a1 * 2**7 + a2, a1 and a2 in -64..63;
            unsigned (Q8_0): X clamped to +-(2**20 - 1), X = (u0 - 64) * 2**14 + u1 * 2**7 + u2); the sums of X
            over the two halves to the int32 pair at ``sa``."""
            def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
                xa, sc, la, sa = args
                v32f = ir.VectorType(ir.FloatType(), 32)
                v32d = ir.VectorType(_D, 32)
                v32i = ir.VectorType(_I32, 32)
                v32b = ir.VectorType(_I8, 32)
                x = builder.fpext(builder.load(builder.inttoptr(xa, v32f.as_pointer()), align=4), v32d)
                one = builder.insert_element(ir.Constant(v32d, ir.Undefined), sc, ir.Constant(_I32, 0))
                x = builder.fmul(x, builder.shuffle_vector(one, one, _idx([0] * 32)))
                q = builder.fptosi(builder.call(_fn(builder, "llvm.rint.v32f64", v32d, [v32d]), [x]), v32i)

                def c(v: int) -> ir.Constant:
                    return ir.Constant(v32i, [v] * 32)

                if unsigned:
                    top = (1 << ACT_BITS) - 1
                    q = builder.call(_fn(builder, "llvm.smin.v32i32", v32i, [v32i, v32i]), [q, c(top)])
                    q = builder.call(_fn(builder, "llvm.smax.v32i32", v32i, [v32i, v32i]), [q, c(-top)])
                    limbs = (builder.add(builder.ashr(q, c(14)), c(64)),
                             builder.and_(builder.ashr(q, c(7)), c(127)), builder.and_(q, c(127)))
                else:
                    a2 = builder.sub(builder.and_(builder.add(q, c(64)), c(127)), c(64))
                    q1 = builder.ashr(builder.sub(q, a2), c(7))
                    a1 = builder.sub(builder.and_(builder.add(q1, c(64)), c(127)), c(64))
                    limbs = (builder.ashr(builder.sub(q1, a1), c(7)), a1, a2)
                for off, limb in zip((0, 64, 128), limbs):
                    builder.store(builder.trunc(limb, v32b), _at(builder, la, off, v32b), align=1)
                red = _fn(builder, "llvm.vector.reduce.add.v16i32", _I32, [_V16I32])
                sp = builder.inttoptr(sa, _I32.as_pointer())
                for h in range(2):
                    half = builder.shuffle_vector(q, q, _idx(list(range(16 * h, 16 * h + 16))))
                    builder.store(builder.call(red, [half]), builder.gep(sp, [ir.Constant(_I32, h)]), align=4)
                return context.get_dummy_value()

            return types.none(xa, sc, la, sa), codegen

        return quant32

    _quant32 = _quant32_intrinsic(False)
    _quant32u = _quant32_intrinsic(True)

    @njit(**_nopts)
    def _frexp_exp(mb: np.uint32) -> int:
        """``frexp``'s exponent of the finite non-negative float32 with bits ``mb`` (0 for zero)."""
        eb = np.int64(mb >> np.uint32(23))
        if eb > 0:
            return eb - 126
        e = 0
        mant = np.int64(mb)
        while mant:
            e += 1
            mant >>= 1
        return e - 149 if e else 0

    @njit(**_nopts)
    def quantize(x: np.ndarray, limbs: np.ndarray, p32: np.ndarray, s16: np.ndarray, perm: bool,
                 unsigned: bool) -> None:
        """Every row of ``x`` [T, K]: ``limbs[s]`` (``limb_stride(K)`` bytes: per 256-block four registers of three
        64-byte limbs; register r holds 32-blocks o[2r], o[2r + 1] with o = SUB_ORDER if ``perm`` else 0..7;
        ``unsigned``: Q8_0's limbs),
        ``p32[s]`` (2**(E - ACT_BITS) per 32-block, NaN for a non-finite one) and ``s16[s]`` (sum of X per
        16 elements). x must be C-contiguous."""
        t, k = x.shape
        xi = x.view(np.uint32)
        xa = np.int64(x.ctypes.data)
        la = np.int64(limbs.ctypes.data)
        sa = np.int64(s16.ctypes.data)
        ls = limbs.shape[1]
        zeros = np.zeros(32, dtype=np.float32)  # a non-finite block's stand-in (its scale is NaN)
        za = np.int64(zeros.ctypes.data)
        for s in range(t):
            for j in range(k // 32):
                b, sj = j // 8, j % 8
                pos = SUB_ORDER[sj] if perm else sj  # SUB_ORDER is its own inverse
                mb = np.uint32(0)
                for i in range(32):
                    mb = max(mb, xi[s, 32 * j + i] & np.uint32(0x7FFFFFFF))
                finite = mb < np.uint32(0x7F800000)
                e = _frexp_exp(mb) if finite else 0
                sc = _pow2(ACT_BITS - e) if finite else 0.0
                base = b * 768 + (pos // 2) * 192 + (pos % 2) * 32
                xj = xa + (s * k + 32 * j) * 4 if finite else za
                if unsigned:
                    _quant32u(xj, sc, la + s * ls + base, sa + (s * (k // 16) + 2 * j) * 4)
                else:
                    _quant32(xj, sc, la + s * ls + base, sa + (s * (k // 16) + 2 * j) * 4)
                p32[s, j] = _pow2(e - ACT_BITS) if finite else np.nan

    @njit(**_nopts)
    def prepare(layout: int, xa: int, t: int, k: int, buf: int) -> None:
        """Quantize the fp32 rows at ``xa`` [t, k] into the buffer at ``buf`` (:func:`buffer_bytes`) for the
        kernel of ``layout`` (LAYOUT_Q4_K or LAYOUT_Q6_K): first t * k / 16 doubles (Q4_K: per block 2**(E -
        ACT_BITS) then S times it, SUB_ORDER; Q6_K: 2**(E - ACT_BITS) per 16-element sub-block), then t * k / 16
        int32 (Q6_K: 32 * S per sub-block), then the t * k * 3 limb bytes."""
        x = numba.carray(_f32p(xa), (t, k))
        dbl = numba.carray(_f64p(buf), (t, k // 16))
        s16 = numba.carray(_i32p(buf + t * k // 16 * 8), (t, k // 16))
        limbs = numba.carray(_i8p(buf + t * k // 16 * 12), (t, (k + 255) // 256 * 768))
        p32 = np.empty((t, k // 32), dtype=np.float64)
        quantize(x, limbs, p32, s16, layout == LAYOUT_Q4_K, layout == LAYOUT_Q8_0)
        for s in range(t):
            if layout == LAYOUT_Q4_K:
                for b in range(k // 256):
                    for i in range(8):
                        j = b * 8 + SUB_ORDER[i]
                        dbl[s, b * 16 + i] = p32[s, j]
                        dbl[s, b * 16 + 8 + i] = np.float64(s16[s, 2 * j] + s16[s, 2 * j + 1]) * p32[s, j]
            else:  # Q6_K, Q8_0: the scale of each 16 elements (and Q6_K's 32 * S)
                for j in range(k // 16):
                    dbl[s, j] = p32[s, j // 2]
                    s16[s, j] = 32 * s16[s, j]

    @njit(**_nopts)
    def q4_k_buf(buf: int, t: int, k: int, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int,
                 r1: int) -> None:
        """Rows ``r0:r1`` of ``x @ W.T`` for Q4_K from x's buffer (:func:`prepare`, LAYOUT_Q4_K). ``tab`` (the
        HALF table, the kernel threads' common signature) is not read: the halves are converted by ``vcvtph2ps``."""
        nb = k // 256
        accp = _stack_f64(32)
        acc = numba.carray(accp, 32)
        scp = _stack_f64(16)
        pa = buf
        la = buf + t * k // 16 * 12
        ls = (k + 255) // 256 * 768  # limb_stride(k)
        rb = w.shape[1]
        for r in range(r0, r1):
            ra = w.ctypes.data + r * rb
            for s0 in range(0, t, 4):  # at most four activation rows at a time (the stack lanes)
                g = min(4, t - s0)
                if g == 1:  # decode's one row
                    _zero_f64(accp, 8)
                else:
                    _zero_f64(accp, 32)
                for b in range(nb):
                    o = b * 144
                    _q4k_scales(ra + o, scp)
                    for s in range(s0, s0 + g):
                        _q4k_block(accp, 8 * (s - s0), ra + o + 16, la + s * ls + b * 768, scp,
                                   pa + (s * nb * 16 + b * 16) * 8, pa + (s * nb * 16 + b * 16 + 8) * 8)
                for s in range(s0, s0 + g):
                    a = 8 * (s - s0)
                    h0 = acc[a] + acc[a + 4]
                    h1 = acc[a + 1] + acc[a + 5]
                    h2 = acc[a + 2] + acc[a + 6]
                    h3 = acc[a + 3] + acc[a + 7]
                    out[s, r] = np.float32((h0 + h2) + (h1 + h3))

    @njit(**_nopts)
    def q6_k_buf(buf: int, t: int, k: int, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int,
                 r1: int) -> None:
        """Rows ``r0:r1`` of ``x @ W.T`` for Q6_K from x's buffer (:func:`prepare`, LAYOUT_Q6_K); ``tab`` is not
        read (as in :func:`q4_k_buf`)."""
        nb = k // 256
        accp = _stack_f64(64)
        acc = numba.carray(accp, 64)
        scp = _stack_f64(16)
        pa = buf
        sa = buf + t * k // 16 * 8
        la = buf + t * k // 16 * 12
        ls = (k + 255) // 256 * 768  # limb_stride(k)
        rb = w.shape[1]
        for r in range(r0, r1):
            ra = w.ctypes.data + r * rb
            for s0 in range(0, t, 4):  # at most four activation rows at a time (the stack lanes)
                g = min(4, t - s0)
                if g == 1:
                    _zero_f64(accp, 16)
                else:
                    _zero_f64(accp, 64)
                for b in range(nb):
                    o = b * 210
                    _q6_scales_f64(ra + o + 192, scp)
                    for s in range(s0, s0 + g):
                        _q6k_block(accp, 16 * (s - s0), ra + o, la + s * ls + b * 768, scp,
                                   pa + (s * nb + b) * 128, sa + (s * nb + b) * 64)
                for s in range(s0, s0 + g):
                    a = 16 * (s - s0)
                    for i in range(8):
                        acc[a + i] += acc[a + 8 + i]
                    h0 = acc[a] + acc[a + 4]
                    h1 = acc[a + 1] + acc[a + 5]
                    h2 = acc[a + 2] + acc[a + 6]
                    h3 = acc[a + 3] + acc[a + 7]
                    out[s, r] = np.float32((h0 + h2) + (h1 + h3))

    @njit(inline="always")
    def _q80_tail(accp, at: int, ga: int, la: int, scp, pa: int, nblk: int) -> None:  # noqa: ANN001
        if nblk == 1:
            _q80_group(accp, at, ga, la, scp, pa, 1)
        elif nblk == 2:
            _q80_group(accp, at, ga, la, scp, pa, 2)
        elif nblk == 3:
            _q80_group(accp, at, ga, la, scp, pa, 3)
        elif nblk == 4:
            _q80_group(accp, at, ga, la, scp, pa, 4)
        elif nblk == 5:
            _q80_group(accp, at, ga, la, scp, pa, 5)
        elif nblk == 6:
            _q80_group(accp, at, ga, la, scp, pa, 6)
        else:
            _q80_group(accp, at, ga, la, scp, pa, 7)

    @njit(**_nopts)
    def q8_0_buf(buf: int, t: int, k: int, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int,
                 r1: int) -> None:
        """Rows ``r0:r1`` of ``x @ W.T`` for Q8_0 from x's buffer (:func:`prepare`, LAYOUT_Q8_0)."""
        nb = k // 32
        accp = _stack_f64(64)
        acc = numba.carray(accp, 64)
        scp = _stack_f64(16)
        sc = numba.carray(scp, 16)
        ptp = _stack_f64(16)  # a last partial group's scales, zero past its blocks
        pt = numba.carray(ptp, 16)
        p16 = numba.carray(_f64p(buf), (t, k // 16))
        la = buf + t * k // 16 * 12
        ls = (k + 255) // 256 * 768  # limb_stride(k)
        rb = w.shape[1]
        for r in range(r0, r1):
            row = w[r]
            ra = w.ctypes.data + r * rb
            for s0 in range(0, t, 4):  # at most four activation rows at a time (the stack lanes)
                n4 = min(4, t - s0)
                for i in range(16 * n4):
                    acc[i] = 0.0
                for g in range((nb + 7) // 8):
                    nblk = min(8, nb - 8 * g)
                    for i in range(8):
                        v = np.float64(kernels._h(tab, row, 34 * (8 * g + i))) if i < nblk else 0.0
                        sc[2 * i] = v
                        sc[2 * i + 1] = v
                    ga = ra + 34 * 8 * g
                    for s in range(s0, s0 + n4):
                        lg = la + s * ls + g * 768
                        if nblk == 8:
                            _q80_group(accp, 16 * (s - s0), ga, lg, scp, buf + (s * (k // 16) + 16 * g) * 8, 8)
                        else:
                            for i in range(16):
                                pt[i] = p16[s, 16 * g + i] if i < 2 * nblk else 0.0
                            _q80_tail(accp, 16 * (s - s0), ga, lg, scp, ptp, nblk)
                for s in range(s0, s0 + n4):
                    a = 16 * (s - s0)
                    for i in range(8):
                        acc[a + i] += acc[a + 8 + i]
                    h0 = acc[a] + acc[a + 4]
                    h1 = acc[a + 1] + acc[a + 5]
                    h2 = acc[a + 2] + acc[a + 6]
                    h3 = acc[a + 3] + acc[a + 7]
                    out[s, r] = np.float32((h0 + h2) + (h1 + h3))

    def _direct(layout: int, kern, x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int,  # noqa: ANN001
                r1: int) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        t, k = x.shape
        buf = np.empty(-(-buffer_bytes(t, k) // 8), dtype=np.float64)
        prepare(layout, x.ctypes.data, t, k, buf.ctypes.data)
        kern(buf.ctypes.data, t, k, w, out, tab, r0, r1)

    def q4_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
        """Rows ``r0:r1`` of ``x @ W.T`` for Q4_K with the integer numerics (one call: quantize, then the rows)."""
        _direct(LAYOUT_Q4_K, q4_k_buf, x, w, out, tab, r0, r1)

    def q6_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
        """Rows ``r0:r1`` of ``x @ W.T`` for Q6_K with the integer numerics (:func:`q6_k_ref`)."""
        _direct(LAYOUT_Q6_K, q6_k_buf, x, w, out, tab, r0, r1)

    def q8_0(x: np.ndarray, w: np.ndarray, out: np.ndarray, tab: np.ndarray, r0: int, r1: int) -> None:
        """Rows ``r0:r1`` of ``x @ W.T`` for Q8_0 with the integer numerics (:func:`q8_0_ref`)."""
        _direct(LAYOUT_Q8_0, q8_0_buf, x, w, out, tab, r0, r1)
