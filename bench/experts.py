"""Expert-workers benchmark: local engine vs routed experts on 1, 2, 3 worker processes over the data lane.

    python bench/experts.py [--dir DIR] [--threads 1] [--workers 1,2,3] [--prompt 64] [--decode 64] [--rounds 3]
                            [--paths lane,quic] [--netns] [--pin] [--no-tcp]

Expert streams go over the data lane (``transport.lane``: TLS over TCP, as a daemon does by default); with
``--paths lane,quic`` (the default) the 1-worker setup also runs over QUIC alone, in the same rounds. By
default everything runs on loopback. ``--netns`` (root) runs the coordinator and the workers in two network
namespaces joined by a veth pair with MTU 1500 (``lane-bench-a``/``lane-bench-b``, 10.199.0.1/2, deleted at
the end), where packets have real LAN sizes (QUIC 1350 B, TCP MSS 1448). ``--pin`` gives each process one core
(taskset: this one, which runs the local engine and the coordinator, CPU 0; the workers CPU 1), so a local
decode runs on one core and a delegated one on two, each process with one kernel thread, and the coordinator
polls while its worker computes: a worker with a core of its own, as on a machine of its own (the memory bus
and the last-level cache are still shared).

Checkpoint: the engine benchmark's mid-size Qwen3-MoE (hidden 768, 8 layers, 12 heads over 4 KV heads,
head_dim 64, 16 experts of width 384, top-4, fp32), written here with numpy (no torch) into --dir
(default: a temp dir) unless already there.

Prefill tok/s on a --prompt-token prompt (best of 2 after a warm-up), locally and with N workers. For each N,
three greedy decodes of --decode tokens run one after the other, the latter two fed the first one's tokens:
local; local with a 4 KB ECHO to a worker before each sparse layer (the transport's round trip "in decode",
after the same compute gaps a delegated layer sees); remote. The per-layer delegation overhead is ((median
remote step) - (median local step)) / (sparse layers): everything delegation adds to a decode step, thread
hand-offs included. It is set against the round trip of a 4 KB ECHO the way a layer call goes
(``RemoteExecutor.echo_rtt``: on the direct channel from this thread when one is up, as a decode layer's call
is; otherwise sent from the loop and read in the read callback, polled for as a layer call is), measured in the
same run both in decode and back to back (a tight loop); the back-to-back round trip of a sleeping echo is shown
too. The default row makes each decode layer's call over the direct channel beside the lane
(``engine.experts.direct``: the engine thread writes the request and reads the reply, nobody polls); the
"1 worker, no direct" row is the session-5 path (the lane's stream, the pass run on the event loop, the
coordinator polling for the replies and the worker for its next request with one loopback worker on two cores,
and warming the next layer when no worker is on loopback), "no direct, no poll" the same without polling, so
the figures show what each adds. Every remote step's logits are checked
byte-equal to the local step's. The whole measurement is repeated --rounds times (a shared VM drifts by +-10%
between runs); the table shows each figure's median over the rounds and, for the ratios, the lowest and
highest round. The workers' own compute time per request (as they report it) is shown too, beside the
local experts' time per layer (the local executor timed in a fourth decode run), the decode ratio an ideal
delegation would reach (local step with the local experts replaced by the round trip in decode plus the
worker's compute: no hand-offs, dispatch or combine; 1 worker) and the per-layer overhead the 0.85x target
leaves. With 1 worker, a plain TCP echo process (no TLS, no framing: 4 KB each way over a socket, both ends
plain Python sleeping in select, next to the workers: same namespace, same CPU with ``--pin``) gives the
machine's floor: its round trip back to back and in decode (before each sparse layer of a local decode, as the
lane's echo), and "TCP floor vs local", the ratio a delegation would reach if a layer cost nothing but that
round trip over local (``--no-tcp`` skips it). Prints a Markdown
table and a JSON line. Workers are ``tests/experts_node.py`` processes (real MeshTransport + ExpertsService).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# Setups run with 1 worker: (setup suffix, CoordinatorConfig changes); 2 and 3 workers run the first only.
# "no direct": the layer calls go over the lane's stream from the event loop (session 5's path), polling
# and warming as configured; the default row makes them over the direct channel from the engine thread.
VARIANTS: list[tuple[str, dict[str, Any]]] = [("", {}), (", no direct", {"direct": False}),
                                              (", no direct, no poll", {"direct": False, "poll_s": 0.0})]

CONFIG = dict(
    model_type="qwen3_moe", vocab_size=8192, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
    num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=16,
    num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu", decoder_sparse_step=1, mlp_only_layers=[],
)


def create(path: Path) -> Path:
    """Write the mid-size checkpoint (once)."""
    import numpy as np
    from safetensors.numpy import save_file

    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    rng = np.random.default_rng(0)
    d, hd, h, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    e, i, v = c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[-1] ** -0.5)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": norm(d),
                                "lm_head.weight": w(v, d)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = w(h * hd, d)
        t[p + "self_attn.k_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.v_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.o_proj.weight"] = w(d, h * hd)
        t[p + "self_attn.q_norm.weight"] = norm(hd)
        t[p + "self_attn.k_norm.weight"] = norm(hd)
        t[p + "mlp.gate.weight"] = w(e, d) * np.float32(2.0)
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            t[q + "gate_proj.weight"], t[q + "up_proj.weight"], t[q + "down_proj.weight"] = w(i, d), w(i, d), w(d, i)
    (path / "config.json").write_text(json.dumps(c))
    save_file(t, str(path / "model.safetensors"))
    return path


class EchoProbe:
    """The local executor, but before each sparse layer one 4 KB ECHO goes to a worker (in turn) and its round
    trip is recorded: the transport's round trip at exactly the moments a delegated layer would go out,
    after the same compute gaps (on a VM a round trip after a millisecond of idling costs more than one in
    a tight loop)."""

    def __init__(self, inner: Any, remote: Any, payload: bytes) -> None:
        self.inner, self.remote, self.payload = inner, remote, payload
        self.nodes = sorted(remote.links)
        self.rtts: list[float] = []
        self._i = 0

    def __call__(self, layer: int, x: Any, work: Any) -> Any:
        node = self.nodes[self._i % len(self.nodes)]
        self._i += 1
        self.rtts.append(self.remote.echo_rtt(node, self.payload, polled=True))
        return self.inner(layer, x, work)


# How long either end of the TCP probe spins on its socket before it sleeps. 0: both sleep (a wake-up each way).
# Spinning both ends naively (no yielding when preempted, unlike transport.poll) beside the kernel pool's spinning
# helper put three spinners on two cores: the probe then measured the scheduler's time slice (~3 ms), not TCP.
POLL_S = 0.0


def _recv_exactly(sock: Any, buf: Any, poll_s: float) -> None:
    """Fill ``buf`` from a non-blocking ``sock``: spin on it for up to ``poll_s``, then sleep in select."""
    import select

    view, got, t0 = memoryview(buf), 0, time.perf_counter()
    while got < len(buf):
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:
            if time.perf_counter() - t0 > poll_s:
                select.select([sock], [], [])
            continue
        if n == 0:
            raise ConnectionError("tcp probe: peer closed")
        got += n


def tcp_echo_server(host: str) -> int:
    """``--tcp-echo``: serve one TCP connection, echoing 4 KB messages (a plain Python process answering at once):
    the floor under any delegated layer between two processes. Prints its port."""
    import socket

    srv = socket.create_server((host, 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setblocking(False)
    buf = bytearray(4096)
    try:
        while True:
            _recv_exactly(conn, buf, POLL_S)
            _send_all(conn, buf)
    except (ConnectionError, OSError):
        return 0


def _send_all(sock: Any, data: Any) -> None:
    view, sent = memoryview(data), 0
    while sent < len(data):
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            import select

            select.select([], [sock], [])


class TcpProbe:
    """The local executor, but before each sparse layer one 4 KB message goes to a plain TCP echo process and back
    (both ends plain Python, TCP_NODELAY, sleeping in select until data is there): the round trip between two
    processes on this machine at the moments a delegated layer would go out. No TLS, no framing, no expert
    work: the floor under any delegation over a socket."""

    def __init__(self, inner: Any, sock: Any) -> None:
        self.inner, self.sock = inner, sock
        self.payload, self.buf = os.urandom(4096), bytearray(4096)
        self.rtts: list[float] = []

    def rtt(self) -> float:
        t0 = time.perf_counter()
        _send_all(self.sock, self.payload)
        _recv_exactly(self.sock, self.buf, POLL_S)
        return time.perf_counter() - t0

    def __call__(self, layer: int, x: Any, work: Any) -> Any:
        self.rtts.append(self.rtt())
        return self.inner(layer, x, work)


def start_tcp_echo(host: str, prefix: list[str]) -> tuple[Any, Any]:
    """(the echo process, a connected non-blocking socket to it)."""
    import socket
    import subprocess

    proc = subprocess.Popen([*prefix, sys.executable, __file__, "--tcp-echo", host], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return proc, sock


class TimedLocal:
    """The local executor, timed: seconds per routed-layer call (the experts' share of a local decode step)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    def __call__(self, layer: int, x: Any, work: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(layer, x, work)
        self.seconds.append(time.perf_counter() - t0)
        return out


def wait_direct(coord: Any, ex: Any, want: bool) -> None:
    """Every link with a direct channel (``want``; raises after 10 s), or none (closed here)."""
    if not want:
        for link in ex.links.values():
            if link.direct is not None:
                link.direct.close("bench: no direct")
        return
    deadline = time.monotonic() + 10
    while not ex.all_direct():
        if time.monotonic() > deadline:
            raise RuntimeError("no direct channel to every worker within 10 s")
        coord.probe()
        time.sleep(0.05)


def prefill(model: Any, executor: Any, prompt: list[int]) -> float:
    """Prefill tok/s: best of 2 after a warm-up (page-in, BLAS init)."""
    model.forward(prompt[:8], model.new_cache(), executor=executor)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        model.forward(prompt, model.new_cache(), executor=executor)
        best = min(best, time.perf_counter() - t0)
    return len(prompt) / best


def decode(model: Any, runs: dict[str, Any], prompt: list[int], steps: int,
           on_decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy decode of ``steps`` tokens by each executor in ``runs`` in turn (the first must be "local";
    the others are fed its tokens, so every step's logits compare). Each run is contiguous: a decode step
    sees the caches a steady decode leaves (interleaving the runs token by token would have each step's
    weights evicted by the other runs'). ``on_decode[name]()`` runs after that run's prefill.
    -> per run: step times (s) and logits bytes per position."""
    import numpy as np

    tokens: list[int] = []
    times: dict[str, list[float]] = {}
    logits: dict[str, list[bytes]] = {}
    for name, ex in runs.items():
        cache = model.new_cache()
        out = model.forward(prompt, cache, executor=ex)[-1]
        if on_decode and name in on_decode:
            on_decode[name]()
        times[name], logits[name] = [], [out.tobytes()]
        for i in range(steps):
            if name == "local":
                tokens.append(int(np.argmax(out)))
            t0 = time.perf_counter()
            out = model.forward([tokens[i]], cache, executor=ex)[-1]
            times[name].append(time.perf_counter() - t0)
            logits[name].append(out.tobytes())
    return {"times": times, "logits": logits}


def measure(model: Any, ex: Any, prompt: list[int], args: Any, local_prefill: float,
            tcp: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """One round with the workers ``ex`` has: (the local row, the remote row). ``tcp``: a socket to the TCP echo
    process (its round trip back to back and in decode go into the remote row)."""
    sparse = len(model.sparse_layers)
    payload = os.urandom(4096)
    rtts = [ex.echo_rtt(node, payload, polled=True) for node in ex.links for _ in range(args.echo)]
    tcp_probe = TcpProbe(model.local_executor, tcp) if tcp is not None else None
    tcp_b2b = [tcp_probe.rtt() for _ in range(args.echo)] if tcp_probe is not None else []
    slept = [ex.echo_rtt(node, payload) for node in ex.links for _ in range(args.echo)]
    remote_prefill = prefill(model, ex, prompt)
    probe = EchoProbe(model.local_executor, ex, payload)
    timed = TimedLocal(model.local_executor)

    def reset() -> None:
        for st in ex.link_stats.values():
            st.__init__()  # count the decode steps only

    runs: dict[str, Any] = {"local": model.local_executor, "timed": timed, "echo": probe}
    hooks: dict[str, Any] = {"timed": timed.seconds.clear, "echo": probe.rtts.clear, "remote": reset}
    if tcp_probe is not None:
        runs["tcp"], hooks["tcp"] = tcp_probe, tcp_probe.rtts.clear
    runs["remote"] = ex
    res = decode(model, runs, prompt, args.decode, hooks)
    t = res["times"]
    calls = sum(st.calls for st in ex.link_stats.values())
    overhead = (statistics.median(t["remote"]) - statistics.median(t["local"])) / sparse * 1e3
    rtt_ms, rtt_decode_ms = statistics.median(rtts) * 1e3, statistics.median(probe.rtts) * 1e3
    n = len(ex.links)
    local_step = statistics.median(t["local"]) * 1e3
    local = {"setup": "local", "prefill_tok_s": local_prefill, "decode_tok_s": len(t["local"]) / sum(t["local"]),
             "step_ms_median": local_step}
    local_experts_ms = statistics.median(timed.seconds) * 1e3
    worker_ms = sum(st.compute_sum_s for st in ex.link_stats.values()) / max(calls, 1) * 1e3
    remote = {"setup": f"{n} worker{'s' if n > 1 else ''}", "prefill_tok_s": remote_prefill,
              "prefill_vs_local": remote_prefill / local_prefill,
              "decode_tok_s": len(t["remote"]) / sum(t["remote"]),
              "decode_vs_local": sum(t["local"]) / sum(t["remote"]),
              "step_ms_median": statistics.median(t["remote"]) * 1e3,
              "overhead_ms": overhead, "rtt_4k_ms": rtt_ms, "overhead_rtts": overhead / rtt_ms,
              "rtt_decode_ms": rtt_decode_ms, "overhead_rtts_decode": overhead / rtt_decode_ms,
              "rtt_4k_sleeping_ms": statistics.median(slept) * 1e3,
              "worker_compute_ms": worker_ms,
              "local_experts_ms": local_experts_ms,
              # what a delegated step would take with nothing but the round trip in decode and the worker's
              # compute in place of the local experts (no hand-offs, no dispatch or combine): an upper bound
              "ideal_vs_local": local_step / (local_step + sparse * (rtt_decode_ms + worker_ms - local_experts_ms))
              if n == 1 else None,
              # the per-layer overhead the 0.85x target leaves
              "overhead_budget_ms": (local_step / 0.85 - local_step) / sparse,
              **({"tcp_rtt_ms": statistics.median(tcp_b2b) * 1e3,
                  "tcp_rtt_decode_ms": statistics.median(tcp_probe.rtts) * 1e3,
                  # a delegation costing nothing but a plain TCP round trip per layer, the worker computing
                  # the experts in the local experts' time: the machine's floor, an upper bound on the ratio
                  "floor_vs_local": local_step / (local_step + sparse * statistics.median(tcp_probe.rtts) * 1e3),
                  "overhead_tcp_rtts_decode": overhead / (statistics.median(tcp_probe.rtts) * 1e3)}
                 if tcp_probe is not None and tcp_probe.rtts else {}),
              "decode_reply_kb": sum(st.bytes_in for st in ex.link_stats.values()) / max(calls, 1) / 1024,
              "passes_on_loop": ex.stats.passes_on_loop,
              "bit_exact": res["logits"]["remote"] == res["logits"]["local"]}
    return local, remote


def summarize(name: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the rounds; the ratios' ranges too; bit-exact only if every round was."""
    row: dict[str, Any] = {"setup": name, "rounds": len(rounds)}
    for key in rounds[0]:
        values = [r[key] for r in rounds if key in r]
        if key == "bit_exact":
            row[key] = all(values)
        elif any(v is None for v in values):
            continue
        elif key != "setup":
            row[key] = statistics.median(values)
            if key in ("overhead_rtts", "overhead_rtts_decode", "decode_vs_local", "floor_vs_local"):
                row[key + "_range"] = [min(values), max(values)]
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="the checkpoint (written once; default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads per process (default 1)")
    ap.add_argument("--workers", default="1,2,3", help="worker counts to measure (default 1,2,3)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--decode", type=int, default=64, help="decode steps per run (default 64)")
    ap.add_argument("--echo", type=int, default=200, help="4 KB echoes per worker, back to back (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="repeat every setup; the table has the medians (default 3)")
    ap.add_argument("--paths", default="lane,quic",
                    help="expert stream paths to measure: lane (all worker counts), quic (1 worker); default lane,quic")
    ap.add_argument("--netns", action="store_true",
                    help="coordinator and workers in two network namespaces over a veth pair, MTU 1500 (root; "
                         "default: loopback)")
    ap.add_argument("--pin", action="store_true",
                    help="one core per process (taskset): this process (local engine and coordinator) on CPU 0, "
                         "the workers on CPU 1, so each computes with one kernel thread and the coordinator may "
                         "poll while its worker computes, as with a worker on a machine of its own; default off")
    ap.add_argument("--no-tcp", action="store_true",
                    help="skip the plain TCP echo process (the round-trip floor; default: measured with 1 worker)")
    ap.add_argument("--in-netns", default=None, help=argparse.SUPPRESS)  # set when re-run inside namespace a
    ap.add_argument("--tcp-echo", default=None, help=argparse.SUPPRESS)  # run as the TCP echo process
    args = ap.parse_args(argv)
    if args.tcp_echo is not None:
        return tcp_echo_server(args.tcp_echo)
    if args.netns and args.in_netns is None:
        return run_in_netns(argv if argv is not None else sys.argv[1:])
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.pin:  # before the engine is imported: its kernel threads follow this process's CPUs
        os.sched_setaffinity(0, {0})

    import random

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    from experts_mesh import Coordinator, MeshFixture, spawn_worker

    from engine.model import Model

    path = create(args.dir or Path(tempfile.mkdtemp(prefix="meshd-bench-experts-")) / "qwen3moe-mid")
    model = Model.load(path)
    r = random.Random(1)
    prompt = [r.randrange(CONFIG["vocab_size"]) for _ in range(args.prompt)]
    local_prefill = prefill(model, model.local_executor, prompt)
    mesh = MeshFixture()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-bench-nodes-"))
    counts = [int(n) for n in args.workers.split(",") if n]
    paths = [p for p in args.paths.split(",") if p]
    where: dict[str, Any] = {}
    host = "127.0.0.1"
    if args.in_netns:
        where = {"netns": NS_B, "listen": ADDR_B}
        host = ADDR_A
    if args.pin:
        where["cpus"] = "1"
    procs = [spawn_worker(mesh, tmp, [str(path)], **where) for _ in range(max(counts, default=0))]
    setups = [(n, v, "lane") for n in counts for v in (VARIANTS if n == 1 else VARIANTS[:1])] if "lane" in paths else []
    if "quic" in paths and 1 in counts:
        setups.append((1, VARIANTS[0], "quic"))
    runs: dict[str, list[dict[str, Any]]] = {}  # setup -> one row per round
    tcp_proc, tcp_sock = None, None
    if not args.no_tcp and 1 in counts:  # beside the workers: in their namespace, on their CPU
        prefix = (["ip", "netns", "exec", NS_B] if args.in_netns else []) + (["taskset", "-c", "1"] if args.pin else [])
        tcp_proc, tcp_sock = start_tcp_echo(ADDR_B if args.in_netns else "127.0.0.1", prefix)
    try:
        for _ in range(args.rounds):
            for n, variant, over in setups:
                coord = Coordinator(mesh, lane=over == "lane", host=host)
                try:
                    coord.connect(procs[:n])
                    ex = coord.executor(path, "on")
                    coord.wait_paths(procs[:n], over, timeout_s=30.0)  # a loaded lane may take redials
                    ex.config = dataclasses.replace(ex.config, **variant[1])
                    wait_direct(coord, ex, ex.config.direct and over == "lane")
                    if args.pin:  # its own CPU set is one core, but the worker has the other one to itself
                        ex._cores = os.cpu_count() or 1
                    local, remote = measure(model, ex, prompt, args, local_prefill,
                                            tcp_sock if n == 1 and variant is VARIANTS[0] else None)
                finally:
                    coord.close()
                remote["setup"] += variant[0] + f" ({over})"
                runs.setdefault("local", []).append(local)
                runs.setdefault(remote["setup"], []).append(remote)
    finally:
        for p in procs:
            p.stop()
        if tcp_proc is not None:
            tcp_sock.close()
            tcp_proc.wait(10)
    rows = [summarize(name, rounds) for name, rounds in runs.items()]
    print(f"\nQwen3-MoE mid-size ({CONFIG['num_hidden_layers']} sparse layers, {CONFIG['num_experts']} experts, "
          f"top-{CONFIG['num_experts_per_tok']}), prompt {args.prompt}, decode {args.decode}, "
          f"{args.threads} BLAS thread(s)/process, "
          f"{'two network namespaces over a veth pair, MTU 1500' if args.in_netns else 'loopback'}"
          f"{', pinned: this process (local and coordinator) on CPU 0, workers on CPU 1' if args.pin else ''}; "
          f"medians of {args.rounds} rounds "
          f"(ratios: median (lowest-highest))\n")
    print("| setup | prefill tok/s | prefill vs local | decode tok/s | decode vs local | decode step ms "
          "| per-layer overhead ms | RTT ms back-to-back | overhead / RTT | RTT ms in decode "
          "| overhead / RTT in decode | RTT ms back-to-back, sleeping | worker compute ms/request "
          "| decode reply KB/request | local experts ms/layer | ideal vs local | overhead budget ms (0.85x) "
          "| TCP RTT ms back-to-back | TCP RTT ms in decode | overhead / TCP RTT in decode | TCP floor vs local "
          "| bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        def f(key: str, fmt: str = "{:.2f}") -> str:
            if key not in row:
                return "-"
            lo_hi = row.get(key + "_range")
            spread = f" ({fmt.format(lo_hi[0])}-{fmt.format(lo_hi[1])})" if lo_hi and row["rounds"] > 1 else ""
            return fmt.format(row[key]) + spread
        print(f"| {row['setup']} | {f('prefill_tok_s', '{:.1f}')} | {f('prefill_vs_local')} | "
              f"{f('decode_tok_s')} | {f('decode_vs_local')} | {f('step_ms_median', '{:.3f}')} | "
              f"{f('overhead_ms', '{:.3f}')} | {f('rtt_4k_ms', '{:.3f}')} | {f('overhead_rtts')} | "
              f"{f('rtt_decode_ms', '{:.3f}')} | {f('overhead_rtts_decode')} | "
              f"{f('rtt_4k_sleeping_ms', '{:.3f}')} | {f('worker_compute_ms', '{:.3f}')} | {f('decode_reply_kb', '{:.1f}')} | "
              f"{f('local_experts_ms', '{:.3f}')} | {f('ideal_vs_local')} | {f('overhead_budget_ms', '{:.3f}')} | "
              f"{f('tcp_rtt_ms', '{:.3f}')} | {f('tcp_rtt_decode_ms', '{:.3f}')} | {f('overhead_tcp_rtts_decode')} | "
              f"{f('floor_vs_local')} | {row.get('bit_exact', '-')} |")
    print(json.dumps({"rows": rows}))
    return 0


NS_A, NS_B = "lane-bench-a", "lane-bench-b"
VETH_A, VETH_B = "lane-bva", "lane-bvb"
ADDR_A, ADDR_B = "10.199.0.1", "10.199.0.2"


def run_in_netns(argv: Sequence[str]) -> int:
    """Make the two namespaces and the veth pair (MTU 1500), re-run this script inside namespace a (it
    starts its workers in namespace b), delete everything afterwards."""
    import subprocess

    def sh(*cmd: str, check: bool = True) -> None:
        subprocess.run(cmd, check=check, capture_output=not check)

    for ns in (NS_A, NS_B):
        sh("ip", "netns", "del", ns, check=False)
    try:
        for ns in (NS_A, NS_B):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", VETH_A, "mtu", "1500", "netns", NS_A, "type", "veth", "peer", "name", VETH_B,
           "mtu", "1500", "netns", NS_B)
        for ns, dev, addr in ((NS_A, VETH_A, ADDR_A), (NS_B, VETH_B, ADDR_B)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        cmd = ["ip", "netns", "exec", NS_A, sys.executable, __file__, *argv, "--in-netns", NS_A]
        return subprocess.run(cmd).returncode
    finally:
        for ns in (NS_A, NS_B):
            sh("ip", "netns", "del", ns, check=False)


if __name__ == "__main__":
    raise SystemExit(main())
