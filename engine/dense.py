"""Every product of the forward pass: ``engine.quant`` for packed weights, and a compiled decode kernel for
fp32 weights (``engine.dense_kernels``, numba: the optional ``[fast]`` extra) where it reads faster than BLAS.

The choice for an fp32 weight depends only on the number of activation rows (``<= KERNEL_MAX_ROWS``), the
weight's size (``>= DENSE_KERNEL_MIN_WEIGHTS``: a test-sized model never imports numba) and whether numba
is installed, so every process computing the same rows (local pass, expert worker, pipeline stage) makes
the same choice and gets the same bits. ``MESHD_KERNELS=numpy`` turns the kernel off, as for the packed ones.
"""

from __future__ import annotations

import itertools
import os
import threading
from types import ModuleType

import numpy as np

from . import quant
from .limits import (DENSE_CHUNK_WEIGHTS, DENSE_KERNEL_MIN_WEIGHTS, DENSE_MAX_PLANS, DENSE_POOL_MIN_WEIGHTS,
                     DENSE_ROUND_MAX_PRODUCTS, KERNEL_MAX_ROWS)

F32 = np.float32

_mod: ModuleType | None = None
_tried = False


def _kernels() -> ModuleType | None:
    """``engine.dense_kernels`` on first use, or None without numba (or with ``MESHD_KERNELS=numpy``)."""
    global _mod, _tried
    if not _tried:
        _tried = True
        if os.environ.get("MESHD_KERNELS", "").lower() != "numpy":
            try:
                from . import dense_kernels
            except ImportError:  # pragma: no cover - exercised when numba is absent
                dense_kernels = None  # type: ignore[assignment]
            _mod = dense_kernels
    return _mod


def _f32_kernel(x: np.ndarray, w: object) -> bool:
    return (isinstance(w, np.ndarray) and w.dtype == F32 and w.ndim == 2 and w.size >= DENSE_KERNEL_MIN_WEIGHTS
            and x.shape[0] <= KERNEL_MAX_ROWS and w.flags.c_contiguous and _kernels() is not None)


class _Round:
    __slots__ = ("args", "entry", "done")

    def __init__(self, args: tuple) -> None:
        self.args = args  # run_jobs' arguments: the products, the job table and the shared claim counter
        self.entry = itertools.count()  # 0 goes to whichever of caller (closing) and helper (joining) is first
        self.done = threading.Lock()
        self.done.acquire()  # released by the helper when it joined and ran out of jobs


