"""A worker's expert compute against the local engine's, in one process, on the same decode layers.

    python bench/experts_compute.py [--dir DIR] [--steps 4] [--blocks 40]

Loads bench/experts.py's mid-size checkpoint (written into --dir unless already there) twice: as the local
engine (``Model.load``) and as a worker's shard (``load_shard``, warmed as the experts service warms it).
Records every routed layer of ``--steps`` greedy decode steps (x and the work list), builds each layer's
request as the coordinator builds it (``planning.request``), checks that the worker's ``compute_request``
gives the local executor's bytes, and then times, in alternating blocks (each timed after one untimed
pass over the same layers): the local executor, the worker's ``compute_request``, and the same with one
``expert_ffn`` per expert (what the worker did before it used ``expert_ffn_many``: two rounds of the kernel
threads per expert instead of two per layer). Medians over the blocks, in ms per layer, with quartiles.
No network and no second process: what is left between these figures and a worker's compute in
bench/experts.py (the ``worker compute`` column) is the other process on the same cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="the checkpoint (written once; default: a temp dir)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps whose routed layers are recorded (default 4)")
    ap.add_argument("--blocks", type=int, default=40, help="timed blocks per variant (default 40)")
    args = ap.parse_args(argv)

    import numpy as np
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    from experts import create

    from engine.experts import planning
    from engine.experts.shard import load_shard
    from engine.experts.worker import compute_request
    from engine.model import Model
    from engine.moe import expert_ffn

    path = create(args.dir or Path(tempfile.mkdtemp(prefix="meshd-bench-experts-")) / "qwen3moe-mid")
    model = Model.load(path)
    shard = load_shard(str(path))
    shard.warm()
    calls: list[tuple[int, Any, list[tuple[int, Any]]]] = []

    def recording(layer: int, x: Any, work: Any) -> list[Any]:
        calls.append((layer, x.copy(), [(e, rows.copy()) for e, rows in work]))
        return model.local_executor(layer, x, work)

    cache = model.new_cache()
    tok = int(np.argmax(model.forward(list(range(10, 74)), cache)[-1]))
    for _ in range(args.steps):
        tok = int(np.argmax(model.forward([tok], cache, executor=recording)[-1]))
    reqs = [planning.request(layer, x, work, list(range(len(work)))) for layer, x, work in calls]

    def one_by_one(req: Any) -> Any:
        out = np.empty((req.pairs.shape[0], req.x.shape[1]), dtype=np.float32)
        pos = 0
        for e, rows in req.groups():
            out[pos:pos + len(rows)] = expert_ffn(req.x[rows], *shard.weights(req.layer, e))
            pos += len(rows)
        return out

    for (layer, x, work), req in zip(calls, reqs):
        want = np.concatenate(model.local_executor(layer, x, work)).tobytes()
        if compute_request(shard.weights, req).tobytes() != want or one_by_one(req).tobytes() != want:
            print(f"layer {layer}: the worker's bytes differ from the local executor's")
            return 1
    variants: dict[str, Callable[[], object]] = {
        "local executor (expert_ffn_many)": lambda: [model.local_executor(la, x, w) for la, x, w in calls],
        "worker compute_request": lambda: [compute_request(shard.weights, r) for r in reqs],
        "one expert_ffn per expert": lambda: [one_by_one(r) for r in reqs],
    }
    res: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.blocks):
        for name, run in variants.items():
            run()
            t0 = time.perf_counter()
            run()
            res[name].append((time.perf_counter() - t0) / len(calls) * 1e3)
    print(f"\n{len(calls)} routed decode layers, bytes equal to the local executor's; {args.blocks} blocks\n")
    print("| compute | ms per layer, median | quartiles |")
    print("|---|---|---|")
    for name, v in res.items():
        v.sort()
        print(f"| {name} | {statistics.median(v):.3f} | {v[len(v) // 4]:.3f}-{v[3 * len(v) // 4]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
