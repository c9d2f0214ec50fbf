"""Constrained-decoding libraries compared on CPU with numpy logits: llguidance, xgrammar, outlines-core.

    python bench/grammar_libs.py [--tokens 300] [--rounds 5]

Two tokenizers: ``tiny``'s (the built-in model's byte-level BPE, ~1k ids) and an 8192-id byte-level BPE
trained here on Python's own standard library source (bench/engine.py's mid-size checkpoint has vocab
8192 but ships no tokenizer). For each library and tokenizer: the time to compile a JSON schema (a
Pydantic-style object with nested object, array, enum, integer, number, boolean), then a seeded random
walk through the grammar (at every step: compute the allowed-token mask, apply it to a [V] float32 numpy
logits vector, pick a random allowed token, advance the matcher). Per-token cost is the median over the
steps of all rounds, with the 10th-90th percentile range. Libraries that cannot be imported are skipped.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "active", "role", "tags", "address"],
    "additionalProperties": False,
}


def tiny_tokenizer_json() -> tuple[str, int]:
    from engine.tiny import build_tokenizer

    tok = build_tokenizer()
    return tok.to_str(), int(tok.token_to_id("<|im_end|>"))


def mid_tokenizer_json(vocab: int = 8192) -> tuple[str, int]:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    return tok.to_str(), int(tok.token_to_id("<|im_end|>"))


class Walker:
    """One library bound to one tokenizer: ``start()`` a matcher, then ``mask()`` -> bool [V], ``advance(t)``."""

    name = ""

    def start(self) -> None: ...
    def mask(self, logits: np.ndarray) -> np.ndarray: ...
    def advance(self, tok: int) -> None: ...
    def done(self) -> bool: ...


def _unpack(bits: np.ndarray, v: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:v].astype(bool)


class LLG(Walker):
    name = "llguidance"

    def __init__(self, tok_json: str, eos: int, v: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tok_json, n_vocab=v, eos_token=eos)
        self.v = v
        t0 = time.perf_counter()
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        self.m = llguidance.LLMatcher(self.tok, self.grammar)
        self.compile_s = time.perf_counter() - t0
        self.bits = np.zeros((v + 31) // 32, dtype=np.int32)

    def start(self) -> None:
        self.m = self.llg.LLMatcher(self.tok, self.grammar)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return _unpack(self.bits, self.v)

    def advance(self, tok: int) -> None:
        assert self.m.consume_token(tok), self.m.get_error()

    def done(self) -> bool:
        return self.m.is_stopped() or self.m.is_accepting()


class XGR(Walker):
    name = "xgrammar"

    def __init__(self, tok_json: str, eos: int, v: int) -> None:
        import xgrammar
        from tokenizers import Tokenizer as HF
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=HF.from_str(tok_json))
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=v, stop_token_ids=[eos])
        t0 = time.perf_counter()
        self.compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
        self.m = xgrammar.GrammarMatcher(self.compiled)
        self.compile_s = time.perf_counter() - t0
        self.bits = xgrammar.allocate_token_bitmask(1, v)
        self.v = v

    def start(self) -> None:
        self.m = self.xgr.GrammarMatcher(self.compiled)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.m.fill_next_token_bitmask(self.bits)
        return _unpack(self.bits.numpy()[0], self.v)

    def advance(self, tok: int) -> None:
        assert self.m.accept_token(tok)

    def done(self) -> bool:
        return self.m.is_terminated() or self.m.is_completed()


class OC(Walker):
    name = "outlines-core"

    def __init__(self, tok_json: str, eos: int, v: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        from engine.tokenizer import Tokenizer
        from tokenizers import Tokenizer as HF

        t = Tokenizer(HF.from_str(tok_json), {}, None, [eos])
        vocab: dict[bytes, list[int]] = {}
        n = HF.from_str(tok_json).get_vocab_size(with_added_tokens=True)
        for i in range(n):
            if i == eos or t.is_special(i):
                continue
            b = t.token_bytes(i)
            if b:
                vocab.setdefault(b, []).append(i)
        self.oc = outlines_core
        t0 = time.perf_counter()
        voc = outlines_core.Vocabulary(eos, vocab)
        self.index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), voc)
        self.g = outlines_core.Guide(self.index)
        self.compile_s = time.perf_counter() - t0
        self.v = v
        self.eos = eos

    def start(self) -> None:
        self.g = self.oc.Guide(self.index)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        m = np.zeros(self.v, dtype=bool)
        m[np.asarray(self.g.get_tokens(), dtype=np.int64)] = True
        return m

    def advance(self, tok: int) -> None:
        self.g.advance(tok)

    def done(self) -> bool:
        return self.g.is_finished()


def walk(w: Walker, v: int, n_tokens: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    logits = nrng.standard_normal(v).astype(np.float32)
    out: list[float] = []
    w.start()
    steps = 0
    while len(out) < n_tokens:
        t0 = time.perf_counter()
        m = w.mask(logits)
        x = np.where(m, logits, np.float32(-np.inf))
        allowed = np.flatnonzero(np.isfinite(x))
        # prefer closing the document after a while so walks do not grow one string forever
        tok = int(allowed[rng.randrange(len(allowed))])
        w.advance(tok)
        out.append(time.perf_counter() - t0)
        steps += 1
        if w.done() or steps > 400:
            w.start()
            steps = 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300, help="tokens per round (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per library (default 5)")
    args = ap.parse_args()
    libs: list[tuple[str, Callable[..., Walker]]] = [("llguidance", LLG), ("xgrammar", XGR), ("outlines-core", OC)]
    print("| tokenizer | vocab | library | compile ms | per-token us median (p10-p90) |")
    print("|---|---|---|---|---|")
    for tname, (tok_json, eos) in (("tiny", tiny_tokenizer_json()), ("mid (bpe-8192)", mid_tokenizer_json())):
        from tokenizers import Tokenizer as HF

        v = HF.from_str(tok_json).get_vocab_size(with_added_tokens=True)
        for lname, cls in libs:
            try:
                w = cls(tok_json, eos, v)
            except Exception as e:  # noqa: BLE001 - a bench reports and goes on
                print(f"| {tname} | {v} | {lname} | failed: {type(e).__name__}: {str(e)[:80]} | |")
                continue
            walk(w, v, 50, 999)  # warm-up
            times: list[float] = []
            for r in range(args.rounds):
                times += walk(w, v, args.tokens, r)
            q = statistics.quantiles(times, n=10)
            print(f"| {tname} | {v} | {lname} | {w.compile_s * 1e3:.1f} | {statistics.median(times) * 1e6:.0f} "
                  f"({q[0] * 1e6:.0f}-{q[-1] * 1e6:.0f}) |", flush=True)


if __name__ == "__main__":
    main()
