"""Where a model's peak RSS goes: one engine process doing bench/engine.py's engine-side steps, measured.

    python bench/prefill_rss.py CHECKPOINT [--root TREE] [--rounds 3] [--phases]

The process imports the engine of ``--root`` (default this checkout), loads numba's kernels (``kernels.warm``,
``dense.warm_step``: the runtime, not counted), takes its RSS, loads CHECKPOINT, runs a cold 256-token prefill,
then ``--rounds`` times a prefill and a prefill with 64 greedy decode steps (one cache alive at a time), and prints
one JSON line: the peak RSS over the RSS before the load (VmHWM), the file size, their ratio, the part of the peak
that is not file-backed (anonymous: KV cache pages, activations, what the allocator keeps), the resident anonymous
growth at the end, and the prefills' milliseconds. Run it in fresh processes, trees alternated, for an A/B: the
figures move by ~1-2 MiB between identical runs (thread timing, the allocator).

``--phases`` adds one 256-token prefill under tracemalloc (numpy's arrays are traced) and prints, per phase of the
pass (embedding, norms, attention, o, residual add, routed experts, combination, logits), the traced memory at its
entry and its peak, in MiB: which phase holds the process's peak live set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 256
DECODE_LEN = 64


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return 0.0


def _phases(model, moe, M, prompt: list[int]) -> dict[str, list[float]]:
    import tracemalloc

    got: dict[str, list[float]] = {}
    depth = [0]

    def wrap(owner: object, name: str, label: str) -> None:
        f = getattr(owner, name)
        static = isinstance(vars(owner).get(name), staticmethod)

        @functools.wraps(f)
        def g(*a: object, **k: object) -> object:
            if depth[0]:
                return f(*a, **k)
            depth[0] += 1
            entry = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            try:
                return f(*a, **k)
            finally:
                peak = tracemalloc.get_traced_memory()[1]
                e, p = got.get(label, [0.0, 0.0])
                got[label] = [max(e, entry / 2**20), max(p, peak / 2**20)]
                depth[0] -= 1

        setattr(owner, name, staticmethod(g) if static else g)

    for owner, name, label in ((M.Model, "embed", "embed"), (M.Model, "_norm", "norm"), (M.Model, "_attend", "attention"),
                               (M.Model, "_out", "o"), (M.Model, "_add_norm", "add + norm"),
                               (moe, "_run_threaded", "routed experts"), (moe, "combine", "combination"),
                               (M.Model, "_logits", "logits")):
        if hasattr(owner, name):
            wrap(owner, name, label)
    cache = model.new_cache(512)
    tracemalloc.start()
    try:
        model.forward(prompt, cache, last_only=True)
    finally:
        tracemalloc.stop()
    return {k: [round(e, 2), round(p, 2)] for k, (e, p) in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a checkpoint directory or GGUF file (required)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the meshd checkout whose engine runs (default: this one)")
    ap.add_argument("--rounds", type=int, default=3, help="prefill + decode rounds after the cold prefill (default 3)")
    ap.add_argument("--phases", action="store_true", help="also trace one prefill's phases (default: off)")
    args = ap.parse_args()
    if not args.checkpoint.exists():
        sys.exit(f"{args.checkpoint}: no such checkpoint")
    sys.path.insert(0, str(args.root.resolve()))
    import engine
    from engine import dense, kernels, moe
    from engine import model as M

    if Path(engine.__file__).resolve().parent != (args.root / "engine").resolve():
        sys.exit(f"imported {engine.__file__}, not the engine of {args.root}")
    kernels.warm()
    dense.warm_step()
    rss0, file0, anon0 = _status("VmRSS:"), _status("RssFile:"), _status("RssAnon:")
    model = M.Model.load(args.checkpoint)
    r = random.Random(1)
    prompt = [r.randrange(model.config.vocab_size) for _ in range(PROMPT_LEN)]
    model.forward(prompt, model.new_cache(512), last_only=True)
    prefill_ms = []
    for _ in range(args.rounds):
        cache = model.new_cache(512)
        t0 = time.perf_counter()
        model.forward(prompt, cache, last_only=True)
        prefill_ms.append(round((time.perf_counter() - t0) * 1e3, 1))
        cache = model.new_cache(512)
        tok = int(model.forward(prompt, cache, last_only=True)[-1].argmax())
        for _ in range(DECODE_LEN):
            tok = int(model.forward([tok], cache)[-1].argmax())
        cache = None
    peak = _status("VmHWM:") - rss0
    p = args.checkpoint
    size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))
    out = {"checkpoint": str(p), "root": str(args.root), "peak_mib": round(peak, 1),
           "file_mib": round(size / 2**20, 1), "peak_over_file": round(peak / (size / 2**20), 3),
           "peak_not_file_mib": round(peak - (_status("RssFile:") - file0), 1),
           "anon_at_end_mib": round(_status("RssAnon:") - anon0, 1), "prefill_ms": prefill_ms,
           "load_average": round(os.getloadavg()[0], 1)}
    if args.phases:
        out["phases_entry_peak_mib"] = _phases(model, moe, M, prompt)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
