"""Where one pipelined decode step's time goes: a timeline across the serving node and its stage.

    python bench/pipeline_timeline.py [--dir DIR] [--decode 64] [--rounds 3] [--threads 1]

bench/pipeline.py's mid-size checkpoint and nodes: a serving node (layers 0-3, ``--pipeline on``) and a
stage process (``--stage PATH@4-7``) on loopback, plus a local node for the reference decode speed. All three
run with ``MESHD_PIPELINE_TRACE`` (``engine/pipeline/trace.py``) and record CLOCK_MONOTONIC timestamps per
decode step. The step takes the stage's direct channel when it is up (the default, engine/pipeline/direct.py):
the scheduler starts the step (S.step), this node's layers are done (S.local), the scheduler thread has encoded
the frame (S.dsend) and written it (S.dwrote), the stage's channel thread has read it (T.drx), its compute
starts and ends (T.c0, T.c1), its reply is encoded (T.dsend) and written (T.dwrote), the scheduler thread has
read it (S.drx) and has the checked logits (S.back). On the stream path (``MESHD_PIPELINE_DIRECT=0`` in the
environment) the marks are: S.step, S.local (the step is handed to the loop), the loop starts the hop (S.fwd),
the frame is written (S.sent, just before the write), the stage has read it (T.rx), T.c0, T.c1, its reply is
encoded (T.sent), the serving node has read and decoded it (S.rx), the waiting callback resumes (S.resume), the
scheduler thread has it back (S.back). The next S.step closes the step (sampling, the event to the client, the
scheduler's loop). Each round streams ``--decode`` tokens from each setup in turn; prints the median and
quartiles of every segment over all steps, the step's mean and tail, the time per token as each node's
scheduler saw it (local node and serving node: from one lone step's start to the next, and its forward), the
client's mean time per token, the garbage collections during the steps, and the decode tok/s of both setups.
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
# The same step over the stage's direct channel (engine/pipeline/direct.py, the default when the stage rides a
# data lane): the scheduler thread writes the FORWARD on a blocking TLS socket and reads the RESULT itself; the
# stage's channel thread reads it, computes and writes the reply. No loop on either side.
DIRECT_ORDER: list[tuple[str, str, str]] = [
    ("S.step", "", ""),
    ("S.local", "S.step", "serving node: embed + layers 0-3"),
    ("S.dsend", "S.local", "scheduler thread: frame encoded (direct)"),
    ("S.dwrote", "S.dsend", "TLS encrypt + socket write (serving node)"),
    ("T.drx", "S.dsend", "loopback, stage channel thread wakes, TLS decrypt"),
    ("T.c0", "T.drx", "stage: frame decoded, checked, lock"),
    ("T.c1", "T.c0", "stage: layers 4-7 + head"),
    ("T.dsend", "T.c1", "stage: reply encoded"),
    ("T.dwrote", "T.dsend", "TLS encrypt + socket write (stage)"),
    ("S.drx", "T.dsend", "loopback, scheduler thread wakes, TLS decrypt"),
    ("S.back", "S.drx", "serving node: reply decoded and checked"),
]
# Marks off the step's critical way: a blocking write that returns only once its thread gets a core back, which
# can be after the reply is in and the next step has started (the step is kept, this segment left out)
OFF_CHAIN = {"S.dwrote", "T.dwrote"}
DIRECT_CHAIN = ["S.step", "S.local", "S.dsend", "T.drx", "T.c0", "T.c1", "T.dsend", "S.drx", "S.back"]
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


def steps(trace_dir: Path, roles: dict[int, str], order: list[tuple[str, str, str]]) -> list[dict[str, int]]:
    """Per decode step, each tag of ``order`` at its first time after its anchor (within the step); a step
    missing a tag is left out, unless the tag is ``OFF_CHAIN``."""
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
        for tag, anchor, _ in order[1:]:
            xs = times.get(tag, [])
            k = bisect.bisect_left(xs, step[anchor])
            if k == len(xs) or xs[k] >= b:
                if tag in OFF_CHAIN:  # a write that returned after the step was over: off the step's way
                    continue
                break
            step[tag] = xs[k]
        else:
            if b - a < 200_000_000:
                out.append(step)
    return out


def gc_pauses(trace_dir: Path, roles: dict[int, str], t0: int, t1: int) -> dict[str, list[tuple[int, float]]]:
    """Per process role, its garbage collections that started within [t0, t1): (generation, ms)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for f in trace_dir.glob("*.trace"):
        role = roles.get(int(f.stem), "?")
        start: tuple[int, int] | None = None
        for line in f.read_text().splitlines():
            tag, ns_s = line.split()
            ns = int(ns_s)
            if tag.startswith("X.gc") and tag != "X.gce":
                start = (int(tag[4:]), ns)
            elif tag == "X.gce" and start is not None:
                if t0 <= start[1] < t1:
                    out.setdefault(role, []).append((start[0], (ns - start[1]) / 1e6))
                start = None
    return out


