"""Engine benchmark: numpy engine (fp32, bf16, GGUF Q8_0 and Q4_K_M) vs transformers (torch CPU) on a
mid-size Qwen3-MoE it creates, plus the machine's memory read bandwidth measured in the same run.

    python bench/engine.py [--threads 2] [--rounds 15] [--blocks 4] [--dir DIR] [--no-ref]
        [--variants fp32,bf16,Q8_0,Q4_K_M]
        [--arch qwen3_moe|glm4_moe|deepseek_v3] [--base DIR [--base-variants fp32,Q8_0,Q4_K_M]]

Checkpoint: Qwen3-MoE, hidden 768, 8 layers, 12 heads over 4 KV heads, head_dim 64, 16 experts of
width 384 with top-4, vocab 8192, fp32 (written once into --dir, default a temp dir), and from it a bf16
safetensors copy and GGUF Q8_0 / Q4_K_M files (``engine.gguf_export``; the experts' down projections have
rows of 384, not whole 256-blocks, so Q4_K_M stores them Q8_0 as llama.cpp falls back for such shapes).

Fairness: every side (transformers, each engine form, the bandwidth probe) runs in its own subprocess, loaded
and warmed up once (one untimed prefill and decode, the same on every side), one load at a time. Then
``--rounds`` rounds: in each, every side in turn runs one timed prefill (256 tokens) and one decode (64
greedy steps after a 256-token prefill), the next round starting one side later, so every side meets the
VM's drift alike. The decodes are interleaved finer (``--blocks``, default 4): after the round's prefills
every side prefills a fresh cache untimed, then the sides take turns block by block, each block the next 16
of its 64 decode steps (the probe, best of three passes as before, runs once, at the middle block's turn),
so the two decodes a ratio compares ran interleaved over the same few seconds rather than one after
the other (``--blocks 1``: each side's 64 steps in one block). A side not being timed is blocked reading its
stdin; each command starts ``SETTLE_S`` after the previous one, so spinning helpers (the kernel pool's
200 us, OpenBLAS's 2**20 cycles with the daemon's ``OPENBLAS_THREAD_TIMEOUT``, which every side gets) have
gone to sleep, and the run reports the CPU time all other sides used while one was timed
(``/proc/PID/task/*/schedstat``): the check that they were idle.
Every subprocess gets the same OMP/OPENBLAS/MKL thread counts and torch the same ``set_num_threads``; both
sides get the same prompt (the same 256 token ids: the checkpoint has no tokenizer, so ids stand in for the
text). Ratios (vs transformers, vs our fp32, of the bandwidth limit) are taken within each round, where the
two sides ran seconds apart, and reported as their median [min-max] over rounds; tok/s as median [min-max].
A prefill computes the logits of its last position only, on both sides, as serving does
(``engine.generate.forward_last``: ``last_only=True``; transformers' ``generate`` passes ``logits_to_keep=1``
likewise): the other 255 rows of logits are 8 MiB no server keeps. The bandwidth probe (its own subprocess, same threads) reads a 1 GiB buffer, far larger
than the caches, with one reader thread per core, best of three passes each round. The bandwidth row
divides the weight bytes one decoded token reads (every non-expert matrix, top-k of the E experts of each
sparse layer, one embedding row) by that bandwidth: the decode speed memory allows.

``--arch glm4_moe`` / ``--arch deepseek_v3`` write the same-size model of that family instead (hidden 768,
8 layers, 16 experts of width 384, top-4, vocab 8192; layer 0 dense, 4 expert groups with 2 kept, one
shared expert; glm4_moe: 12 heads over 4 KV heads of 64 with q/k/v bias, qk-norm and half rotary;
deepseek_v3: 12 heads of latent attention, q LoRA 384, KV latent 256, nope 64 + rope 32, v 64, YaRN).
Every variant exists for every arch (GGUF: glm4moe / deepseek2 as llama.cpp's converter writes them).

``--base DIR``: another checkout of meshd (e.g. ``git archive main | tar -x -C DIR``) whose engine runs the fp32
checkpoint as one more side, ``fp32@base``, in the same rounds: the table gets its row and a line with this
tree's fp32 against it (prefill and decode, paired within rounds), the same-run A/B a change is judged by.
``--base-variants`` (default ``fp32``) names the forms the base tree runs as sides ``V@base``, each with its row
(peak RSS / file included) and a line of this tree's V against it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 256
DECODE_LEN = 64
BATCH_CTX = 64
BATCH_STEPS = 32
ROUNDS = 15
BLOCKS = 4  # a round's decodes are interleaved in blocks of DECODE_LEN / BLOCKS steps (--blocks)
BATCHES = (1, 4, 8)  # the fp32 side's concurrent sequences (forward_batch) rows
BATCH_EVERY = 3  # ... timed in every third round (not a target; they take as long as the rest of a round)
SETTLE_S = 0.05  # pause before each timed command: spinning helpers (200 us) and BLAS (2**20 cycles) sleep
CONFIG = dict(
    vocab_size=8192, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
    num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
    num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
)
_DEEPSEEK_MOE = dict(
    vocab_size=8192, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=8,
    num_attention_heads=12, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=4096,
)
# --arch: (transformers config class, model class, config kwargs)
ARCHES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", CONFIG),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        _DEEPSEEK_MOE, num_key_value_heads=4, head_dim=64, attention_bias=True, use_qk_norm=True,
        partial_rotary_factor=0.5)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _DEEPSEEK_MOE, num_key_value_heads=12, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    """VmHWM: this process image's peak RSS. (ru_maxrss would include the parent's RSS at fork time,
    which Linux carries across exec.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompt(n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(CONFIG["vocab_size"]) for _ in range(n)]


