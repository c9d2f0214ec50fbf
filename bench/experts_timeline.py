"""Where a delegated decode layer's time goes, with one worker: a timeline across both processes.

    python bench/experts_timeline.py [--dir DIR] [--decode 64] [--rounds 3] [--echo 200]

Uses bench/experts.py's mid-size checkpoint and harness: one worker process (``tests/experts_node.py``) and
the coordinator in this process, over QUIC on loopback. Both record timestamps at the points a request
and its reply pass (``tests/experts_trace.py``: our dispatch and reply match, the worker's compute, aioquic's
``datagrams_to_send`` and ``receive_datagram``, ``sendto``), on CLOCK_MONOTONIC, which both processes share.
Each round records a polled 4 KB ECHO back to back (``--echo`` of them) and then a greedy decode of
``--decode`` tokens. Prints, for every sparse layer of the decodes, the median and quartiles of each
segment from the coordinator's dispatch to the reply's match, and for the echoes the same segments
without the compute; then each aioquic call's (and sendto's) duration back to back against in decode. The
trace points cost about a microsecond each, so the figures run a little above an untraced bench/experts.py.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

Event = tuple[float, str, int]
BIG = 1000  # bytes: a packet at least this large carries a request, a reply or an echo (not an ACK)

# (segment, process, from tag, to tag); "C" is this coordinator, "W" the worker. Tags: see experts_trace.
# A packet's hop starts when sendto is called ("s0"), not when it returns ("s1"): on a busy machine the
# receiver has often parsed the datagram before the sender's sendto returns (the woken receiver preempts
# the sender), and a hop from "s1" would then skip its packet and follow the next one of the same size.
# sendto's own duration, s0 to s1, is reported with the aioquic calls instead.
LAYER = [
    ("request built and handed to QUIC", "C", "dispatch", "out0"),
    ("aioquic packs and encrypts it", "C", "out0", "out1"),
    ("asyncio hands it to sendto", "C", "out1", "s0"),
    ("sendto, kernel, loopback, to the worker", "CW", "s0", "in0"),
    ("aioquic decrypts and parses it", "W", "in0", "in1"),
    ("meshd: frames, message, checks", "W", "in1", "c0"),
    ("expert compute", "W", "c0", "c1"),
    ("meshd: reply message and frame", "W", "c1", "out0"),
    ("aioquic packs and encrypts the reply", "W", "out0", "out1"),
    ("asyncio hands the reply to sendto", "W", "out1", "s0"),
    ("sendto, kernel, loopback, to the coordinator", "WC", "s0", "in0"),
    ("aioquic decrypts and parses the reply", "C", "in0", "in1"),
    ("meshd: frames, message, reply matched", "C", "in1", "reply"),
]


class Streams:
    """Both processes' events, each sorted by time, searchable from a time on."""

    def __init__(self, coordinator: list[Event], worker: list[Event]) -> None:
        self.ev = {"C": sorted(coordinator), "W": sorted(worker)}
        self.t = {p: [e[0] for e in ev] for p, ev in self.ev.items()}

    def next(self, proc: str, t: float, tag: str, size: int | None = None,
             within: float = 0.01) -> Event | None:
        """The first ``tag`` event of ``proc`` at or after ``t`` (of exactly ``size`` bytes if given, of
        some bytes if ``size`` is 0), at most ``within`` seconds on."""
        ev, times = self.ev[proc], self.t[proc]
        for i in range(bisect.bisect_left(times, t), len(ev)):
            e = ev[i]
            if e[0] - t > within:
                return None
            if e[1] == tag and (size is None or (e[2] == size if size else e[2] > 0)):
                return e
        return None

    def last(self, proc: str, t: float, tag: str) -> float | None:
        """Time of the last ``tag`` event of ``proc`` at or before ``t``."""
        ev = self.ev[proc]
        for i in range(bisect.bisect_right(self.t[proc], t) - 1, -1, -1):
            if ev[i][1] == tag:
                return ev[i][0]
        return None

    def starts(self, tag: str, windows: list[tuple[float, float]], min_size: int = 0) -> list[float]:
        """Times of the coordinator's ``tag`` events of at least ``min_size`` bytes inside ``windows``."""
        return [e[0] for e in self.ev["C"] if e[1] == tag and e[2] >= min_size
                and any(a <= e[0] <= b for a, b in windows)]


