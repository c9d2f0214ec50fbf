"""Where the planned fp32 decode step's time goes, round by round, in one process with the bandwidth probe.

    python bench/decode_rounds.py [--dir /tmp/compact-bench] [--threads 2] [--rounds 8] [--steps 24]
        [--base PACKAGE_DIR]

Uses the fp32 checkpoint ``bench/engine.py`` writes into ``--dir``. Loads it, prefills 256 tokens, then runs
``--rounds`` times: ``--steps`` planned decode steps (the cache kept at 256-320 positions) with every kernel
round logged, then the two-reader bandwidth probe (bench/engine.py's, 1 GiB, best of three). The kernel pool
is swapped for a logging copy (the same chunk claims and kernels, each chunk's thread and start/end cycle
counts written to a log), so per token it reports: the whole step; the rounds' wall time (from the caller
entering the round to its return); inside them, each thread's busy time, the helper's start delay (round
published -> its first chunk), the tail (the first thread out of chunks -> the last chunk done: one thread
idle) and the caller's wait (its last chunk done -> every chunk done); the time outside the rounds; and the
weight bytes read against the probe (the whole step's and the rounds' own rate). Medians [min-max] over
rounds. The logging costs two cycle-counter reads and one atomic add per chunk.

When the plan runs its layers in ``engine.plan_kernels``' compiled calls (the default), their rounds do not go
through the logging pool; the split is then from those calls' own cycle counts (their ``G_STATS`` word): the
rounds (the caller's view: publish to every chunk done), the time in the compiled calls outside the rounds
(norms, routing, SwiGLU, the combination) and the time outside the rounds in all. ``MESHD_PLAN_PARTS=0`` runs
the Python loop instead, with the per-thread split above.

``--base PACKAGE_DIR``: instead, an in-process A/B of the whole planned step against another tree's engine
package (e.g. ``git archive main engine | tar -x -C /tmp/b && mv /tmp/b/engine /tmp/b/engine_base``, then
``--base /tmp/b/engine_base``; a copy, so numba's cache files do not go into a checkout), imported under its
directory's name: both load the checkpoint (the same file pages), each with its own kernel threads, and every
round runs a block of steps on each (the order alternating) and the probe; reports each side's ms/token and
fraction of the probe, and the per-round ratio base/this, as medians [min-max].
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/compact-bench", help="bench/engine.py's checkpoint directory (default /tmp/compact-bench)")
    ap.add_argument("--threads", type=int, default=2, help="kernel threads (default 2)")
    ap.add_argument("--rounds", type=int, default=8, help="alternations of the decode block and the probe (default 8)")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per round (default 24)")
    ap.add_argument("--base", type=Path, default=None,
                    help="another tree's engine package directory to A/B against in this process (default: none)")
    return ap


if __name__ == "__main__":
    _parser().parse_args()  # --help and bad options answered before numba is imported
try:
    import numba  # noqa: F401 - the [fast] extra; everything below compiles with it
except ImportError:
    sys.exit("bench/decode_rounds.py needs numba: pip install '.[fast]'")

from llvmlite import ir  # noqa: E402
from numba import njit  # noqa: E402
from numba.core import types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from engine import kernel_pool as kp  # noqa: E402
from engine import kernels  # noqa: E402

LOG_ROWS = 1 << 20  # chunk records per logging window (a token is ~330 chunks)


@intrinsic
def _cycles(typingctx):  # noqa: ANN001, ANN202
    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])

    return types.int64(), codegen


_opts = {"nogil": True, "boundscheck": False, "error_model": "numpy"}


@njit(**_opts)
def _note(log: int, kind: int, a: int, t0: int, t1: int) -> None:
    i = kp._add(log, 1)
    p = kp._i64p(log)
    if i < LOG_ROWS:
        p[4 + 4 * i] = kind
        p[5 + 4 * i] = a
        p[6 + 4 * i] = t0
        p[7 + 4 * i] = t1


@njit(**_opts)
def _work_log(ctl: int, table: np.ndarray, ha: int, gen: int, total: int, log: int) -> None:
    """kernel_pool._work (wait=True) logging each chunk (kind 0: the caller) and the round (kind 2)."""
    mask = (1 << kp.GEN_SHIFT) - 1
    start = _cycles()
    while True:
        word = kp._load(ctl)
        g = word >> kp.GEN_SHIFT
        if g < gen:
            kp._pause()
            continue
        if g != gen or (word & mask) >= total:
            break
        if kp._cas(ctl, word, word + 1):
            t0 = _cycles()
            kp._chunk(table, word & mask, ha)
            _note(log, 0, gen, t0, _cycles())
            kp._add(ctl + 8, 1)
    out = _cycles()
    while kp._load(ctl + 8) < total:
        kp._pause()
    _note(log, 2, gen, start, out)
    _note(log, 3, gen, out, _cycles())


@njit(**_opts)
def _helper_log(ctl: int, ha: int, seen: int, iters: int, log: int) -> int:
    """kernel_pool._helper_loop logging each chunk (kind 1: the helper)."""
    mask = (1 << kp.GEN_SHIFT) - 1
    while True:
        i = 0
        while True:
            g = kp._load(ctl) >> kp.GEN_SHIFT
            if g != seen:
                break
            i += 1
            if i >= iters:
                return seen
            kp._pause()
            if i % 256 == 0:
                kp._sched_yield()
        seen = g
        while True:
            word = kp._load(ctl)
            if word >> kp.GEN_SHIFT != g or (word & mask) >= kp._load(ctl + 24):
                break
            if kp._cas(ctl, word, word + 1):
                table = kp.numba.carray(kp._i64p(kp._load(ctl + 16)), (kp._load(ctl + 32), kp._COLS))
                t0 = _cycles()
                kp._chunk(table, word & mask, ha)
                _note(log, 1, g, t0, _cycles())
                kp._add(ctl + 8, 1)


class LogPool(kp.Pool):
    """kernel_pool.Pool with the logging loops (the same claims, the same kernels)."""

    def __init__(self, helpers: int) -> None:
        self.log = np.zeros(4 + 4 * LOG_ROWS, dtype=np.int64)
        self.log_addr = int(self.log.ctypes.data)
        super().__init__(helpers)

    def _helper(self) -> None:
        seen = 0
        while True:
            seen = _helper_log(self._addr, kp._HALF_ADDR, seen, self._spin_iters, self.log_addr)
            with self._cv:
                kp._sleeping(self._addr, 1)
                while int(self._ctl[0]) >> kp.GEN_SHIFT == seen:
                    self._cv.wait()
                kp._sleeping(self._addr, -1)

    def run_table(self, tbl: np.ndarray, total: int, keep: object) -> None:
        with self._round:
            self._gen += 1
            gen = self._gen
            self._keep = (tbl, keep)
            kp._prepare(tbl)
            kp._publish(self._addr, gen, tbl, total)
            if self._ctl[5]:
                with self._cv:
                    self._cv.notify_all()
            _work_log(self._addr, tbl, kp._HALF_ADDR, gen, total, self.log_addr)
            self._keep = None

    def records(self) -> np.ndarray:
        n = min(int(self.log[0]), LOG_ROWS)
        return self.log[4:4 + 4 * n].reshape(n, 4).copy()

    def reset(self) -> None:
        self.log[0] = 0


def _cycle_rate() -> float:
    c = np.zeros(1, dtype=np.int64)

    @njit
    def now(c: np.ndarray) -> None:
        c[0] = _cycles()

    now(c)
    t0, c0 = time.perf_counter(), int(c[0])
    time.sleep(0.2)
    now(c)
    return (int(c[0]) - c0) / (time.perf_counter() - t0)


def analyse(rec: np.ndarray, hz: float, steps: int) -> dict[str, float]:
    """Per-token microseconds of each part of the rounds (see the module docstring)."""
    us = 1e6 / hz
    rounds = rec[rec[:, 0] == 2]
    waits = {int(r[1]): int(r[3] - r[2]) for r in rec[rec[:, 0] == 3]}
    chunks = rec[rec[:, 0] <= 1]
    out = {"rounds": 0.0, "caller_busy": 0.0, "helper_busy": 0.0, "helper_delay": 0.0, "tail": 0.0,
           "caller_wait": 0.0, "n_rounds": 0.0, "helper_share": 0.0}
    by_gen: dict[int, list] = {}
    for c in chunks:
        by_gen.setdefault(int(c[1]), []).append(c)
    for r in rounds:
        gen, start, end = int(r[1]), int(r[2]), int(r[3]) + waits.get(int(r[1]), 0)
        cs = np.array(by_gen.get(gen, []))
        out["rounds"] += end - start
        out["n_rounds"] += 1
        out["caller_wait"] += waits.get(gen, 0)
        if not len(cs):
            continue
        mine, his = cs[cs[:, 0] == 0], cs[cs[:, 0] == 1]
        out["caller_busy"] += int((mine[:, 3] - mine[:, 2]).sum()) if len(mine) else 0
        out["helper_busy"] += int((his[:, 3] - his[:, 2]).sum()) if len(his) else 0
        if len(his):
            out["helper_delay"] += int(his[:, 2].min()) - start
            ends = [int(mine[:, 3].max()) if len(mine) else start, int(his[:, 3].max())]
            out["tail"] += max(ends) - min(ends)
        else:
            out["helper_delay"] += end - start
    tot = out["caller_busy"] + out["helper_busy"]
    share = out["helper_busy"] / tot if tot else 0.0
    res = {k: v * us / steps for k, v in out.items() if k not in ("n_rounds", "helper_share")}
    res["n_rounds"] = out["n_rounds"] / steps
    res["helper_share"] = share
    return res


def main() -> None:
    args = _parser().parse_args()
    if args.base is not None:
        ab(args)
        return
    be = _bench_engine()
    from engine.model import Model

    kernels._pool = LogPool(args.threads - 1) if args.threads > 1 else None
    pool = kernels._pool
    m = Model.load(args.dir)
    active = be._active_bytes(m)
    cache = m.new_cache(1024)
    tok = int(np.argmax(m.forward(list(range(10, 266)), cache)[-1]))
    for _ in range(8):
        tok = int(np.argmax(m.forward([tok], cache)[-1]))
    buf = np.ones(1 << 28, dtype=np.float32)
    hz = _cycle_rate()
    rows: list[dict[str, float]] = []
    # the planned step's layers in engine.plan_kernels' compiled calls: their rounds bypass LogPool.run_table,
    # so only the compiled calls' own cycle counts (G_STATS) split the step (MESHD_PLAN_PARTS=0: the loop's)
    program = getattr(m._plan, "program", None)
    stats = np.zeros(3, dtype=np.int64)
    if program is not None:
        pk, _, words = program
        words[pk.G_STATS] = stats.ctypes.data
    print(f"threads={args.threads} rounds={args.rounds} steps={args.steps} load average {_load():.1f}"
          f" active bytes/token {active / 1e6:.1f} MB; layers in "
          f"{'compiled parts (engine.plan_kernels)' if program is not None else 'the Python loop'}")
    for _ in range(args.rounds):
        while cache.length > 320:
            cache.truncate(256)
        if pool is not None:
            pool.reset()
        stats[:] = 0
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            logits = m.forward([tok], cache)
            ts.append(time.perf_counter() - t)
            tok = int(np.argmax(logits[-1]))
        step_us = float(np.median(ts)) * 1e6
        mean_us = float(np.mean(ts)) * 1e6
        bw = be._bandwidth(args.threads, buf)["read_gb_s"]
        row = {"step": step_us, "probe_gb_s": bw, "step_frac": active / (step_us * 1e-6) / 1e9 / bw}
        if program is not None:  # rounds: publish to every chunk done (caller's view), per token
            us = 1e6 / hz / args.steps
            row.update(rounds=stats[1] * us, n_rounds=stats[2] / args.steps, in_parts=stats[0] * us,
                       parts_not_rounds=(stats[0] - stats[1]) * us, outside=mean_us - stats[1] * us,
                       rounds_frac=active / (stats[1] * us * 1e-6) / 1e9 / bw)
        elif pool is not None:
            a = analyse(pool.records(), hz, args.steps)
            row.update(a)
            row["outside"] = mean_us - a["rounds"]
            row["rounds_frac"] = active / (a["rounds"] * 1e-6) / 1e9 / bw
        rows.append(row)
    keys = list(rows[0])
    for k in keys:
        xs = [r[k] for r in rows]
        print(f"{k:14s} {statistics.median(xs):9.3f} [{min(xs):.3f}-{max(xs):.3f}]")
    print(f"load average at the end {_load():.1f}")


def _bench_engine():  # noqa: ANN202 - bench/engine.py as a module (its probe and byte count)
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "bench" / "engine.py")
    be = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(be)  # type: ignore[union-attr]
    return be


def ab(args: argparse.Namespace) -> None:
    """The ``--base`` A/B (see the module docstring)."""
    import importlib
    import importlib.util

    if not (args.base / "model.py").exists():
        sys.exit(f"--base {args.base}: not an engine package (no model.py)")
    name = args.base.name
    spec = importlib.util.spec_from_file_location(name, args.base / "__init__.py",
                                                  submodule_search_locations=[str(args.base)])
    pkg = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)  # type: ignore[union-attr]
    base_model = importlib.import_module(f"{name}.model")
    from engine.model import Model

    be = _bench_engine()
    sides = {"base": base_model.Model.load(args.dir), "this": Model.load(args.dir)}
    active = be._active_bytes(sides["this"])
    caches, toks = {}, {}
    for k, m in sides.items():
        caches[k] = m.new_cache(1024)
        toks[k] = int(np.argmax(m.forward(list(range(10, 266)), caches[k])[-1]))
        for _ in range(8):
            toks[k] = int(np.argmax(m.forward([toks[k]], caches[k])[-1]))
    buf = np.ones(1 << 28, dtype=np.float32)
    res: dict[str, list[float]] = {"base": [], "this": [], "probe": []}
    print(f"threads={args.threads} rounds={args.rounds} steps={args.steps} load average {_load():.1f}"
          f" active bytes/token {active / 1e6:.1f} MB")
    for r in range(args.rounds):
        for k in (("base", "this") if r % 2 == 0 else ("this", "base")):
            m, cache = sides[k], caches[k]
            while cache.length > 320:
                cache.truncate(256)
            ts = []
            for _ in range(args.steps + 3):
                t = time.perf_counter()
                logits = m.forward([toks[k]], cache)
                ts.append(time.perf_counter() - t)
                toks[k] = int(np.argmax(logits[-1]))
            res[k].append(float(np.median(ts[3:])) * 1e3)
        res["probe"].append(be._bandwidth(args.threads, buf)["read_gb_s"])
    med = statistics.median

    def fmt(xs: list[float]) -> str:
        return f"{med(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"

    for k in ("base", "this"):
        frac = [active / (t * 1e-3) / 1e9 / bw for t, bw in zip(res[k], res["probe"])]
        print(f"{k:5s} ms/token {fmt(res[k])}  fraction of the probe {fmt(frac)}")
    print(f"probe GB/s {fmt(res['probe'])}")
    print(f"base/this per round {fmt([b / t for b, t in zip(res['base'], res['this'])])}")
    print(f"load average at the end {_load():.1f}")


def _load() -> float:
    import os

    return os.getloadavg()[0]


if __name__ == "__main__":
    main()
