"""Where a two-thread prefill loses against one thread: every ``prefill_threads.run`` of a prefill timed on both
threads, in one process, the pool's prefill alternating with the same code paths run serially on one thread.

    python bench/prefill_timeline.py [--model DIR_OR_GGUF] [--rounds 10] [--tokens 256]

Two modes, alternating per round (the same process, the same model, a fresh cache each):
- ``two``: the process's pool (``MESHD_PREFILL_THREADS``, default BLAS's count: set it to 2);
- ``one``: the same two-thread code paths (``prefill_threads.threads`` reads the pool's count) with every run's
  tasks called in order on the caller, as ``bench/prefill_parts.py``'s span table does.
For each, per prefill (median over rounds): wall ms, the time outside any top-level run (serial on any thread
count), the caller's and the helpers' time in top-level tasks (a task's nested runs count in it), the caller's
wait at the end of runs. Per call site (the function that called ``run``): one thread's work (wall and thread CPU),
two threads' run wall, the tasks' summed wall and thread CPU, and their inflation over one thread's (>1: the
tasks ran slower side by side: the GIL, wake-ups, shared caches), and the site's scaling (one's work / two's
wall). Replaces ``prefill_threads._Job.work`` and ``_Pool.run`` with timed copies of them for the process.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import prefill_threads as pt

pc, tt = time.perf_counter_ns, time.thread_time_ns
EVENTS: list[tuple] = []  # ("task", thread, t0, t1, site, cpu) and ("run", thread, t0, t1, site, caller's wait)
_depth = threading.local()


def _site(f) -> str:
    site = f.f_code.co_name
    if site == "run_rows":
        site = "rows: " + f.f_back.f_code.co_name
    elif site in ("matmul_many", "matmul"):
        g = f.f_back
        while g is not None and g.f_code.co_name in ("matmul_many", "matmul"):
            g = g.f_back
        site = "products: " + (g.f_code.co_name if g is not None else "?")
    return site


def _work(self: pt._Job) -> None:  # _Job.work, each top-level task timed
    n = len(self.tasks)
    while True:
        with self._lock:
            i = self._next
            self._next += 1
        if i >= n:
            return
        d = getattr(_depth, "d", 0)
        _depth.d = d + 1
        t0, c0 = pc(), tt()
        try:
            self.tasks[i]()
        except BaseException as e:  # noqa: BLE001
            if self.error is None:
                self.error = e
        t1, c1 = pc(), tt()
        _depth.d = d
        if d == 0:
            EVENTS.append(("task", threading.get_ident(), t0, t1, self.site, c1 - c0))
        with self._lock:
            self._done += 1
            if self._done == n:
                self.finished.set()


def _pool_run(self: pt._Pool, tasks) -> None:
    job = pt._Job(tasks)
    job.site = _site(sys._getframe(2))  # type: ignore[attr-defined]
    t0 = pc()
    for _ in range(min(self.helpers, len(tasks) - 1)):
        self._jobs.put(job)
    with pt._kernels_alone():
        job.work()
    t1 = pc()
    job.finished.wait()
    t2 = pc()
    job.tasks = ()
    if getattr(_depth, "d", 0) == 0:
        EVENTS.append(("run", threading.get_ident(), t0, t2, job.site, t2 - t1))
    if job.error is not None:
        raise job.error


class _Serial:  # the pool's interface, every task on the caller
    def __init__(self, helpers: int) -> None:
        self.helpers = helpers

    def run(self, tasks) -> None:
        job = pt._Job(tasks)
        job.site = _site(sys._getframe(2))  # type: ignore[attr-defined]
        t0 = pc()
        job.work()
        if getattr(_depth, "d", 0) == 0:
            EVENTS.append(("run", threading.get_ident(), t0, pc(), job.site, 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/compact-bench", help="checkpoint dir or GGUF file (default /tmp/compact-bench)")
    ap.add_argument("--rounds", type=int, default=10, help="prefills per mode (default 10)")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens (default 256)")
    args = ap.parse_args()
    from engine.model import Model

    pt._Job.work = _work  # type: ignore[method-assign]
    pt._Pool.run = _pool_run  # type: ignore[method-assign]
    pool = pt._get_pool()
    if pool is None:
        sys.exit("no prefill pool in this process: run with MESHD_PREFILL_THREADS=2 (and OpenBLAS)")
    serial = _Serial(pool.helpers)
    m = Model.load(args.model)
    r = random.Random(1)
    prompt = [r.randrange(m.config.vocab_size) for _ in range(args.tokens)]
    main_thread = threading.get_ident()

    def measure(p: object) -> dict:
        pt._pool = p  # type: ignore[assignment]
        time.sleep(0.1)
        EVENTS.clear()
        a = pc()
        m.forward(prompt, m.new_cache(args.tokens + 8), last_only=True)
        total = pc() - a
        runs = [e for e in EVENTS if e[0] == "run"]
        tasks = [e for e in EVENTS if e[0] == "task"]
        site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for e in runs:
            site[e[4]]["wall"] += e[3] - e[2]
            site[e[4]]["n"] += 1
            site[e[4]]["wait"] += e[5]
        for e in tasks:
            site[e[4]]["work"] += e[3] - e[2]
            site[e[4]]["cpu"] += e[5]
        return {"total": total, "outside": total - sum(e[3] - e[2] for e in runs),
                "caller": sum(e[3] - e[2] for e in tasks if e[1] == main_thread),
                "helpers": sum(e[3] - e[2] for e in tasks if e[1] != main_thread),
                "wait": sum(e[5] for e in runs), "site": site}

    for p in (pool, serial):
        measure(p)
    got: dict[str, list[dict]] = {"one": [], "two": []}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        got["two"].append(measure(pool))
        got["one"].append(measure(serial))
    print(f"{args.rounds} prefills per mode of {args.tokens} tokens, {1 + pool.helpers} threads, "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}")

    def med(mode: str, f) -> float:
        return statistics.median(f(d) for d in got[mode]) / 1e6

    for mode in ("one", "two"):
        print(f"{mode}: wall {med(mode, lambda d: d['total']):.1f} ms, outside any run {med(mode, lambda d: d['outside']):.1f}, "
              f"caller's tasks {med(mode, lambda d: d['caller']):.1f}, helpers' tasks {med(mode, lambda d: d['helpers']):.1f}, "
              f"caller waiting at runs' ends {med(mode, lambda d: d['wait']):.1f}")
    print(f"two threads' scaling: {med('one', lambda d: d['total']) / med('two', lambda d: d['total']):.2f}x")
    print("| call site | runs | one: work ms (CPU) | two: run wall ms | two: tasks' wall (CPU) | inflation wall (CPU) "
          "| scaling |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    sites = sorted(got["one"][0]["site"], key=lambda s: -got["one"][0]["site"][s]["work"])
    for s in sites:
        def one(k: str, s: str = s) -> float:
            return med("one", lambda d: d["site"][s][k])

        def two(k: str, s: str = s) -> float:
            return med("two", lambda d: d["site"][s][k])

        print(f"| {s} | {got['one'][0]['site'][s]['n']} | {one('work'):.1f} ({one('cpu'):.1f}) | {two('wall'):.1f} | "
              f"{two('work'):.1f} ({two('cpu'):.1f}) | {two('work') / one('work'):.2f}x ({two('cpu') / one('cpu'):.2f}x) | "
              f"{one('work') / two('wall'):.2f}x |")


if __name__ == "__main__":
    main()
