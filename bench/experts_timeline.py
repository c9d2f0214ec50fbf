"""Where a delegated decode layer's time goes, with one worker: a timeline across both processes.

    python bench/experts_timeline.py [--dir DIR] [--decode 64] [--rounds 3] [--echo 200] [--path lane|quic]
                                     [--no-warm] [--no-poll] [--pin]

Uses bench/experts.py's mid-size checkpoint and harness: one worker process (``tests/experts_node.py``) and
the coordinator in this process, over the data lane (default; TLS over TCP, as a daemon uses) or QUIC on
loopback. Both record timestamps at the points a request and its reply pass (``tests/experts_trace.py``: our
dispatch and reply match, the worker's compute, the transport's packing (aioquic's ``datagrams_to_send``;
the lane's message to the TLS socket write) and reading (aioquic's ``receive_datagram``; the TLS ciphertext
in to the plaintext handed to the lane), the socket write, the pass's resumption and warming), on
CLOCK_MONOTONIC, which both processes share. After the reply, the coordinator's own part of each layer is
followed too: reply matched to pass resumed, the warm-up, and the pass's compute up to the next layer's
dispatch (the next layer of the same token only).
Each round records a polled 4 KB ECHO back to back (``--echo`` of them) and then a greedy decode of
``--decode`` tokens. Prints, for every sparse layer of the decodes, the median and quartiles of each
segment from the coordinator's dispatch to the reply's match, and for the echoes the same segments
without the compute; then each aioquic call's (and sendto's) duration back to back against in decode. The
trace points cost about a microsecond each, so the figures run a little above an untraced bench/experts.py.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import itertools
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
    ("request built and handed to the transport", "C", "dispatch", "out0"),
    ("transport packs and encrypts it", "C", "out0", "out1"),
    ("asyncio hands it to sendto", "C", "out1", "s0"),
    ("sendto, kernel, loopback, to the worker", "CW", "s0", "in0"),
    ("transport decrypts and parses it", "W", "in0", "in1"),
    ("meshd: frames, message, checks", "W", "in1", "c0"),
    ("expert compute", "W", "c0", "c1"),
    ("meshd: reply message and frame", "W", "c1", "out0"),
    ("transport packs and encrypts the reply", "W", "out0", "out1"),
    ("asyncio hands the reply to sendto", "W", "out1", "s0"),
    ("sendto, kernel, loopback, to the coordinator", "WC", "s0", "in0"),
    ("transport decrypts and parses the reply", "C", "in0", "in1"),
    ("meshd: frames, message, reply matched", "C", "in1", "reply"),
]
# the coordinator after the reply, up to the next layer's dispatch (not part of "all but the compute")
TAIL = [
    ("reply matched to pass resumed", "C", "reply", "resume"),
    ("pass: combine, attention, routing, request (no warm-up)", "C", "resume", "dispatch"),
    ("warm-up of the next layer (when it runs)", "C", "warm0", "warm1"),
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
    start_dispatch = start
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
    if with_compute:  # the coordinator's own part after the reply (same token: the next layer's dispatch)
        layer = s.next("C", marks["C", "reply"], "reply", within=0)
        resume = s.next("C", marks["C", "reply"], "resume", within=within)
        if resume is not None and layer is not None:
            marks["C", "resume"] = resume[0]
            nxt = s.next("C", resume[0], "dispatch", within=within)
            if nxt is not None and nxt[2] == layer[2] + 1:
                marks["C", "dispatch"] = nxt[0]  # (the tail's, read after LAYER's segments below)
        w0 = s.next("C", start, "warm0", within=within)
        if w0 is not None and w0[0] < marks["C", "reply"]:
            w1 = s.next("C", w0[0], "warm1", within=within)
            if w1 is not None:
                marks["C", "warm0"], marks["C", "warm1"] = w0[0], w1[0]
                marks["W", "late"] = max(0.0, w1[0] - marks["W", "s0"])
    out: dict[str, float] = {}
    if with_compute:  # fine points (EXPERTS_TRACE_FINE): offsets after the plaintext arrived
        for proc, a, b in (("W", "in1", "c0"), ("C", "in1", "reply")):
            ev, times = s.ev[proc], s.t[proc]
            for i in range(bisect.bisect_left(times, marks[proc, a]), len(ev)):
                e = ev[i]
                if e[0] > marks[proc, b]:
                    break
                if e[1].startswith("f:") and f"{proc} {e[1]}" not in out:
                    out[f"{proc} {e[1]}"] = e[0] - marks[proc, a]
    first_dispatch = marks.get(("C", "dispatch"))
    if with_compute:
        marks["C", "dispatch0"] = start_dispatch
    for name, proc, a, b in LAYER:
        pa, pb = proc[0], proc[-1]
        a = "dispatch0" if a == "dispatch" else a
        if (pa, a) in marks and (pb, b) in marks:
            out[name] = marks[pb, b] - marks[pa, a]
    if with_compute:
        if ("C", "resume") in marks:
            out[TAIL[0][0]] = marks["C", "resume"] - marks["C", "reply"]
            if first_dispatch is not None and first_dispatch != start_dispatch:
                out[TAIL[1][0]] = first_dispatch - marks["C", "resume"]
        if ("C", "warm0") in marks:
            out[TAIL[2][0]] = marks["C", "warm1"] - marks["C", "warm0"]
            out["reply waited for the warm-up"] = marks["W", "late"]
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
    ap.add_argument("--dir", type=Path, default=None, help="the checkpoint (written once; default: a temp dir)")
    ap.add_argument("--decode", type=int, default=64, help="decode steps per round (default 64)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--echo", type=int, default=200, help="polled 4 KB echoes per round (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--path", choices=("lane", "quic"), default="lane",
                    help="the expert streams' path: the data lane (default) or QUIC")
    ap.add_argument("--no-warm", action="store_true", help="the coordinator does not warm the next layer (default: it warms where its policy says)")
    ap.add_argument("--no-poll", action="store_true", help="neither side polls (default: both poll where a core is free)")
    ap.add_argument("--pin", action="store_true",
                    help="as bench/experts.py --pin: this process on CPU 0, the worker on CPU 1 (default off)")
    args = ap.parse_args(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    if args.pin:  # before the engine is imported: its kernel threads follow this process's CPUs
        os.sched_setaffinity(0, {0})

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
    worker = spawn_worker(mesh, tmp, [str(path)], trace=str(trace_file), lane=args.path == "lane",
                          cpus="1" if args.pin else None)
    variant = {"warm": not args.no_warm, **({"poll_s": 0.0} if args.no_poll else {})}
    windows: dict[str, list[tuple[float, float]]] = {"echo": [], "decode": [], "local": []}
    try:
        for _ in range(args.rounds):
            from engine.experts.coordinator import CoordinatorConfig

            # the timeline follows the stream path (loop callbacks, the lane's records): no direct channel
            coord = Coordinator(mesh, CoordinatorConfig(direct=False), lane=args.path == "lane")
            try:
                coord.connect([worker])
                ex = coord.executor(path, "on")
                coord.wait_paths([worker], args.path)
                ex.config = dataclasses.replace(ex.config, **variant)
                if args.pin:  # its own CPU set is one core, but the worker has the other one to itself
                    ex._cores = os.cpu_count() or 1
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
                    rec("step0")
                    out = model.forward([int(np.argmax(out))], cache, executor=ex)[-1]
                    rec("step1")
                rec.on = False
                windows["decode"].append((t0, time.perf_counter()))
                local_decode(model, prompt, args.decode, rec, windows)
            finally:
                coord.close()
    finally:
        worker.stop()
        experts_trace.uninstall()
    worker_events: list[Event] = [tuple(e) for e in json.loads(trace_file.read_text())]  # type: ignore[misc]
    n_sparse = len(model.sparse_layers)
    report(Streams(list(rec.events), worker_events), windows, len(payload),
           f"One worker, loopback {'QUIC' if args.path == 'quic' else 'data lane'}"
           f"{', no warm-up' if args.no_warm else ''}{', no polling' if args.no_poll else ''}, {args.rounds} rounds: of {args.rounds * args.decode * n_sparse} "
           f"delegated layers in decode and {args.rounds * args.echo} polled 4 KB echoes back to back")
    return 0


def local_decode(model: object, prompt: list[int], steps: int, rec: object,
                 windows: dict[str, list[tuple[float, float]]]) -> None:
    """The same decode with the local experts, their calls timed ("lx0"/"lx1"), for the pass's segments."""
    import numpy as np

    inner = model.local_executor  # type: ignore[attr-defined]

    def timed(layer: int, x: object, work: object) -> object:
        rec("lx0", layer)  # type: ignore[operator]
        try:
            return inner(layer, x, work)
        finally:
            rec("lx1", layer)  # type: ignore[operator]

    cache = model.new_cache()  # type: ignore[attr-defined]
    out = model.forward(prompt, cache, executor=timed)[-1]  # type: ignore[attr-defined]
    out = model.forward([int(np.argmax(out))], cache, executor=timed)[-1]  # type: ignore[attr-defined]
    t0, rec.on = time.perf_counter(), True  # type: ignore[attr-defined]
    for _ in range(steps):
        rec("lstep0")  # type: ignore[operator]
        out = model.forward([int(np.argmax(out))], cache, executor=timed)[-1]  # type: ignore[attr-defined]
        rec("lstep1")  # type: ignore[operator]
    rec.on = False  # type: ignore[attr-defined]
    windows["local"].append((t0, time.perf_counter()))


