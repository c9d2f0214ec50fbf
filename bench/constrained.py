"""Per-token cost of constrained decoding (a JSON schema through llguidance) against free decoding.

    python bench/constrained.py [--rounds 5] [--tokens 64] [--dir DIR] [--no-mid]

Two checkpoints: the built-in ``tiny`` and bench/engine.py's mid-size Qwen3-MoE (hidden 768, 8 layers,
16 experts top-4, vocab 8192; created with transformers into --dir, default a temp dir), which ships no
tokenizer: it gets an 8192-id byte-level BPE trained on Python's standard library (bench/grammar_libs.py).
Each round decodes after the same 32-token prompt twice, free and under the schema (a Pydantic-style
object: strings, integer, number, boolean, enum, array, nested object), in alternating order, same
seed, temperature 1: the constrained side decodes until its document ends or ``--tokens`` (its
closing steer is kept out of reach), the free side exactly as many tokens. Timed per side: the model's
forward passes and the sampling step (``DecodeState.step``: mask, penalties, draw, detokenize), per
token. Reported: medians over rounds with the range, and the median of the per-round ratios (each
round's two sides ran back to back, so machine load hits both alike). Both sides are warmed up first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the repo: bench/engine.py must not shadow engine/

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
        "active": {"type": "boolean"}, "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "active", "role", "tags", "address"],
    "additionalProperties": False,
}


def mid_checkpoint(d: Path) -> Path:
    import importlib.util

    path = d / "mid"
    if not any(path.glob("model*.safetensors")):
        # bench/engine.py would shadow the engine package as a plain import: load it under another name
        spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "bench" / "engine.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.create(path)
    if not (path / "tokenizer.json").exists():
        from grammar_libs import mid_tokenizer_json

        tok_json, eos = mid_tokenizer_json()
        (path / "tokenizer.json").write_text(tok_json)
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return path


def one(model: Any, tok: Any, prompt: list[int], n: int, grammar: str | None, seed: int) -> tuple[float, float, int]:
    from engine.generate import DecodeState, context_length, forward_last
    from engine.sampling import SamplingParams

    # A constrained run gets a budget far beyond n so its closing steer stays off; it stops at n tokens.
    params = SamplingParams(max_tokens=n if grammar is None else 100 * n, temperature=1.0, seed=seed,
                            grammar=grammar, ignore_eos=True)
    state = DecodeState(tok, prompt, params, context_length(model))
    cache = model.new_cache()
    logits = forward_last(model, prompt, cache)
    fwd = step = 0.0
    count = 0
    while True:
        t0 = time.perf_counter()
        ev = state.step(logits)
        step += time.perf_counter() - t0
        count += 1
        if ev.finish_reason is not None or count >= n:
            break
        t0 = time.perf_counter()
        logits = forward_last(model, [ev.token_id], cache)
        fwd += time.perf_counter() - t0
    return fwd / max(1, count - 1), step / count, count


def bench(name: str, path: Path, rounds: int, n: int) -> None:
    import random

    from engine.constraint import json_schema_grammar
    from engine.model import Model
    from engine.tokenizer import Tokenizer

    model, tok = Model.load(path), Tokenizer.load(path)
    r = random.Random(1)
    prompt = [r.randrange(min(tok.vocab_size, 500)) for _ in range(32)]
    g = json_schema_grammar(SCHEMA)
    for grammar in (None, g):  # warm-up (also builds llguidance's tokenizer view once)
        one(model, tok, prompt, 8, grammar, 0)
    sides: dict[str, list[tuple[float, float, int]]] = {"free": [], "json": []}
    ratios = []
    for i in range(rounds):
        if i % 2 == 0:
            j = one(model, tok, prompt, n, g, i)
            f = one(model, tok, prompt, j[2], None, i)
        else:  # the free side first: it needs the count, so run the constrained one twice (first untimed)
            count = one(model, tok, prompt, n, g, i)[2]
            f = one(model, tok, prompt, count, None, i)
            j = one(model, tok, prompt, n, g, i)
        sides["json"].append(j)
        sides["free"].append(f)
        ratios.append((j[0] + j[1]) / (f[0] + f[1]))
    med = {}
    for side, runs in sides.items():
        fwd = [x[0] * 1e3 for x in runs]
        st = [x[1] * 1e3 for x in runs]
        tot = [a + b for a, b in zip(fwd, st)]
        med[side] = statistics.median(tot)
        print(f"| {name} | {side} | {statistics.median(fwd):.2f} | {statistics.median(st):.3f} "
              f"({min(st):.3f}-{max(st):.3f}) | {statistics.median(tot):.2f} ({min(tot):.2f}-{max(tot):.2f}) "
              f"| {statistics.median([x[2] for x in runs]):.0f} |", flush=True)
    step_extra = statistics.median([(j[1] - f[1]) / (f[0] + f[1]) for j, f in zip(sides["json"], sides["free"])])
    print(f"| {name} | json / free | | step: +{step_extra * 100:.1f}% of a free token | "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) per round | |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="rounds per side (default 5)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per round (default 64)")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--no-mid", action="store_true", help="only tiny (the mid-size one needs torch+transformers)")
    args = ap.parse_args()
    d = args.dir or Path(tempfile.mkdtemp(prefix="meshd-constrained-"))
    from engine.tiny import ensure_tiny

    print("| model | side | forward ms/token | step ms/token (range) | total ms/token (range) | tokens |")
    print("|---|---|---|---|---|---|")
    bench("tiny", ensure_tiny(d / "state"), args.rounds, args.tokens)
    if not args.no_mid:
        bench("mid (bench/engine.py)", mid_checkpoint(d), args.rounds, args.tokens)


if __name__ == "__main__":
    main()
