"""A decode plan's layers in compiled calls (engine/decode_plan.py): the work between the kernel rounds of a
one-token step, and the rounds themselves, without coming back to Python except for the router's product.

A planned step used to make ~110 calls from Python per token on the bench model (a norm, the cache's attention
block, a norm, routing, two table takes, SwiGLU, the combination and five kernel rounds per layer, each round
its own Python method); each call costs 1-2 us hot and several times that in a decode step, where the weights
streamed by the rounds have pushed the interpreter's and numba's dispatch data out of the caches. Here one
compiled call (:func:`part`) runs a layer's routed half (routing .. the combination) and the next layer's
attention half (its norm .. the MLP's norm), so a token makes one call per layer plus the router's product.

Same bits: every float operation runs in the compiled function the general pass runs, compiled once, with its
own fastmath flags. numba compiles a callee with its caller's flags, and LLVM may schedule (and round) a function
inlined into two callers differently, so each is wrapped here as a C function (``cfunc``) with the flags of its
``engine.dense_kernels`` definition and called through its address, as the kernel threads call the products'
kernels; the rounds are ``engine.kernel_pool``'s own compiled functions (the same claims, the same kernels).
``tests/test_decode_plan.py`` checks the logits against the general pass; the rest of the parity tests run it.

Only imported with the compiled kernels (numba, the ``[fast]`` extra), like engine/kernel_pool.py.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit
from numba.core import types
from numba.extending import intrinsic

from . import dense_kernels as dk
from . import kernel_pool as kp

_i64p = kp._i64p
_f32p = kp._f32p
_f64p = kp._ptr_intrinsic(types.float64)
_SIG = types.void(*([types.int64] * 7))


@intrinsic
def _call7(typingctx, fn, a, b, c, d, e, f, g):  # noqa: ANN001, ANN202, PLR0913
    """Call the C function at address ``fn`` with seven int64 arguments (an indirect call: never inlined)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        i64 = ir.IntType(64)
        ptr = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [i64] * 7).as_pointer())
        builder.call(ptr, list(args[1:]))
        return context.get_dummy_value()

    return types.none(*([types.int64] * 8)), codegen


# the C functions, each compiled with its kernel's flags in engine.dense_kernels (_OPTS, _ROUTE_OPTS, combine_add's)
_FAST = dict(cache=True, fastmath=True, nogil=True, boundscheck=False, error_model="numpy")
_ROUTE = dict(_FAST, fastmath={"nnan", "ninf", "nsz", "contract", "arcp", "afn"})
_PLAIN = dict(cache=True, nogil=True, boundscheck=False)


@cfunc(_SIG, **_FAST)
def _c_rms(xa, wa, oa, n, epsa, _f, _g):  # noqa: ANN001, ANN202 - rmsnorm_rows(x [1, n], w [n], eps, out [1, n])
    dk.rmsnorm_rows(numba.carray(_f32p(xa), (1, n)), numba.carray(_f32p(wa), (n,)),
                    numba.carray(_f64p(epsa), (1,))[0], numba.carray(_f32p(oa), (1, n)))


@cfunc(_SIG, **_FAST)
def _c_add_rms(xa, oa, wa, ha, n, epsa, _g):  # noqa: ANN001, ANN202 - add_rmsnorm(x, o, w, eps, h)
    dk.add_rmsnorm(numba.carray(_f32p(xa), (1, n)), numba.carray(_f32p(oa), (1, n)), numba.carray(_f32p(wa), (n,)),
                   numba.carray(_f64p(epsa), (1,))[0], numba.carray(_f32p(ha), (1, n)))


@cfunc(_SIG, **_ROUTE)
def _c_route(la, e, norm, sela, wtsa, k, pa):  # noqa: ANN001, ANN202 - route_one(logits [e], norm, sel [k], wts [k])
    dk.route_into(numba.carray(_f32p(la), (e,)), norm != 0, numba.carray(_i64p(sela), (k,)),
                  numba.carray(_f32p(wtsa), (k,)), numba.carray(_f32p(pa), (e,)))


@cfunc(_SIG, **_FAST)
def _c_swiglu_sel(ga, ua, sela, e, n, k, _g):  # noqa: ANN001, ANN202 - swiglu_sel(g [e, 1, n], u, sel [k])
    dk.swiglu_sel(numba.carray(_f32p(ga), (e, 1, n)), numba.carray(_f32p(ua), (e, 1, n)),
                  numba.carray(_i64p(sela), (k,)))


