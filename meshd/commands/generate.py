"""`meshd generate`: load a model in this process and generate from a prompt (SPEC).

Plain output streams the text to stdout; ``--json`` prints one object: ``model``, ``prompt_tokens``,
``tokens``, ``text``, ``logprobs``, ``finish_reason``, ``timings`` {``load_s``, ``prefill_s``,
``decode_s``}. The prompt is encoded as-is (tokenizer post-processor included, no chat template).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from meshd.errors import RuntimeFailure, UsageError

LARGE_CHECKPOINT_BYTES = 256 * 1024 * 1024  # show a load progress bar above this (on a terminal)


def state_dir_from(args: argparse.Namespace) -> Path:
    """--state-dir, else $MESHD_STATE_DIR, else $STATE_DIRECTORY, else ~/.local/state/meshd (SPEC)."""
    from meshd.state import resolve_state_dir

    return resolve_state_dir(getattr(args, "state_dir", None), os.environ)


def _weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


def load_model(path: Path, name: str, stream: Any = None, min_bytes: int = LARGE_CHECKPOINT_BYTES) -> Any:
    """``engine.model.Model.load(path)`` with a progress bar on ``stream`` if it is a terminal and the
    checkpoint is large. Raises ``UsageError`` for a checkpoint that cannot be loaded."""
    try:
        from engine.model import Model
    except ImportError as e:
        raise RuntimeFailure(f"the inference engine is not available in this build ({e})") from None
    stream = sys.stderr if stream is None else stream
    total = _weight_bytes(path)
    show = total >= min_bytes and hasattr(stream, "isatty") and stream.isatty()
    bar = None
    kwargs: dict[str, Any] = {}
    ticker: threading.Thread | None = None
    stop = threading.Event()
    if show:
        from meshd.progress import ProgressBar

        bar = ProgressBar(f"loading {name}", stream, total=total)
        try:
            accepts = "progress" in inspect.signature(Model.load).parameters
        except (TypeError, ValueError):
            accepts = False
        if accepts:
            kwargs["progress"] = bar
        else:  # no byte counts from the loader: show elapsed time against the size
            def tick() -> None:
                while not stop.wait(0.25):
                    bar.update(0)

            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
    try:
        return Model.load(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot load model from {path}: {e}") from None
    except Exception as e:  # the loader's own error types (e.g. CheckpointError) name the file and key
        if type(e).__module__.startswith("engine"):
            raise UsageError(f"cannot load model from {path}: {e}") from None
        raise
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        if bar is not None:
            bar.update(total)
            bar.close()


# info events that still reach stderr: the first load of a GGUF or bf16 model on a machine compiles the
# kernels (a minute here under load) and would otherwise leave the command silent as if it hung
SAID_EVENTS = frozenset({"kernels_compiling", "kernels_ready"})


def _keep_said(_logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    import structlog

    if method in ("debug", "info") and event.get("event") not in SAID_EVENTS:
        raise structlog.DropEvent
    return event


def _quiet_logs() -> None:
    # stdout carries the result (one JSON object with --json): engine logs go to stderr, warnings only,
    # and the few info events a user waits on (SAID_EVENTS).
    import logging

    import structlog

    structlog.reset_defaults()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        processors=[_keep_said, *structlog.get_config()["processors"]],
                        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))


def run(args: argparse.Namespace) -> int:
    _quiet_logs()
    from engine.generate import GenerationStats, generate
    from engine.sampling import SamplingParams
    from engine.spec import parse_model_spec, resolve_checkpoint
    from engine.tokenizer import Tokenizer, TokenizerError

    try:
        spec = parse_model_spec(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if spec.kind == "openai":
        raise UsageError("meshd generate runs a model in this process; serve openai: models with "
                         "`meshd serve --model openai:URL`")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        params.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    t0 = time.perf_counter()
    try:
        path = resolve_checkpoint(spec, state_dir_from(args))
    except ValueError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise RuntimeFailure(f"cannot create the tiny model: {e}") from None
    try:
        tokenizer = Tokenizer.load(path)
    except TokenizerError as e:
        raise UsageError(str(e)) from None
    model = load_model(path, spec.name or path.name)
    load_s = time.perf_counter() - t0
    prompt_ids = tokenizer.encode(args.prompt)
    stats = GenerationStats()
    try:
        events = generate(model, tokenizer, prompt_ids, params, stats=stats)
    except ValueError as e:
        raise UsageError(str(e)) from None
    text: list[str] = []
    tokens: list[int] = []
    logprobs: list[float] = []
    finish = None
    try:
        for ev in events:
            if ev.token_id is not None:
                tokens.append(ev.token_id)
                logprobs.append(float(ev.logprob) if ev.logprob is not None else 0.0)
            text.append(ev.text)
            finish = ev.finish_reason
            if not args.json and ev.text:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    except (ValueError, FloatingPointError, RuntimeError, MemoryError) as e:
        if not args.json:
            sys.stdout.write("\n")
        raise RuntimeFailure(f"generation failed after {len(tokens)} tokens: {e}") from None
    if args.json:
        out = {"model": spec.name, "prompt_tokens": prompt_ids, "tokens": tokens, "text": "".join(text),
               "logprobs": logprobs, "finish_reason": finish,
               "timings": {"load_s": round(load_s, 6), "prefill_s": round(stats.prefill_s, 6),
                           "decode_s": round(stats.decode_s, 6)}}
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
