"""Every product of the forward pass: ``engine.quant`` for packed weights, and a compiled decode kernel for
fp32 weights (``engine.kernels``' F32 row kernel, numba: the optional ``[fast]`` extra) where it reads faster
than BLAS. fp32 and packed decode products share one pool of kernel threads (``engine.kernel_pool``): a
``matmul_many`` of both kinds is one round, one hand-off.

The choice for an fp32 weight depends only on the number of activation rows (``<= KERNEL_MAX_ROWS``), the
weight's size (``>= DENSE_KERNEL_MIN_WEIGHTS``: a test-sized model never imports numba) and whether numba
is installed, so every process computing the same rows (local pass, expert worker, pipeline stage) makes
the same choice and gets the same bits. ``MESHD_KERNELS=numpy`` turns the kernel off, as for the packed ones.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

from . import quant
from .limits import ATTEND_POOL_MIN_MACS, DENSE_KERNEL_MIN_WEIGHTS, KERNEL_MAX_ROWS

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
            and x.shape[0] <= KERNEL_MAX_ROWS and w.flags.c_contiguous and _kernels() is not None
            and quant._kernels().AVAILABLE)


def threads() -> int:
    """Threads computing fp32 decode products: the kernel threads' count (``engine.kernels.threads``), since
    fp32 products run in the same pool and rounds as the packed ones."""
    return quant._kernels().threads()


def _f32_many(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    todo = []
    for x, w in pairs:
        if x.dtype != F32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=F32)
        todo.append((x, "F32", w, np.empty((x.shape[0], w.shape[0]), dtype=F32)))
    quant._kernels().run_products(todo)
    return [t[3] for t in todo]


def _f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return _f32_many([(x, w)])[0]


def matmul(x: np.ndarray, w: object) -> np.ndarray:
    """``x @ w.T``: [T, K] -> [T, N] fp32, for any weight the engine holds."""
    if _f32_kernel(x, w):
        return _f32(x, w)  # type: ignore[arg-type]
    return quant.matmul(x, w)  # type: ignore[arg-type]  # a prefill's in column pieces (engine.products)


def matmul_many(pairs: list[tuple[np.ndarray, object]]) -> list[np.ndarray]:
    """``[matmul(x, w) for x, w in pairs]``, bit for bit: every product with a compiled kernel (fp32 and packed
    alike) in one round of the kernel threads (``engine.kernels.run_products``), the others one by one."""
    fast = [_f32_kernel(x, w) for x, w in pairs]  # decode rows only (<= KERNEL_MAX_ROWS)
    if not any(fast):
        return quant.matmul_many(pairs)  # type: ignore[arg-type]
    todo = []
    outs: list[np.ndarray | None] = []
    for (x, w), f in zip(pairs, fast):
        if f or quant._uses_kernel(x, w):
            if x.dtype != F32 or not x.flags.c_contiguous:
                x = np.ascontiguousarray(x, dtype=F32)
            data = w if f else w.data  # type: ignore[union-attr]
            out = np.empty((x.shape[0], data.shape[0]), dtype=F32)
            todo.append((x, "F32" if f else w.qtype, data, out))  # type: ignore[union-attr]
            outs.append(out)
        else:
            outs.append(None)
    quant._kernels().run_products(todo)
    return [o if o is not None else matmul(x, w) for o, (x, w) in zip(outs, pairs)]


def uses_kernel(weights: list[object]) -> bool:
    """Whether a decode over these weights would use the fp32 kernel (then ``warm`` is worth calling)."""
    return any(isinstance(w, np.ndarray) and w.dtype == F32 and w.ndim == 2 and w.size >= DENSE_KERNEL_MIN_WEIGHTS
               for w in weights)


def warm(weights: list[object]) -> None:
    """Load the compiled kernels now if a decode over ``weights`` would use them (numba's import and cache:
    the first request does not stall, and the runtime's memory is paid before any activation)."""
    if uses_kernel(weights) and (mod := _kernels()) is not None:
        mod.warm()
        quant._kernels().warm()  # the fp32 row kernel and the kernel threads' round functions


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


def attend_one(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, eps: float,
               cos: np.ndarray, sin: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: int, lo: int, scale: float,
               out: np.ndarray) -> None:
    """``engine.dense_kernels.attend_one`` (callers check ``step_kernels`` first), split by KV head over the
    kernel threads when it has at least ``ATTEND_POOL_MIN_MACS`` multiply-adds (``kernel_pool.attend_table``: the
    same compiled kernel, so the same bits) and the thread may use the pool."""
    nh, hd, vd = q.shape[0], q.shape[1], v.shape[1]
    kern = quant._kernels()
    pool = None
    if nh * (pos + 1 - lo) * (hd + vd) >= ATTEND_POOL_MIN_MACS and not kern.is_single_threaded():
        pool = kern._get_pool()
    if pool is None:
        _mod.attend_one(q, k, v, q_norm, k_norm, eps, cos, sin, kc, vc, pos, lo, scale, out)  # type: ignore[union-attr]
        return
    from . import kernel_pool

    prm = np.empty(_mod.ATTEND_WORDS, dtype=np.int64)  # type: ignore[union-attr]
    _mod.attend_params(prm, q, k, v, q_norm, k_norm, eps, cos, sin, kc, vc, pos, lo, scale, out)  # type: ignore[union-attr]
    tbl, total = kernel_pool.attend_table(prm, k.shape[0])
    pool.run_table(tbl, total, (prm, q, k, v, q_norm, k_norm, cos, sin, kc, vc, out))


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
