"""Pipeline benchmark: one model split over 2 and 3 stage processes against the same model on one node.

    python bench/pipeline.py [--dir DIR] [--rounds 3] [--prompt 256] [--decode 64] [--concurrency 8] [--threads 1]
                             [--large-layers 24] [--python PYTHON]
                             [--variant NAME=VALUE[,NAME=VALUE]]

Checkpoint: the engine benchmark's mid-size Qwen3-MoE (hidden 768, 8 layers, 16 experts of width 384,
top-4, vocab 8192, fp32; ``bench/experts.py``'s numpy writer) with the tiny model's tokenizer, in --dir
(default: a temp dir). Every node is a real ``meshd serve`` process on loopback (--no-mdns, port 0), each
with --threads BLAS threads:

- local: ``--model m=PATH`` alone in its own mesh;
- 2 stages: ``--model m=PATH --pipeline on`` (layers 0-3) + a stage ``--stage PATH@4-7``;
- 3 stages: the serving node (0-2) + ``--stage PATH@3-5`` + ``--stage PATH@6-7``.

All requests go through the OpenAI API (completions with token-id prompts, greedy), so both sides pay the
same HTTP costs. Per round, setups take turns (the others idle): prefill tok/s (a --prompt-token prompt,
max_tokens 1), decode tok/s of one stream (--decode tokens after the first, from SSE arrival times), and
aggregate decode tok/s of --concurrency concurrent streams. The per-hop overhead is (a stage's round trip
as the serving node sees it) - (the stage's own compute), per decode step, from the serving node's status
counters over the single-stream decode, set against the round trip of the stage's own stream measured in
the same decode (the serving node's pings: a KEEPALIVE the stage echoes; status ``path_rtt_ms_avg``) and,
for reference, QUIC's smoothed round trip. The path column says what carried the stage streams (``lane``
when the data lane was up, else ``quic``; ``+direct`` when lone decode steps went over the stage's direct
channel, whose own round trip the pings then measure: ``--variant MESHD_PIPELINE_DIRECT=0`` gives the lane's
stream in the same run). Peak RSS (VmHWM) of every stage process against the bytes of
the weights it holds, and of both processes of a 2-stage split of the same checkpoint grown to
--large-layers layers (1.6 GB at 24), where the daemon's fixed ~90 MB weighs less; the idle daemon
(a stage of the same checkpoint that is never planned) is measured too. ``--python`` runs the nodes with
another interpreter: a fresh venv with meshd installed the README way (``pip install .``, or
``pip install '.[fast]'``) gives the figures a user gets, without the dev environment's extra packages.
Recovery: a stream of 200 tokens on the 2-stage setup, the stage killed with SIGKILL after 20 tokens; the
longest gap between two tokens is the recovery time (the serving node then runs all layers itself). Every pipelined
reply is checked equal to the local one. ``--variant ENV=VALUE[,ENV=VALUE]`` (repeatable) adds a 2-stage
setup whose two processes run with that environment (e.g. ``MESHD_DECODE_PLAN=0,MESHD_PIPELINE_POLL=1``:
session 4's behaviour; ``MESHD_PIPELINE_SERIAL=1``; ``MESHD_PIPELINE_BATCH=0``: lone rolling steps as before
session 6; ``MESHD_PIPELINE_GROUPS=2``: batched steps in two overlapping groups), in the same rounds: an A/B
in one run. Against another checkout's code (``git archive main | tar -x -C /tmp/base``):
``--variant PYTHONSAFEPATH=1,PYTHONPATH=/tmp/base`` (that setup's processes then import the other tree; start
one of its nodes once beforehand so that numba's cache there is filled, or the node may not start in time).
During the concurrent streams, the CPU time of every process of
the setup over the wall time (1.0: one core all the time) shows where the idle time is. Medians over
rounds with [min, max]. Prints a Markdown table
and a JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
PYTHON = sys.executable  # what runs the nodes (--python: e.g. a venv with meshd installed the README way)


class Node:
    def __init__(
        self, state: Path, args: list[str], threads: int, extra_env: dict[str, str] | None = None
    ) -> None:
        state.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **(extra_env or {}),
            "OPENBLAS_NUM_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
        }
        self.state = state
        self.err = open(state.parent / f"{state.name}.stderr", "wb")
        self.proc = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "meshd",
                "serve",
                "--state-dir",
                str(state),
                "--no-mdns",
                "--listen",
                "127.0.0.1:0",
                "--api",
                "127.0.0.1:0",
                "--log-level",
                "warning",
                *args,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.err,
            cwd=state if PYTHON != sys.executable else None,  # not a source tree: the installed meshd
        )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"meshd exited: {(state.parent / f'{state.name}.stderr').read_text()[-2000:]}"
                )
            try:
                self.run = json.loads((state / "run.json").read_text())
                break
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError("meshd did not start") from None
                time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            [PYTHON, "-m", "meshd", "status", "--json", "--state-dir", str(self.state)],
            capture_output=True,
            timeout=30,
            check=True,
        )
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    def invite(self) -> str:
        return subprocess.run(
            [PYTHON, "-m", "meshd", "invite", "--uses", "4", "--state-dir", str(self.state)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()

    def cpu_s(self) -> float:
        """CPU seconds (user + system, every thread) this process has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def _request(api: str, body: dict[str, Any]) -> tuple[list[float], list[int], dict[str, Any] | None]:
    """(arrival times, token counts per event, final reply or None when streamed)."""
    host, _, port = api.rpartition(":")
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
        if not body.get("stream"):
            return [time.perf_counter()], [], json.loads(r.read())
        times, texts = [], []
        while line := r.readline():
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                ev = json.loads(line[5:])
                if "error" in ev:
                    raise RuntimeError(f"stream error: {ev}")
                times.append(time.perf_counter())
                texts.append(ev["choices"][0].get("text", ""))
        return times, texts, None  # type: ignore[return-value]
    finally:
        c.close()


