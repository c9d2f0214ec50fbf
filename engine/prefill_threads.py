"""A prefill's independent pieces (a routed layer's work items, attention's KV groups, row ranges of the
combination) on as many Python threads as BLAS would use, each piece's BLAS products single-threaded.

Why: numpy runs BLAS products on BLAS's threads but every other operation (softmax, SwiGLU, gathers, the
combination, norms) on the calling thread alone, and a routed layer's products are small (an expert's ~64 rows
by 768x384) so BLAS's threads spend much of each product waiting for each other. One 256-token fp32 prefill of
the bench model spent ~21% of its single-threaded time outside BLAS, which two BLAS threads cannot shorten.
Here the pieces themselves are spread over the threads, each running whole on one thread.

Bits: a piece is the same numpy and BLAS calls on the same arrays whichever thread runs it, always with BLAS
single-threaded (``single_blas``), with or without helpers. Single-threaded BLAS is not always the bits of
threaded BLAS: on an AMD EPYC (Zen) VM with OpenBLAS's Haswell kernels, 2 threads against 1 changed the bits of
most prefill shapes (64x768 by 768x384, 256x768 by 768x768, 256x64 by 64x256, ...), where another VM's did not;
so a prefill's pieces (an expert item, an attention piece) never run on threaded BLAS, even alone, and an
expert worker computes a prefill's items the same way. The products outside the pieces (q/k/v, o, the router,
a dense MLP) run on BLAS's own threads on every path.

``run(tasks)`` runs callables and returns when all are done (the first exception re-raised in the caller). The
pool is used only where BLAS's per-thread count can be set (OpenBLAS's ``openblas_set_num_threads_local``,
0.3.27 and later); elsewhere (another BLAS, ``MESHD_PREFILL_THREADS=1``) ``run`` calls the tasks in order on the
calling thread, as before. Threads: ``MESHD_PREFILL_THREADS``, else BLAS's own thread count (so
``OPENBLAS_NUM_THREADS`` sets both), at most ``PREFILL_MAX_THREADS``; the helpers are daemon threads made on
first use, shared by every thread of the process (a caller whose helpers are busy does its pieces itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import threading
from collections.abc import Callable, Generator, Sequence

import numpy as np  # noqa: F401 - loads numpy's BLAS, which _openblas looks for among the mapped libraries

from .limits import PREFILL_MAX_THREADS
from .numerics import openblas_libs

Task = Callable[[], object]


def _openblas() -> tuple[Callable[[int], int], Callable[[], int]] | None:
    """numpy's OpenBLAS ``(set_num_threads_local, get_num_threads)``, found among the libraries this process has
    mapped (as engine/numerics.py reads its core), or None (not Linux, not OpenBLAS, or older than 0.3.27)."""
    for dll in openblas_libs():
        set_local = getattr(dll, "openblas_set_num_threads_local", None)
        get = next((getattr(dll, s) for s in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                                              "openblas_get_num_threads") if hasattr(dll, s)), None)
        if set_local is None or get is None:
            continue
        set_local.argtypes, set_local.restype = [ctypes.c_int], ctypes.c_int
        get.argtypes, get.restype = [], ctypes.c_int
        return set_local, get
    return None


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


class _Pool:
    def __init__(self, helpers: int) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        for i in range(helpers):
            threading.Thread(target=self._helper, name=f"meshd-prefill-{i}", daemon=True).start()
        self.helpers = helpers

    def _helper(self) -> None:
        while True:
            self._jobs.get().work()

    def run(self, tasks: Sequence[Task], blas: bool) -> None:
        job = _Job(tasks)
        with single_blas() if blas else contextlib.nullcontext():  # before a helper can take a task
            for _ in range(min(self.helpers, len(tasks) - 1)):
                self._jobs.put(job)
            job.work()
            job.finished.wait()  # BLAS stays single-threaded until the helpers' last piece is done
        # A helper that did not wake before the caller ran every task takes this job off the queue only when it
        # next gets the GIL, up to a switch interval later, when the next layer already runs: the tasks (closures
        # over a layer's expert outputs and gathered slots, ~6 MiB of a 256-token prefill) must not live that long.
        job.tasks = ()
        if job.error is not None:
            raise job.error


_pool: _Pool | None = None
_decided = False
_lock = threading.Lock()
_blas: tuple[Callable[[int], int], Callable[[], int]] | None = None
_blas_threads = 1  # BLAS's own thread count, read before this module changes it
_single = 0  # threads inside single_blas()
_single_lock = threading.Lock()


@contextlib.contextmanager
def single_blas() -> Generator[None, None, None]:
    """BLAS single-threaded within the block (while any thread is inside one), back to its own count after.

    ``openblas_set_num_threads_local`` sets a count every thread sees (measured with numpy 2.4's OpenBLAS
    0.3.31: a count set on one thread is the one another thread's next product uses), so one thread's restore
    would change the count under a piece still running on a helper; hence one count for the process, 1 from the
    first thread in to the last one out. Products made meanwhile by threads outside a block run single-threaded
    too (same bits wherever the BLAS gives them at any count). No-op without the per-thread API."""
    global _single
    _get_pool()
    if _blas is None:
        yield
        return
    with _single_lock:
        _single += 1
        if _single == 1:
            _blas[0](1)
    try:
        yield
    finally:
        with _single_lock:
            _single -= 1
            if _single == 0:
                _blas[0](_blas_threads)


def threads() -> int:
    """Threads a ``run`` spreads over (1: the calling thread alone)."""
    pool = _get_pool()
    return 1 + pool.helpers if pool is not None else 1


def _get_pool() -> _Pool | None:
    global _pool, _decided, _blas, _blas_threads
    if _decided:
        return _pool
    with _lock:
        if not _decided:
            _blas = _openblas()
            _blas_threads = _blas[1]() if _blas is not None else 1
            env = os.environ.get("MESHD_PREFILL_THREADS", "")
            n = int(env) if env.isdigit() and int(env) > 0 else _blas_threads
            n = max(1, min(n, PREFILL_MAX_THREADS))
            _pool = _Pool(n - 1) if _blas is not None and n > 1 else None
            _decided = True
    return _pool


def _forget() -> None:  # a forked child has none of the parent's helper threads (and maybe a held lock)
    global _pool, _decided, _lock, _single, _single_lock
    _pool, _decided, _lock, _single, _single_lock = None, False, threading.Lock(), 0, threading.Lock()


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
    run([functools.partial(fn, a, b) for a, b in row_ranges(t)], blas=False)


def run(tasks: Sequence[Task], *, blas: bool = True) -> None:
    """Run every task (independent of each other; each writes its own outputs) and return when all are done;
    the first exception any raised is raised here. Spread over the pool when there is one and more than one
    task, else in order on this thread; either way with BLAS single-threaded (``single_blas``), so a task's
    products are the same bits whichever thread runs it and whether or not there is a pool. ``blas=False``:
    the tasks make no BLAS call, leave BLAS's count alone."""
    pool = _get_pool() if len(tasks) > 1 else None
    if pool is None:
        with single_blas() if blas else contextlib.nullcontext():
            for t in tasks:
                t()
        return
    pool.run(tasks, blas)