def create(path: Path, arch: str = "qwen3_moe") -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg_cls, model_cls, kw = ARCHES[arch]
    cfg = getattr(transformers, cfg_cls)(**kw)
    model = getattr(transformers, model_cls)(cfg).eval()
    model.save_pretrained(path)


def blas_kernel() -> str:
    """OpenBLAS core name numpy's BLAS picked (OPENBLAS_CORETYPE overrides it)."""
    import ctypes
    import glob

    import numpy as np

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "libscipy_openblas*.so"))
    for lib in libs:
        try:
            dll = ctypes.CDLL(lib)
            for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
                        "openblas_get_corename"):
                fn = getattr(dll, sym, None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    return fn().decode()
        except OSError:
            continue
    return "unknown"


class _EngineSide:
    """The numpy engine (this tree's, or ``root``'s), driven step by step by the parent."""

    def __init__(self, path: Path, threads: int, root: Path = ROOT) -> None:
        import numpy as np

        sys.path.insert(0, str(root))
        import engine
        from engine import dense, kernels

        if Path(engine.__file__).resolve().parent != (root / "engine").resolve():
            raise RuntimeError(f"imported {engine.__file__}, not the engine of {root}")
        from engine.model import Model

        self.np = np
        # The runtime's fixed cost is paid before the baseline, weights and activations after it: numba (the
        # fast extra) imported and its kernels loaded from the on-disk cache (the parent compiled them first,
        # so no LLVM compile inflates the peak). Its size is reported on its own.
        rss_a = _rss_mb()
        kernels.warm()
        dense.warm_step()
        self.kernels_mb = _rss_mb() - rss_a
        self.kernel_threads = kernels.threads() if kernels.AVAILABLE else 0
        self.rss0 = _rss_mb()
        file0, anon0 = _status_mb("RssFile:"), _status_mb("RssAnon:")
        t0 = time.perf_counter()
        self.model = Model.load(path)
        self.load_s = time.perf_counter() - t0
        self.prompt = _prompt(PROMPT_LEN, 1)
        t0 = time.perf_counter()
        self.model.forward(self.prompt, self.model.new_cache(512), last_only=True)  # faults the mapping in
        self.cold_prefill_s = time.perf_counter() - t0
        # right after a prefill: file-backed pages (the weights' mapping) vs anonymous memory (KV cache,
        # activations, allocator), the two parts of the peak
        self.rss_file_mb = _status_mb("RssFile:") - file0
        self.rss_anon_mb = _status_mb("RssAnon:") - anon0

    def prefill(self) -> float:
        self.cache = None  # the last round's decode cache: a finished sequence's cache is freed, not kept
        cache = self.model.new_cache(512)
        t0 = time.perf_counter()
        self.model.forward(self.prompt, cache, last_only=True)
        return time.perf_counter() - t0

    def decode(self) -> float:
        cache = self.model.new_cache(512)
        tok = int(self.model.forward(self.prompt, cache, last_only=True)[-1].argmax())
        t0 = time.perf_counter()
        for _ in range(DECODE_LEN):
            tok = int(self.model.forward([tok], cache)[-1].argmax())
        return time.perf_counter() - t0

    def decode_begin(self) -> float:
        """Untimed: a 256-token prefill into a new cache and the first token; ``decode_block`` continues."""
        self.cache = None  # freed before the next is made: one sequence's cache at a time, as ``decode`` has
        self.cache = self.model.new_cache(512)
        self.tok = int(self.model.forward(self.prompt, self.cache, last_only=True)[-1].argmax())
        return 0.0

    def decode_block(self, n: int) -> float:
        """The next ``n`` greedy decode steps after ``decode_begin`` (and earlier blocks), timed."""
        tok, cache = self.tok, self.cache
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(self.model.forward([tok], cache)[-1].argmax())
        dt = time.perf_counter() - t0
        self.tok = tok
        return dt

    def batch(self, b: int) -> float:
        m = self.model
        caches = [m.new_cache(BATCH_CTX + BATCH_STEPS + 1) for _ in range(b)]
        toks = [int(m.forward(_prompt(BATCH_CTX, 100 + s), c, last_only=True)[-1].argmax())
                for s, c in enumerate(caches)]
        t0 = time.perf_counter()
        for _ in range(BATCH_STEPS):
            toks = [int(t) for t in m.forward_batch(toks, caches).argmax(axis=-1)]
        return time.perf_counter() - t0

    def info(self) -> dict:
        return {"weight_bytes": self.model.checkpoint.nbytes, "load_s": self.load_s,
                "kernels_mb": self.kernels_mb, "kernel_threads": self.kernel_threads,
                "rss_file_mb": self.rss_file_mb, "rss_anon_mb": self.rss_anon_mb,
                "cold_prefill_s": self.cold_prefill_s, "rss_before_load_mb": self.rss0,
                "peak_rss_mb": _peak_mb(), "blas": blas_kernel(), "numpy": self.np.__version__}


class _TorchSide:
    """transformers on torch CPU, the same steps."""

    def __init__(self, path: Path, threads: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch, self.transformers = torch, transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.prompt = torch.tensor([_prompt(PROMPT_LEN, 1)])
        with torch.inference_mode():
            self.model(self.prompt, use_cache=True, logits_to_keep=1)

    def prefill(self) -> float:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self.model(self.prompt, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

    def decode(self) -> float:
        with self.torch.inference_mode():
            out = self.model(self.prompt, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(DECODE_LEN):
                out = self.model(tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t0

    def decode_begin(self) -> float:
        with self.torch.inference_mode():
            out = self.model(self.prompt, use_cache=True, logits_to_keep=1)
            self.past, self.tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return 0.0

    def decode_block(self, n: int) -> float:
        with self.torch.inference_mode():
            past, tok = self.past, self.tok
            t0 = time.perf_counter()
            for _ in range(n):
                out = self.model(tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            dt = time.perf_counter() - t0
            self.past, self.tok = past, tok
            return dt

    def info(self) -> dict:
        return {"peak_rss_mb": _peak_mb(), "torch": self.torch.__version__,
                "transformers": self.transformers.__version__, "torch_threads": self.torch.get_num_threads()}



def _bandwidth(threads: int, buf: "np.ndarray", passes: int = 3) -> dict:  # noqa: F821
    """Memory read bandwidth: ``threads`` readers over ``buf`` (1 GiB), best of ``passes`` passes (GB/s), for
    two
    streaming reads that are not compute-bound (a 32-bit integer max, and BLAS ``sdot`` of the buffer with
    itself); the larger is the machine's figure. (A float32 ``sum``, used before, is pairwise summation:
    it measured ~24 GB/s where these read ~38 GB/s on the development VM, so it understated the limit.)"""
    import threading

    import numpy as np

    parts = np.array_split(buf, threads)
    probes = {"max_u32": lambda a: a.view(np.uint32).max(), "sdot": lambda a: np.dot(a, a)}
    out: dict = {}
    for name, fn in probes.items():
        best = 0.0
        for _ in range(passes):
            barrier = threading.Barrier(threads + 1)

            def read(a: np.ndarray, fn=fn) -> None:  # noqa: ANN001
                barrier.wait()
                fn(a)

            ts = [threading.Thread(target=read, args=(p,)) for p in parts]
            for t in ts:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in ts:
                t.join()
            best = max(best, buf.nbytes / (time.perf_counter() - t0) / 1e9)
        out[name] = best
    out["read_gb_s"] = max(out.values())
    return out


def _active_bytes(model) -> int:
    """Weight bytes one decode step reads: non-expert matrices, top-k experts per sparse layer, one embedding row."""
    import numpy as np

    total = 0
    cfg = model.config
    for lay in model.layers:
        for name in ("q", "k", "v", "o", "gate", "up", "down", "router", "attn_norm", "mlp_norm", "q_norm", "k_norm"):
            w = getattr(lay, name, None)
            if w is not None:
                total += int(w.nbytes)
        if lay.sparse:
            per = sum(int(w.nbytes) for w in lay.experts[0])
            total += per * cfg.top_k
        if lay.shared is not None:
            total += sum(int(w.nbytes) for w in lay.shared)
        total += sum(int(w.nbytes) for w in lay.extra.values())  # latent attention's q_a, w_uk, w_uv, norms
    total += int(model.lm_head.nbytes) + int(np.asarray(model.norm).nbytes)
    total += int(model._embed.nbytes) // cfg.vocab_size
    return total


class _BandwidthSide:
    """The memory read bandwidth probe as a side: its 1 GiB buffer is allocated once, every round reads it."""

    def __init__(self, path: Path, threads: int) -> None:
        import numpy as np

        self.threads = threads
        self.buf = np.ones(1 << 28, dtype=np.float32)  # 1 GiB, written once so every page is resident

    def probe(self) -> dict:
        return _bandwidth(self.threads, self.buf)

    def info(self) -> dict:
        return {"peak_rss_mb": _peak_mb()}


def _serve(kind: str, path: Path, threads: int, proto, root: Path = ROOT) -> None:  # noqa: ANN001
    """Inside a side's process: load, warm up (one untimed prefill and decode, the same on every side), then
    run the parent's commands one at a time (one JSON line in, one out) until stdin closes. Between commands
    the process blocks on its stdin: nothing of it runs while another side is timed (the parent checks)."""
    if kind == "bandwidth":
        side = _BandwidthSide(path, threads)
        side.probe()
    else:
        side = _TorchSide(path, threads) if kind == "torch" else _EngineSide(path, threads, root)
        side.prefill()
        side.decode()
        if kind == "engine-fp32":
            for b in BATCHES:
                side.batch(b)
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "info":
            out = side.info()
            if kind.startswith("engine-"):
                out["active_bytes"] = _active_bytes(side.model)
                out["file_bytes"] = sum(Path(f).stat().st_size for f in
                                        ([path] if path.is_file() else path.glob("*.safetensors")))
        else:
            out = {"r": getattr(side, op)(*cmd.get("args", ()))}
        proto.write(json.dumps(out) + "\n")
        proto.flush()


class _Proc:
    """One side's process, alive for the whole run, driven one command at a time."""

    def __init__(self, kind: str, path: Path, threads: int, root: Path = ROOT) -> None:
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MESHD_KERNEL_THREADS"):
            env[var] = str(threads)
        # the BLAS thread timeout the daemon gives itself (engine/__init__.py; meshd imports it before numpy),
        # for every side: numpy is imported before engine in a side's process, so it is set here
        sys.path.insert(0, str(ROOT))
        from engine import BLAS_THREAD_TIMEOUT

        env.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
        self.kind = kind
        cmd = [sys.executable, __file__, "--worker", kind, "--dir", str(path), "--threads", str(threads),
               "--root", str(root)]
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        self._read()  # ready: loaded and warmed up

    def _read(self) -> dict:
        line = self.p.stdout.readline() if self.p.stdout else ""
        if not line:
            raise RuntimeError(f"benchmark side {self.kind} failed (exit {self.p.wait()})")
        return json.loads(line)

    def call(self, op: str, *args: object) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.p.stdin.flush()
        return self._read()

    def cpu_ns(self) -> int:
        """CPU time of all of this process's threads so far (ns; /proc/PID/task/*/schedstat)."""
        total = 0
        for t in Path(f"/proc/{self.p.pid}/task").iterdir():
            try:
                total += int((t / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return total

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait()


def _timed(procs: dict[str, _Proc], name: str, idle: dict[str, list[float]], op: str, *args: object) -> dict:
    """Run one command on side ``name`` after the others have had ``SETTLE_S`` to go quiet; add to
    ``idle[name]`` [wall seconds, CPU seconds every other side used meanwhile]."""
    time.sleep(SETTLE_S)
    others = [p for k, p in procs.items() if k != name]
    before = [p.cpu_ns() for p in others]
    t0 = time.perf_counter()
    out = procs[name].call(op, *args)
    wall = time.perf_counter() - t0
    used = sum(p.cpu_ns() - b for p, b in zip(others, before)) / 1e9
    acc = idle.setdefault(name, [0.0, 0.0])
    acc[0] += wall
    acc[1] += used
    return out


def _variants(path: Path, wanted: list[str]) -> dict[str, Path]:
    """The checkpoint in each stored form: fp32 dir, bf16 dir, GGUF files (created once)."""
    out: dict[str, Path] = {}
    for v in wanted:
        if v == "fp32":
            out[v] = path
        elif v == "bf16":
            d = path / "bf16"
            if not (d / "config.json").exists():
                import torch
                import transformers

                m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                m.to(torch.bfloat16).save_pretrained(d)
            out[v] = d
        else:
            f = path / f"model-{v}.gguf"
            if not f.exists():
                sys.path.insert(0, str(ROOT))
                from engine.gguf_export import export_gguf

                export_gguf(path, f, v)
            out[v] = f
    return out


def _med(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="BLAS/OpenMP/torch threads and engine kernel threads (MESHD_KERNEL_THREADS) of every side (default 2)")
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint dir (created if empty; default a temp dir)")
    ap.add_argument("--no-ref", action="store_true", help="skip the transformers side (default: run it)")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help=f"rounds (every side once per round, in turn); median and range reported (default {ROUNDS})")
    ap.add_argument("--variants", default="fp32,bf16,Q8_0,Q4_K_M",
                    help="engine weight forms to run (default fp32,bf16,Q8_0,Q4_K_M)")
    ap.add_argument("--blocks", type=int, default=BLOCKS,
                    help=f"blocks each side's {DECODE_LEN} decode steps are split into, the sides taking"
                         f" turns block by block, the bandwidth probe amid them (default {BLOCKS})")
    ap.add_argument("--base", type=Path, default=None,
                    help="another meshd checkout whose engine runs the fp32 checkpoint as side fp32@base in the same"
                         " rounds, for a paired A/B against this tree (default: none)")
    ap.add_argument("--base-variants", default="fp32",
                    help="with --base: the weight forms the base tree runs too, each as side V@base (default fp32)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--arch", choices=sorted(ARCHES), default="qwen3_moe",
                    help="model family of the checkpoint written when --dir has none (default: qwen3_moe)")
    args = ap.parse_args()
    if args.worker:
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        _serve(args.worker, args.dir, args.threads, out, args.root.resolve())
        return
    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="meshd-bench-")
        path = Path(tmp.name)
    if not (path / "config.json").exists():
        create(path, args.arch)
    variants = _variants(path, [v for v in args.variants.split(",") if v])
    # compile the kernels into numba's on-disk cache once, here, so no timed side pays (or peaks on) LLVM
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                    " from engine import dense, kernels; kernels.warm(); dense.warm_step()", str(ROOT)], check=False)
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    kinds = {"bandwidth": "bandwidth"}
    if not args.no_ref:
        kinds["torch"] = "torch"
    kinds.update({v: f"engine-{v}" for v in variants})
    roots = {name: ROOT for name in kinds}
    if args.base is not None:
        if not (args.base / "engine" / "model.py").exists():
            sys.exit(f"--base {args.base}: not a meshd checkout (no engine/model.py)")
        for v in [v for v in args.base_variants.split(",") if v in variants]:
            kinds[f"{v}@base"], roots[f"{v}@base"] = f"engine-{v}", args.base.resolve()
    procs: dict[str, _Proc] = {}
    try:
        for name, kind in kinds.items():  # one at a time, so every load and warm-up runs alone too
            procs[name] = _Proc(kind, variants.get(name.split("@")[0], path), args.threads, roots[name])
        t_loaded = time.perf_counter()
        res: dict[str, dict] = {name: {"prefill": [], "decode": [], "probe": []} for name in procs}
        idle: dict[str, list[float]] = {}
        loads = [load0]
        names = list(procs)
        blocks = max(1, min(args.blocks, DECODE_LEN))
        steps = [DECODE_LEN // blocks + (b < DECODE_LEN % blocks) for b in range(blocks)]
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]  # each round starts one side later
            for name in order:
                if name == "bandwidth":
                    continue
                res[name]["prefill"].append(_timed(procs, name, idle, "prefill")["r"])
                if name == "fp32" and r % BATCH_EVERY == 0:
                    for b in BATCHES:
                        t = _timed(procs, name, idle, "batch", b)["r"]
                        res[name].setdefault(f"batch{b}", []).append(t)
            # decode: every side's 64 steps in blocks, the sides taking turns block by block (and the probe
            # one pass per block), so the sides a ratio compares ran interleaved over the same few seconds
            for name in order:
                if name != "bandwidth":
                    procs[name].call("decode_begin")
            dec = {name: 0.0 for name in order}
            for b, n in enumerate(steps):
                for name in order[b % len(order):] + order[: b % len(order)]:
                    if name != "bandwidth":
                        dec[name] += _timed(procs, name, idle, "decode_block", n)["r"]
                    elif b == len(steps) // 2:  # the probe once, amid the decodes it is compared with
                        res[name]["probe"].append(_timed(procs, name, idle, "probe")["r"])
            for name in order:
                if name != "bandwidth":
                    res[name]["decode"].append(dec[name])
            loads.append(os.getloadavg()[0])
        for name, proc in procs.items():
            res[name]["info"] = proc.call("info")
    finally:
        for proc in procs.values():
            proc.close()
    bws = [x["read_gb_s"] for x in res["bandwidth"]["probe"]]
    bw = _med(bws)

    def rate(r: dict, key: str, n: int) -> tuple[float, float, float]:
        xs = [n / t for t in r[key]]
        return _med(xs), min(xs), max(xs)

    def paired(num: dict, den: dict, key: str) -> str:
        """Median [min-max] over rounds of den's time over num's time in the same round (num's speed-up)."""
        xs = [d / n for n, d in zip(num[key], den[key])]
        return f"{_med(xs):.2f}x [{min(xs):.2f}-{max(xs):.2f}]"

    idle_wall = sum(w for w, _ in idle.values())
    idle_cpu = sum(c for _, c in idle.values())
    worst = max(idle.items(), key=lambda kv: kv[1][1] / max(kv[1][0], 1e-9))
    info0 = next(iter(res[v]["info"] for v in variants)) if variants else {}
    bwp = res["bandwidth"]["probe"]
    lines = [
        f"every side in its own process, all loaded once, then {args.rounds} rounds; in a round each side runs"
        f" a prefill (the fp32 side also its batches, every {BATCH_EVERY}rd round), one side at a time, each"
        f" round starting one side later, then every side's {DECODE_LEN}-step decode in {blocks} blocks, the"
        f" sides taking turns block by block (the probe at the middle block); median [min-max] over rounds;"
        f" a ratio is taken within each"
        f" round, then its median [min-max]; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}"
        f" (max {max(loads):.1f}); loads {t_loaded - t_start:.0f} s, rounds {time.perf_counter() - t_loaded:.0f} s",
        f"idle sides: while one side was timed ({idle_wall:.1f} s in all) the others used"
        f" {idle_cpu * 1e3:.0f} ms of CPU ({idle_cpu / max(idle_wall, 1e-9):.2%}; most while {worst[0]} was"
        f" timed: {worst[1][1] / max(worst[1][0], 1e-9):.2%}); each command starts {SETTLE_S * 1e3:.0f} ms"
        f" after the previous",
        f"threads={args.threads} BLAS kernel={info0.get('blas', '?')} numpy={info0.get('numpy', '?')}"
        + (f" torch={res['torch']['info']['torch']} transformers={res['torch']['info']['transformers']}"
           if "torch" in res else "") + f"; memory read bandwidth {bw:.1f} GB/s [{min(bws):.1f}-{max(bws):.1f}]"
        f" (max u32 {_med([x['max_u32'] for x in bwp]):.1f}, sdot {_med([x['sdot'] for x in bwp]):.1f})",
        f"compiled kernels: {'numba, ' + str(info0.get('kernel_threads')) + ' threads' if info0.get('kernel_threads') else 'not installed (numpy tiles)'};"
        f" numba runtime {info0.get('kernels_mb', 0):.0f} MiB per process (fixed, not counted in peak RSS / file)",
        "",
        "| weights | prefill tok/s | vs transformers | decode tok/s | vs transformers | vs our fp32 |"
        " bandwidth limit tok/s | of limit | peak RSS / file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ref = res.get("torch")
    fp32 = res.get("fp32")
    if ref is not None:
        pm, pl, ph = rate(ref, "prefill", PROMPT_LEN)
        dm, dl, dh = rate(ref, "decode", DECODE_LEN)
        lines.append(f"| transformers fp32 | {pm:.0f} [{pl:.0f}-{ph:.0f}] | 1.00x | {dm:.1f} [{dl:.1f}-{dh:.1f}] |"
                     f" 1.00x | | | | {ref['info']['peak_rss_mb']:.0f} MB |")
    based = [v for v in variants if f"{v}@base" in res]
    for v in [*variants, *(f"{v}@base" for v in based)]:
        r = res[v]
        pm, pl, ph = rate(r, "prefill", PROMPT_LEN)
        dm, dl, dh = rate(r, "decode", DECODE_LEN)
        vs_ref_p = paired(r, ref, "prefill") if ref else "-"
        vs_ref_d = paired(r, ref, "decode") if ref else "-"
        vs_fp32 = paired(r, fp32, "decode") if fp32 and v != "fp32" else "1.00x" if fp32 else "-"
        act = r["info"]["active_bytes"]
        of = [DECODE_LEN / t / (g * 1e9 / act) for t, g in zip(r["decode"], bws)]
        rss = r["info"]["peak_rss_mb"] - r["info"]["rss_before_load_mb"]
        fmb = r["info"]["file_bytes"] / 2**20
        lines.append(f"| {v} ({fmb:.0f} MiB) | {pm:.0f} [{pl:.0f}-{ph:.0f}] | {vs_ref_p} | {dm:.1f} [{dl:.1f}-{dh:.1f}]"
                     f" | {vs_ref_d} | {vs_fp32} | {bw * 1e9 / act:.0f} ({act / 2**20:.0f} MiB/token)"
                     f" | {_med(of):.2f} [{min(of):.2f}-{max(of):.2f}] | {rss:.0f} MiB ({rss / fmb:.2f}x;"
                     f" mapped {r['info']['rss_file_mb']:.0f}, anon {r['info']['rss_anon_mb']:.0f}) |")
    for v in based:
        mine, base = res[v], res[f"{v}@base"]
        rss = [r["info"]["peak_rss_mb"] - r["info"]["rss_before_load_mb"] for r in (mine, base)]
        lines.append(f"| {v} (this tree) against {v}@base ({args.base}) | | {paired(mine, base, 'prefill')} | |"
                     f" {paired(mine, base, 'decode')} | | | | {rss[0] - rss[1]:+.1f} MiB |")
    if fp32 is not None:
        for b in BATCHES:
            m, lo, hi = rate(fp32, f"batch{b}", b * BATCH_STEPS)
            lines.append(f"| fp32, {b} concurrent (forward_batch, ctx {BATCH_CTX}) | | | {m:.1f} [{lo:.1f}-{hi:.1f}]"
                         f" | | | | | |")
    lines.append("")
    lines.append("peak RSS / file: VmHWM of the engine process minus its RSS before loading (runtime and kernels"
                 " already imported), over the files' size; it includes the KV cache and activations of a"
                 " 256-token prefill (logits of its last position only; one sequence's cache alive at a time: a"
                 " round's prefill frees the last round's decode cache first); mapped / anon: file-backed pages (the"
                 " weights' mapping) and anonymous memory (KV cache pages written, activations, allocator) grown by the"
                 " first prefill")
    sys.stdout.write("\n".join(lines) + "\n")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
