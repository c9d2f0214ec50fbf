"""Constrained decoding: a grammar decides which token ids may come next (llguidance underneath).

A grammar is llguidance's grammar text (``json_schema_grammar(schema)``, ``lark_grammar(text)``); it is
carried in ``SamplingParams.grammar`` so that whichever node samples (local, tunnelled, expert-delegated
or the last stage of a pipeline) builds the matcher next to its sampler. ``check_grammar(g)`` returns an
error message (the unsupported feature is named by llguidance, e.g. ``Unimplemented keys: ["if"]``) or
None, without a tokenizer, so an API node can refuse a request before routing it.

``Matcher(grammar, tokenizer, n_vocab)``: ``allowed()`` -> bool [n_vocab] (eos ids are allowed exactly
when the grammar may end), ``accept(tok)``, ``stopped`` (nothing but the end may follow), ``error``.
Ids past the tokenizer's vocabulary (padded model vocab) are never allowed. llguidance's tokenizer view
is built once per (tokenizer, n_vocab) (~10 ms at 8k ids) and shared by every request.

Chosen by measurement (bench/grammar_libs.py): llguidance and xgrammar cost 8/8 us per token on tiny's
716 ids and 16/14 us at 8,192 ids; outlines-core 18 and 263 us. xgrammar needs torch and triton; llguidance
has no dependencies and takes Lark grammars with embedded JSON schemas, which tool calls need.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

# JSON without free whitespace: a model with bad (or random) weights cannot pad the document forever.
_JSON_OPTIONS = {"whitespace_flexible": False}

_cache_lock = threading.Lock()
_ll_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; the message names what is unsupported."""


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """Grammar text for a JSON document valid under ``schema`` (None: any JSON object)."""
    import llguidance

    if schema is None:
        schema = {"type": "object"}
    return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS))


def lark_grammar(text: str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_lark(text))


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body matching compact JSON valid under ``schema`` (llguidance's ``%json`` extension)."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, separators=(",", ":"))


def lark_string(s: str) -> str:
    """``s`` as a Lark string literal."""
    return json.dumps(s)


def check_grammar(grammar: str) -> str | None:
    """None if ``grammar`` compiles, else llguidance's one-line reason."""
    import llguidance

    is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_err:
        return " ".join((msgs[0] if msgs else "invalid grammar").split())
    return None


def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    import llguidance

    with _cache_lock:
        per = _ll_tokenizers.setdefault(tokenizer, {})
        tok = per.get(n_vocab)
        if tok is None:
            eos = sorted(tokenizer.eos_ids) or None
            tok = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=n_vocab, eos_token=eos)
            per[n_vocab] = tok
        return tok


class Matcher:
    """One sequence's grammar state (see module docstring). Raises ``GrammarError`` for a bad grammar."""

    def __init__(self, grammar: str, tokenizer: Any, n_vocab: int) -> None:
        import llguidance

        self.n_vocab = n_vocab
        self._tok = _ll_tokenizer(tokenizer, n_vocab)
        self._m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(" ".join(self._m.get_error().split()))
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @property
    def stopped(self) -> bool:
        """True once the grammar is complete and nothing but the end may follow."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the ids that may come next."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].view(bool)

    def accept(self, tok: int) -> bool:
        """Advance by one sampled id; False (and ``error`` set) if the grammar did not allow it."""
        return bool(self._m.consume_token(int(tok)))

    def accept_all(self, toks: Sequence[int]) -> bool:
        return all(self.accept(t) for t in toks)
