"""Cost of constrained decoding (a JSON schema through llguidance) against free decoding, end to end.

    flock /tmp/meshd-bench.lock python bench/constrained.py [--rounds 9] [--tiny-rounds 30] [--tokens 256] [--dir DIR] [--no-mid]
        [--threads N] [--breakdown]

Two checkpoints: the built-in ``tiny`` and bench/engine.py's mid-size Qwen3-MoE (hidden 768, 8 layers,
16 experts top-4, vocab 8192; created with transformers into --dir, default a temp dir), which ships no
tokenizer: the bench writes it one, an 8192-id byte-level BPE trained on Python's standard library
(bench/grammar_libs.py).

End to end (the headline): a real ``meshd serve --model PATH`` daemon on loopback, the whole
``/v1/completions`` request timed by the client (HTTP, prompt, grammar compile, prefill, every decode
step, detokenize, JSON answer). Per round and seed, the constrained request (``response_format``
json_schema, the schema below, ``max_tokens`` --tokens, temperature 1) ends its document after k tokens;
the free request (no ``response_format``, ``ignore_eos``, ``max_tokens`` k) decodes exactly k tokens
with the same seed. k per seed comes from an untimed pass first (which also warms both sides up); the
timed rounds alternate which side goes first. Reported per side: tokens/s of the whole request (k /
wall time) and the serving process's CPU ms per token (from /proc), medians over rounds with the range;
then the median of the per-round time ratios (json / free: each round's two requests ran back to back,
so load from other processes hits both alike) and the ratio of each side's best (least disturbed) time.

``--breakdown`` adds the in-process split: the model's forward passes and the sampling step
(``DecodeState.step``: mask, penalties, draw, detokenize) per token, timed separately.
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


def _completion(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    import urllib.request

    req = urllib.request.Request(url + "/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def _cpu_s(pid: int) -> float:
    """CPU seconds every thread of a process has run so far (/proc/PID/task/*/schedstat, nanoseconds:
    /proc/PID/stat counts 10 ms ticks, too coarse for one request). A thread that ended in between is
    lost; the daemon's threads (event loop, scheduler) live as long as it does."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def end_to_end(name: str, spec: str, state: Path, rounds: int, n: int, threads: int | None) -> dict[str, Any]:
    """Both sides through one real daemon serving ``spec``; prints one table row per side and the ratios."""
    sys.path.insert(0, str(ROOT / "tests"))
    from api_helpers import wait_models
    from conftest import meshd_env
    from daemon_testlib import start_node

    env = meshd_env()
    if threads is not None:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
    node = start_node(state, "--model", f"bench={spec}", env=env)
    try:
        url = f"http://{node.run['api']}/v1"
        model = "bench"
        if wait_models(url, {model}, timeout=300) != {model}:
            raise RuntimeError(f"the daemon did not serve {spec}: {node.stderr()[-2000:]}")
        pid = node.proc.pid
        prompt = "Describe one user of the system as a JSON object with name, age and address:"
        rf = {"type": "json_schema", "json_schema": {"name": "user", "strict": True, "schema": SCHEMA}}
        base = {"model": model, "prompt": prompt, "temperature": 1.0}

        def json_side(seed: int) -> tuple[float, float, int]:
            c0 = _cpu_s(pid)
            out, wall = _completion(url, {**base, "seed": seed, "max_tokens": n, "response_format": rf})
            cpu = _cpu_s(pid) - c0
            k = out["usage"]["completion_tokens"]
            if out["choices"][0]["finish_reason"] == "stop":  # a whole document: it must be valid
                doc = json.loads(out["choices"][0]["text"])
                assert set(SCHEMA["required"]) <= set(doc), doc
                whole.add(seed)
            return wall, cpu, k

        def free_side(seed: int, k: int) -> tuple[float, float, int]:
            c0 = _cpu_s(pid)
            out, wall = _completion(url, {**base, "seed": seed, "max_tokens": k, "ignore_eos": True})
            cpu = _cpu_s(pid) - c0
            assert out["usage"]["completion_tokens"] == k, out["usage"]
            return wall, cpu, k

        counts: dict[int, int] = {}
        whole: set[int] = set()
        for i in range(rounds):  # untimed: k per seed, and both sides warmed up
            counts[i] = json_side(i)[2]
            free_side(i, counts[i])
        sides: dict[str, list[tuple[float, float, int]]] = {"free": [], "json": []}
        for i in range(rounds):
            if i % 2 == 0:
                j = json_side(i)
                f = free_side(i, j[2])
            else:
                f = free_side(i, counts[i])
                j = json_side(i)
            assert j[2] == counts[i], (i, j[2], counts[i])  # seeded: the same document every time
            sides["json"].append(j)
            sides["free"].append(f)
        res: dict[str, Any] = {}
        for side, runs in sides.items():
            tps = [k / wall for wall, _, k in runs]
            cpu = [c / k * 1e3 for _, c, k in runs]
            res[side] = {"tok_s": statistics.median(tps), "cpu_ms": statistics.median(cpu)}
            print(f"| {name} | {side} | {statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f}) | "
                  f"{statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) | "
                  f"{statistics.median([k for _, _, k in runs]):.0f} |", flush=True)
        print(f"| {name} | json | whole valid documents: {len(whole)} of {rounds}; cut by max_tokens: "
              f"{rounds - len(whole)} | | |")
        slow = [j[0] / f[0] for j, f in zip(sides["json"], sides["free"])]
        cpu_r = [j[1] / f[1] if f[1] > 0 else float("nan") for j, f in zip(sides["json"], sides["free"])]
        best = min(w for w, _, _ in sides["json"]) / min(w for w, _, _ in sides["free"])
        res.update(wall_ratio=statistics.median(slow), cpu_ratio=statistics.median(cpu_r), best_ratio=best)
        print(f"| {name} | json / free time | {statistics.median(slow):.3f} ({min(slow):.3f}-{max(slow):.3f}) "
              f"per round; best of each side {best:.3f} | {statistics.median(cpu_r):.3f} "
              f"({min(cpu_r):.3f}-{max(cpu_r):.3f}) per round | |", flush=True)
        return res
    finally:
        node.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds per side on the mid-size checkpoint "
                    "(default 9)")
    ap.add_argument("--tiny-rounds", type=int, default=30, help="timed rounds per side on tiny (default 30)")
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of the constrained request (default 256)")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--no-mid", action="store_true",
                    help="only tiny (default: tiny and the mid-size model, which needs torch+transformers)")
    ap.add_argument("--threads", type=int, default=None, help="BLAS/OpenMP threads of the daemon (default: "
                    "its own default, one per core); 1 keeps its CPU time free of threads spinning on a busy machine")
    ap.add_argument("--breakdown", action="store_true", help="also time forward passes and the sampling step "
                    "apart, in this process (default off)")
    args = ap.parse_args()
    d = args.dir or Path(tempfile.mkdtemp(prefix="meshd-constrained-"))
    from engine.tiny import ensure_tiny

    tiny = ensure_tiny(d / "state")
    models = [("tiny", tiny, args.tiny_rounds)]
    if not args.no_mid:
        models.append(("mid (bench/engine.py)", mid_checkpoint(d), args.rounds))
    print("End to end: a meshd daemon, whole /v1/completions requests, the same k tokens per round on both sides")
    print()
    print("| model | side | tokens/s of the whole request (range) | daemon CPU ms/token (range) | tokens |")
    print("|---|---|---|---|---|")
    for i, (name, path, rounds) in enumerate(models):
        end_to_end(name, str(path), d / f"node{i}", rounds, args.tokens, args.threads)
    if args.breakdown:
        print()
        print("| model | side | forward ms/token | step ms/token (range) | total ms/token (range) | tokens |")
        print("|---|---|---|---|---|---|")
        for name, path, rounds in models:
            bench(name, path, rounds, min(args.tokens, 64))


if __name__ == "__main__":
    main()
