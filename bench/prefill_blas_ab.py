"""In-process A/B of the fp32 prefill's products outside the pieces (q/k/v, o, the router) on BLAS's own count
against one BLAS thread (what session 8's prefill pool left after a process's first prefill), with transformers
in the same rounds; the pieces run on the prefill threads either way.

    flock /tmp/meshd-bench.lock python bench/prefill_blas_ab.py --dir DIR [--rounds 15] [--threads 2]

DIR: ``bench/engine.py``'s fp32 checkpoint (``--dir``). Each round runs the three sides in turn (the order
rotating), 256-token prefills with the last position's logits; prints wall and process CPU ms (median [min-max])
and the paired speed ratios. One BLAS thread outside the pieces is also what ``OPENBLAS_NUM_THREADS=1
MESHD_PREFILL_THREADS=2`` gives.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="fp32 checkpoint dir (bench/engine.py --dir; required)")
    ap.add_argument("--rounds", type=int, default=15, help="rounds of the three sides (default 15)")
    ap.add_argument("--threads", type=int, default=2, help="BLAS, OpenMP and torch threads (default 2)")
    args = ap.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from engine import prefill_threads
    from engine.model import Model

    torch.set_num_threads(args.threads)
    r = random.Random(1)
    prompt = [r.randrange(8192) for _ in range(256)]
    model = Model.load(args.dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    prefill_threads.threads()
    blas = prefill_threads._blas
    if blas is None:
        sys.exit("numpy's BLAS has no per-thread count: nothing to compare")
    own = prefill_threads._blas_threads

    def ours(n: int) -> tuple[float, float]:
        prefill_threads._blas_threads = n
        blas[0](n)
        cache = model.new_cache(512)
        w0, c0 = time.perf_counter(), time.process_time()
        model.forward(prompt, cache, last_only=True)
        return time.perf_counter() - w0, time.process_time() - c0

    def theirs() -> tuple[float, float]:
        with torch.inference_mode():
            w0, c0 = time.perf_counter(), time.process_time()
            ref(ids, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - w0, time.process_time() - c0

    sides = {"blas-own": lambda: ours(own), "blas-1": lambda: ours(1), "transformers": theirs}
    for f in sides.values():
        f()
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    load0 = os.getloadavg()[0]
    names = list(sides)
    for i in range(args.rounds):
        for k in names[i % 3 :] + names[: i % 3]:
            time.sleep(0.05)
            res[k].append(sides[k]())
    prefill_threads._blas_threads = own
    blas[0](own)

    def ms(v: list[float]) -> str:
        return f"{statistics.median(v) * 1e3:.0f} [{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}]"

    def ratio(a: str, b: str) -> str:
        v = [x[0] / y[0] for x, y in zip(res[a], res[b])]
        return f"{statistics.median(v):.2f}x [{min(v):.2f}-{max(v):.2f}]"

    print(f"{args.rounds} rounds, BLAS's own count {own}, load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    for k, v in res.items():
        print(f"{k:13s} wall ms {ms([x[0] for x in v])}  process CPU ms {ms([x[1] for x in v])}")
    print(f"speed, BLAS's own count against 1 thread outside the pieces: {ratio('blas-1', 'blas-own')}")
    print(f"speed against transformers: own count {ratio('transformers', 'blas-own')},"
          f" 1 thread {ratio('transformers', 'blas-1')}")


if __name__ == "__main__":
    main()