class _Pool:
    """One helper thread that shares rounds of product chunks with the caller (2 cores: the weights stream at
    ~46 GB/s from two readers against ~37 from one). Both run ``dense_kernels.run_jobs`` on the round, which
    claims chunks with an atomic counter without the GIL, so a round costs one wake-up of the helper and
    no GIL hand-off per chunk; the caller then waits only if the helper joined the round, so a helper that
    is not scheduled costs nothing. Raw locks only."""

    def __init__(self) -> None:
        self._busy = threading.Lock()  # one round at a time; another thread's products run on that thread
        self._go = threading.Lock()
        self._go.acquire()
        self._round = _Round(())
        threading.Thread(target=self._helper, name="meshd-dense", daemon=True).start()

    def _helper(self) -> None:
        while True:
            self._go.acquire()
            r = self._round
            if next(r.entry):  # the caller closed this round before we woke
                continue
            try:
                _mod.run_jobs(*r.args)  # type: ignore[union-attr]
            finally:
                r.done.release()

    def run(self, args: tuple) -> bool:
        """Run a round with the helper; False (nothing done) when another thread's round is in progress."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            r = _Round(args)
            self._round = r
            if self._go.locked():
                self._go.release()
            _mod.run_jobs(*args)  # type: ignore[union-attr]
            if next(r.entry):  # the helper joined: wait for its last chunk
                r.done.acquire()
        finally:
            self._busy.release()
        return True


_pool: _Pool | None = None
_pool_checked = False


def threads() -> int:
    """Threads computing fp32 decode products: 2 (the caller and one helper) unless ``MESHD_KERNEL_THREADS``
    (the compiled kernels' setting) or the CPUs this process may use say 1."""
    env = os.environ.get("MESHD_KERNEL_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return min(int(env), 2)
    try:
        return min(2, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return min(2, os.cpu_count() or 1)


def _get_pool() -> _Pool | None:
    global _pool, _pool_checked
    if not _pool_checked:
        _pool_checked = True
        if threads() > 1:
            _pool = _Pool()
    return _pool


def _forget_pool() -> None:  # a forked child has no helper thread
    global _pool, _pool_checked
    _pool, _pool_checked = None, False


os.register_at_fork(after_in_child=_forget_pool)


_plans: dict[tuple, tuple[np.ndarray, int]] = {}  # product shapes -> (job table, weights x rows)


def _plan(shapes: tuple[tuple[int, int, int], ...]) -> tuple[np.ndarray, int]:
    """The job table of a round of products of these (rows, N, K) shapes: row chunks of about
    ``DENSE_CHUNK_WEIGHTS``, starting on multiples of 8."""
    jobs, total = [], 0
    for p, (t, n, k) in enumerate(shapes):
        total += n * k * t
        step = max(8, DENSE_CHUNK_WEIGHTS // max(1, k * t) // 8 * 8)
        jobs += [(p, a, min(n, a + step)) for a in range(0, n, step)]
    return np.array(jobs, dtype=np.int64), total  # never written: shared by every round of these shapes


def _run(products: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """Each (x, w, out) fp32 product into its ``out``, in one ``run_jobs`` round: chunks of rows (starting on
    multiples of 8, so a row's bits do not depend on the split) shared with the helper when the round is big
    enough, else all on this thread."""
    if len(products) > DENSE_ROUND_MAX_PRODUCTS:  # numba compiles one run_jobs per tuple length: warm() covers these
        for a in range(0, len(products), DENSE_ROUND_MAX_PRODUCTS):
            _run(products[a : a + DENSE_ROUND_MAX_PRODUCTS])
        return
    if len({w.flags.writeable for _, w, _ in products}) > 1:  # one tuple type per round: split read-only from not
        for _, group in itertools.groupby(sorted(products, key=lambda p: p[1].flags.writeable),
                                          key=lambda p: p[1].flags.writeable):
            _run(list(group))
        return
    shape = tuple((x.shape[0], *w.shape) for x, w, _ in products)
    plan = _plans.get(shape)
    if plan is None:
        plan = _plan(shape)
        if len(_plans) >= DENSE_MAX_PLANS:
            _plans.clear()
        _plans[shape] = plan
    jobs, total = plan
    # numba compiles run_jobs once per tuple length: pad to a power of two with the first product (no job
    # refers to the pads), so 5 variants cover 1-16 products (warm() compiles those, ~8 s once per machine)
    pad = [products[0]] * ((1 << (len(products) - 1).bit_length()) - len(products))
    xs, ws, outs = (tuple(p[i] for p in (*products, *pad)) for i in range(3))
    args = (xs, ws, outs, jobs, np.zeros(1, dtype=np.int64))
    pool = _get_pool() if total >= DENSE_POOL_MIN_WEIGHTS else None
    if pool is None or not pool.run(args):
        _mod.run_jobs(*args)  # type: ignore[union-attr]


def _f32_many(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    todo = []
    for x, w in pairs:
        x = np.ascontiguousarray(x, dtype=F32)
        todo.append((x, w, np.empty((x.shape[0], w.shape[0]), dtype=F32)))
    _run(todo)
    return [t[2] for t in todo]


def _f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return _f32_many([(x, w)])[0]


def matmul(x: np.ndarray, w: object) -> np.ndarray:
    """``x @ w.T``: [T, K] -> [T, N] fp32, for any weight the engine holds."""
    if _f32_kernel(x, w):
        return _f32(x, w)  # type: ignore[arg-type]
    return x @ w.T  # type: ignore[attr-defined]


def matmul_many(pairs: list[tuple[np.ndarray, object]]) -> list[np.ndarray]:
    """``[matmul(x, w) for x, w in pairs]``, bit for bit; the packed ones in one ``quant.matmul_many`` round."""
    fast = [_f32_kernel(x, w) for x, w in pairs]
    if not any(fast):
        return quant.matmul_many(pairs)  # type: ignore[arg-type]
    mine = iter(_f32_many([p for p, f in zip(pairs, fast) if f]))  # type: ignore[misc]
    rest = iter(quant.matmul_many([p for p, f in zip(pairs, fast) if not f]))  # type: ignore[misc]
    return [next(mine) if f else next(rest) for f in fast]


def uses_kernel(weights: list[object]) -> bool:
    """Whether a decode over these weights would use the fp32 kernel (then ``warm`` is worth calling)."""
    return any(isinstance(w, np.ndarray) and w.dtype == F32 and w.ndim == 2 and w.size >= DENSE_KERNEL_MIN_WEIGHTS
               for w in weights)


def warm(weights: list[object]) -> None:
    """Load the compiled kernels now if a decode over ``weights`` would use them (numba's import and cache:
    the first request does not stall, and the runtime's memory is paid before any activation)."""
    if uses_kernel(weights) and (mod := _kernels()) is not None:
        mod.warm()


def step_kernels(hidden: int, heads: int, head_dim: int, qk_norm: str, clip_qkv: float | None) -> bool:
    """Whether a model of this shape runs its decode attention (one new position per sequence) compiled:
    numba is there, the model is not test-sized (q is at least ``DENSE_KERNEL_MIN_WEIGHTS`` weights) and its
    attention has no full-width q/k norm or clipping. Depends on the config only, so a pipeline stage decides
    as the whole model does."""
    return (hidden * heads * head_dim >= DENSE_KERNEL_MIN_WEIGHTS and qk_norm in ("none", "head")
            and clip_qkv is None and _kernels() is not None)


def warm_step() -> None:
    """Load the compiled decode-step kernels now (see ``warm``)."""
    if (mod := _kernels()) is not None:
        mod.warm()


def attend_one(*args: object) -> None:
    """``engine.dense_kernels.attend_one`` (callers check ``step_kernels`` first)."""
    _mod.attend_one(*args)  # type: ignore[union-attr]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``ops.rmsnorm`` of a few rows [T, n] compiled (callers check ``step_kernels`` first)."""
    x = np.ascontiguousarray(x, dtype=F32)
    out = np.empty_like(x)
    _mod.rmsnorm_rows(x, w, eps, out)  # type: ignore[union-attr]
    return out


def swiglu_compiled(x: np.ndarray, gate: object) -> bool:
    """Whether an expert's SwiGLU on rows x runs compiled: decode rows, a gate of at least
    ``DENSE_KERNEL_MIN_WEIGHTS`` weights (any stored type) and numba; depends on the item alone, so a worker
    computing it by itself decides as the local pass does."""
    shape = getattr(gate, "shape", (0, 0))
    return x.shape[0] <= KERNEL_MAX_ROWS and shape[0] * shape[1] >= DENSE_KERNEL_MIN_WEIGHTS and _kernels() is not None


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``silu(g) * u`` compiled, into g (callers check ``swiglu_compiled`` first)."""
    _mod.swiglu(g, u)  # type: ignore[union-attr]
    return g


def route_one(logits: np.ndarray, top_k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax top-k routing of one token compiled: logits [E] -> experts [1, k] int64, weights [1, k] fp32
    (callers check ``step_kernels`` first)."""
    experts = np.empty((1, top_k), dtype=np.int64)
    weights = np.empty((1, top_k), dtype=F32)
    _mod.route_one(np.ascontiguousarray(logits, dtype=F32), norm, experts[0], weights[0])  # type: ignore[union-attr]
    return experts, weights
