"""A pipeline part's one-token step in one process: the decode plan's layer-range form vs the general pass.

    python bench/pipeline_span.py [--dir DIR] [--rounds 8] [--steps 8]

bench/pipeline.py's mid-size checkpoint (written to --dir if missing). The two parts of its 2-stage split,
the serving node's layers 0-3 and the stage's 4-7 + head, each as ``Model.part`` views of one loaded model,
after a 256-position prefill: per round, ``--steps`` one-token steps through ``decode_plan.forward_span``
(with the kernel pool, and inside ``kernels.single_threaded()``) and through ``span_steps`` (+ ``logits``),
the three sides alternating on their own caches. Prints the median step time per side over rounds [min, max].
Needs numba (the ``[fast]`` extra): without it there is no plan and the script says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import engine.tiny  # noqa: E402,F401 - the package, before bench/ (which has an engine.py) goes on the path

sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint dir (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=8, help="alternating rounds (default 8)")
    ap.add_argument("--steps", type=int, default=8, help="one-token steps per side per round (default 8)")
    args = ap.parse_args()

    import numpy as np
    from experts import create

    from engine import dense, kernels
    from engine.decode_plan import DecodePlan, forward_span
    from engine.model import Model
    from engine.moe import drive

    if dense._kernels() is None:
        print("numba is not installed: no decode plan to measure")
        return 1
    ck = create((args.dir or Path(tempfile.mkdtemp(prefix="pipeline-span-"))).resolve() / "mid")
    full = Model.load(ck)
    rng = np.random.default_rng(0)
    d = full.config.hidden_size
    for first, last in ((0, 3), (4, 7)):
        p, g = full.part(first, last), full.part(first, last)
        g._plan = False
        head = p.lm_head is not None
        sides = ("plan", "plan, single_threaded", "general pass")
        res: dict[str, list[float]] = {k: [] for k in sides}
        models = {k: g if k == "general pass" else p for k in sides}
        caches = {k: models[k].new_cache(512) for k in sides}
        pre = rng.standard_normal((256, d)).astype(np.float32)
        for k, c in caches.items():
            m = models[k]
            c.reserve(256)
            drive(m.span_steps(pre, c, 0), m.local_executor, m.warm)
            c.length = 256
        for _ in range(args.rounds):
            for k in sides:
                c, ts = caches[k], []
                for _ in range(args.steps):
                    x = rng.standard_normal((1, d)).astype(np.float32)
                    t0 = time.perf_counter()
                    if k == "general pass":
                        c.reserve(c.length + 1)
                        y = drive(g.span_steps(x, c, c.length), g.local_executor, g.warm)
                        if head:
                            g.logits(y)
                    elif k == "plan":
                        forward_span(p, x, c, None, head)
                    else:
                        with kernels.single_threaded():
                            forward_span(p, x, c, None, head)
                    ts.append(time.perf_counter() - t0)
                    c.length += 1
                res[k].append(statistics.median(ts) * 1e3)
        assert isinstance(p._plan, DecodePlan)
        name = f"layers {first}-{last}{' + head' if head else ''}"
        for k, v in res.items():
            print(f"{name}, {k}: {statistics.median(v):.2f} ms [{min(v):.2f}, {max(v):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
