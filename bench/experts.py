"""Expert-workers benchmark: local engine vs routed experts on 1, 2, 3 worker processes over QUIC loopback.

    python bench/experts.py [--dir DIR] [--threads 1] [--workers 1,2,3] [--prompt 64] [--decode 16]

Checkpoint: the engine benchmark's mid-size Qwen3-MoE (hidden 768, 8 layers, 12 heads over 4 KV heads,
head_dim 64, 16 experts of width 384, top-4, vocab 8192, fp32), written here with numpy (no torch) into
--dir (default: a temp dir) unless already there.

For each setup (local, then N workers): prefill tok/s on a --prompt-token prompt (best of 2 after a
warm-up) and decode tok/s over --decode greedy tokens; during decode every sparse layer's executor call is
timed (expert work and the weighted combination, which workers may do themselves). The per-layer
delegation overhead is (median remote layer call) - (median local layer call), set
against the median round trip of a 4 KB ECHO on the same expert streams, sent and read the way a layer
call is (``RemoteExecutor.echo_rtt``), measured in the same run twice: back to back (a tight loop) and in
decode (one echo before each sparse layer of a local decode run, i.e. after the same compute gaps a
delegated layer sees). The workers' own compute time per request (as they report it) is shown too.
Every remote run's decode logits are checked byte-equal to the local run. Prints a Markdown table and a
JSON line. Workers are ``tests/experts_node.py`` processes (real MeshTransport + ExpertsService).
"""

from __future__ import annotations

import argparse
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
        self.rtts.append(self.remote.echo_rtt(node, self.payload))
        return self.inner(layer, x, work)


