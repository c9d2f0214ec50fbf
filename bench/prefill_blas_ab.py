"""Prefill A/B of this tree against another checkout, in the same rounds: each side (tree x weight form) is its
own subprocess, loaded and warmed once, then in every round each side runs one timed 256-token prefill (the last
position's logits, as serving does) and 16 greedy decode steps after it, in turn, the order rotating; prints
prefill wall and process CPU ms and decode ms per token per side (median [min-max]) and this tree's speeds
against the base's per form, paired within rounds.

    flock /tmp/meshd-bench.lock python bench/prefill_blas_ab.py --base DIR --model PATH [--model PATH ...]
        [--rounds 11] [--threads 2] [--numpy]

--base: a checkout of meshd (``git archive main | tar -x -C DIR``). --model: checkpoint dirs or GGUF files
(``bench/engine.py --dir``'s fp32 dir and its ``model-Q4_K_M.gguf``). Every side gets the same
``OPENBLAS_NUM_THREADS`` / ``MESHD_PREFILL_THREADS`` (``--threads``) and ``MESHD_KERNEL_THREADS``. It also
prints each side's logits hash: sides of one tree agree with each other at any thread count (tests); the
base's may differ from this tree's where the products are cut differently.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SIDE = r"""
import hashlib, json, random, sys, time
sys.path.insert(0, sys.argv[1])
from engine.model import Model
model = Model.load(sys.argv[2])
r = random.Random(1)
prompt = [r.randrange(model.config.vocab_size) for _ in range(256)]
def once():
    cache = model.new_cache(512)
    w0, c0 = time.perf_counter(), time.process_time()
    out = model.forward(prompt, cache, last_only=True)
    w1, c1 = time.perf_counter(), time.process_time()
    tok = int(out[-1].argmax())
    for _ in range(16):  # decode steps after it
        tok = int(model.forward([tok], cache)[-1].argmax())
    w2 = time.perf_counter()
    return w1 - w0, c1 - c0, hashlib.sha256(out.tobytes()).hexdigest()[:12], (w2 - w1) / 16
once()
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps(once()), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="another meshd checkout (required)")
    ap.add_argument("--model", type=Path, action="append", required=True,
                    help="a checkpoint dir or GGUF file (repeatable; required)")
    ap.add_argument("--rounds", type=int, default=11, help="rounds of every side (default 11)")
    ap.add_argument("--threads", type=int, default=2, help="BLAS, prefill and kernel threads (default 2)")
    ap.add_argument("--numpy", action="store_true", help="every side with MESHD_KERNELS=numpy (default: off)")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHD_", "OPENBLAS_"))}
    env.update(OPENBLAS_NUM_THREADS=str(args.threads), MESHD_PREFILL_THREADS=str(args.threads),
               MESHD_KERNEL_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    if args.numpy:
        env["MESHD_KERNELS"] = "numpy"
    sides: dict[str, subprocess.Popen[str]] = {}
    for m in args.model:
        for tree, name in ((ROOT, "this"), (args.base.resolve(), "base")):
            p = subprocess.Popen([sys.executable, "-c", SIDE, str(tree), str(m)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
            assert p.stdout is not None
            while (line := p.stdout.readline()) and line.strip() != "ready":  # the engine's log lines before it
                pass
            if not line:
                sys.exit(f"side {name} {m} failed to start")
            sides[f"{name}:{m.name}"] = p
    res: dict[str, list[tuple[float, float, str, float]]] = {k: [] for k in sides}
    names = list(sides)
    load0 = os.getloadavg()[0]
    for i in range(args.rounds):
        k0 = i % len(names)
        for k in names[k0:] + names[:k0]:
            time.sleep(0.1)  # the previous side's helpers go idle
            p = sides[k]
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            while not (line := p.stdout.readline()).startswith("["):  # type: ignore[union-attr]
                if not line:
                    sys.exit(f"side {k} died")
            res[k].append(tuple(json.loads(line)))  # type: ignore[arg-type]
    for p in sides.values():
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(30)

    def ms(v: list[float]) -> str:
        return f"{statistics.median(v) * 1e3:.0f} [{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}]"

    print(f"{args.rounds} rounds, {args.threads} threads, load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    for k, v in res.items():
        print(f"{k:28s} prefill wall ms {ms([x[0] for x in v])}  CPU ms {ms([x[1] for x in v])}"
              f"  decode ms/token {ms([x[3] for x in v])}  logits {sorted({x[2] for x in v})}")
    for m in args.model:
        a, b = res[f"this:{m.name}"], res[f"base:{m.name}"]
        for i, what in ((0, "prefill"), (3, "decode")):
            r = [y[i] / x[i] for x, y in zip(a, b)]
            print(f"{m.name}: this tree's {what} speed against the base's {statistics.median(r):.2f}x"
                  f" [{min(r):.2f}-{max(r):.2f}]")


if __name__ == "__main__":
    main()
