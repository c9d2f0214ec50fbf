"""Paired A/B of the expert decode path: two checkouts, the same workload, interleaved in time.

    python bench/experts_ab.py A_CHECKOUT B_CHECKOUT [--blocks 40] [--steps 20] [--workers 1] [--dir DIR]
                               [--path lane|quic] [--a-env KEY=VALUE ...]

``--a-env`` sets a variable in A's process only, so one checkout can be set against itself with a switch:
``python bench/experts_ab.py . . --a-env MESHD_EXPERTS_DIRECT=0`` is the lane's stream path (A) against the
direct channel (B).

On a shared VM, runs made minutes apart drift by 10-20%, more than most changes to the decode path are
worth. Here each checkout gets its own process (its code, its coordinator, its worker processes, the
mid-size checkpoint of ``bench/experts.py``; expert streams over the data lane, as a daemon's, or
``--path quic``), and the two take turns: a block of --steps remote decode
steps from A, then one from B (the order flips every block), then a block of local steps from each. Each
block's figure is its median step. Per-layer overhead = (remote block - local block) / sparse layers, per
checkout; the paired figure is B's remote block minus A's remote block of the same round, per layer:
negative means B is faster. Only two of the processes run at any time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()


def child(checkout: Path, workers: int, ckpt: Path, path_kind: str) -> int:
    """Serve blocks for the parent: reads ``run remote|local N``, answers the N step times as JSON."""
    import os
    import random

    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    for p in (checkout / "tests", checkout / "bench", checkout):
        sys.path.insert(0, str(p))
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    import experts as bench  # the checkout's own bench/experts.py (its checkpoint recipe)
    import numpy as np
    from experts_mesh import Coordinator, MeshFixture, spawn_worker

    from engine.model import Model

    path = bench.create(ckpt)
    model = Model.load(path)
    sparse = len(model.sparse_layers)
    r = random.Random(1)
    prompt = [r.randrange(bench.CONFIG["vocab_size"]) for _ in range(64)]
    mesh = MeshFixture()
    procs = [spawn_worker(mesh, Path(tempfile.mkdtemp(prefix="meshd-ab-")), [str(path)]) for _ in range(workers)]
    coord = Coordinator(mesh, lane=path_kind == "lane")
    try:
        coord.connect(procs)
        executors = {"remote": coord.executor(path, "on"), "local": model.local_executor}
        coord.wait_paths(procs, path_kind)
        caches = {k: model.new_cache() for k in executors}
        outs = {k: model.forward(prompt, caches[k], executor=ex)[-1] for k, ex in executors.items()}
        print(json.dumps({"ready": True, "sparse": sparse}), flush=True)
        import time

        for line in sys.stdin:
            cmd, kind, n = line.split()
            if cmd != "run":
                break
            times = []
            for _ in range(int(n)):
                t0 = time.perf_counter()
                outs[kind] = model.forward([int(np.argmax(outs[kind]))], caches[kind], executor=executors[kind])[-1]
                times.append(time.perf_counter() - t0)
            print(json.dumps(times), flush=True)
    finally:
        coord.close()
        for p in procs:
            p.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, nargs="?",
                    help="checkout A, the baseline (required; e.g. . with --a-env)")
    ap.add_argument("b", type=Path, nargs="?", help="checkout B (required; may be the same tree as A)")
    ap.add_argument("--blocks", type=int, default=40,
                    help="rounds of one block per checkout and kind (default 40)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per block (default 20)")
    ap.add_argument("--workers", type=int, default=1, help="expert worker processes (default 1)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "meshd-bench-experts-ab",
                    help="the checkpoint (written once; default TMPDIR/meshd-bench-experts-ab)")
    ap.add_argument("--path", choices=("lane", "quic"), default="lane",
                    help="the expert streams' path (default lane: the data lane, as a daemon uses)")
    ap.add_argument("--a-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for A's process only (repeatable; default none)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.workers, args.dir, args.path)
    if args.a is None or args.b is None:
        ap.error("give two checkouts")
    checkouts = [args.a.resolve(), args.b.resolve()]
    for c in checkouts:
        if not (c / "engine" / "experts").is_dir():
            sys.exit(f"experts_ab: {c} is not a meshd checkout with expert workers")
    kids: list[subprocess.Popen[str]] = []
    try:
        sparse = 0
        import os

        for n, c in enumerate(checkouts):  # one at a time: the first writes the checkpoint
            env = dict(os.environ)
            if n == 0:
                env.update(kv.split("=", 1) for kv in args.a_env)
            kid = subprocess.Popen([sys.executable, str(HERE), "--child", str(c), "--workers", str(args.workers),
                                    "--dir", str(args.dir), "--path", args.path], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env)
            kids.append(kid)
            assert kid.stdout is not None
            line = kid.stdout.readline()
            if not line:
                sys.exit(f"experts_ab: {c} failed to start (see its error above)")
            sparse = json.loads(line)["sparse"]
        blocks: dict[tuple[int, str], list[float]] = {(i, k): [] for i in range(2) for k in ("remote", "local")}
        for b in range(args.blocks):
            for kind in ("remote", "local"):
                for i in ((0, 1) if b % 2 == 0 else (1, 0)):
                    assert kids[i].stdin is not None and kids[i].stdout is not None
                    kids[i].stdin.write(f"run {kind} {args.steps}\n")
                    kids[i].stdin.flush()
                    blocks[(i, kind)].append(statistics.median(json.loads(kids[i].stdout.readline())))
    finally:
        for kid in kids:
            if kid.stdin is not None:
                kid.stdin.close()
            kid.wait(60)
    print(f"{args.blocks} blocks of {args.steps} decode steps, {args.workers} worker(s) over {args.path}, "
          f"{sparse} sparse layers")
    for i, c in enumerate(checkouts):
        per_layer = [(r - lo) * 1e3 / sparse for r, lo in zip(blocks[(i, "remote")], blocks[(i, "local")])]
        print(f"{'AB'[i]} {c}: remote step {statistics.median(blocks[(i, 'remote')]) * 1e3:.3f} ms, local step "
              f"{statistics.median(blocks[(i, 'local')]) * 1e3:.3f} ms, per-layer overhead {statistics.median(per_layer):.3f} ms")
    diff = sorted((b - a) * 1e3 / sparse for a, b in zip(blocks[(0, "remote")], blocks[(1, "remote")]))
    q = statistics.quantiles(diff, n=4)
    print(f"B - A, remote step per sparse layer: median {statistics.median(diff):+.3f} ms "
          f"(quartiles {q[0]:+.3f} to {q[2]:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
