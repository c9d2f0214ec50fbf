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
import bisect
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import engine.tiny  # noqa: F401 - the package, before bench/ (which has an engine.py) goes on the path

sys.path.insert(0, str(ROOT / "bench"))

# (tag, the tag after which to look for it, what the segment up to it is). The lane's marks (transport side,
# X.* renamed to the process's role) are looked for after the frame's own mark, since on a busy machine the
# reader often has the bytes before the writer's call returned.
ORDER: list[tuple[str, str, str]] = [
    ("S.step", "", ""),
    ("S.local", "S.step", "serving node: embed + layers 0-3"),
    ("S.fwd", "S.local", "hand-off: scheduler thread -> loop"),
    ("S.sent", "S.fwd", "loop: frame encoded"),
    ("S.write", "S.sent", "stream framing, lane record"),
    ("S.wrote", "S.write", "TLS encrypt + socket write (serving node)"),
    ("T.sock", "S.write", "loopback, stage loop sees its socket readable"),
    ("T.in", "T.sock", "stage: socket read + TLS decrypt"),
    ("T.rx", "T.in", "stage: lane record, stream frame, recv wakes the session"),
    ("T.c0", "T.rx", "stage: frame decoded, dispatched"),
    ("T.c1", "T.c0", "stage: layers 4-7 + head"),
    ("T.sent", "T.c1", "stage: reply encoded"),
    ("T.write", "T.sent", "stream framing, lane record"),
    ("T.wrote", "T.write", "TLS encrypt + socket write (stage)"),
    ("S.sock", "T.write", "loopback, serving loop sees its socket readable"),
    ("S.in", "S.sock", "serving node: socket read + TLS decrypt"),
    ("S.rx", "S.in", "serving node: lane record, stream frame, frame decoded"),
    ("S.resume", "S.rx", "loop: reply to the waiting step"),
    ("S.back", "S.resume", "hand-off: loop -> scheduler thread"),
]
CHAIN = [
    "S.step",
    "S.local",
    "S.fwd",
    "S.sent",
    "S.write",
    "T.sock",
    "T.in",
    "T.rx",
    "T.c0",
    "T.c1",
    "T.sent",
    "T.write",
    "S.sock",
    "S.in",
    "S.rx",
    "S.resume",
    "S.back",
]


def steps(trace_dir: Path, roles: dict[int, str]) -> list[dict[str, int]]:
    """Per decode step, each tag's first time after its anchor (within the step)."""
    events: list[tuple[int, str]] = []
    for f in trace_dir.glob("*.trace"):
        role = roles.get(int(f.stem), "?")
        for line in f.read_text().splitlines():
            tag, ns = line.split()
            if tag.startswith("X."):
                tag = role + tag[1:]
            events.append((int(ns), tag))
    events.sort()
    times: dict[str, list[int]] = {}
    for ns, tag in events:
        times.setdefault(tag, []).append(ns)
    starts = times.get("S.step", [])
    out: list[dict[str, int]] = []
    for a, b in itertools.pairwise(starts):
        step = {"S.step": a, "next": b}
        for tag, anchor, _ in ORDER[1:]:
            xs = times.get(tag, [])
            k = bisect.bisect_left(xs, step[anchor])
            if k == len(xs) or xs[k] >= b:
                break
            step[tag] = xs[k]
        else:
            if b - a < 200_000_000:
                out.append(step)
    return out


def _cpu_s(node: Any) -> float:
    """CPU seconds (user + system) of a node's process so far."""
    with open(f"/proc/{node.proc.pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        roles = {srv.proc.pid: "S", st.proc.pid: "T"}
        deadline = time.monotonic() + 120
        while len(srv.status()["services"]["pipeline"]["pipeline"]["models"]["m"].get("plan") or []) != 2:
            if time.monotonic() > deadline:
                raise RuntimeError("no 2-stage plan")
            time.sleep(0.5)
        for node in (local, srv):
            decode_tps(node.run["api"], prompt, 16)
        for f in tdir.glob("*.trace"):
            f.write_text("")
        cpu0 = {n: _cpu_s(n) for n in nodes}
        wall = 0.0
        for _ in range(args.rounds):
            for name, node in (("local", local), ("2 stages", srv)):
                t0 = time.perf_counter()
                t, _text = decode_tps(node.run["api"], prompt, args.decode)
                if name != "local":
                    wall += time.perf_counter() - t0
                tps[name].append(t)
        busy = {n: (_cpu_s(n) - cpu0[n]) for n in (srv, st)}
    finally:
        for n in reversed(nodes):
            n.stop()
    got = steps(tdir, roles)
    shutil.rmtree(states, ignore_errors=True)
    if not got:
        print("no complete decode step traced", file=sys.stderr)
        return 1
    print(
        f"\n{len(got)} decode steps, 2 stages (0-3 | 4-7 + head), {args.threads} BLAS thread(s) per process"
    )
    print(
        f"decode tok/s: local {statistics.median(tps['local']):.1f}, 2 stages {statistics.median(tps['2 stages']):.1f}\n"
    )
    print("| segment | median ms | p25 | p75 |")
    print("|---|---|---|---|")
    total = 0.0
    for tag, anchor, name in ORDER[1:]:
        xs = sorted((s[tag] - s[anchor]) / 1e6 for s in got)
        q = statistics.quantiles(xs, n=4)
        if tag in CHAIN:
            total += statistics.median(xs)
        print(f"| {name} | {statistics.median(xs):.3f} | {q[0]:.3f} | {q[2]:.3f} |")
    xs = sorted((s["next"] - s["S.back"]) / 1e6 for s in got)
    total += statistics.median(xs)
    print(f"| serving node: sampling, event, next step | {statistics.median(xs):.3f} | | |")
    whole = sorted((s["next"] - s["S.step"]) / 1e6 for s in got)
    hop = sorted(((s["S.back"] - s["S.local"]) - (s["T.c1"] - s["T.c0"])) / 1e6 for s in got)
    print(f"| step (S.step to next S.step) | {statistics.median(whole):.3f} | | |")
    print(
        f"\nsum of the chain's segment medians {total:.3f} ms; hop overhead as the scheduler sees it "
        f"(S.local..S.back minus the stage's compute) {statistics.median(hop):.3f} ms"
    )
    print(
        f"CPU time over the pipelined decodes ({wall:.2f} s wall): serving node {busy[srv]:.2f} s, "
        f"stage {busy[st]:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
