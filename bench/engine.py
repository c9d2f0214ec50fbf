"""Engine benchmark: numpy engine vs transformers (torch CPU) on a mid-size Qwen3-MoE it creates.

    python bench/engine.py [--threads 2] [--dir DIR] [--no-ref]

Checkpoint: Qwen3-MoE, hidden 768, 8 layers, 12 heads over 4 KV heads, head_dim 64, 16 experts of
width 384 with top-4, vocab 8192, fp32 (written once into --dir, default a temp dir). Each side runs in
its own subprocess with the same thread count (so peak RSS is its own), one after the other:
prefill tok/s on a 256-token prompt (best of 3, after one warm-up), decode tok/s over 64 greedy tokens,
and for the engine, decode tok/s of 4 and 8 concurrent sequences through ``forward_batch`` and peak
RSS against the weight bytes. Prints a Markdown table and the BLAS kernel that ran.
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


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompt(n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(CONFIG["vocab_size"]) for _ in range(n)]


def create(path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**CONFIG)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
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
            for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
                fn = getattr(dll, sym, None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    return fn().decode()
        except OSError:
            continue
    return "unknown"


def worker_engine(path: Path) -> dict:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from engine.model import Model

    rss0 = _rss_mb()
    t0 = time.perf_counter()
    model = Model.load(path)
    load_s = time.perf_counter() - t0
    prompt = _prompt(PROMPT_LEN, 1)
    t0 = time.perf_counter()
    model.forward(prompt, model.new_cache(512))  # warm-up: faults the mapping in
    cold_prefill_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(3):
        cache = model.new_cache(512)
        t0 = time.perf_counter()
        logits = model.forward(prompt, cache)
        best = min(best, time.perf_counter() - t0)
    tok = int(logits[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(DECODE_LEN):
        tok = int(model.forward([tok], cache)[-1].argmax())
    decode_s = time.perf_counter() - t0
    batch = {}
    for b in (1, 4, 8):
        caches = [model.new_cache(BATCH_CTX + BATCH_STEPS + 1) for _ in range(b)]
        toks = []
        for s, c in enumerate(caches):
            toks.append(int(model.forward(_prompt(BATCH_CTX, 100 + s), c)[-1].argmax()))
        t0 = time.perf_counter()
        for _ in range(BATCH_STEPS):
            toks = [int(t) for t in model.forward_batch(toks, caches).argmax(axis=-1)]
        batch[b] = b * BATCH_STEPS / (time.perf_counter() - t0)
    return {
        "weight_bytes": model.checkpoint.nbytes,
        "load_s": load_s,
        "cold_prefill_s": cold_prefill_s,
        "prefill_tok_s": PROMPT_LEN / best,
        "decode_tok_s": DECODE_LEN / decode_s,
        "batch_tok_s": batch,
        "rss_before_load_mb": rss0,
        "peak_rss_mb": _peak_mb(),
        "blas": blas_kernel(),
        "numpy": np.__version__,
    }


def worker_torch(path: Path, threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.tensor([_prompt(PROMPT_LEN, 1)])
    with torch.inference_mode():
        model(prompt, use_cache=True)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            out = model(prompt, use_cache=True)
            best = min(best, time.perf_counter() - t0)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(DECODE_LEN):
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - t0
    return {
        "prefill_tok_s": PROMPT_LEN / best,
        "decode_tok_s": DECODE_LEN / decode_s,
        "peak_rss_mb": _peak_mb(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _run_worker(kind: str, path: Path, threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    cmd = [sys.executable, __file__, "--worker", kind, "--dir", str(path), "--threads", str(threads)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best(runs: list[dict]) -> dict:
    """Best throughput and lowest peak RSS over rounds (other machine load only ever slows a round)."""
    out = dict(runs[0])
    for r in runs[1:]:
        for k in ("prefill_tok_s", "decode_tok_s"):
            out[k] = max(out[k], r[k])
        out["peak_rss_mb"] = min(out["peak_rss_mb"], r["peak_rss_mb"])
        if "batch_tok_s" in r:
            out["batch_tok_s"] = {b: max(v, r["batch_tok_s"][b]) for b, v in out["batch_tok_s"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="checkpoint dir (created if empty)")
    ap.add_argument("--no-ref", action="store_true", help="skip transformers")
    ap.add_argument("--rounds", type=int, default=2, help="alternating engine/transformers rounds; best kept")
    ap.add_argument("--worker", choices=["engine", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = worker_engine(args.dir) if args.worker == "engine" else worker_torch(args.dir, args.threads)
        sys.stdout.write(json.dumps(res) + "\n")
        return
    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="meshd-bench-")
        path = Path(tmp.name)
    if not (path / "config.json").exists():
        create(path)
    load0 = os.getloadavg()[0]
    engs, refs = [], []
    for _ in range(max(1, args.rounds)):  # alternate, so both sides see the same machine load
        engs.append(_run_worker("engine", path, args.threads))
        if not args.no_ref:
            refs.append(_run_worker("torch", path, args.threads))
    eng = _best(engs)
    ref = _best(refs) if refs else None
    w_mb = eng["weight_bytes"] / 2**20
    lines = [
        f"rounds={len(engs)} (best of each kept) load average {load0:.1f} -> {os.getloadavg()[0]:.1f}",
        f"threads={args.threads} BLAS kernel={eng['blas']} OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}"
        f" numpy={eng['numpy']}" + (f" torch={ref['torch']} transformers={ref['transformers']}" if ref else ""),
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
