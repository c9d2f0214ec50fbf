"""Where one pipelined decode step's time goes: a timeline across the serving node and its stage.

    python bench/pipeline_timeline.py [--dir DIR] [--decode 64] [--rounds 3] [--threads 1]

bench/pipeline.py's mid-size checkpoint and nodes: a serving node (layers 0-3, ``--pipeline on``) and a
stage process (``--stage PATH@4-7``) on loopback, plus a local node for the reference decode speed. Both
pipeline processes run with ``MESHD_PIPELINE_TRACE`` (``engine/pipeline/trace.py``) and record, per decode
step, CLOCK_MONOTONIC timestamps at: the scheduler starts the step (S.step), this node's layers are done
and the step is handed to the loop (S.local), the loop starts the hop (S.fwd), the frame is written
(S.sent, just before the write), the stage has read it (T.rx), its compute starts and ends (T.c0, T.c1), its reply is encoded
(T.sent), the serving node has read and decoded it (S.rx), the waiting coroutine resumes (S.resume), the
scheduler thread has it back (S.back). The next S.step closes the step (sampling, the event to the client,
the scheduler's loop). Each round streams ``--decode`` tokens from each setup in turn; prints the median
and quartiles of every segment over all steps, and the decode tok/s of both setups.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import engine.tiny  # noqa: E402 - the package, before bench/ (which has an engine.py) goes on the path

sys.path.insert(0, str(ROOT / "bench"))

ORDER = ["S.step", "S.local", "S.fwd", "S.sent", "T.rx", "T.c0", "T.c1", "T.sent", "S.rx", "S.resume", "S.back"]
NAMES = {
    ("S.step", "S.local"): "serving node: embed + layers 0-3",
    ("S.local", "S.fwd"): "hand-off: scheduler thread -> loop",
    ("S.fwd", "S.sent"): "loop: frame encoded",
    ("S.sent", "T.rx"): "write, wire, stage wake-up, read",
    ("T.rx", "T.c0"): "stage: frame decoded, dispatched",
    ("T.c0", "T.c1"): "stage: layers 4-7 + head",
    ("T.c1", "T.sent"): "stage: reply encoded",
    ("T.sent", "S.rx"): "write, wire, serving node wake-up, read, decode",
    ("S.rx", "S.resume"): "loop: reply to the waiting coroutine",
    ("S.resume", "S.back"): "hand-off: loop -> scheduler thread",
    ("S.back", "S.step"): "serving node: sampling, event, next step",
}


def steps(trace_dir: Path) -> list[dict[str, int]]:
    events: list[tuple[int, str]] = []
    for f in trace_dir.glob("*.trace"):
        for line in f.read_text().splitlines():
            tag, ns = line.split()
            events.append((int(ns), tag))
    events.sort()
    out: list[dict[str, int]] = []
    cur: dict[str, int] | None = None
    for ns, tag in events:
        if tag == "S.step":
            if cur is not None and len(cur) == len(ORDER):
                cur["next"] = ns
                out.append(cur)
            cur = {"S.step": ns}
            continue
        if cur is None:
            continue
        want = ORDER[len(cur)] if len(cur) < len(ORDER) else None
        if tag == want:
            cur[tag] = ns
        elif tag in cur or tag not in ORDER:
            continue
        else:  # out of order (another sequence, or a prefill): drop this step
            cur = None
    return [s for s in out if s["next"] - s["S.step"] < 200_000_000]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint and state dirs (default: a temp dir)")
    ap.add_argument("--decode", type=int, default=64, help="decode tokens per stream (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads per process (default 1)")
    args = ap.parse_args()

    from experts import create
    from pipeline import Node, decode_tps

    from engine.tiny import create_tiny

    base = args.dir or Path(tempfile.mkdtemp(prefix="pipeline-timeline-"))
    ck = create(base / "mid")
    if not (ck / "tokenizer.json").exists():
        tiny = create_tiny(base / "tiny")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / name, ck / name)
    states = base / f"timeline-{os.getpid()}"
    tdir = states / "trace"
    tdir.mkdir(parents=True)
    prompt = list(range(10, 26))
    nodes: list[Node] = []
    tps: dict[str, list[float]] = {"local": [], "2 stages": []}
    try:
        local = Node(states / "local", ["--model", f"m={ck}"], args.threads)
        nodes.append(local)
        os.environ["MESHD_PIPELINE_TRACE"] = str(tdir)
        srv = Node(states / "s2", ["--model", f"m={ck}", "--pipeline", "on"], args.threads)
        nodes.append(srv)
        st = Node(states / "st2", ["--stage", f"{ck}@4-7", "--join", srv.invite()], args.threads)
        nodes.append(st)
        del os.environ["MESHD_PIPELINE_TRACE"]
        deadline = time.monotonic() + 120
        while len(srv.status()["services"]["pipeline"]["pipeline"]["models"]["m"].get("plan") or []) != 2:
            if time.monotonic() > deadline:
                raise RuntimeError("no 2-stage plan")
            time.sleep(0.5)
        for node in (local, srv):
            decode_tps(node.run["api"], prompt, 16)
        for f in tdir.glob("*.trace"):
            f.write_text("")
        for _ in range(args.rounds):
            for name, node in (("local", local), ("2 stages", srv)):
                t, _text = decode_tps(node.run["api"], prompt, args.decode)
                tps[name].append(t)
    finally:
        for n in reversed(nodes):
            n.stop()
    got = steps(tdir)
    if not got:
        print("no complete decode step traced", file=sys.stderr)
        return 1
    print(f"\n{len(got)} decode steps, 2 stages (0-3 | 4-7 + head), {args.threads} BLAS thread(s) per process")
    print(f"decode tok/s: local {statistics.median(tps['local']):.1f}, 2 stages {statistics.median(tps['2 stages']):.1f}\n")
    print("| segment | median ms | p25 | p75 |")
    print("|---|---|---|---|")
    keys = ORDER + ["next"]
    total = 0.0
    for a, b in zip(keys, keys[1:]):
        xs = sorted((s[b] - s[a]) / 1e6 for s in got)
        q = statistics.quantiles(xs, n=4)
        total += statistics.median(xs)
        name = NAMES[(a, "S.step" if b == "next" else b)]
        print(f"| {name} | {statistics.median(xs):.3f} | {q[0]:.3f} | {q[2]:.3f} |")
    whole = sorted((s["next"] - s["S.step"]) / 1e6 for s in got)
    hop = sorted(((s["S.back"] - s["S.local"]) - (s["T.c1"] - s["T.c0"])) / 1e6 for s in got)
    print(f"| step (S.step to next S.step) | {statistics.median(whole):.3f} | | |")
    print(f"\nsum of segment medians {total:.3f} ms; hop overhead as the scheduler sees it "
          f"(S.local..S.back minus the stage's compute) {statistics.median(hop):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
