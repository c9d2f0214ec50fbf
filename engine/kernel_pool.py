"""The kernel threads (engine/kernels.py): one round of products shared by the calling thread and helpers, with
the hand-offs inside compiled code.

A round is a table of products (one int64 row each: kernel, addresses and shapes of x, the stored weights
and out, row chunks); its chunks are numbered 0..total-1. Everyone (the caller and the helpers) claims the
next chunk with one compare-and-swap on a 64-bit word holding ``gen << GEN_SHIFT | next`` and computes it,
GIL released, until none is left; the caller then waits (spinning: chunks are microseconds) until every
claimed chunk is done. The generation in the word means a helper that wakes late can never claim a chunk of
a round other than the one it read the table of. A helper that finds no round waits for the next one
spinning for ``KERNEL_SPIN_US`` (decode issues a round every ~50-200 us, so a helper stays hot through a
forward pass without an OS wake-up per round), then blocks on a condition variable until woken.

Every chunk is computed by the same compiled code (``_chunk``) whichever thread claims it, and a row's bits
never depend on the chunking, so the thread count never changes a bit (tests/test_gguf_kernels.py).
"""

from __future__ import annotations

import platform
import threading
import time

import numpy as np

from . import dense_kernels, kernels, kernels_avx2, kernels_int, kernels_lut, kernels_q8
from .limits import KERNEL_CHUNK_WEIGHTS, KERNEL_SPIN_US, KERNEL_TAIL_SPLIT

import numba  # noqa: E402 - only imported when kernels.AVAILABLE (engine.kernels imports this lazily)
from llvmlite import ir  # noqa: E402
from numba import cfunc, njit  # noqa: E402
from numba.core import cgutils, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
GEN_SHIFT = 24  # low 24 bits of the word: the next chunk (a round has < 16 Mi chunks); high 39: the generation
# kernel address, x, T, K, w, N, row bytes, out, chunks, rows per chunk, first row, end row, and for the integer
# kernels (engine/kernels_int.py) the address of x's quantized buffer (passed to the kernel instead of x) and the
# layout to quantize x into it before the round (0 when another row of the table fills the same buffer)
_COLS = 14
_opts = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")


@intrinsic
def _load(typingctx, addr):  # noqa: ANN001, ANN202
    """Atomic (acquire) load of the int64 at ``addr``."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(types.int64), codegen


@intrinsic
def _store(typingctx, addr, v):  # noqa: ANN001, ANN202
    """Atomic (release) store of ``v`` to the int64 at ``addr``: every store before it is visible first."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        builder.store_atomic(args[1], ptr, "release", 8)
        return context.get_dummy_value()

    return types.none(types.int64, types.int64), codegen