@cfunc(_SIG, **_PLAIN)
def _c_combine(xa, wtsa, sela, ya, e, d, k):  # noqa: ANN001, ANN202 - combine_add(x [1, d], wts, sel, y [e, 1, d])
    dk.combine_add(numba.carray(_f32p(xa), (1, d)), numba.carray(_f32p(wtsa), (k,)), numba.carray(_i64p(sela), (k,)),
                   numba.carray(_f32p(ya), (e, 1, d)))


# (addresses handed over in the plan's words, never read as globals: numba would bake a global into its cached
# machine code, and every process has its own addresses)
FUNCS = tuple(int(f.address) for f in (_c_rms, _c_add_rms, _c_route, _c_swiglu_sel, _c_combine))

# a layer's row of the program (int64 words): norms, its rounds' tables (address, rows, chunks, shared), attention's
# block and table, the expert rounds' per-expert rows (address of the plain and the last-slot rows, rows each)
(L_ATTN_NORM, L_MLP_NORM, L_QKV, L_QKV_ROWS, L_QKV_TOTAL, L_QKV_POOL, L_ATT_PRM, L_ATT_TBL, L_O, L_O_ROWS, L_O_TOTAL,
 L_O_POOL, L_GU_PLAIN, L_GU_LAST, L_GU_P, L_GU_PT, L_GU_TBL, L_GU_TOTAL, L_GU_POOL, L_DN_PLAIN, L_DN_LAST, L_DN_P,
 L_DN_PT, L_DN_TBL, L_DN_TOTAL, L_DN_POOL) = range(26)
LAYER_WORDS = 26
# the plan's words: its buffers' addresses and sizes, the head's round, the step's position and attention's sharing,
# the kernel threads' words (0: none), the helper table and the C functions' addresses
(G_X, G_H, G_O, G_G, G_U, G_Y, G_SEL, G_WTS, G_P, G_D, G_E, G_I, G_K, G_NKV, G_NORM_TOPK, G_EPS, G_HEAD_NORM,
 G_HEAD, G_HEAD_ROWS, G_HEAD_TOTAL, G_HEAD_POOL, G_POS, G_LO, G_ATT_POOL, G_CTL, G_HA, G_RMS, G_ADD_RMS, G_ROUTE,
 G_SWIGLU_SEL, G_COMBINE, G_STATS) = range(32)
PLAN_WORDS = 32
# G_STATS: 0, or the address of int64 [3] a bench reads (bench/decode_rounds.py): cycles inside part() calls, cycles
# inside their rounds (publish to every chunk done), rounds run


@intrinsic
def _cycles(typingctx):  # noqa: ANN001, ANN202 - the CPU's cycle counter (G_STATS' timing)
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(**kp._opts)
def _run(ctl: int, ha: int, addr: int, rows: int, total: int, shared: int, gen: int, stats: int) -> int:
    """One round of the table at ``addr`` (``rows`` rows): on the kernel threads (``ctl``, the pool's words; 0:
    none) when ``shared``, as ``Pool.run_table`` runs it, else on this thread; returns the last round's number,
    as ``~number`` (negative) once a helper was found asleep: a helper is not woken here (that needs Python),
    this thread computes every chunk itself, and :func:`part`'s caller wakes the helper after the call."""
    tbl = numba.carray(_i64p(addr), (rows, kp._COLS))
    t0 = _cycles() if stats else 0
    if ctl == 0 or shared == 0:
        kp._serial(tbl, ha, total)
    else:
        gen = (gen if gen >= 0 else ~gen) + 1
        if not kp._round(ctl, tbl, ha, gen, total):
            kp._work(ctl, tbl, ha, gen, total, True)
            gen = ~gen  # (negative: a helper is asleep, part()'s caller wakes it)
    if stats:
        st = numba.carray(_i64p(stats), (3,))
        st[1] += _cycles() - t0
        st[2] += 1
    return gen


@njit(inline="always")
def _take(plain: int, last: int, p: int, pt: int, e: int, sel: np.ndarray, out: int) -> None:
    """kernel_pool.take_rows on addresses: the chosen experts' table rows into the round's table."""
    cols = kp._COLS
    k = sel.shape[0]
    kp.take_rows(numba.carray(_i64p(plain), (e, p, cols)), numba.carray(_i64p(last), (e, pt, cols)), sel,
                 numba.carray(_i64p(out), ((k - 1) * p + pt, cols)))


