"""A prefill's independent pieces (a routed layer's work items, attention's KV groups, row ranges of the
combination) on as many Python threads as BLAS would use, each piece's BLAS products single-threaded.

Why: numpy runs BLAS products on BLAS's threads but every other operation (softmax, SwiGLU, gathers, the
combination, norms) on the calling thread alone, and a routed layer's products are small (an expert's ~64 rows
by 768x384) so BLAS's threads spend much of each product waiting for each other. One 256-token fp32 prefill of
the bench model spent ~21% of its single-threaded time outside BLAS, which two BLAS threads cannot shorten.
Here the pieces themselves are spread over the threads, each running whole on one thread.

Bits: a piece is the same numpy and BLAS calls on the same arrays as when run alone, on one BLAS thread
wherever it runs, so which thread runs a piece never matters. One BLAS thread does not always give the bits of
two (OpenBLAS 0.3.31 sgemm, Haswell core, differs from 4 rows at 512x512), so with the pool a product inside a piece
may differ from the same product outside one: the same on every run and every path of a node, which all run this
code (tests/test_prefill_threads.py). That needs a per-thread count: where BLAS's "local" count is in truth the
process's (``per_thread``), there is no pool.

``run(tasks)`` runs callables and returns when all are done (the first exception re-raised in the caller). The
pool is used only where BLAS's per-thread count can be set (OpenBLAS's ``openblas_set_num_threads_local``,
0.3.27 and later); elsewhere (another BLAS, ``MESHD_PREFILL_THREADS=1``) ``run`` calls the tasks in order on the
calling thread, as before. Threads: ``MESHD_PREFILL_THREADS``, else BLAS's own thread count (so
``OPENBLAS_NUM_THREADS`` sets both), at most ``PREFILL_MAX_THREADS``; the helpers are daemon threads made on
first use, shared by every thread of the process (a caller whose helpers are busy does its pieces itself).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable, Sequence

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
    def __init__(self, helpers: int, set_local: Callable[[int], int]) -> None:
        self._set_local = set_local
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        for i in range(helpers):
            threading.Thread(target=self._helper, name=f"meshd-prefill-{i}", daemon=True).start()
        self.helpers = helpers

    def _helper(self) -> None:
        self._set_local(1)  # this thread's BLAS products stay on it
        while True:
            self._jobs.get().work()

    def run(self, tasks: Sequence[Task]) -> None:
        job = _Job(tasks)
        for _ in range(min(self.helpers, len(tasks) - 1)):
            self._jobs.put(job)
        prev = self._set_local(1)
        try:
            job.work()
        finally:
            self._set_local(prev)
        job.finished.wait()
        if job.error is not None:
            raise job.error


_pool: _Pool | None = None
_decided = False
_lock = threading.Lock()


def threads() -> int:
    """Threads a ``run`` spreads over (1: the calling thread alone)."""
    pool = _get_pool()
    return 1 + pool.helpers if pool is not None else 1


def per_thread(set_local: Callable[[int], int], get: Callable[[], int]) -> bool:
    """Whether a count set by ``set_local`` on one thread stays that thread's: set 1 on a short-lived thread, then
    read the count here (put back if it moved). In numpy 2.4's scipy-openblas 0.3.31 (pthreads) it does not: a
    helper's ``set_local(1)`` set every thread's count, so the caller's products between its pieces ran on one
    BLAS thread or two depending on when the helpers had started and the caller had restored its count, and a
    prefill's bits changed from call to call (OpenBLAS's one- and two-thread sgemm differ from 4 rows at
    512x512; session 9, tests/test_prefill_threads.py). A count of 1 tells nothing and needs no pool: True."""
    before = get()
    if before <= 1:
        return True
    probe = threading.Thread(target=set_local, args=(1,), name="meshd-prefill-probe", daemon=True)
    probe.start()
    probe.join()
    after = get()
    if after != before:
        set_local(before)
    return after == before


def _get_pool() -> _Pool | None:
    global _pool, _decided
    if _decided:
        return _pool
    with _lock:
        if not _decided:
            blas = _openblas()
            env = os.environ.get("MESHD_PREFILL_THREADS", "")
            n = int(env) if env.isdigit() and int(env) > 0 else (blas[1]() if blas is not None else 1)
            n = max(1, min(n, PREFILL_MAX_THREADS))
            if blas is not None and n > 1 and not per_thread(*blas):
                blas = None  # the count is not per thread: pieces in order on the caller, BLAS's own threads
            _pool = _Pool(n - 1, blas[0]) if blas is not None and n > 1 else None
            _decided = True
    return _pool


def _forget() -> None:  # a forked child has none of the parent's helper threads (and maybe a held lock)
    global _pool, _decided, _lock
    _pool, _decided, _lock = None, False, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def run(tasks: Sequence[Task]) -> None:
    """Run every task (independent of each other; each writes its own outputs) and return when all are done;
    the first exception any raised is raised here. Spread over the pool when there is one and more than one
    task, else in order on this thread."""
    pool = _get_pool() if len(tasks) > 1 else None
    if pool is None:
        for t in tasks:
            t()
        return
    pool.run(tasks)