@intrinsic
def _cas(typingctx, addr, old, new):  # noqa: ANN001, ANN202
    """Compare-and-swap of the int64 at ``addr``: True when it held ``old`` and now holds ``new``."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        res = builder.cmpxchg(ptr, args[1], args[2], "acq_rel", "acquire")
        return builder.extract_value(res, 1)

    return types.boolean(types.int64, types.int64, types.int64), codegen


@intrinsic
def _add(typingctx, addr, v):  # noqa: ANN001, ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "acq_rel")

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _fence(typingctx):  # noqa: ANN001, ANN202
    """A sequentially consistent fence: no load after it is done before a store ahead of it is visible."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _pause(typingctx):  # noqa: ANN001, ANN202
    """x86's ``pause`` in a spin loop (other CPUs: nothing, the loop's atomic load is enough)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _sched_yield(typingctx):  # noqa: ANN001, ANN202 - libc's sched_yield(), resolved by symbol (cacheable)
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


_ptr_intrinsic = kernels.ptr_intrinsic
_i64p = _ptr_intrinsic(types.int64)
_f32p = _ptr_intrinsic(types.float32)
_u8p = _ptr_intrinsic(types.uint8)
_u16p = _ptr_intrinsic(types.uint16)


# Each kernel is compiled once, as a C function called through its address (an indirect call: never inlined).
# Compiled into each caller instead, LLVM may schedule the same source differently (other contractions, other
# bits) and a row's result would depend on the path that computed it; and one function dispatching to all
# kernels measured 10-25% slower than each kernel alone.
_KERNEL_SIG = types.void(*([types.int64] * 10))  # x, T, K, w, N, row bytes, out, r0, r1, half table


_cfunc = cfunc(_KERNEL_SIG, cache=True, fastmath=kernels.FASTMATH, boundscheck=False, error_model="numpy")
# (top-level functions, not closures: numba keys a closure's cache entry on its pickled cells, which differ in
# every process, so each start recompiled them and added files to the cache)


@_cfunc
def _c_bf16(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
    kernels._bf16(numba.carray(_f32p(xa), (t, k)), numba.carray(_u16p(wa), (n, k)), numba.carray(_f32p(oa), (t, n)),
                  numba.carray(_f32p(ha), (65536,)), r0, r1)


@_cfunc
def _c_q8_0(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
    kernels._q8_0(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)), numba.carray(_f32p(oa), (t, n)),
                  numba.carray(_f32p(ha), (65536,)), r0, r1)


@_cfunc
def _c_q4_0(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
    kernels._q4_0(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)), numba.carray(_f32p(oa), (t, n)),
                  numba.carray(_f32p(ha), (65536,)), r0, r1)


@_cfunc
def _c_q4_k(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
    kernels._q45_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                   numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1, False)


if kernels_lut.AVAILABLE:  # compiled only where the CPU has the instructions (AVX-512)
    @_cfunc
    def _c_q4_k_lut(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - _c_q4_k's bits
        kernels_lut.q4_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                         numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1)

    @_cfunc
    def _c_q5_k_lut(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - _c_q5_k's bits
        kernels_lut.q5_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                         numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1)

    @_cfunc
    def _c_q6_k_lut(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - _c_q6_k's bits
        kernels_lut.q6_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                         numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1)


if kernels_q8.AVAILABLE:  # AVX-512: explicit 16-lane Q8_0 code (_c_q8_0's bits)
    @_cfunc
    def _c_q8_0_v(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - _c_q8_0's bits
        kernels_q8.q8_0(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                        numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1)


if kernels_avx2.AVAILABLE:  # AVX2 without AVX-512: explicit 8-lane code (the generic kernels' bits)
    @_cfunc
    def _c_q4_k_avx2(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - _c_q4_k's bits
        kernels_avx2.q4_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                          numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1)

    @_cfunc
    def _c_q6_k_avx2(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - _c_q6_k's bits
        kernels_avx2.q6_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                          numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1)

    @_cfunc
    def _c_q8_0_avx2(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - _c_q8_0's bits
        kernels_avx2.q8_0(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                          numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1)


if kernels_int.AVAILABLE:  # AVX-512 VNNI: integer dot products on exactly quantized activations (other bits)
    @_cfunc
    def _c_q4_k_int(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - kernels_int.q4_k_ref's bits
        # xa: x's quantized buffer (kernels_int.prepare, before the round)
        kernels_int.q4_k_buf(xa, t, k, numba.carray(_u8p(wa), (n, rb)), numba.carray(_f32p(oa), (t, n)),
                             numba.carray(_f32p(ha), (65536,)), r0, r1)

    @_cfunc
    def _c_q6_k_int(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - kernels_int.q6_k_ref's bits
        kernels_int.q6_k_buf(xa, t, k, numba.carray(_u8p(wa), (n, rb)), numba.carray(_f32p(oa), (t, n)),
                             numba.carray(_f32p(ha), (65536,)), r0, r1)

    @_cfunc
    def _c_q8_0_int(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - kernels_int.q8_0_ref's bits
        kernels_int.q8_0_buf(xa, t, k, numba.carray(_u8p(wa), (n, rb)), numba.carray(_f32p(oa), (t, n)),
                             numba.carray(_f32p(ha), (65536,)), r0, r1)


@_cfunc
def _c_q5_k(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
    kernels._q45_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)),
                   numba.carray(_f32p(oa), (t, n)), numba.carray(_f32p(ha), (65536,)), r0, r1, True)


@_cfunc
def _c_q6_k(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
    kernels._q6_k(numba.carray(_f32p(xa), (t, k)), numba.carray(_u8p(wa), (n, rb)), numba.carray(_f32p(oa), (t, n)),
                  numba.carray(_f32p(ha), (65536,)), r0, r1)


@_cfunc
def _c_f32(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202 - r0 a multiple of F32_ROW_ALIGN
    dense_kernels.f32_rows(numba.carray(_f32p(xa), (t, k)), numba.carray(_f32p(wa), (n, k)),
                           numba.carray(_f32p(oa), (t, n)), r0, r1)


_CFUNCS = {"F32": _c_f32, "BF16": _c_bf16, "Q8_0": _c_q8_0, "Q4_0": _c_q4_0, "Q4_K": _c_q4_k, "Q5_K": _c_q5_k,
           "Q6_K": _c_q6_k}
if kernels_lut.AVAILABLE:  # AVX-512: the table-lookup kernels (same bits, fewer operations per weight)
    _CFUNCS.update(Q4_K=_c_q4_k_lut, Q5_K=_c_q5_k_lut, Q6_K=_c_q6_k_lut)
if kernels_q8.AVAILABLE:  # AVX-512: Q8_0's weights shared by the activation rows, lanes in registers (same bits)
    _CFUNCS.update(Q8_0=_c_q8_0_v)
if kernels_avx2.AVAILABLE:  # (never with the two above: those need AVX-512)
    _CFUNCS.update(Q4_K=_c_q4_k_avx2, Q6_K=_c_q6_k_avx2, Q8_0=_c_q8_0_avx2)
if kernels_int.AVAILABLE:  # AVX-512 VNNI and MESHD_KERNELS_INT not 0: integer dot products (kernels_int's bits)
    _CFUNCS.update({q: {"Q4_K": _c_q4_k_int, "Q6_K": _c_q6_k_int, "Q8_0": _c_q8_0_int}[q]
                    for q in kernels_int.POOL_TYPES})
_ADDR = {q: int(f.address) for q, f in _CFUNCS.items()}
# kernel address -> the activation layout it reads (its table rows get a quantized buffer of x)
_INT_LAYOUT = ({int(_c_q4_k_int.address): kernels_int.LAYOUT_Q4_K, int(_c_q6_k_int.address): kernels_int.LAYOUT_Q6_K,
                int(_c_q8_0_int.address): kernels_int.LAYOUT_Q8_0} if kernels_int.AVAILABLE else {})
_HALF_ADDR = int(kernels.HALF.ctypes.data)  # the module's table lives as long as the process


@intrinsic
def _call_kernel(typingctx, fn, xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202, PLR0913
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        i64 = ir.IntType(64)
        f = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [i64] * 10).as_pointer())
        builder.call(f, list(args[1:]))
        return context.get_dummy_value()

    return types.none(*([types.int64] * 11)), codegen


@njit(inline="always")
def _chunk(table: np.ndarray, c: int, ha: int) -> None:
    """Compute chunk ``c`` of the round: rows of one product."""
    for p in range(table.shape[0]):
        n_chunks = table[p, 8]
        if c >= n_chunks:
            c -= n_chunks
            continue
        r0 = table[p, 10] + c * table[p, 9]
        r1 = min(table[p, 11], r0 + table[p, 9])
        _call_kernel(table[p, 0], table[p, 12] if table[p, 12] else table[p, 1], table[p, 2], table[p, 3], table[p, 4], table[p, 5], table[p, 6],
                     table[p, 7], r0, r1, ha)
        return


@njit(**_opts)
def _work(ctl: int, table: np.ndarray, ha: int, gen: int, total: int, wait: bool) -> None:
    """Claim and compute chunks of round ``gen`` until none is left; ``wait``: then until all are done."""
    mask = (1 << GEN_SHIFT) - 1
    while True:
        word = _load(ctl)
        g = word >> GEN_SHIFT
        if g < gen:  # the caller has set the table but not yet published the round
            _pause()
            continue
        if g != gen or (word & mask) >= total:
            break
        if _cas(ctl, word, word + 1):
            _chunk(table, word & mask, ha)
            _add(ctl + 8, 1)
    if wait:
        i = 0
        while _load(ctl + 8) < total:
            _pause()
            i += 1
            if i % 1024 == 0:  # ~30 us: a helper holding a chunk may need this core
                _sched_yield()


@njit(**_opts)
def _helper_loop(ctl: int, ha: int, seen: int, iters: int) -> int:
    """A helper's life while rounds keep coming: wait up to ``iters`` pauses for a round other than ``seen``,
    claim and compute its chunks (the table's address and size from ``ctl``), wait again. Returns the last
    round seen once no round came in time (the thread then blocks). Never needs the GIL."""
    mask = (1 << GEN_SHIFT) - 1
    while True:
        i = 0
        while True:
            g = _load(ctl) >> GEN_SHIFT
            if g != seen:
                break
            i += 1
            if i >= iters:
                return seen
            _pause()
            if i % 256 == 0:  # every ~7 us: a thread that needs this core (the event loop) gets it
                _sched_yield()
        seen = g
        while True:
            word = _load(ctl)
            if word >> GEN_SHIFT != g or (word & mask) >= _load(ctl + 24):
                break
            if _cas(ctl, word, word + 1):
                # claimed: round g cannot end before this chunk is done, so ctl still holds its table
                table = numba.carray(_i64p(_load(ctl + 16)), (_load(ctl + 32), _COLS))
                _chunk(table, word & mask, ha)
                _add(ctl + 8, 1)


@njit(**_opts)
def _spin(ctl: int, seen: int, iters: int) -> int:
    """Wait up to ``iters`` pauses for a round other than ``seen``; return the current generation."""
    for i in range(iters):
        g = _load(ctl) >> GEN_SHIFT
        if g != seen:
            return g
        _pause()
    return _load(ctl) >> GEN_SHIFT


@njit(**_opts)
def _publish(ctl: int, gen: int, tbl: np.ndarray, total: int) -> None:
    """Start round ``gen``: first mark the last round's word used up, then its table, then zero chunks done,
    then (release) the word helpers claim from. A helper that read the last round's word when every chunk was
    claimed, and this round's larger total after, would otherwise win its compare-and-swap on the old word
    before the new word is stored, compute a chunk of this round early and count it done: the round would
    end one chunk before its last one is written."""
    _store(ctl, ((_load(ctl) >> GEN_SHIFT) << GEN_SHIFT) | ((1 << GEN_SHIFT) - 1))
    # release stores, each after the one before: a plain store may be moved by the compiler ahead of the release
    # store above (release orders what comes before it only), and then a helper could see this round's total
    # with the last round's word, the race above
    _store(ctl + 16, tbl.ctypes.data)
    _store(ctl + 24, total)
    _store(ctl + 32, tbl.shape[0])
    _store(ctl + 8, 0)
    _store(ctl, gen << GEN_SHIFT)


if kernels_int.AVAILABLE:
    @njit(**_opts)
    def _prepare(table: np.ndarray) -> None:
        """Before a round: quantize each integer kernel row's x into its buffer (once per x and layout)."""
        for p in range(table.shape[0]):
            if table[p, 13]:
                kernels_int.prepare(table[p, 13], table[p, 1], table[p, 2], table[p, 3], table[p, 12])
else:
    @njit(**_opts)
    def _prepare(table: np.ndarray) -> None:
        pass


@njit(**_opts)
def _round(ctl: int, table: np.ndarray, ha: int, gen: int, total: int) -> bool:
    """Round ``gen``: the integer kernels' activations, publish, then, unless a helper has gone to sleep (then
    False: the caller wakes it and calls ``_work``), claim and wait, all in one compiled call (a call with an
    array argument costs ~1-2 us of dispatch, and a decoded token makes ~33 rounds). The fence pairs with the
    one in :func:`_sleeping`: a helper either sees this round before it waits or is counted here."""
    _prepare(table)
    _publish(ctl, gen, table, total)
    _fence()
    if _load(ctl + 40):
        return False
    _work(ctl, table, ha, gen, total, True)
    return True


@njit(**_opts)
def _sleeping(ctl: int, d: int) -> None:
    """A helper going to sleep (``d`` 1; before it checks for a round) or waking (-1): word 5 of ``ctl``."""
    _add(ctl + 40, d)
    _fence()


@njit(**_opts)
def take_rows(plain: np.ndarray, last: np.ndarray, sel: np.ndarray, out: np.ndarray) -> None:
    """A round's table from prebuilt per-item rows: ``out`` = ``plain[sel[0]]``, ..., ``plain[sel[-2]]``, then
    ``last[sel[-1]]`` (the round's end: its rows with finer last chunks), stacked. plain [E, P, cols], last
    [E, P', cols], sel [k] int64, out [(k-1) * P + P', cols] (a decode plan's expert rounds; ~4 us as numpy)."""
    p = plain.shape[1]
    k = sel.shape[0]
    for j in range(k - 1):
        out[j * p:(j + 1) * p] = plain[sel[j]]
    out[(k - 1) * p:] = last[sel[k - 1]]


@njit(**_opts)
def _serial(table: np.ndarray, ha: int, total: int) -> None:
    """Every chunk of a round on this thread, in order (after the integer kernels' activations)."""
    _prepare(table)
    for c in range(total):
        _chunk(table, c, ha)


@njit(**_opts)
def _fill(tbl: np.ndarray, i: int, fn: int, x: np.ndarray, w: np.ndarray, out: np.ndarray, a: int, b: int,
          chunk_weights: int, align: int) -> int:
    """Row ``i`` of a round's table (numba reads the addresses in ~0.3 us; ``ndarray.ctypes`` takes ~1.2 us
    each); returns its number of chunks, of a multiple of ``align`` rows each."""
    t, k = x.shape
    step = max(align, chunk_weights // max(1, k * t) // align * align)
    chunks = (b - a + step - 1) // step
    tbl[i, 0] = fn
    tbl[i, 1] = x.ctypes.data
    tbl[i, 2] = t
    tbl[i, 3] = k
    tbl[i, 4] = w.ctypes.data
    tbl[i, 5] = w.shape[0]
    tbl[i, 6] = w.shape[1] * w.itemsize
    tbl[i, 7] = out.ctypes.data
    tbl[i, 8] = chunks
    tbl[i, 9] = step
    tbl[i, 10] = a
    tbl[i, 11] = b
    return chunks


def _step(x: np.ndarray, qtype: str) -> tuple[int, int]:
    """(rows per chunk, row alignment) of a product with activations x (``_fill``'s rule)."""
    align = kernels.F32_ROW_ALIGN if qtype == "F32" else 1
    t, k = x.shape
    return max(align, KERNEL_CHUNK_WEIGHTS // max(1, k * t) // align * align), align


def _tail_split(products: list[tuple[np.ndarray, str, np.ndarray, np.ndarray]],
                rows_range: tuple[int, int] | None) -> tuple[int, int] | None:
    """Where the last product's rows are cut so that its last chunk's worth of rows (the round's end) is claimed
    in ``KERNEL_TAIL_SPLIT`` finer chunks: (first fine row, rows per fine chunk), or None (too few rows)."""
    if not products:
        return None
    x, qtype, data, _ = products[-1]
    a, b = rows_range if rows_range is not None else (0, data.shape[0])
    step, align = _step(x, qtype)
    fine = max(align, step // KERNEL_TAIL_SPLIT // align * align)
    if fine >= step or b - a <= step:
        return None
    return a + (b - a - step) // align * align, fine  # a multiple of align: every F32 chunk starts on a group


def table(products: list[tuple[np.ndarray, str, np.ndarray, np.ndarray]],
          rows_range: tuple[int, int] | None = None, tail: bool = True) -> tuple[np.ndarray, int, list, int]:
    """The round's table, its number of chunks, the arrays it points into beyond ``products`` (keep both alive
    through the round) and its number of weight-row products. x and out must be C-contiguous fp32 (the
    caller's); the stored data is made C-contiguous here (a copy only for an odd view). Integer kernel rows get
    a buffer for x's quantized form (one per x and layout, filled at the start of every run of the table), in
    the same allocation as the table: a view of it, so the table alone keeps the buffers alive too.

    Chunks are claimed in table order; with ``tail`` the last product's last chunk's worth of rows takes one
    more table row, of ``KERNEL_TAIL_SPLIT`` times finer chunks, so that the threads run out of work at most a
    fine chunk apart (a round waits for its slowest thread's last chunk). A row's bits never depend on its
    chunk (F32 chunks start on whole 8-row groups), so neither do the results."""
    layouts = [_INT_LAYOUT.get(_ADDR[q], 0) for _, q, _, _ in products] if _INT_LAYOUT else []
    bufs: dict[tuple[int, int], tuple[int, int]] = {}  # (id of x, layout) -> (offset in words, product index)
    split = _tail_split(products, rows_range) if tail else None
    rows = len(products) + (split is not None)
    words = rows * _COLS
    for i, layout in enumerate(layouts):
        x = products[i][0]
        if layout and (id(x), layout) not in bufs:
            bufs[(id(x), layout)] = (words, i)
            words += -(-kernels_int.buffer_bytes(x.shape[0], x.shape[1]) // 8)
    store = np.empty(words, dtype=np.int64)
    tbl = store[:rows * _COLS].reshape(rows, _COLS)
    tbl[:, 12:] = 0
    keep: list = [store] if bufs else []
    base = store.__array_interface__["data"][0] if bufs else 0
    total = 0
    weights = 0
    i = 0
    for x, qtype, data, out in products:
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
            keep.append(data)
        n = data.shape[0]
        a, b = rows_range if rows_range is not None else (0, n)
        if qtype == "F32" and a % kernels.F32_ROW_ALIGN:
            raise ValueError(f"F32 rows start on multiples of {kernels.F32_ROW_ALIGN}, not {a}")
        align = kernels.F32_ROW_ALIGN if qtype == "F32" else 1
        last = i == len(products) - 1 and split is not None
        total += _fill(tbl, i, _ADDR[qtype], x, data, out, a, split[0] if last else b,  # type: ignore[index]
                       KERNEL_CHUNK_WEIGHTS, align)
        if last:  # the fine tail: the same product from row split[0] on, split[1] rows a chunk
            total += _fill(tbl, i + 1, _ADDR[qtype], x, data, out, split[0], b,  # type: ignore[index]
                           split[1] * x.shape[0] * x.shape[1], align)  # type: ignore[index]
        if layouts and layouts[i]:
            off, first = bufs[(id(x), layouts[i])]
            tbl[i:i + 1 + last, 12] = base + 8 * off
            tbl[i, 13] = layouts[i] if first == i else 0
        weights += x.size * (b - a)
        i += 1
    if total >> GEN_SHIFT:
        raise ValueError(f"a round of {total} kernel chunks is too many (at most {(1 << GEN_SHIFT) - 1})")
    return tbl, total, keep, weights


def attend_table(prm: np.ndarray, heads: int) -> tuple[np.ndarray, int]:
    """A round of attention (``dense_kernels.attend_one``'s compiled kernel over the block ``prm``, written by
    ``dense_kernels.attend_params``), one chunk per KV head: the table and its number of chunks. The kernel is
    the one the serial ``attend_one`` calls, and a head's work depends on the head alone: the same bits on any
    number of threads. ``prm`` must stay alive (and describe live arrays) whenever the table runs."""
    tbl = np.zeros((1, _COLS), dtype=np.int64)
    tbl[0, 0] = dense_kernels.ATTEND_ADDR
    tbl[0, 1] = prm.__array_interface__["data"][0]
    tbl[0, 8] = heads
    tbl[0, 9] = 1
    tbl[0, 11] = heads
    return tbl, heads


def run_serial(products: list[tuple[np.ndarray, str, np.ndarray, np.ndarray]],
               rows_range: tuple[int, int] | None = None) -> None:
    """Every product (rows ``rows_range`` of each, default all) on this thread."""
    tbl, total, _keep, _ = table(products, rows_range)
    _serial(tbl, _HALF_ADDR, total)


def run_table_serial(tbl: np.ndarray, total: int) -> None:
    """Every chunk of a :func:`table` on this thread (its arrays kept alive by the caller)."""
    _serial(tbl, _HALF_ADDR, total)


def warm() -> None:
    """Compile (or load from the cache) the round functions the kernel threads use, on an empty round."""
    ctl = np.zeros(6, dtype=np.int64)
    tbl = np.zeros((0, _COLS), dtype=np.int64)
    _publish(int(ctl.ctypes.data), 1, tbl, 0)
    _work(int(ctl.ctypes.data), tbl, _HALF_ADDR, 1, 0, True)
    _prepare(tbl)
    _helper_loop(int(ctl.ctypes.data), _HALF_ADDR, 1, 1)
    _spin(int(ctl.ctypes.data), 1, 1)
    _round(int(ctl.ctypes.data), tbl, _HALF_ADDR, 2, 0)
    _sleeping(int(ctl.ctypes.data), 0)
    rows = np.zeros((1, 1, _COLS), dtype=np.int64)
    take_rows(rows, rows, np.zeros(1, dtype=np.int64), rows[0])


def _calibrate() -> int:
    """Pauses in ``KERNEL_SPIN_US`` microseconds (a pause is 10-150 cycles depending on the CPU)."""
    ctl = np.zeros(2, dtype=np.int64)
    n = 20000
    _spin(ctl.ctypes.data, 0, 100)
    t0 = time.perf_counter()
    _spin(ctl.ctypes.data, 0, n)
    per = max(1e-9, (time.perf_counter() - t0) / n)
    return max(1000, int(KERNEL_SPIN_US * 1e-6 / per))


_EMPTY = np.zeros((0, _COLS), dtype=np.int64)  # Pool.wake's round


class Pool:
    """``helpers`` threads that share each round with the caller; one round at a time (a lock serialises
    callers from several threads)."""

    def __init__(self, helpers: int) -> None:
        self._round = threading.Lock()
        self._cv = threading.Condition(threading.Lock())
        # [gen << GEN_SHIFT | next chunk, chunks done, table address, chunks, products, helpers asleep]
        self._ctl = np.zeros(6, dtype=np.int64)
        self._addr = int(self._ctl.ctypes.data)
        self._gen = 0
        self._keep: object = None
        self._spin_iters = _calibrate()
        for i in range(helpers):
            threading.Thread(target=self._helper, name=f"meshd-kernel-{i}", daemon=True).start()

    def _helper(self) -> None:
        seen = 0
        while True:
            seen = _helper_loop(self._addr, _HALF_ADDR, seen, self._spin_iters)
            with self._cv:
                _sleeping(self._addr, 1)
                while int(self._ctl[0]) >> GEN_SHIFT == seen:
                    self._cv.wait()
                _sleeping(self._addr, -1)

    def wake(self) -> None:
        """Wake sleeping helpers with an empty round (the caller holds ``self._round``): for rounds published by
        compiled code (engine.plan_kernels), which cannot signal the condition variable; a helper then spins
        through them as through ``run_table``'s."""
        self._gen += 1
        _publish(self._addr, self._gen, _EMPTY, 0)
        with self._cv:
            self._cv.notify_all()

    def run(self, products: list[tuple[np.ndarray, str, np.ndarray, np.ndarray]]) -> None:
        tbl, total, keep, _ = table(products)
        self.run_table(tbl, total, (products, keep))

    def run_table(self, tbl: np.ndarray, total: int, keep: object) -> None:
        """One round over a :func:`table`; ``keep``: every array it points into (alive through the round)."""
        with self._round:
            self._gen += 1
            gen = self._gen
            self._keep = (tbl, keep)
            if not _round(self._addr, tbl, _HALF_ADDR, gen, total):  # published; a helper sleeps: wake it
                with self._cv:
                    self._cv.notify_all()
                _work(self._addr, tbl, _HALF_ADDR, gen, total, True)
            self._keep = None
