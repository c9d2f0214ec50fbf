"""Decode A/B/C of the compiled decode step (engine/dense.py), with and without the decode plan
(engine/decode_plan.py), against the path without either, in one process.

    python bench/decode_step.py [--dir /tmp/compact-bench] [--variants fp32,bf16,Q8_0,Q4_K_M] [--threads 2]
        [--rounds 6] [--steps 40]

Uses the checkpoints ``bench/engine.py`` writes into ``--dir`` (run that first). For each variant a subprocess
(BLAS/OpenMP threads and ``MESHD_KERNEL_THREADS`` from ``--threads``) loads the model, prefills 64 tokens and
then alternates, ``--rounds`` times, a block of ``--steps`` greedy decode steps on each side: the planned
step (P: ``engine.decode_plan``, what ``Model.forward`` of one token runs), the compiled step through the
general pass (A: fp32 kernel, compiled attention/norms/routing/SwiGLU; ``MESHD_DECODE_PLAN=0``) and neither
(B: BLAS and numpy, the engine's path without the ``fast`` extra), each block after 5 untimed steps; the
cache is kept between 100 and 200 positions. Same process, same weights in memory, same pages: the ratios
hold even on a busy machine, the absolute figures less so. Prints the median ms/token of each side with
every round, and the ratios.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/compact-bench", help="bench/engine.py's checkpoint directory (default /tmp/compact-bench)")
    ap.add_argument("--variants", default="fp32,bf16,Q8_0,Q4_K_M", help="weight forms to run (default fp32,bf16,Q8_0,Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2, help="BLAS/OpenMP threads and MESHD_KERNEL_THREADS (default 2)")
    ap.add_argument("--rounds", type=int, default=6, help="alternations of the two sides (default 6)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per block (default 40)")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = ap.parse_args()
    if args.side:
        print(json.dumps(_side(args.side, args.rounds, args.steps)))
        return
    import statistics

    env = dict(os.environ)
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
