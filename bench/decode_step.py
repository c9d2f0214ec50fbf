"""Decode A/B/C of the compiled decode step (engine/dense.py), with and without the decode plan
(engine/decode_plan.py), against the path without either, in one process.

    python bench/decode_step.py [--dir /tmp/compact-bench] [--variants fp32,bf16,Q8_0,Q4_K_M] [--threads 2]
        [--rounds 6] [--steps 40] [--parts]

Uses the checkpoints ``bench/engine.py`` writes into ``--dir`` (run that first). For each variant a subprocess
(BLAS/OpenMP threads and ``MESHD_KERNEL_THREADS`` from ``--threads``) loads the model, prefills 64 tokens and
then alternates, ``--rounds`` times, a block of ``--steps`` greedy decode steps on each side: the planned
step (P: ``engine.decode_plan``, what ``Model.forward`` of one token runs), the compiled step through the
general pass (A: fp32 kernel, compiled attention/norms/routing/SwiGLU; ``MESHD_DECODE_PLAN=0``) and neither
(B: BLAS and numpy, the engine's path without the ``fast`` extra), each block after 5 untimed steps; the
cache is kept between 100 and 200 positions. Same process, same weights in memory, same pages: the ratios
hold even on a busy machine, the absolute figures less so. Prints the median ms/token of each side with
every round, and the ratios.

``--parts``: instead, where one planned token goes, on one thread (``MESHD_KERNEL_THREADS=1``, one BLAS thread),
in thread CPU time (what other processes do to the core counts less): the planned step, then the same token's
products replayed one by one in step order (each its own kernel table, from the plan's buffers), summed by
stored type, with the integer kernels' activation quantization apart (0 where they do not run); "rest" is the step minus those (attention,
norms, routing, Python). Each type's bytes over its time is the rate to hold against the memory probe.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = {"fp32": "", "bf16": "bf16", "Q8_0": "model-Q8_0.gguf", "Q4_K_M": "model-Q4_K_M.gguf"}


def _side(path: str, rounds: int, steps: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from engine import dense
    from engine.model import Model

    m = Model.load(path)
    mod = dense._kernels()
    step = m._step
    cache = m.new_cache(1024)
    tok = int(np.argmax(m.forward(list(range(10, 74)), cache)[-1]))
    tok = int(np.argmax(m.forward([tok], cache)[-1]))  # makes the plan (if the model takes it)
    plan = m._plan

    def run(n: int) -> float:
        nonlocal tok
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            logits = m.forward([tok], cache)
            ts.append(time.perf_counter() - t)
            tok = int(np.argmax(logits[-1]))
            if cache.length > 200:
                cache.truncate(100)
        return float(np.median(ts)) * 1e3

    res: dict[str, list[float]] = {"plan": [], "on": [], "off": []}
    for _ in range(rounds):
        for side in ("plan", "on", "off"):
            dense._mod = mod if side != "off" else None
            m._step = step if side != "off" else False
            m._plan = plan if side == "plan" else False
            run(5)
            res[side].append(run(steps))
    return {"compiled": mod is not None and step, "planned": type(plan).__name__ == "DecodePlan", **res}


def _parts(path: str, rounds: int, steps: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from engine import kernel_pool, kernels_int
    from engine.model import Model

    m = Model.load(path)
    cache = m.new_cache(1024)
    tok = int(np.argmax(m.forward(list(range(10, 74)), cache)[-1]))
    tok = int(np.argmax(m.forward([tok], cache)[-1]))
    plan = m._plan
    if type(plan).__name__ != "DecodePlan":
        return {"error": "the model does not take the decode plan"}
    prods = []  # (stored type, x, weight, out): one token's products in step order, on the plan's buffers
    for lp in plan.layers:
        lay = lp.layer
        prods += [(plan.h, lay.q, plan.q), (plan.h, lay.k, plan.k), (plan.h, lay.v, plan.v), (plan.att, lay.o, plan.o)]
        for e in range(len(plan.sel)):  # the first top-k experts stand for the routed ones (same shapes and types)
            gate, up, down = lay.experts[e]
            prods += [(plan.h, gate, plan.g[e]), (plan.h, up, plan.u[e]), (plan.g[e], down, plan.y[e])]
    prods.append((plan.h, m.lm_head, plan.logits))
    tabs = []
    for x, w, out in prods:
        qtype = getattr(w, "qtype", "F32")
        data = w.data if qtype != "F32" else w
        tbl, total, keep, _ = kernel_pool.table([(x, qtype, data, out)])
        tabs.append((qtype, tbl, total, keep, data.nbytes))

    def step_ms(n: int) -> list[float]:
        nonlocal tok
        ts = []
        for _ in range(n):
            t = time.thread_time_ns()
            logits = m.forward([tok], cache)
            ts.append((time.thread_time_ns() - t) / 1e6)
            tok = int(np.argmax(logits[-1]))
            if cache.length > 200:
                cache.truncate(100)
        return ts

    def replay() -> dict[str, list[float]]:
        got: dict[str, list[float]] = {}
        for qtype, tbl, total, _keep, nbytes in tabs:
            t0 = time.thread_time_ns()
            if kernels_int.AVAILABLE:
                kernel_pool._prepare(tbl)  # the integer kernels' quantization of x
            t1 = time.thread_time_ns()
            kernel_pool._serial(tbl, kernel_pool._HALF_ADDR, total)  # quantizes again, then every chunk
            t2 = time.thread_time_ns()
            r = got.setdefault(qtype, [0.0, 0.0, 0.0])
            r[0] += ((t2 - t1) - (t1 - t0)) / 1e6
            r[1] += (t1 - t0) / 1e6
            r[2] += nbytes
        return got

    step_ms(5)
    steps_got: list[float] = []
    reps = []
    for _ in range(rounds):
        steps_got += step_ms(steps)
        reps += [replay() for _ in range(5)]
    out = {"step": float(np.median(steps_got)), "types": {}}
    for qtype in reps[0]:
        out["types"][qtype] = [float(np.median([r[qtype][i] for r in reps])) for i in range(2)] + [reps[0][qtype][2]]
    return out


def parts(args: argparse.Namespace, env: dict[str, str]) -> None:
    env = dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", MESHD_KERNEL_THREADS="1")
    print(f"one thread, thread CPU time; rounds={args.rounds} steps={args.steps} load average {os.getloadavg()[0]:.1f}")
    print("| weights | planned step ms | type | products ms | quantization ms | MB | GB/s | rest ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for v in [x for x in args.variants.split(",") if x]:
        path = str(Path(args.dir) / FILES[v])
        out = subprocess.run([sys.executable, __file__, "--side", path, "--parts", "--rounds", str(args.rounds),
                              "--steps", str(args.steps)], env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if "error" in r:
            print(f"| {v} | {r['error']} | | | | | | |")
            continue
        rest = r["step"] - sum(a + b for a, b, _ in r["types"].values())
        for i, (qtype, (ms, qms, nbytes)) in enumerate(sorted(r["types"].items())):
            print(f"| {v if i == 0 else ''} | {r['step']:.2f} | {qtype} | {ms:.2f} | {qms:.3f} | {nbytes / 1e6:.1f} |"
                  f" {nbytes / ms / 1e6:.1f} | {rest:.2f} |")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/compact-bench", help="bench/engine.py's checkpoint directory (default /tmp/compact-bench)")
    ap.add_argument("--variants", default="fp32,bf16,Q8_0,Q4_K_M", help="weight forms to run (default fp32,bf16,Q8_0,Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2, help="BLAS/OpenMP threads and MESHD_KERNEL_THREADS (default 2)")
    ap.add_argument("--rounds", type=int, default=6, help="alternations of the two sides (default 6)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per block (default 40)")
    ap.add_argument("--parts", action="store_true", help="where one planned token goes, by part, on one thread"
                    " (default off: the three-sided A/B)")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = ap.parse_args()
    if args.side:
        print(json.dumps(_parts(args.side, args.rounds, args.steps) if args.parts
                         else _side(args.side, args.rounds, args.steps)))
        return
    import statistics

    env = dict(os.environ)
    if args.parts:
        parts(args, env)
        return
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MESHD_KERNEL_THREADS"):
        env[var] = str(args.threads)
    print(f"threads={args.threads} rounds={args.rounds} steps={args.steps} load average {os.getloadavg()[0]:.1f}")
    print("| weights | planned step ms/token | compiled step ms/token | without ms/token | plan gain | step gain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for v in [x for x in args.variants.split(",") if x]:
        path = str(Path(args.dir) / FILES[v])
        out = subprocess.run([sys.executable, __file__, "--side", path, "--rounds", str(args.rounds), "--steps",
                              str(args.steps)], env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        p, a, b = statistics.median(r["plan"]), statistics.median(r["on"]), statistics.median(r["off"])
        rounds = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        print(f"| {v} | {p:.2f} [{rounds(r['plan'])}] | {a:.2f} [{rounds(r['on'])}] | {b:.2f} [{rounds(r['off'])}]"
              f" | {a / p:.2f}x | {b / a:.2f}x |")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