def report(s: Streams, windows: dict[str, list[tuple[float, float]]], echo_bytes: int, title: str) -> None:
    """Print the tables and a JSON line."""
    layers, first_layers = [], []
    for t in s.starts("dispatch", windows["decode"]):
        c = chain(s, t, True)
        if c is not None:
            layers.append(c)
            d = s.next("C", t, "dispatch", within=0)
            if d is not None and d[2] == min(e[2] for e in s.ev["C"] if e[1] == "dispatch"):
                first_layers.append(c)
    echoes = [c for t in s.starts("out1", windows["echo"], min_size=echo_bytes)
              if (c := chain(s, t, False)) is not None]
    print(f"\n{title}, {len(layers)} and {len(echoes)} were followed end to end (the rest missed a point, "
          "e.g. an ACK-only packet in between)\n")
    print("| segment | where | layer in decode, median us | quartiles | echo back to back, median us "
          "| quartiles |")
    print("|---|---|---|---|---|---|")
    names = {name for name, *_ in LAYER} - {"expert compute"}
    total_layer = [sum(v for k, v in c.items() if k in names) for c in layers]
    total_echo = [sum(c.values()) for c in echoes]
    for name, proc, _a, _b in LAYER + [("meshd: echo answered", "W", "", "")]:
        where = {"C": "coordinator", "W": "worker", "CW": "both", "WC": "both"}[proc]
        print(f"| {name} | {where} | {fmt([c[name] for c in layers if name in c])} | "
              f"{fmt([c[name] for c in echoes if name in c])} |")
    print(f"| **all but the compute** (echo: the transport's send to its receive) | | {fmt(total_layer)} | "
          f"{fmt(total_echo)} |")
    hop = LAYER[3][0]
    rest = [c[hop] for c in layers if not any(c is f for f in first_layers)]
    print(f"| {hop}: each token's first sparse layer (the worker did not poll across the token) | both | "
          f"{fmt([c[hop] for c in first_layers])} | - | - |\n| {hop}: the other layers | both | {fmt(rest)} | - | - |")
    for name, *_ in TAIL + [("reply waited for the warm-up",)]:
        values = [c[name] for c in layers if name in c]
        print(f"| {name} ({len(values)} layers) | coordinator | {fmt(values)} | - | - |")
    steps = [b - a for a, b in zip(s.starts("step0", windows["decode"]), s.starts("step1", windows["decode"]))]
    firsts = [d - a for a in s.starts("step0", windows["decode"])
              if (d := (s.next("C", a, "dispatch", within=0.02) or (None,))[0]) is not None]
    lasts = [b - r for b in s.starts("step1", windows["decode"])
             if (r := s.last("C", b, "resume")) is not None]
    def gaps(a_tag: str, b_tag: str) -> list[float]:  # from each a_tag in decode to the next b_tag
        return [b[0] - a for a in s.starts(a_tag, windows["decode"])
                if (b := s.next("C", a, b_tag, within=0.02)) is not None]

    def back(b_tag: str, a_tag: str) -> list[float]:  # to each b_tag in decode from the a_tag before it
        return [b - a for b in s.starts(b_tag, windows["decode"]) if (a := s.last("C", b, a_tag)) is not None]

    print(f"\n| decode step | median us | quartiles |\n|---|---|---|\n| whole step | {fmt(steps)} |\n"
          f"| step start to the first layer's dispatch (engine thread: embed, attention; hand-off) | {fmt(firsts)} |\n"
          f"| of which: step start to the hand-off (engine thread's compute) | {fmt(gaps('step0', 'wait0'))} |\n"
          f"| of which: hand-off to the first dispatch (loop wakes, request built) | {fmt(gaps('wait0', 'dispatch'))} |\n"
          f"| last layer's pass resumed to the step's end (final norm, head; hand-back) | {fmt(lasts)} |\n"
          f"| of which: resumed to the pass's end (combine, final norm, head) | {fmt(back('finish', 'resume'))} |\n"
          f"| of which: the pass's end to the engine thread's return from the wait | {fmt(gaps('finish', 'wait1'))} |\n"
          f"| of which: the wait's return to the step's end | {fmt(gaps('wait1', 'step1'))} |")
    if windows.get("local"):  # the same segments of a local decode in the same rounds
        def local(a_tag: str, b_tag: str, same_layer: bool) -> list[float]:
            out = []
            for a in s.starts(a_tag, windows["local"]):
                e = s.next("C", a, b_tag, within=0.02)
                if e is not None:
                    out.append(e[0] - a)
            return out
        lx = [e for e in s.ev["C"] if e[1] in ("lx0", "lx1", "lstep0", "lstep1")
              and any(a <= e[0] <= b for a, b in windows["local"])]
        between = [b[0] - a[0] for a, b in itertools.pairwise(lx) if a[1] == "lx1" and b[1] == "lx0"]
        experts = [b[0] - a[0] for a, b in itertools.pairwise(lx) if a[1] == "lx0" and b[1] == "lx1"]
        first = [b[0] - a[0] for a, b in itertools.pairwise(lx) if a[1] == "lstep0" and b[1] == "lx0"]
        last = [b[0] - a[0] for a, b in itertools.pairwise(lx) if a[1] == "lx1" and b[1] == "lstep1"]
        print(f"\n| local decode, same rounds | median us | quartiles |\n|---|---|---|\n"
              f"| whole step | {fmt(local('lstep0', 'lstep1', False))} |\n"
              f"| step start to the first experts (embed, attention) | {fmt(first)} |\n"
              f"| the experts of one layer | {fmt(experts)} |\n"
              f"| between two layers' experts (combine, attention, routing) | {fmt(between)} |\n"
              f"| last layer's experts to the step's end (combine, final norm, head) | {fmt(last)} |")
    if any(e[1] == "sel0" for e in s.ev["C"]):  # EXPERTS_TRACE_FINE: the coordinator's loop after the pass
        print(f"| (fine) resumed to the combine's start | {fmt(gaps('resume', 'assemble0'))} |\n"
              f"| (fine) the combine (``_assemble``) | {fmt(gaps('assemble0', 'assemble1'))} |\n"
              f"| (fine) the combine's end to the next layer's requests being built (model compute) | "
              f"{fmt(gaps('assemble1', 'steplayer'))} |\n"
              f"| (fine) requests built (``_fast_call``) to the dispatch | {fmt(gaps('steplayer', 'dispatch'))} |\n"
              f"| (fine) the pass's end to the loop's next select | {fmt(gaps('finish', 'sel0'))} |\n"
              f"| (fine) the pass's end to the next step's start | {fmt(gaps('finish', 'step0'))} |")
    fine = sorted({k for c in layers for k in c if k[2:4] == "f:"})
    if fine:
        print("\n| fine point (after the plaintext arrived) | median us | quartiles |\n|---|---|---|")
        for name in sorted(fine, key=lambda k: (k[0], statistics.median([c[k] for c in layers if k in c]))):
            print(f"| {name} | {fmt([c[name] for c in layers if name in c])} |")
    print("\n| call (transport; socket write), one packet of 1 KB or more | process | back to back, median us "
          "| quartiles | in decode, median us | quartiles |")
    print("|---|---|---|---|---|---|")

    def median_us(values: list[float]) -> float | None:
        return statistics.median(values) * 1e6 if values else None

    rows = []
    for proc, events in (("coordinator", s.ev["C"]), ("worker", s.ev["W"])):
        for what, a, b in (("pack, encrypt", "out0", "out1"),
                           ("decrypt, parse", "in0", "in1"),
                           ("socket write (until it returns)", "s0", "s1")):
            hot = call_times(events, windows["echo"], a, b)
            cold = call_times(events, windows["decode"], a, b)
            rows.append({"call": what, "process": proc, "b2b_us": median_us(hot),
                         "decode_us": median_us(cold)})
            print(f"| {what} | {proc} | {fmt(hot)} | {fmt(cold)} |")
    print(json.dumps({"layers": len(layers), "echoes": len(echoes),
                      "layer_segments_us": {k: median_us([c[k] for c in layers if k in c])
                                            for k, *_ in LAYER + TAIL},
                      "layer_without_compute_us": median_us(total_layer), "echo_aioquic_to_aioquic_us":
                      median_us(total_echo), "aioquic_calls": rows}))


if __name__ == "__main__":
    raise SystemExit(main())