@njit(**kp._opts)
def part(prog: np.ndarray, g: np.ndarray, j: int, routed: bool, logits: np.ndarray, kc: np.ndarray, vc: np.ndarray,
         cos: np.ndarray, sin: np.ndarray, gen: int) -> int:
    """Layer ``j - 1``'s routed half when ``routed`` (its router's logits given: routing, gate/up round, SwiGLU,
    down round, the combination added to x), then layer ``j``'s attention half (norm, q/k/v round, attention over
    the cache kc/vc at position ``g[G_POS]`` with angles cos/sin, o round, x += o and the MLP's norm into h), or,
    when ``j`` is past the last layer, the final norm and the head's round if the plan has one (``g[G_HEAD]``).
    ``gen``: the kernel threads' last round number; returns theirs after this call's rounds (``~number`` if a
    helper was found asleep: see :func:`_run`)."""
    ctl, ha, stats = g[G_CTL], g[G_HA], g[G_STATS]
    t0 = _cycles() if stats else 0
    d, e, k = g[G_D], g[G_E], g[G_K]
    x, h = g[G_X], g[G_H]
    sel = numba.carray(_i64p(g[G_SEL]), (k,))
    if routed:
        lp = prog[j - 1]
        _call7(g[G_ROUTE], logits.ctypes.data, e, g[G_NORM_TOPK], g[G_SEL], g[G_WTS], k, g[G_P])
        _take(lp[L_GU_PLAIN], lp[L_GU_LAST], lp[L_GU_P], lp[L_GU_PT], e, sel, lp[L_GU_TBL])
        gen = _run(ctl, ha, lp[L_GU_TBL], (k - 1) * lp[L_GU_P] + lp[L_GU_PT], lp[L_GU_TOTAL], lp[L_GU_POOL], gen,
                   stats)
        _call7(g[G_SWIGLU_SEL], g[G_G], g[G_U], g[G_SEL], e, g[G_I], k, 0)
        _take(lp[L_DN_PLAIN], lp[L_DN_LAST], lp[L_DN_P], lp[L_DN_PT], e, sel, lp[L_DN_TBL])
        gen = _run(ctl, ha, lp[L_DN_TBL], (k - 1) * lp[L_DN_P] + lp[L_DN_PT], lp[L_DN_TOTAL], lp[L_DN_POOL], gen,
                   stats)
        _call7(g[G_COMBINE], x, g[G_WTS], g[G_SEL], g[G_Y], e, d, k)
    if j >= prog.shape[0]:
        if g[G_HEAD]:
            _call7(g[G_RMS], x, g[G_HEAD_NORM], h, d, g[G_EPS], 0, 0)
            gen = _run(ctl, ha, g[G_HEAD], g[G_HEAD_ROWS], g[G_HEAD_TOTAL], g[G_HEAD_POOL], gen, stats)
        if stats:
            numba.carray(_i64p(stats), (3,))[0] += _cycles() - t0
        return gen
    lp = prog[j]
    _call7(g[G_RMS], x, lp[L_ATTN_NORM], h, d, g[G_EPS], 0, 0)
    gen = _run(ctl, ha, lp[L_QKV], lp[L_QKV_ROWS], lp[L_QKV_TOTAL], lp[L_QKV_POOL], gen, stats)
    # attend_cache's words (and its checks: a ValueError here, before the kernel reads the cache)
    dk.attend_cache(numba.carray(_i64p(lp[L_ATT_PRM]), (dk.ATTEND_WORDS,)), kc, vc, cos, sin, g[G_POS], g[G_LO])
    gen = _run(ctl, ha, lp[L_ATT_TBL], 1, g[G_NKV], g[G_ATT_POOL], gen, stats)
    gen = _run(ctl, ha, lp[L_O], lp[L_O_ROWS], lp[L_O_TOTAL], lp[L_O_POOL], gen, stats)
    _call7(g[G_ADD_RMS], x, g[G_O], lp[L_MLP_NORM], h, d, g[G_EPS], 0)
    if stats:
        numba.carray(_i64p(stats), (3,))[0] += _cycles() - t0
    return gen
