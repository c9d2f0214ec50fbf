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

Closing: a model that never ends its document (random weights do not) would run into ``max_tokens`` and
return JSON cut in half. ``closing(allowed)`` narrows the mask to one token that ends the document
soonest, by a fixed preference: inside a JSON string ``"``; elsewhere an end-of-sequence id, then the
one-character tokens ``< } ] , 0 t f n " : - 1..9 { [`` (``<`` is never allowed by JSON outside a string;
it ends a raw GLM argument value); when none of them is allowed (e.g. inside a key the grammar already
fixes), the allowed id with the most bytes. The steer is deterministic, so ``closing_distance()`` can
count on a copy of the grammar state exactly how many tokens it needs from here; the sampler
(``engine.generate.DecodeState``) starts it once the tokens left come within that distance (plus
``CLOSE_MARGIN_TOKENS``), re-counting at shrinking intervals as the budget runs down. No random draw is
spent on it, so seeded sampling stays reproducible.

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

# Start closing this many tokens before the counted distance strictly requires: one sampled token can add
# up to 3 (a UTF-8 lead byte inside a string needs its continuation bytes before the closing quote).
CLOSE_MARGIN_TOKENS = 4
CLOSE_COUNT_MAX_TOKENS = 512  # closing_distance() stops counting here (a check costs ~25 us per token)
# "," before "0": after a digit both are allowed, and more zeros would never end the number.
_CLOSERS = [b"<", b"}", b"]", b",", b"0", b"t", b"f", b"n", b'"', b":", b"-", *[bytes([c]) for c in b"123456789"],
            b"{", b"["]

_cache_lock = threading.Lock()
_ll_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; the message names what is unsupported."""


def _error_line(message: str) -> str:
    """llguidance's error as one line. A grammar over one of its internal limits (e.g. 65,525 symbols:
    thousands of ``anyOf`` branches) passes ``check_grammar`` and then panics building the matcher; the
    panic's message comes with a native backtrace, dropped here."""
    text = " ".join(message.split("<backtrace>")[0].split())
    if text.startswith("panic:"):
        return f"the grammar is too large to enforce ({text.removeprefix('panic:').strip()})"
    return text


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


def _quote_step(b: bytes, in_string: bool, escaped: bool) -> tuple[bool, bool, int]:
    """(in_string, escaped, quotes toggled) after the bytes ``b`` of a token holding a quote or backslash."""
    toggles = 0
    for c in b:
        if escaped:
            escaped = False
        elif c == 0x5C and in_string:
            escaped = True
        elif c == 0x22:
            in_string = not in_string
            toggles += 1
    return in_string, escaped, toggles


class _Closers:
    """Per tokenizer: the ids to prefer when closing, the bytes of every id holding a quote or backslash
    (to follow whether the output is inside a JSON string), and every id's length in bytes."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        single: dict[bytes, int] = {}
        self.quoting: dict[int, bytes] = {}
        self.eos = frozenset(i for i in tokenizer.eos_ids if i < n_vocab)
        self.lengths = np.zeros(n_vocab, dtype=np.int32)  # [V] bytes per id (0: special, or past the vocab)
        n = min(n_vocab, int(tokenizer.vocab_size))
        for i in range(n):
            if tokenizer.is_special(i):
                continue
            b = tokenizer.token_bytes(i)
            self.lengths[i] = len(b)
            if len(b) == 1 and b not in single:
                single[b] = i
            if b'"' in b or b"\\" in b:
                self.quoting[i] = b
        self.outside = sorted(i for i in tokenizer.eos_ids if i < n_vocab) + \
            [single[c] for c in _CLOSERS if c in single]
        self.inside = [single[b'"']] if b'"' in single else []


def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    import llguidance

    with _cache_lock:
        per = _ll_tokenizers.setdefault(tokenizer, {})
        tok = per.get(n_vocab)
        if tok is None:
            eos = sorted(tokenizer.eos_ids) or None
            tok = (llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=n_vocab, eos_token=eos),
                   _Closers(tokenizer, n_vocab))
            per[n_vocab] = tok
        return tok


class Matcher:
    """One sequence's grammar state (see module docstring). Raises ``GrammarError`` for a bad grammar."""

    def __init__(self, grammar: str, tokenizer: Any, n_vocab: int) -> None:
        import llguidance

        self.n_vocab = n_vocab
        self._tok, self._closers = _ll_tokenizer(tokenizer, n_vocab)
        self._m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(_error_line(self._m.get_error()))
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._in_string = False
        self._escaped = False
        self._quotes = 0  # quotes toggled so far: names the string the output is in

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

    @property
    def string_id(self) -> int | None:
        """Which JSON string the output is inside (None: outside any). Within one string the closing
        distance grows by at most 3 (an unfinished UTF-8 character) whatever is written into it."""
        return self._quotes if self._in_string else None

    def _pick_closer(self, allowed: np.ndarray, in_string: bool) -> int | None:
        for i in (self._closers.inside if in_string else self._closers.outside):
            if allowed[i]:
                return i
        i = int(np.argmax(np.where(allowed, self._closers.lengths, -1)))
        return i if allowed[i] else None

    def closing(self, allowed: np.ndarray) -> np.ndarray:
        """``allowed`` narrowed to the one closing token (see module docstring); as it is if none is allowed."""
        i = self._pick_closer(allowed, self._in_string)
        if i is None:
            return allowed
        only = np.zeros_like(allowed)
        only[i] = True
        return only

    def closing_distance(self, limit: int) -> int:
        """How many tokens, this one included, the closing steer takes from here to end the document (an
        end-of-sequence id counts as one), or ``limit + 1`` if more. Counted on a copy of the grammar state."""
        m = self._m.deep_copy()
        bits = np.zeros_like(self._bits)
        in_string, escaped = self._in_string, self._escaped
        for n in range(1, limit + 1):
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.n_vocab].view(bool)
            tok = self._pick_closer(allowed, in_string)
            if tok is None or not m.consume_token(tok):
                return limit + 1
            if tok in self._closers.eos or m.is_stopped():
                return n
            b = self._closers.quoting.get(tok)
            if b is not None:
                in_string, escaped, _ = _quote_step(b, in_string, escaped)
            elif escaped:
                escaped = False
        return limit + 1

    def accept(self, tok: int) -> bool:
        """Advance by one sampled id; False (and ``error`` set) if the grammar did not allow it."""
        b = self._closers.quoting.get(int(tok))
        if b is not None:
            self._in_string, self._escaped, toggles = _quote_step(b, self._in_string, self._escaped)
            self._quotes += toggles
        elif self._escaped:
            self._escaped = False
        return bool(self._m.consume_token(int(tok)))

    def accept_all(self, toks: Sequence[int]) -> bool:
        return all(self.accept(t) for t in toks)
