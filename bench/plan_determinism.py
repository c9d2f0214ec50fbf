"""Repeat one planned decode step from the same cache position in fresh processes and report whether its logits'
bytes ever differ: the check that found the planned Q4_K_M step's dependence on the heap layout
(docs/engine-model.md, session 8).

    python bench/plan_determinism.py [--model /tmp/compact-bench/model-Q4_K_M.gguf] [--processes 8]
        [--repeats 6] [--junk 16] [--threads 2]

Each process loads the model, prefills 64 tokens, takes one step (which makes the plan), then runs the same next
step ``--repeats`` times (``cache.truncate`` between) and prints T (same bytes as the first) or F per repeat.
``--junk`` small arrays are allocated right after the plan is made (16 of 8 and 42 int64: what the warm rounds'
tables took), which on main's code made about 60% of processes alternate TFTFTF at 2.4e-6; 0: none.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _side(path: str, repeats: int, junk: int) -> str:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from engine import decode_plan
    from engine.model import Model

    keep = []
    make = decode_plan.DecodePlan.make.__func__

    def make_and_allocate(cls, model):  # noqa: ANN001, ANN202
        plan = make(cls, model)
        keep.extend((np.zeros(8, np.int64), np.zeros((3, 14), np.int64)) for _ in range(junk))
        return plan

    decode_plan.DecodePlan.make = classmethod(make_and_allocate)
    m = Model.load(path)
    cache = m.new_cache(1024)
    tok = int(np.argmax(m.forward(list(range(10, 74)), cache)[-1]))
    tok = int(np.argmax(m.forward([tok], cache)[-1]))
    n = cache.length
    outs = []
    for _ in range(repeats):
        outs.append(m.forward([tok], cache))
        cache.truncate(n)
    diff = max(float(np.abs(o - outs[0]).max()) for o in outs)
    return "".join("T" if o.tobytes() == outs[0].tobytes() else "F" for o in outs) + f" max diff {diff:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/compact-bench/model-Q4_K_M.gguf",
                    help="model to decode (default /tmp/compact-bench/model-Q4_K_M.gguf, from bench/engine.py)")
    ap.add_argument("--processes", type=int, default=8, help="fresh processes to try (default 8)")
    ap.add_argument("--repeats", type=int, default=6, help="repeats of the step per process (default 6)")
    ap.add_argument("--junk", type=int, default=16, help="small allocations after the plan is made (default 16)")
    ap.add_argument("--threads", type=int, default=2, help="BLAS threads and MESHD_KERNEL_THREADS (default 2)")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(_side(args.model, args.repeats, args.junk))
        return
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               MESHD_KERNEL_THREADS=str(args.threads))
    bad = 0
    for i in range(args.processes):
        out = subprocess.run([sys.executable, __file__, "--side", "--model", args.model, "--repeats",
                              str(args.repeats), "--junk", str(args.junk)], env=env, capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-200:]
        bad += "F" in line.split()[0] if out.returncode == 0 else 0
        print(f"process {i}: {line}")
    print(f"{bad} of {args.processes} processes gave two results for one step (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
