"""The AVX-512 Q8_0 decode kernel (engine/kernels_q8.py) against the generic one (engine.kernels._q8_0, main's
kernel on every CPU before it), in one process.

    python bench/q8_kernel.py [--rounds 100] [--alternations 7] [--decode /tmp/compact-bench/model-Q4_K_M.gguf]
        [--fp32 /tmp/compact-bench]

Table 1: one thread, thread CPU time, G weights/s (weights of the matrix per second of one call, whatever the
number of rows) on the experts' down projections of the engine benchmark's checkpoint (768x384: Q4_K_M files
store them Q8_0, their rows being 384 wide) and a Q8_0 file's q/o shape (1536x768, 768x1536), 1, 2 and 4
activation rows; "cache": one matrix called again and again, "cold": 150 distinct matrices (45-180 MB, past
the 32 MB L3) in turn. The two sides alternate ``--alternations`` times, ``--rounds`` calls each; median [range]
of the per-alternation rates, and the ratio paired per alternation. The outputs are compared bit for bit.

Table 2 (with ``--decode``): the planned decode of that GGUF checkpoint with either kernel in the kernel threads'
table (``kernel_pool._ADDR`` switched, the plan rebuilt per side; the first logits compared bit for bit), and of
the fp32 checkpoint ``--fp32`` in the same rounds: ms per token, wall and calling thread's CPU time (with
``MESHD_KERNEL_THREADS=1`` the CPU time is all the work), median [range] over rounds of 40 steps after 5 untimed
ones, the sides' order reversed every other round; ratios paired per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))  # after the engine package: bench/ has an engine.py
from kernels import _greedy_steps as _steps  # (bench/kernels.py: the same timer as its tables 8-10)


def _blocks(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random Q8_0 rows: halves in [1e-3, 1.1e-2), codes over all of int8."""
    nb = k // 32
    d = (rng.random((n, nb)) * 0.01 + 1e-3).astype(np.float16)
    w = np.empty((n, nb, 34), dtype=np.uint8)
    w[:, :, :2] = d.view(np.uint8).reshape(n, nb, 2)
    w[:, :, 2:] = rng.integers(0, 256, (n, nb, 32), dtype=np.uint8)
    return w.reshape(n, nb * 34)


