"""The prefill threads: a prefill's independent pieces (a routed layer's work items, attention's KV groups, the
column pieces of a product, row ranges of the row-wise steps) on several Python threads, with BLAS held at one
thread for the whole process.

Why threads of our own: numpy runs BLAS products on BLAS's threads but every other operation (softmax, SwiGLU,
gathers, the combination, norms) on the calling thread alone, and a routed layer's products are small, so BLAS's
threads spend much of each product waiting for each other. Here the pieces themselves are spread over the threads,
each running whole on one thread.

Bits: BLAS's own threads split a product in their own way, and one and two OpenBLAS threads give other last bits
for most prefill-sized shapes on some CPUs (OpenBLAS's ``Haswell`` kernels: an AMD EPYC VM, and a Zen 4 VM with
them forced by ``OPENBLAS_CORETYPE``), so the products' bits followed ``OPENBLAS_NUM_THREADS`` and the core count.
So at import this module sets OpenBLAS's thread count to 1 for the process, for good (``openblas_set_num_threads``;
the count is the process's, not a thread's), and every product of the engine is a single-threaded BLAS call: the
big ones cut into column pieces by a rule of their shape (engine/products.py), a piece the same call on the same
arrays whichever thread runs it, so no bit depends on the thread counts. Where the count cannot be set (another
BLAS than OpenBLAS) nothing is pinned, ``run`` calls the tasks in order on the calling thread, and the numerics
tag says so (``pinned``: engine/numerics.py).

``run(tasks)`` runs callables and returns when all are done (the first exception re-raised in the caller).
Threads: ``MESHD_PREFILL_THREADS``, else BLAS's own thread count as it was before this module set it to 1 (so
``OPENBLAS_NUM_THREADS`` sets it, else OpenBLAS's default: the core count), at most ``PREFILL_MAX_THREADS``; the
helpers are daemon threads made on first use, shared by every thread of the process (a caller whose helpers are
busy does its pieces itself; a task may call ``run`` itself).
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np  # noqa: F401 - loads numpy's BLAS, which _openblas looks for among the mapped libraries

from .limits import PREFILL_MAX_THREADS
from .numerics import openblas_libs

Task = Callable[[], object]


def _openblas() -> tuple[Callable[[int], object], Callable[[], int]] | None:
    """numpy's OpenBLAS ``(set_num_threads, get_num_threads)``, found among the libraries this process has mapped
    (as engine/numerics.py reads its core), or None (not Linux, not OpenBLAS)."""
    for dll in openblas_libs():
        put = next((getattr(dll, s) for s in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                                              "openblas_set_num_threads64_", "openblas_set_num_threads")
                    if hasattr(dll, s)), None)
        get = next((getattr(dll, s) for s in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                                              "openblas_get_num_threads64_", "openblas_get_num_threads")
                    if hasattr(dll, s)), None)
        if put is None or get is None:
            continue
        put.argtypes, put.restype = [ctypes.c_int], None
        get.argtypes, get.restype = [], ctypes.c_int
        return put, get
    return None


def _pin() -> tuple[tuple[Callable[[int], object], Callable[[], int]] | None, int]:
    """OpenBLAS held at one thread for the process: ``(its functions or None, its own count before)``."""
    blas = _openblas()
    if blas is None:
        return None, 1
    own = max(1, blas[1]())
    blas[0](1)
    if blas[1]() != 1:  # pragma: no cover - an OpenBLAS that ignores the call
        return None, own
    return blas, own


_blas, _blas_threads = _pin()  # before any product of the engine (every path that computes imports this module)


def pinned() -> bool:
    """Whether BLAS runs on one thread for this process (OpenBLAS found and set), so that no product's bits depend
    on a thread count."""
    return _blas is not None and _blas[1]() == 1


class _Job:
    """One ``run``: its tasks claimed one at a time by whoever calls ``work``."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = tasks
        self._next = 0
        self._done = 0
        self._lock = threading.Lock()
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        """Claim and run tasks until none is left."""
        n = len(self.tasks)
        while True:
            with self._lock:
                i = self._next
                self._next += 1
            if i >= n:
                return
            try:
                self.tasks[i]()
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
                if self.error is None:
                    self.error = e
            with self._lock:
                self._done += 1
                if self._done == n:
                    self.finished.set()