class Timed:
    """Wraps an executor and records each layer's wall time (seconds), combination included, so a remote
    executor whose workers combine (``run_routed``) and the local one are timed alike."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.times: list[float] = []

    def __call__(self, layer: int, x: Any, work: Any) -> Any:
        return self.inner(layer, x, work)

    def run_routed(self, layer: int, x: Any, routing: Any) -> Any:
        from engine.moe import combine

        t0 = time.perf_counter()
        if hasattr(self.inner, "run_routed"):
            out = self.inner.run_routed(layer, x, routing)
        else:
            out = combine(routing, self.inner(layer, x, routing.work), x.shape[0], x.shape[1])
        self.times.append(time.perf_counter() - t0)
        return out


def run(model: Any, executor: Any, prompt: list[int], decode: int, on_decode: Any = None) -> dict[str, Any]:
    import numpy as np

    ex = Timed(executor)
    model.forward(prompt[:8], model.new_cache(), executor=ex)  # warm-up (page-in, BLAS init)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        model.forward(prompt, model.new_cache(), executor=ex)
        best = min(best, time.perf_counter() - t0)
    cache = model.new_cache()
    logits = model.forward(prompt, cache, executor=ex)[-1]
    ex.times.clear()
    if on_decode is not None:
        on_decode()
    tokens, all_logits = [], [logits.tobytes()]
    t0 = time.perf_counter()
    for _ in range(decode):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        logits = model.forward([tok], cache, executor=ex)[-1]
        all_logits.append(logits.tobytes())
    dt = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt) / best, "decode_tok_s": decode / dt, "tokens": tokens,
            "logits": all_logits, "layer_call_ms_median": statistics.median(ex.times) * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads per process (default 1)")
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--echo", type=int, default=200, help="4 KB echoes per worker")
    args = ap.parse_args(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)

    import random

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    from experts_mesh import Coordinator, MeshFixture, spawn_worker

    from engine.model import Model

    path = create(args.dir or Path(tempfile.mkdtemp(prefix="meshd-bench-experts-")) / "qwen3moe-mid")
    model = Model.load(path)
    r = random.Random(1)
    prompt = [r.randrange(CONFIG["vocab_size"]) for _ in range(args.prompt)]
    rows: list[dict[str, Any]] = []
    local = run(model, model.local_executor, prompt, args.decode)
    rows.append({"setup": "local", **{k: v for k, v in local.items() if k not in ("tokens", "logits")}})
    mesh = MeshFixture()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-bench-nodes-"))
    counts = [int(n) for n in args.workers.split(",") if n]
    procs = [spawn_worker(mesh, tmp, [str(path)]) for _ in range(max(counts, default=0))]
    try:
        for n in counts:
            coord = Coordinator(mesh)
            try:
                coord.connect(procs[:n])
                ex = coord.executor(path, "on")
                payload = os.urandom(4096)
                rtts = [ex.echo_rtt(node, payload) for node in ex.links for _ in range(args.echo)]
                probe = EchoProbe(model.local_executor, ex, payload)
                run(model, probe, prompt, args.decode, probe.rtts.clear)
                rtt_decode_ms = statistics.median(probe.rtts) * 1e3
                def reset(ex: Any = ex) -> None:
                    for st in ex.link_stats.values():
                        st.__init__()  # count the decode steps only

                res = run(model, ex, prompt, args.decode, reset)
                calls = sum(st.calls for st in ex.link_stats.values())
                compute_ms = sum(st.compute_sum_s for st in ex.link_stats.values()) / max(calls, 1) * 1e3
                reply_kb = sum(st.bytes_in for st in ex.link_stats.values()) / max(calls, 1) / 1024
                exact = res["logits"] == local["logits"] and res["tokens"] == local["tokens"]
                rtt_ms = statistics.median(rtts) * 1e3
                overhead = res["layer_call_ms_median"] - local["layer_call_ms_median"]
                rows.append({"setup": f"{n} worker{'s' if n > 1 else ''}", "prefill_tok_s": res["prefill_tok_s"],
                             "prefill_vs_local": res["prefill_tok_s"] / local["prefill_tok_s"],
                             "decode_reply_kb": reply_kb,
                             "decode_tok_s": res["decode_tok_s"], "layer_call_ms_median": res["layer_call_ms_median"],
                             "overhead_ms": overhead, "rtt_4k_ms": rtt_ms, "overhead_rtts": overhead / rtt_ms,
                             "rtt_decode_ms": rtt_decode_ms, "overhead_rtts_decode": overhead / rtt_decode_ms,
                             "worker_compute_ms": compute_ms,
                             "decode_vs_local": res["decode_tok_s"] / local["decode_tok_s"], "bit_exact": exact})
            finally:
                coord.close()
    finally:
        for p in procs:
            p.stop()
    print(f"\nQwen3-MoE mid-size ({CONFIG['num_hidden_layers']} sparse layers, {CONFIG['num_experts']} experts, "
          f"top-{CONFIG['num_experts_per_tok']}), prompt {args.prompt}, decode {args.decode}, "
          f"{args.threads} BLAS thread(s)/process, loopback QUIC\n")
    print("| setup | prefill tok/s | prefill vs local | decode tok/s | decode vs local | layer call ms "
          "| per-layer overhead ms | RTT ms back-to-back | overhead / RTT | RTT ms in decode "
          "| overhead / RTT in decode | worker compute ms/request | decode reply KB/request | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        def f(key: str, fmt: str = "{:.2f}") -> str:
            return fmt.format(row[key]) if key in row else "-"
        print(f"| {row['setup']} | {f('prefill_tok_s', '{:.1f}')} | {f('prefill_vs_local')} | "
              f"{f('decode_tok_s')} | "
              f"{f('decode_vs_local')} | "
              f"{f('layer_call_ms_median', '{:.3f}')} | {f('overhead_ms', '{:.3f}')} | {f('rtt_4k_ms', '{:.3f}')} | "
              f"{f('overhead_rtts')} | {f('rtt_decode_ms', '{:.3f}')} | {f('overhead_rtts_decode')} | "
              f"{f('worker_compute_ms', '{:.3f}')} | {f('decode_reply_kb', '{:.1f}')} | "
              f"{row.get('bit_exact', '-')} |")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