def chain(s: Streams, start: float, with_compute: bool,
          within: float = 0.01) -> dict[str, float] | None:
    """One request's segments from ``start`` (a dispatch, or an echo packet's ``out1``); None if a point
    is missing (a lost packet, an event outside the recorded window, or more than ``within`` seconds after
    the point before it: a process can wait that long for a core on a loaded machine). A packet is followed
    by its size: the receiver's ``in0`` of as many bytes as the sender's ``s0`` (sendto called)."""
    marks: dict[tuple[str, str], float] = {}
    if with_compute:
        marks["C", "dispatch"] = start
        first = s.next("C", start, "out1", size=0, within=within)  # the dispatch sends its request at once
        if first is None:
            return None
        start = first[0]
    out0 = s.last("C", start, "out0")
    if out0 is None:
        return None
    marks["C", "out0"], marks["C", "out1"] = out0, start
    t = start
    route: list[tuple[str, str, str]] = [("C", "s0", "any"), ("W", "in0", "match"), ("W", "in1", "any")]
    route += [("W", "c0", "any"), ("W", "c1", "any")] if with_compute else []
    route += [("W", "out1", "nonempty"), ("W", "s0", "any"), ("C", "in0", "match"), ("C", "in1", "any")]
    route += [("C", "reply", "any")] if with_compute else []
    size = 0
    for proc, tag, how in route:
        e = s.next(proc, t, tag, size if how == "match" else 0 if how == "nonempty" else None, within)
        if e is None:
            return None
        t, size = e[0], e[2]
        marks[proc, tag] = t
        if tag == "out1":
            w_out0 = s.last("W", t, "out0")
            if w_out0 is None:
                return None
            marks["W", "out0"] = w_out0
    out: dict[str, float] = {}
    for name, proc, a, b in LAYER:
        pa, pb = proc[0], proc[-1]
        if (pa, a) in marks and (pb, b) in marks:
            out[name] = marks[pb, b] - marks[pa, a]
    if not with_compute:
        out["meshd: echo answered"] = marks["W", "out0"] - marks["W", "in1"]
    return out


def call_times(events: list[Event], windows: list[tuple[float, float]], first: str,
               second: str) -> list[float]:
    """Durations of the aioquic calls ``first``..``second`` that moved a BIG packet, inside ``windows``."""
    out, began = [], None
    for when, tag, size in sorted(events):
        if tag == first:
            began = when
        elif tag == second and began is not None:
            if size >= BIG and any(a <= began <= b for a, b in windows):
                out.append(when - began)
            began = None
    return out