def _kernels_alone() -> object:
    """``engine.kernels.single_threaded()``: a run's tasks compute their compiled-kernel products (a prefill's
    expert items of at most ``KERNEL_MAX_ROWS`` rows, quantized tiles) on their own thread, not in a round of the
    kernel threads, whose helpers would spin on the cores the run's other threads are using (the same bits: a
    row's never depend on the kernel threads). Imported here, not at the top: engine.kernels imports engine.quant,
    which imports engine.products, which imports this module."""
    global _kernels
    if _kernels is None:
        from . import kernels

        _kernels = kernels
    return _kernels.single_threaded()


_kernels = None


class _Pool:
    def __init__(self, helpers: int) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        for i in range(helpers):
            threading.Thread(target=self._helper, name=f"meshd-prefill-{i}", daemon=True).start()
        self.helpers = helpers

    def _helper(self) -> None:
        with _kernels_alone():  # a helper only ever runs a run's tasks
            while True:
                self._jobs.get().work()

    def run(self, tasks: Sequence[Task]) -> None:
        job = _Job(tasks)
        for _ in range(min(self.helpers, len(tasks) - 1)):
            self._jobs.put(job)
        with _kernels_alone():
            job.work()
        job.finished.wait()
        # A helper that did not wake before the caller ran every task takes this job off the queue only when it
        # next gets the GIL, up to a switch interval later, when the next layer already runs: the tasks (closures
        # over a layer's expert outputs and gathered slots, ~6 MiB of a 256-token prefill) must not live that long.
        job.tasks = ()
        if job.error is not None:
            raise job.error


_pool: _Pool | None = None
_decided = False
_lock = threading.Lock()


def threads() -> int:
    """Threads a ``run`` spreads over (1: the calling thread alone)."""
    pool = _get_pool()
    return 1 + pool.helpers if pool is not None else 1


def _get_pool() -> _Pool | None:
    global _pool, _decided
    if _decided:
        return _pool
    with _lock:
        if not _decided:
            env = os.environ.get("MESHD_PREFILL_THREADS", "")
            n = int(env) if env.isdigit() and int(env) > 0 else _blas_threads
            n = max(1, min(n, PREFILL_MAX_THREADS))
            _pool = _Pool(n - 1) if _blas is not None and n > 1 else None
            _decided = True
    return _pool


def _forget() -> None:  # a forked child has none of the parent's helper threads (and maybe a held lock)
    global _pool, _decided, _lock
    _pool, _decided, _lock = None, False, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def row_ranges(t: int) -> list[tuple[int, int]]:
    """Rows 0..t cut into one contiguous range per thread (one range without a pool; never an empty one)."""
    n = max(1, min(threads(), t))
    return [(t * i // n, t * (i + 1) // n) for i in range(n)]


def run_rows(t: int, fn: Callable[[int, int], object]) -> None:
    """``fn(a, b)`` over contiguous row ranges covering rows 0..t, one per thread (see ``run``): for a prefill's
    row-wise steps (norms, the residual adds, rope and the cache writes), whose every row is the same bits
    whatever range computes it."""
    run([functools.partial(fn, a, b) for a, b in row_ranges(t)])


def run(tasks: Sequence[Task]) -> None:
    """Run every task (independent of each other; each writes its own outputs) and return when all are done;
    the first exception any raised is raised here. Spread over the pool when there is one and more than one
    task, else in order on this thread. BLAS is single-threaded either way (pinned at import), so a task's
    products are the same bits whichever thread runs it and whether or not there is a pool."""
    pool = _get_pool() if len(tasks) > 1 else None
    if pool is None:
        for t in tasks:
            t()
        return
    pool.run(tasks)
