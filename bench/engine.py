"""Engine benchmark: numpy engine vs transformers (torch CPU) on a mid-size Qwen3-MoE it creates.

    python bench/engine.py [--threads 2] [--rounds 5] [--dir DIR] [--no-ref] [--arch ARCH]

Checkpoint: Qwen3-MoE, hidden 768, 8 layers, 12 heads over 4 KV heads, head_dim 64, 16 experts of
width 384 with top-4, vocab 8192, fp32 (written once into --dir, default a temp dir). Each side runs in
its own long-lived subprocess with the same thread count (so peak RSS is its own); the parent steps
them alternately (prefill of a 256-token prompt, then 64 greedy decode steps) for several rounds and
keeps each side's best, so both see the same machine load. The engine also runs 1, 4 and 8 concurrent
sequences through ``forward_batch``. Prints a Markdown table and the BLAS kernel that ran.

``--arch glm4_moe`` / ``--arch deepseek_v3`` write the same-size model of that family instead (hidden 768,
8 layers, 16 experts of width 384, top-4, vocab 8192; layer 0 dense, 4 expert groups with 2 kept, one
shared expert; glm4_moe: 12 heads over 4 KV heads of 64 with q/k/v bias, qk-norm and half rotary;
deepseek_v3: 12 heads of latent attention, q LoRA 384, KV latent 256, nope 64 + rope 32, v 64, YaRN).
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
    """The numpy engine, driven step by step by the parent."""

    def __init__(self, path: Path, threads: int) -> None:
        import numpy as np

        sys.path.insert(0, str(ROOT))
        from engine.model import Model

        self.np = np
        self.rss0 = _rss_mb()
        t0 = time.perf_counter()
        self.model = Model.load(path)
        self.load_s = time.perf_counter() - t0
        self.prompt = _prompt(PROMPT_LEN, 1)
        t0 = time.perf_counter()
        self.model.forward(self.prompt, self.model.new_cache(512))  # faults the mapping in
        self.cold_prefill_s = time.perf_counter() - t0

    def prefill(self) -> float:
        cache = self.model.new_cache(512)
        t0 = time.perf_counter()
        self.model.forward(self.prompt, cache)
        return time.perf_counter() - t0

    def decode(self) -> float:
        cache = self.model.new_cache(512)
        tok = int(self.model.forward(self.prompt, cache)[-1].argmax())
        t0 = time.perf_counter()
        for _ in range(DECODE_LEN):
            tok = int(self.model.forward([tok], cache)[-1].argmax())
        return time.perf_counter() - t0

    def batch(self, b: int) -> float:
        m = self.model
        caches = [m.new_cache(BATCH_CTX + BATCH_STEPS + 1) for _ in range(b)]
        toks = [int(m.forward(_prompt(BATCH_CTX, 100 + s), c)[-1].argmax()) for s, c in enumerate(caches)]
        t0 = time.perf_counter()
        for _ in range(BATCH_STEPS):
            toks = [int(t) for t in m.forward_batch(toks, caches).argmax(axis=-1)]
        return time.perf_counter() - t0

    def info(self) -> dict:
        return {"weight_bytes": self.model.checkpoint.nbytes, "load_s": self.load_s,
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
            self.model(self.prompt, use_cache=True)

    def prefill(self) -> float:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self.model(self.prompt, use_cache=True)
            return time.perf_counter() - t0

    def decode(self) -> float:
        with self.torch.inference_mode():
            out = self.model(self.prompt, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(DECODE_LEN):
                out = self.model(tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t0

    def info(self) -> dict:
        return {"peak_rss_mb": _peak_mb(), "torch": self.torch.__version__,
                "transformers": self.transformers.__version__, "torch_threads": self.torch.get_num_threads()}


def _serve(kind: str, path: Path, threads: int) -> None:
    """Worker loop: one command per stdin line (prefill | decode | batch B | info) -> one JSON line."""
    # Replies go over the original stdout; anything else printing (logs, progress bars) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    side = _EngineSide(path, threads) if kind == "engine" else _TorchSide(path, threads)
    out.write("{}\n")
    out.flush()
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "info":
            res: object = side.info()
        elif cmd == "batch":
            res = side.batch(int(arg[0]))  # type: ignore[union-attr]
        else:
            res = getattr(side, cmd)()
        out.write(json.dumps(res) + "\n")
        out.flush()


class _Worker:
    def __init__(self, kind: str, path: Path, threads: int) -> None:
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
        cmd = [sys.executable, __file__, "--worker", kind, "--dir", str(path), "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self._read()  # ready

    def _read(self) -> object:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("benchmark worker died")
        return json.loads(line)

    def ask(self, cmd: str) -> object:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint dir (created if empty)")
    ap.add_argument("--no-ref", action="store_true", help="skip transformers")
    ap.add_argument("--rounds", type=int, default=5, help="alternating engine/transformers rounds; best kept")
    ap.add_argument("--arch", choices=sorted(ARCHES), default="qwen3_moe",
                    help="model family of the checkpoint written when --dir has none (default: qwen3_moe)")
    ap.add_argument("--worker", choices=["engine", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _serve(args.worker, args.dir, args.threads)
        return
    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="meshd-bench-")
        path = Path(tmp.name)
    if not (path / "config.json").exists():
        create(path, args.arch)
    load0 = os.getloadavg()[0]
    # Both sides stay loaded and are stepped alternately, so each sees the same machine load
    # (this machine is shared); the best of the rounds is kept for each.
    ew = _Worker("engine", path, args.threads)
    tw = None if args.no_ref else _Worker("torch", path, args.threads)
    times: dict[str, list[float]] = {}
    for _ in range(max(1, args.rounds)):
        for step in ("prefill", "decode"):
            for name, w in (("engine", ew), ("torch", tw)):
                if w is not None:
                    t = float(w.ask(step))  # type: ignore[arg-type]
                    times.setdefault(f"{name}_{step}", []).append(t)
        for b in (1, 4, 8):
            t = float(ew.ask(f"batch {b}"))  # type: ignore[arg-type]
            times.setdefault(f"engine_batch{b}", []).append(t)
    eng = dict(ew.ask("info"))  # type: ignore[arg-type]
    eng["prefill_tok_s"] = PROMPT_LEN / min(times["engine_prefill"])
    eng["decode_tok_s"] = DECODE_LEN / min(times["engine_decode"])
    eng["batch_tok_s"] = {b: b * BATCH_STEPS / min(times[f"engine_batch{b}"]) for b in (1, 4, 8)}
    ref = None
    if tw is not None:
        ref = dict(tw.ask("info"))  # type: ignore[arg-type]
        ref["prefill_tok_s"] = PROMPT_LEN / min(times["torch_prefill"])
        ref["decode_tok_s"] = DECODE_LEN / min(times["torch_decode"])
        tw.close()
    ew.close()
    rounds = max(1, args.rounds)
    w_mb = eng["weight_bytes"] / 2**20
    lines = [
        f"rounds={rounds} alternating (best of each kept)"
        f" load average {load0:.1f} -> {os.getloadavg()[0]:.1f}",
        f"threads={args.threads} BLAS kernel={eng['blas']}"
        f" OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')} numpy={eng['numpy']}"
        + (f" torch={ref['torch']} transformers={ref['transformers']}" if ref else ""),
        "",
        "| metric | numpy engine | transformers | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for key, label in (("prefill_tok_s", f"prefill tok/s ({PROMPT_LEN}-token prompt)"),
                       ("decode_tok_s", f"decode tok/s ({DECODE_LEN} tokens)")):
        r = f"{ref[key]:.1f}" if ref else "-"
        ratio = f"{eng[key] / ref[key]:.2f}x" if ref else "-"
        lines.append(f"| {label} | {eng[key]:.1f} | {r} | {ratio} |")
    for b, v in eng["batch_tok_s"].items():
        lines.append(f"| decode tok/s, {b} concurrent (forward_batch, ctx {BATCH_CTX}) | {v:.1f} | | |")
    lines.append(f"| peak RSS MB (weights {w_mb:.0f} MB) | {eng['peak_rss_mb']:.0f} "
                 f"({eng['peak_rss_mb'] / w_mb:.2f}x) | {ref['peak_rss_mb']:.0f} |  |" if ref else
                 f"| peak RSS MB (weights {w_mb:.0f} MB) | {eng['peak_rss_mb']:.0f} "
                 f"({eng['peak_rss_mb'] / w_mb:.2f}x) | - | |")
    lines.append(f"| load s / cold first prefill s | {eng['load_s']:.3f} / {eng['cold_prefill_s']:.2f} | | |")
    sys.stdout.write("\n".join(lines) + "\n")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