def fmt(values: list[float]) -> str:
    if not values:
        return "- | -"
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values) * 1e6:.0f} | {q[0] * 1e6:.0f}-{q[2] * 1e6:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--echo", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"

    import numpy as np
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    import experts_trace
    from experts import CONFIG, create
    from experts_mesh import Coordinator, MeshFixture, spawn_worker

    from engine.model import Model

    path = create(args.dir or Path(tempfile.mkdtemp(prefix="meshd-bench-experts-")) / "qwen3moe-mid")
    model = Model.load(path)
    r = random.Random(1)
    prompt = [r.randrange(CONFIG["vocab_size"]) for _ in range(args.prompt)]
    payload = os.urandom(4096)
    mesh = MeshFixture()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-bench-timeline-"))
    trace_file = tmp / "worker-trace.json"
    rec = experts_trace.Recorder()
    rec.on = False
    experts_trace.install(rec)
    worker = spawn_worker(mesh, tmp, [str(path)], trace=str(trace_file), lane=False)  # traces QUIC
    windows: dict[str, list[tuple[float, float]]] = {"echo": [], "decode": []}
    try:
        for _ in range(args.rounds):
            coord = Coordinator(mesh)
            try:
                coord.connect([worker])
                ex = coord.executor(path, "on")
                node = next(iter(ex.links))
                cache = model.new_cache()
                out = model.forward(prompt, cache, executor=ex)[-1]
                out = model.forward([int(np.argmax(out))], cache, executor=ex)[-1]  # a first decode step
                t0, rec.on = time.perf_counter(), True
                for _ in range(args.echo):
                    ex.echo_rtt(node, payload, polled=True)
                rec.on = False
                windows["echo"].append((t0, time.perf_counter()))
                t0, rec.on = time.perf_counter(), True
                for _ in range(args.decode):
                    out = model.forward([int(np.argmax(out))], cache, executor=ex)[-1]
                rec.on = False
                windows["decode"].append((t0, time.perf_counter()))
            finally:
                coord.close()
    finally:
        worker.stop()
        experts_trace.uninstall()
    worker_events: list[Event] = [tuple(e) for e in json.loads(trace_file.read_text())]  # type: ignore[misc]
    n_sparse = len(model.sparse_layers)
    report(Streams(list(rec.events), worker_events), windows, len(payload),
           f"One worker, loopback QUIC, {args.rounds} rounds: of {args.rounds * args.decode * n_sparse} "
           f"delegated layers in decode and {args.rounds * args.echo} polled 4 KB echoes back to back")
    return 0


def report(s: Streams, windows: dict[str, list[tuple[float, float]]], echo_bytes: int, title: str) -> None:
    """Print the tables and a JSON line."""
    layers = [c for t in s.starts("dispatch", windows["decode"]) if (c := chain(s, t, True)) is not None]
    echoes = [c for t in s.starts("out1", windows["echo"], min_size=echo_bytes)
              if (c := chain(s, t, False)) is not None]
    print(f"\n{title}, {len(layers)} and {len(echoes)} were followed end to end (the rest missed a point, "
          "e.g. an ACK-only packet in between)\n")
    print("| segment | where | layer in decode, median us | quartiles | echo back to back, median us "
          "| quartiles |")
    print("|---|---|---|---|---|---|")
    total_layer = [sum(v for k, v in c.items() if k != "expert compute") for c in layers]
    total_echo = [sum(c.values()) for c in echoes]
    for name, proc, _a, _b in LAYER + [("meshd: echo answered", "W", "", "")]:
        where = {"C": "coordinator", "W": "worker", "CW": "both", "WC": "both"}[proc]
        print(f"| {name} | {where} | {fmt([c[name] for c in layers if name in c])} | "
              f"{fmt([c[name] for c in echoes if name in c])} |")
    print(f"| **all but the compute** (echo: aioquic's send to aioquic's receive) | | {fmt(total_layer)} | "
          f"{fmt(total_echo)} |")
    print("\n| call (aioquic; sendto), one packet of 1 KB or more | process | back to back, median us "
          "| quartiles | in decode, median us | quartiles |")
    print("|---|---|---|---|---|---|")

    def median_us(values: list[float]) -> float | None:
        return statistics.median(values) * 1e6 if values else None

    rows = []
    for proc, events in (("coordinator", s.ev["C"]), ("worker", s.ev["W"])):
        for what, a, b in (("datagrams_to_send (pack, encrypt)", "out0", "out1"),
                           ("receive_datagram (decrypt, parse)", "in0", "in1"),
                           ("sendto (until it returns)", "s0", "s1")):
            hot = call_times(events, windows["echo"], a, b)
            cold = call_times(events, windows["decode"], a, b)
            rows.append({"call": what, "process": proc, "b2b_us": median_us(hot),
                         "decode_us": median_us(cold)})
            print(f"| {what} | {proc} | {fmt(hot)} | {fmt(cold)} |")
    print(json.dumps({"layers": len(layers), "echoes": len(echoes),
                      "layer_segments_us": {k: median_us([c[k] for c in layers if k in c])
                                            for k, *_ in LAYER},
                      "layer_without_compute_us": median_us(total_layer), "echo_aioquic_to_aioquic_us":
                      median_us(total_echo), "aioquic_calls": rows}))


if __name__ == "__main__":
    raise SystemExit(main())