def prefill_tps(api: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    _request(api, {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    return len(prompt) / (time.perf_counter() - t0)


def decode_tps(api: str, prompt: list[int], n: int) -> tuple[float, str]:
    times, texts, _ = _request(
        api, {"model": "m", "prompt": prompt, "max_tokens": n + 1, "temperature": 0, "stream": True}
    )
    return (len(times) - 1) / (times[-1] - times[0]), "".join(texts)  # type: ignore[arg-type]


def concurrent_tps(api: str, prompts: list[list[int]], n: int) -> float:
    """Aggregate tok/s of len(prompts) concurrent streams. A 429 (the previous request's sequence not yet
    released, so one slot short) is retried within 5 s, the wait counted in the time; other failures raise."""
    counts = [0] * len(prompts)
    failed: list[str] = []

    def one(i: int) -> None:
        deadline = time.monotonic() + 5
        body = {"model": "m", "prompt": prompts[i], "max_tokens": n, "temperature": 0, "stream": True}
        while True:
            try:
                times, _, _ = _request(api, body)
                counts[i] = len(times)
                return
            except RuntimeError as e:
                if "HTTP 429" in str(e) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                failed.append(str(e))
                return

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} concurrent streams failed: {failed[0]}")
    return sum(counts) / (time.perf_counter() - t0)


def _stage_sums(srv: Node) -> dict[str, tuple[int, float, float, int, float, str]]:
    """node id -> (calls, latency sum s, compute sum s, pings, ping round-trip sum s, path) over the serving
    node's current run (pings: the stage's echo of a KEEPALIVE, the round trip of the same stream)."""
    st = srv.status()["services"]["pipeline"]["pipeline"]["models"]["m"]
    out = {}
    for lk in st["runs"][st["run"]]["stages"]:
        n, p = lk["calls"], lk.get("pings") or 0
        out[lk["node_id"]] = (
            n,
            lk["latency_ms_avg"] * n / 1e3,
            lk["compute_ms_avg"] * n / 1e3,
            p,
            (lk.get("path_rtt_ms_avg") or 0.0) * p / 1e3,
            str(lk.get("path")) + ("+direct" if lk.get("direct_calls") else ""),
        )
    return out


def _rtt_ms(srv: Node, node_id: str) -> float | None:
    st = srv.status()["services"]["pipeline"]["pipeline"]["models"]["m"]
    for lk in st["runs"][st["run"]]["stages"]:
        if lk["node_id"] == node_id:
            return lk.get("rtt_ms")  # type: ignore[no-any-return]
    return None


def create_large(mid: Path, path: Path, layers: int) -> Path:
    """The mid-size checkpoint grown to ``layers`` layers (layer i holds the mid-size layer i % 8's weights;
    same shapes, so the same per-layer bytes), for the peak-RSS check on a larger model (once)."""
    import re

    from experts import CONFIG
    from safetensors.numpy import load_file, save_file

    if (path / "model.safetensors").exists():
        return path
    src = load_file(str(mid / "model.safetensors"))
    n = int(CONFIG["num_hidden_layers"])  # type: ignore[call-overload]
    out = {}
    for k, v in src.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)", k)
        if m is None:
            out[k] = v
            continue
        for i in range(int(m[1]), layers, n):
            out[f"model.layers.{i}.{m[2]}"] = v
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"))
    del src, out
    cfg = json.loads((mid / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(mid / name, path / name)
    (path / "config.json").write_text(json.dumps(cfg))  # last: a half-written checkpoint has no config
    return path


def large_rss(
    ck: Path, base: Path, states: Path, layers: int, threads: int, prompt: list[int], short: list[list[int]], n: int
) -> dict[str, tuple[float, int]]:
    """Peak RSS of both processes of a 2-stage split of a ``layers``-layer checkpoint after a prefill and
    ``len(short)`` concurrent streams of n tokens, against the bytes each holds."""
    from engine.model import Model
    from engine.pipeline.layout import embed_bytes, fingerprint, need_of

    big = create_large(ck, base / f"large-{layers}", layers)
    model = Model.load(big, prefetch=False)
    need, emb = need_of(model, fingerprint(big)), embed_bytes(model)
    del model
    half = layers // 2
    nodes = []
    try:
        srv = Node(states / "large-s", ["--model", f"m={big}", "--pipeline", "on"], threads)
        nodes.append(srv)
        stg = Node(states / "large-st", ["--stage", f"{big}@{half}-{layers - 1}", "--join", srv.invite()], threads)
        nodes.append(stg)
        deadline = time.monotonic() + 180
        while len(srv.status()["services"]["pipeline"]["pipeline"]["models"]["m"].get("plan") or []) != 2:
            if time.monotonic() > deadline:
                raise RuntimeError("no 2-stage plan for the large checkpoint")
            time.sleep(0.5)
        prefill_tps(srv.run["api"], prompt)
        concurrent_tps(srv.run["api"], short, n)
        return {
            f"{layers} layers, 2 stages: serving node 0-{half - 1} + embeddings": (
                srv.peak_mb(),
                sum(need.layer_bytes[:half]) + emb,
            ),
            f"{layers} layers, 2 stages: stage {half}-{layers - 1} + head": (
                stg.peak_mb(),
                sum(need.layer_bytes[half:]) + need.head_bytes,
            ),
        }
    finally:
        for node in reversed(nodes):
            node.stop()


def _med(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]  # a round that failed is nan
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint and state dirs (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--prompt", type=int, default=256, help="prefill prompt tokens (default 256)")
    ap.add_argument("--decode", type=int, default=64, help="decode tokens per stream (default 64)")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent streams (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads per process (default 1)")
    ap.add_argument(
        "--large-layers",
        type=int,
        default=24,
        help="also measure peak RSS of a 2-stage split of the checkpoint grown to this many layers "
        "(default 24: 1.6 GB; 0 skips it)",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter that runs the nodes, e.g. a fresh venv's bin/python after `pip install .` or "
        "`pip install '.[fast]'` (default: this one)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="also run a 2-stage setup whose two processes have these environment variables (A/B in one "
        "run, e.g. MESHD_DECODE_PLAN=0,MESHD_PIPELINE_POLL=1 or MESHD_PIPELINE_SERIAL=1; repeatable; "
        "default: none)",
    )
    args = ap.parse_args()
    global PYTHON
    PYTHON = args.python

    import random

    from experts import CONFIG, create

    from engine.model import Model
    from engine.pipeline.layout import fingerprint, need_of
    from engine.tiny import create_tiny

    base = (args.dir or Path(tempfile.mkdtemp(prefix="pipeline-bench-"))).resolve()
    ck = create(base / "mid")
    if not (ck / "tokenizer.json").exists():
        tiny = create_tiny(base / "tiny")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / name, ck / name)
    need = need_of(Model.load(ck, prefetch=False), fingerprint(ck))
    total = sum(need.layer_bytes) + need.head_bytes + need.token_bytes // 4 * CONFIG["vocab_size"] * 4
    share = {
        "4-7": sum(need.layer_bytes[4:8]) + need.head_bytes,
        "3-5": sum(need.layer_bytes[3:6]),
        "6-7": sum(need.layer_bytes[6:8]) + need.head_bytes,
    }
    r = random.Random(0)
    vocab = min(CONFIG["vocab_size"], 1000)
    prompt = [r.randrange(vocab) for _ in range(args.prompt)]
    short = [[r.randrange(vocab) for _ in range(16)] for _ in range(args.concurrency)]

    nodes: list[Node] = []
    try:
        states = base / f"nodes-{os.getpid()}"
        idle = Node(
            states / "idle", ["--stage", str(ck)], args.threads
        )  # a stage of the same checkpoint, never planned (it is alone): the process without layers
        nodes.append(idle)
        local = Node(states / "local", ["--model", f"m={ck}"], args.threads)
        nodes.append(local)
        s2 = Node(states / "s2", ["--model", f"m={ck}", "--pipeline", "on"], args.threads)
        nodes.append(s2)
        st2 = Node(states / "st2", ["--stage", f"{ck}@4-7", "--join", s2.invite()], args.threads)
        nodes.append(st2)
        s3 = Node(states / "s3", ["--model", f"m={ck}", "--pipeline", "on"], args.threads)
        nodes.append(s3)
        tok3 = s3.invite()
        st3a = Node(states / "st3a", ["--stage", f"{ck}@3-5", "--join", tok3], args.threads)
        st3b = Node(states / "st3b", ["--stage", f"{ck}@6-7", "--join", tok3], args.threads)
        nodes += [st3a, st3b]
        variants: dict[str, tuple[Node, Node]] = {}
        for k, spec in enumerate(args.variant):
            env = dict(kv.split("=", 1) for kv in spec.split(","))
            vs = Node(states / f"v{k}", ["--model", f"m={ck}", "--pipeline", "on"], args.threads, env)
            nodes.append(vs)
            vst = Node(states / f"v{k}st", ["--stage", f"{ck}@4-7", "--join", vs.invite()], args.threads, env)
            nodes.append(vst)
            variants[f"2 stages {spec}"] = (vs, vst)
        for srv, want in ((s2, 2), (s3, 3), *((v[0], 2) for v in variants.values())):
            deadline = time.monotonic() + 120
            while True:
                plan = srv.status()["services"]["pipeline"]["pipeline"]["models"]["m"].get("plan")
                if plan and len(plan) == want:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {want}-stage plan: {plan}")
                time.sleep(0.5)
        setups = {"local": local, "2 stages": s2, "3 stages": s3, **{k: v[0] for k, v in variants.items()}}
        for srv in setups.values():  # warm-up: page in the weights, the same for every side
            prefill_tps(srv.run["api"], prompt)
            decode_tps(srv.run["api"], short[0], 8)
        res: dict[str, dict[str, list[float]]] = {
            k: {
                "prefill": [],
                "decode1": [],
                "decodeN": [],
                "hop_ms": [],
                "ping_ms": [],
                "hop_per_rtt": [],
                "rtt_ms": [],
            }
            for k in setups
        }
        # CPU busy during the concurrent streams (1.0: one core all the time): where the idle time is
        busy_of = {"local": [local], "2 stages": [s2, st2], "3 stages": [s3, st3a, st3b],
                   **{k: list(v) for k, v in variants.items()}}
        labels = {
            "local": ["node"],
            "2 stages": ["serving", "stage 4-7"],
            "3 stages": ["serving", "stage 3-5", "stage 6-7"],
            **{k: ["serving", "stage 4-7"] for k in variants},
        }
        busy: dict[str, list[float]] = {}
        paths: dict[str, set[str]] = {}
        errors: list[str] = []
        mismatches: list[str] = []
        for rnd in range(args.rounds):
            ref_text = None
            for name, srv in setups.items():
                try:
                    api = srv.run["api"]
                    res[name]["prefill"].append(prefill_tps(api, prompt))
                    before = _stage_sums(srv) if name != "local" else {}
                    tps, text = decode_tps(api, short[0], args.decode)
                    res[name]["decode1"].append(tps)
                    if name == "local":
                        ref_text = text
                    elif text != ref_text:
                        mismatches.append(f"round {rnd + 1} {name}")
                    if before:
                        after = _stage_sums(srv)
                        for node, (n1, l1, c1, p1, r1, path) in after.items():
                            n0, l0, c0, p0, r0, _ = before.get(node, (0, 0.0, 0.0, 0, 0.0, ""))
                            paths.setdefault(name, set()).add(path)
                            if n1 > n0:
                                hop = ((l1 - l0) - (c1 - c0)) / (n1 - n0) * 1e3
                                res[name]["hop_ms"].append(hop)
                                if p1 > p0:
                                    ping = (r1 - r0) / (p1 - p0) * 1e3
                                    res[name]["ping_ms"].append(ping)
                                    res[name]["hop_per_rtt"].append(hop / ping)
                            rtt = _rtt_ms(srv, node)
                            if rtt is not None:
                                res[name]["rtt_ms"].append(rtt)
                    procs = busy_of[name]
                    c0, w0 = [n.cpu_s() for n in procs], time.perf_counter()
                    res[name]["decodeN"].append(concurrent_tps(api, short, args.decode))
                    wall = time.perf_counter() - w0
                    for i, n in enumerate(procs):  # the share of the wall time each process was on a CPU
                        busy.setdefault(f"{name}: {labels[name][i]}", []).append((n.cpu_s() - c0[i]) / wall)
                except RuntimeError as e:  # a stream error: counted, the run goes on
                    errors.append(f"round {rnd + 1} {name}: {e}")
                    for key in ("prefill", "decode1", "decodeN"):  # keep rounds aligned for the ratios
                        if len(res[name][key]) < rnd + 1:
                            res[name][key].append(float("nan"))
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
        rss = {
            "2 stages: stage 4-7": (st2.peak_mb(), share["4-7"]),
            "3 stages: stage 3-5": (st3a.peak_mb(), share["3-5"]),
            "3 stages: stage 6-7": (st3b.peak_mb(), share["6-7"]),
            "local (all layers)": (local.peak_mb(), total),
        }
        idle_mb = idle.peak_mb()
        recoveries = {
            name: srv.status()["services"]["pipeline"]["pipeline"]["models"]["m"]["recoveries"]
            for name, srv in setups.items()
            if name != "local"
        }
        # recovery: kill the 2-stage setup's stage mid-stream; the serving node re-plans (alone) and replays
        times: list[float] = []

        def watch() -> None:
            nonlocal times
            t, _, _ = _request(
                s2.run["api"],
                {"model": "m", "prompt": short[1 % len(short)], "max_tokens": 200, "temperature": 0, "stream": True},
            )
            times = t

        th = threading.Thread(target=watch)
        th.start()
        time.sleep(0.1)
        while True:  # kill after ~20 tokens: poll the stage's step counter
            st = st2.status()["services"]["pipeline"]["pipeline"]["stages"][0]
            if st["steps"] >= 40:
                break
            time.sleep(0.02)
        st2.proc.send_signal(signal.SIGKILL)
        th.join()
        gaps = [b - a for a, b in itertools.pairwise(times)]
        recovery_s = max(gaps) if gaps else float("nan")
        last_ms = s2.status()["services"]["pipeline"]["pipeline"]["models"]["m"]["last_recovery_ms"]
    finally:
        for n in reversed(nodes):
            n.stop()

    if args.large_layers:
        rss.update(
            large_rss(ck, base, states, args.large_layers, args.threads, prompt, short, max(8, args.decode // 4))
        )

    def ratio(name: str, key: str) -> str:
        xs = [a / b for a, b in zip(res[name][key], res["local"][key])]
        return _med(xs)

    print(
        f"\nmid-size Qwen3-MoE (8 layers, fp32), {args.threads} BLAS thread(s) per process, prompt {args.prompt}, "
        f"decode {args.decode}, {args.concurrency} concurrent, {args.rounds} rounds, median [min, max]\n"
    )
    print(
        "| setup | path | prefill tok/s | x local | decode tok/s (1) | x local | decode tok/s (8) | x local "
        "| hop overhead ms | path RTT ms | hop / path RTT | QUIC RTT ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in setups:
        row = [
            name,
            ",".join(sorted(paths.get(name, ()))) or "-",
            _med(res[name]["prefill"]),
            "1" if name == "local" else ratio(name, "prefill"),
            _med(res[name]["decode1"]),
            "1" if name == "local" else ratio(name, "decode1"),
            _med(res[name]["decodeN"]),
            "1" if name == "local" else ratio(name, "decodeN"),
            _med(res[name]["hop_ms"]) if res[name]["hop_ms"] else "-",
            _med(res[name]["ping_ms"]) if res[name]["ping_ms"] else "-",
            _med(res[name]["hop_per_rtt"]) if res[name]["hop_per_rtt"] else "-",
            _med(res[name]["rtt_ms"]) if res[name]["rtt_ms"] else "-",
        ]
        print("| " + " | ".join(row) + " |")
    print(f"\nCPU busy during the {args.concurrency} concurrent streams (cores; 1 = one core all the time):")
    print("; ".join(f"{k} {_med(v)}" for k, v in busy.items()))
    print(
        f"\n| process | peak RSS MB | weights held MB | ratio | ratio after the idle daemon's {idle_mb:.1f} MB |"
    )
    print("|---|---|---|---|---|")
    for name, (mb, b) in rss.items():
        print(
            f"| {name} | {mb:.1f} | {b / 2**20:.1f} | {mb / (b / 2**20):.2f} | {(mb - idle_mb) / (b / 2**20):.2f} |"
        )
    print(
        f"\nrecovery (2 stages, stage SIGKILLed mid-stream): longest inter-token gap {recovery_s * 1e3:.0f} ms "
        f"(of which re-plan {last_ms} ms); stream completed with {len(times)} tokens"
    )
    print(f"\nrecoveries during the rounds (a stage thought dead, replayed): {recoveries}")
    print(f"stream errors: {errors or 'none'}; outputs differing from local: {mismatches or 'none'}")
    print(
        json.dumps(
            {
                "errors": errors,
                "mismatches": mismatches,
                "recoveries": recoveries,
                "results": res,
                "rss": {k: [v[0], v[1]] for k, v in rss.items()},
                "idle_mb": idle_mb,
                "recovery_s": recovery_s,
                "paths": {k: sorted(v) for k, v in paths.items()},
                "replan_ms": last_ms,
                "busy": busy,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