def tokens(trace_dir: Path, roles: dict[int, str], role: str) -> tuple[list[float], list[float]]:
    """A node's lone decode steps as its scheduler saw them (X.tok: a step starts, X.fwd: its forward returned):
    (ms from one step's start to the next within a stream: the time per token; ms in the forward)."""
    pid = next(p for p, r in roles.items() if r == role)
    marks = [line.split() for line in (trace_dir / f"{pid}.trace").read_text().splitlines()]
    starts = [int(ns) for tag, ns in marks if tag == "X.tok"]
    fwds = [int(ns) for tag, ns in marks if tag == "X.fwd"]
    period, fwd = [], []
    for a, b in itertools.pairwise(starts):
        if b - a >= 200_000_000:  # the end of a stream
            continue
        k = bisect.bisect_left(fwds, a)
        if k < len(fwds) and fwds[k] < b:
            period.append((b - a) / 1e6)
            fwd.append((fwds[k] - a) / 1e6)
    return period, fwd


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
        os.environ["MESHD_PIPELINE_TRACE"] = str(tdir)
        local = Node(states / "local", ["--model", f"m={ck}"], args.threads)
        nodes.append(local)
        srv = Node(states / "s2", ["--model", f"m={ck}", "--pipeline", "on"], args.threads)
        nodes.append(srv)
        st = Node(states / "st2", ["--stage", f"{ck}@4-7", "--join", srv.invite()], args.threads)
        nodes.append(st)
        del os.environ["MESHD_PIPELINE_TRACE"]
        roles = {srv.proc.pid: "S", st.proc.pid: "T", local.proc.pid: "L"}
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
    try:
        return report(tdir, roles, tps, wall, busy, srv, st, args.threads)
    finally:
        shutil.rmtree(states, ignore_errors=True)


def report(tdir: Path, roles: dict[int, str], tps: dict[str, list[float]], wall: float, busy: dict[Any, float],
           srv: Any, st: Any, threads: int) -> int:
    """Print the timeline of the traced decode steps (see the module docstring)."""
    direct = any("S.dsend" in f.read_text() for f in tdir.glob("*.trace"))
    order, chain = (DIRECT_ORDER, DIRECT_CHAIN) if direct else (ORDER, CHAIN)
    got = steps(tdir, roles, order)
    if not got:
        print("no complete decode step traced", file=sys.stderr)
        return 1
    print(
        f"\n{len(got)} decode steps, 2 stages (0-3 | 4-7 + head), {threads} BLAS thread(s) per process, "
        f"{'direct channel' if direct else 'stream'} path"
    )
    print(
        f"decode tok/s: local {statistics.median(tps['local']):.1f}, 2 stages {statistics.median(tps['2 stages']):.1f}\n"
    )
    print("| segment | median ms | p25 | p75 |")
    print("|---|---|---|---|")
    total = 0.0
    for tag, anchor, name in order[1:]:
        xs = sorted((s[tag] - s[anchor]) / 1e6 for s in got if tag in s)
        if len(xs) < 2:
            print(f"| {name} | - | | |")
            continue
        q = statistics.quantiles(xs, n=4)
        if tag in chain:
            total += statistics.median(xs)
        print(f"| {name} | {statistics.median(xs):.3f} | {q[0]:.3f} | {q[2]:.3f} |")
    xs = sorted((s["next"] - s["S.back"]) / 1e6 for s in got)
    total += statistics.median(xs)
    print(f"| serving node: sampling, event, next step | {statistics.median(xs):.3f} | | |")
    all_steps = [s["next"] - s["S.step"] for s in got]
    whole = sorted(x / 1e6 for x in all_steps)
    hop = sorted(((s["S.back"] - s["S.local"]) - (s["T.c1"] - s["T.c0"])) / 1e6 for s in got)
    print(f"| step (S.step to next S.step) | {statistics.median(whole):.3f} | | |")
    print(
        f"\nsum of the chain's segment medians {total:.3f} ms; hop overhead as the scheduler sees it "
        f"(S.local..S.back minus the stage's compute) {statistics.median(hop):.3f} ms"
    )
    q = statistics.quantiles(whole, n=10)
    print(
        f"step time: mean {statistics.fmean(whole):.3f} ms, median {statistics.median(whole):.3f}, p90 {q[8]:.3f}, "
        f"max {whole[-1]:.3f}; the client's mean time per token (SSE arrivals): local "
        f"{statistics.fmean(1e3 / t for t in tps['local']):.3f} ms, 2 stages "
        f"{statistics.fmean(1e3 / t for t in tps['2 stages']):.3f} ms"
    )
    print("\n| node | time per token (scheduler) median | mean | p90 | forward median | mean | rest median |")
    print("|---|---|---|---|---|---|---|")
    for role, name in (("L", "local (all layers)"), ("S", "2 stages: serving node")):
        period, fwd = tokens(tdir, roles, role)
        if len(period) < 2:
            continue
        rest = [p - f for p, f in zip(period, fwd)]
        print(f"| {name} | {statistics.median(period):.3f} | {statistics.fmean(period):.3f} | "
              f"{statistics.quantiles(period, n=10)[8]:.3f} | {statistics.median(fwd):.3f} | "
              f"{statistics.fmean(fwd):.3f} | {statistics.median(rest):.3f} |")
    print()
    span = (min(s["S.step"] for s in got), max(s["next"] for s in got))
    gcs = gc_pauses(tdir, roles, *span)
    if not gcs:
        print("garbage collections during the traced steps: none")
    for role, pauses in sorted(gcs.items()):
        per = {g: [ms for gen, ms in pauses if gen == g] for g in sorted({gen for gen, _ in pauses})}
        print(f"garbage collections ({'serving node' if role == 'S' else 'stage'}, during the traced steps): " + ", ".join(
            f"generation {g}: {len(xs)} ({sum(xs):.2f} ms in all, max {max(xs):.2f})" for g, xs in per.items()))
    print(
        f"CPU time over the pipelined decodes ({wall:.2f} s wall): serving node {busy[srv]:.2f} s, "
        f"stage {busy[st]:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