def products(rounds: int, alternations: int) -> None:
    from engine import kernels_q8

    rng = np.random.default_rng(0)
    sides = {"generic": kernels._q8_0, "AVX-512": kernels_q8.q8_0}
    print("| shape | rows | weights | generic | AVX-512 | AVX-512/generic |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, k in ((768, 384), (1536, 768), (768, 1536)):
        for where, count in (("cache", 1), ("cold", 150)):
            mats = [_blocks(rng, n, k) for _ in range(count)]
            for t in (1, 2, 4):
                x = rng.standard_normal((t, k)).astype(np.float32)
                outs = {s: np.empty((t, n), dtype=np.float32) for s in sides}
                for s, f in sides.items():
                    for i in range(20):
                        f(x, mats[i % count], outs[s], kernels.HALF, 0, n)
                assert outs["generic"].tobytes() == outs["AVX-512"].tobytes(), (n, k, t)
                got: dict[str, list[float]] = {s: [] for s in sides}
                for _ in range(alternations):
                    for s, f in sides.items():
                        c0 = time.thread_time_ns()
                        for i in range(rounds):
                            f(x, mats[i % count], outs[s], kernels.HALF, 0, n)
                        got[s].append(n * k * rounds / (time.thread_time_ns() - c0))

                def g(v: list[float]) -> str:
                    return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"

                r = [b / a for a, b in zip(got["generic"], got["AVX-512"])]
                print(f"| {n}x{k} | {t} | {where} | {g(got['generic'])} | {g(got['AVX-512'])} |"
                      f" {statistics.median(r):.3f}x [{min(r):.3f}-{max(r):.3f}] |", flush=True)


def decode(path: str, fp32: str, alternations: int) -> None:
    from engine import kernel_pool
    from engine.model import Model

    addrs = {"generic": int(kernel_pool._c_q8_0.address), "AVX-512": int(kernel_pool._c_q8_0_v.address)}
    q = Model.load(path)
    seqs, plans, first = {}, {}, {}
    try:
        for side, addr in addrs.items():
            kernel_pool._ADDR["Q8_0"] = addr
            q._plan = True  # rebuilt on the next step, with this kernel in its tables
            cache = q.new_cache(1024)
            tok = int(np.argmax(q.forward(list(range(10, 74)), cache)[-1]))
            logits = q.forward([tok], cache)
            first[side] = logits.tobytes()
            seqs[side] = [q, cache, int(np.argmax(logits[-1]))]
            plans[side] = q._plan
    finally:
        kernel_pool._ADDR["Q8_0"] = addrs["AVX-512"]
    assert first["generic"] == first["AVX-512"], "the two Q8_0 kernels gave other logits"
    if fp32:
        m = Model.load(fp32)
        cache = m.new_cache(1024)
        seqs["fp32"] = [m, cache, int(np.argmax(m.forward(list(range(10, 74)), cache)[-1]))]
    res: dict[str, list[tuple[float, float]]] = {side: [] for side in seqs}
    for a in range(alternations):
        for side in (list(seqs) if a % 2 == 0 else list(seqs)[::-1]):
            if side in plans:
                q._plan = plans[side]
            _steps(seqs[side], 5)
            res[side].append(_steps(seqs[side], 40))
    print(f"\n| {Path(path).name}, {kernels.threads()} kernel threads | wall ms/token | thread CPU ms/token |")
    print("| --- | --- | --- |")
    for side, v in res.items():
        cols = [f"{statistics.median(r[i] for r in v):.2f} [{min(r[i] for r in v):.2f}-{max(r[i] for r in v):.2f}]"
                for i in (0, 1)]
        print(f"| {side} | {cols[0]} | {cols[1]} |")

    def ratio(num: str, den: str, i: int) -> str:
        v = [a[i] / b[i] for a, b in zip(res[num], res[den])]
        return f"{statistics.median(v):.3f}x [{min(v):.3f}-{max(v):.3f}]"

    for i, what in ((0, "wall"), (1, "CPU")):
        line = f"{what}: AVX-512/generic {ratio('generic', 'AVX-512', i)}"
        if "fp32" in res:
            line += (f"; our fp32 over {Path(path).stem}: generic {ratio('fp32', 'generic', i)},"
                     f" AVX-512 {ratio('fp32', 'AVX-512', i)}")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=100, help="calls per side and alternation (default 100)")
    ap.add_argument("--alternations", type=int, default=7, help="times the sides alternate (default 7)")
    ap.add_argument("--decode", default="",
                    help="table 2: a GGUF checkpoint, e.g. /tmp/compact-bench/model-Q4_K_M.gguf (default none: no"
                         " table 2)")
    ap.add_argument("--fp32", default="",
                    help="table 2: bench/engine.py's fp32 checkpoint dir, in the same rounds (default none)")
    ap.add_argument("--only", default="", help="'1' or '2' (default both)")
    args = ap.parse_args()
    if not kernels.AVAILABLE:
        sys.exit("numba is not installed (pip install 'meshd[fast]'): nothing to compare")
    from engine import kernels_q8

    if not kernels_q8.AVAILABLE:
        sys.exit("engine/kernels_q8.py does not run here (no AVX-512, NUMBA_CPU_NAME set, or MESHD_KERNELS_Q8=0)")
    print(f"load average {os.getloadavg()[0]:.1f}; kernel threads {kernels.threads()}")
    if args.only in ("", "1"):
        products(args.rounds, args.alternations)
    if args.decode and args.only in ("", "2"):
        decode(args.decode, args.fp32, args.alternations)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
