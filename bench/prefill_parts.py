"""Where a prefill goes against transformers, in measures a loaded VM does not spoil: one thread each side, thread
CPU time (``time.thread_time``), both sides in one process, alternating.

    python bench/prefill_parts.py --model DIR [--rounds 8] [--tokens 256] [--skip shapes,whole,span]

--model: an fp32 checkpoint dir transformers loads too (``bench/engine.py --dir``'s). Three tables:

1. ``shapes``: the GEMM shapes of a prefill of the bench model (q/o, k/v, router, experts at several row counts,
   attention per KV group), ``x @ w.T`` (what engine/products.py computed before), ``w @ x.T`` transposed back
   (what it computes for few rows: ``products.transposed``), our pieces (``products.matmul``) and torch's
   ``F.linear``, each the best of several calls per round, median over rounds, ms and G multiply-adds/s.
2. ``whole``: a whole ``--tokens``-token prefill (last position's logits, as serving does) of our engine and of
   transformers, thread CPU ms, median [min-max] over ``--rounds`` alternating rounds.
3. ``span``: our prefill on one thread with the two-thread code paths (``prefill_threads.threads`` reads 2), each
   top-level ``prefill_threads.run``'s tasks timed: the work outside any run (serial on any thread count), each
   call site's work and the span a two-thread pool would need for it (the tasks claimed in order by whichever
   thread is free, as ``prefill_threads`` does): a model of the quiet two-thread prefill that ignores the GIL,
   wake-ups and shared caches, so an upper bound of the scaling.

The process runs with ``MESHD_PREFILL_THREADS=1`` and torch at one thread (set here).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ["MESHD_PREFILL_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from engine import prefill_threads, products

SHAPES = [  # m, k, n, where (the bench model: hidden 768, 12 heads over 4 KV heads of 64, experts of 384)
    (256, 768, 768, "q, o"), (256, 768, 256, "k, v"), (256, 768, 16, "router"),
    (256, 768, 384, "expert gate/up, 256 rows"), (256, 384, 768, "expert down, 256 rows"),
    (96, 768, 384, "expert gate/up, 96 rows"), (32, 768, 384, "expert gate/up, 32 rows"),
    (32, 384, 768, "expert down, 32 rows"), (8, 768, 384, "expert gate/up, 8 rows"),
    (192, 64, 256, "attention qk, one 64-query block x 3 heads"), (192, 256, 64, "attention pv, the same"),
]


def _best(f: Callable[[], object], calls: int) -> float:
    f()
    best = float("inf")
    for _ in range(calls):
        c = time.thread_time()
        f()
        best = min(best, time.thread_time() - c)
    return best * 1e3


def shapes(rounds: int) -> None:
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    print("| shape (M x K x N) | where | x @ w.T | (w @ x.T).T | our pieces | torch F.linear | torch / pieces |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m, k, n, where in SHAPES:
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        calls = max(5, int(2e7 / (m * k * n)))
        sides: dict[str, Callable[[], object]] = {
            "plain": functools.partial(np.matmul, x, w.T),
            "transposed": lambda x=x, w=w: np.ascontiguousarray(np.matmul(w, x.T).T),
            "pieces": functools.partial(products.matmul, x, w), "torch": functools.partial(F.linear, tx, tw)}
        got: dict[str, list[float]] = {s: [] for s in sides}
        for _ in range(rounds):
            for s, f in sides.items():
                got[s].append(_best(f, calls))
        med = {s: statistics.median(v) for s, v in got.items()}
        cell = {s: f"{v:.3f} ({m * k * n / v / 1e6:.0f})" for s, v in med.items()}
        print(f"| {m}x{k}x{n} | {where} | {cell['plain']} | {cell['transposed']} | {cell['pieces']} | {cell['torch']} "
              f"| {med['torch'] / med['pieces']:.2f}x |", flush=True)
    print("(ms, best of several calls, median over rounds; in brackets G multiply-adds/s)")


def _prompt(n: int, vocab: int) -> list[int]:
    r = random.Random(1)
    return [r.randrange(vocab) for _ in range(n)]


def whole(path: str, rounds: int, tokens: int) -> None:
    import torch
    import transformers

    from engine.model import Model

    ours = Model.load(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _prompt(tokens, ours.config.vocab_size)
    ids = torch.tensor([prompt])

    def a() -> None:
        ours.forward(prompt, ours.new_cache(tokens + 8), last_only=True)

    def b() -> None:
        with torch.inference_mode():
            ref(ids, use_cache=True, logits_to_keep=1)

    a(), b()
    got: dict[str, list[float]] = {"ours": [], "transformers": []}
    ratios = []
    for i in range(rounds):
        t = {}
        for name, f in ((("ours", a), ("transformers", b)) if i % 2 == 0 else (("transformers", b), ("ours", a))):
            c = time.thread_time()
            f()
            t[name] = time.thread_time() - c
            got[name].append(t[name] * 1e3)
        ratios.append(t["transformers"] / t["ours"])
    for name, v in got.items():
        print(f"{name}: {statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}] ms thread CPU per {tokens}-token prefill")
    print(f"ours against transformers (speed, paired within rounds): {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]")


def span(path: str, rounds: int, tokens: int) -> None:
    from engine.model import Model

    log: list[tuple[str, list[float]]] = []
    depth = 0

    def run(tasks: list[Callable[[], object]]) -> None:  # prefill_threads.run, serial, each task timed
        nonlocal depth
        if depth or len(tasks) <= 1:
            for t in tasks:
                t()
            return
        f = sys._getframe(1)
        site = f.f_code.co_name
        if site == "run_rows":
            site = "rows: " + f.f_back.f_code.co_name  # type: ignore[union-attr]
        elif site in ("matmul_many", "matmul"):
            g = f.f_back
            while g is not None and g.f_code.co_name in ("matmul_many", "matmul"):
                g = g.f_back
            site = "products: " + (g.f_code.co_name if g is not None else "?")
        depth += 1
        times = []
        for t in tasks:
            c = time.thread_time()
            t()
            times.append(time.thread_time() - c)
        depth -= 1
        log.append((site, times))

    def two_thread_span(times: list[float]) -> float:
        free = [0.0, 0.0]
        for t in times:
            i = free.index(min(free))
            free[i] += t
        return max(free)

    prefill_threads.threads = lambda: 2  # type: ignore[assignment]  # the two-thread code paths
    prefill_threads.run = run  # type: ignore[assignment]
    m = Model.load(path)
    prompt = _prompt(tokens, m.config.vocab_size)

    def once() -> tuple[float, dict[str, list[float]]]:
        log.clear()
        c = time.thread_time()
        m.forward(prompt, m.new_cache(tokens + 8), last_only=True)
        total = time.thread_time() - c
        by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for site, times in log:
            by[site][0] += sum(times)
            by[site][1] += two_thread_span(times)
            by[site][2] += 1
        return total, dict(by)

    once()
    runs = sorted((once() for _ in range(rounds)), key=lambda r: r[0])
    total, by = runs[len(runs) // 2]  # the median prefill
    inside = sum(v[0] for v in by.values())
    modelled = total - inside + sum(v[1] for v in by.values())
    print(f"one thread: {total * 1e3:.0f} ms thread CPU; outside any run (serial): {(total - inside) * 1e3:.0f} ms; "
          f"modelled two-thread span {modelled * 1e3:.0f} ms ({total / modelled:.2f}x)")
    print("| call site | runs | work ms | two-thread span ms | scaling |")
    print("| --- | --- | --- | --- | --- |")
    for site, (work, sp, n) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"| {site} | {n} | {work * 1e3:.1f} | {sp * 1e3:.1f} | {work / sp:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="fp32 checkpoint dir (bench/engine.py --dir; required)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per table (default 8)")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens of a whole prefill (default 256)")
    ap.add_argument("--skip", default="", help="comma-separated tables to skip: shapes, whole, span (default none)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if bad := skip - {"shapes", "whole", "span"}:
        ap.error(f"unknown table(s) in --skip: {', '.join(sorted(bad))}")
    import torch

    torch.set_num_threads(1)
    print(f"load {os.getloadavg()[0]:.2f}; torch {torch.__version__}; numpy {np.__version__}; "
          f"BLAS pinned at one thread: {prefill_threads.pinned()}")
    if "shapes" not in skip:
        shapes(max(3, args.rounds // 2))
    if "whole" not in skip:
        whole(args.model, args.rounds, args.tokens)
    if "span" not in skip:  # last: it replaces prefill_threads' functions for the rest of the process
        span(args.model, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
