"""Generation: prefill the prompt, then decode one token at a time with the model's KV cache.

``generate(model, tokenizer, prompt_ids, params, cancel)`` validates eagerly (raises ``ValueError`` for bad
params or a prompt that does not fit the context) and returns an iterator of ``TokenEvent``: one per
generated token, the last one carrying ``finish_reason``:

- ``"stop"``: an eos id was generated (unless ``ignore_eos``), a stop string appeared, or the output
  completed ``params.grammar`` (then only an end may follow; an eos id always ends a constrained output). The eos token's
  event has text ""; a stop string and anything after it are trimmed and never emitted, even partly
  (text that could still become a stop string is held back until it cannot).
- ``"length"``: ``max_tokens`` were generated or the context is full.
- ``"cancelled"``: ``cancel`` was set; checked between steps, so at most one more forward runs. This
  event has ``token_id=None``.
- ``"error"``: only from the scheduler, with ``error`` set (``generate`` raises instead, e.g.
  ``FloatingPointError`` for non-finite logits).

The concatenated ``text`` of all events is the generated text. ``DecodeState`` is the per-sequence state
machine shared by ``generate`` and ``engine.scheduler`` so that both produce identical events.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.sampling import Sampler, SamplingParams, logsumexp, top_n
from engine.tokenizer import Tokenizer

__all__ = ["DecodeState", "GenerationStats", "SamplingParams", "TokenEvent", "check_request",
           "context_length", "forward_last", "generate"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token (or the terminal ``cancelled``/``error`` event when ``token_id`` is None)."""

    token_id: int | None
    text: str
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    # The exception behind an ``error`` event, for callers that answer by its kind (the API answers
    # 503 when routed-expert workers became unavailable mid-generation).
    exception: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class GenerationStats:
    """Filled in while generating: counts and wall-clock seconds."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None
    tokens: list[int] = field(default_factory=list)


def context_length(model: Any) -> int | None:
    """The model's maximum positions (config ``max_position_embeddings``), or None if it does not say."""
    cfg = getattr(model, "config", None)
    for obj, name in ((cfg, "max_position_embeddings"), (model, "max_position_embeddings"),
                      (model, "context_length")):
        value = getattr(obj, name, None) if obj is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_request(model: Any, prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """Raise ``ValueError`` (user-readable) if this request cannot run."""
    params.validate()
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty (it encodes to no tokens)")
    n_ctx = context_length(model)  # checked first: a megabyte prompt is refused without a pass over its ids
    if n_ctx is not None and len(prompt_ids) >= n_ctx:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {n_ctx}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for t in prompt_ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"prompt token ids must be integers, got {t!r}")
        if t < 0 or (isinstance(vocab, int) and t >= vocab):
            raise ValueError(f"prompt token id {int(t)} is outside the vocabulary [0, {vocab})")


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class DecodeState:
    """Per-sequence decoding: turns each step's logits into one ``TokenEvent``."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                 n_ctx: int | None) -> None:
        self.params = params
        self.sampler = Sampler(params, prompt_ids)
        self.tokenizer = tokenizer
        self.matcher: Any = None  # engine.constraint.Matcher, built at the first step (needs the vocab size)
        self._closing = False  # with a grammar: steering to the document's end (engine.constraint)
        self._count_at = 0  # with a grammar: count the closing distance again once this few tokens are left
        self._counted: tuple[int | None, int] = (None, 0)  # (string_id, distance) of the last count
        self.detok = tokenizer.detokenizer(prompt_ids)
        self.eos_ids = tokenizer.eos_ids
        self.n_prompt = len(prompt_ids)
        self.n_ctx = n_ctx
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._held = ""  # decoded text not yet emitted (could be the start of a stop string)

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def step(self, logits: np.ndarray) -> TokenEvent:
        """Pick the next token from ``logits`` [V] and return its event (with finish_reason if it ends)."""
        lse = logsumexp(logits)
        if not math.isfinite(lse):
            raise FloatingPointError("the model produced non-finite logits (NaN or +inf)")
        allowed = None
        if self.params.grammar is not None:
            if self.matcher is None:
                from engine.constraint import Matcher

                self.matcher = Matcher(self.params.grammar, self.tokenizer, int(logits.shape[0]))
                self._count_at = self._left()
            allowed = self.matcher.allowed()
            if not self._closing and self._left() <= self._count_at:
                self._plan_closing()
            if self._closing:
                allowed = self.matcher.closing(allowed)
        tok = self.sampler.pick(logits, allowed)
        self.sampler.accept(tok)
        self.tokens.append(tok)
        logprob = float(logits[tok]) - lse
        top = tuple(top_n(logits, self.params.top_logprobs, offset=lse))
        grammar_done = False
        if self.matcher is not None:
            if not self.matcher.accept(tok):
                raise RuntimeError(f"constrained decoding failed: {self.matcher.error}")
            grammar_done = self.matcher.stopped
        if tok in self.eos_ids and (not self.params.ignore_eos or self.matcher is not None):
            text, stopped = self._scan(self.detok.flush(), final=True)
            return self._finish(tok, text, logprob, top, "stop")
        text, stopped = self._scan(self.detok.add(tok), final=False)
        if stopped:
            return self._finish(tok, text, logprob, top, "stop")
        if grammar_done:
            more, _ = self._scan(self.detok.flush(), final=True)
            return self._finish(tok, text + more, logprob, top, "stop")
        full = len(self.tokens) >= self.params.max_tokens or (
            self.n_ctx is not None and self.n_prompt + len(self.tokens) >= self.n_ctx)
        if full:
            more, stopped = self._scan(self.detok.flush(), final=True)
            return self._finish(tok, text + more, logprob, top, "stop" if stopped else "length")
        return TokenEvent(tok, text, logprob, top)

    def _plan_closing(self) -> None:
        """Start closing if the tokens left barely cover the closing distance; else schedule the next count
        a quarter of the slack later (so a distance growing up to 3 tokens per token is still caught).
        Inside the JSON string of the last count the distance stays (within the margin), so it is reused."""
        from engine.constraint import CLOSE_COUNT_MAX_TOKENS, CLOSE_MARGIN_TOKENS

        left = self._left()
        sid = self.matcher.string_id
        if sid is not None and self._counted[0] == sid:
            dist = self._counted[1]
        else:
            dist = self.matcher.closing_distance(min(left, CLOSE_COUNT_MAX_TOKENS))
            self._counted = (sid, dist)
        slack = left - CLOSE_MARGIN_TOKENS - dist
        if slack <= 0:
            self._closing = True
        else:
            self._count_at = left - max(1, slack // 4)

    def _budget(self) -> int:
        """Tokens this sequence may generate in all (``max_tokens``, or less if the context is smaller)."""
        room = self.n_ctx - self.n_prompt if self.n_ctx is not None else self.params.max_tokens
        return max(1, min(self.params.max_tokens, room))

    def _left(self) -> int:
        return self._budget() - len(self.tokens)

    def cancelled(self) -> TokenEvent:
        """The terminal event for a cancelled sequence (held text is dropped: nobody is listening)."""
        self.finish_reason = "cancelled"
        return TokenEvent(None, "", None, (), "cancelled")

    def _scan(self, piece: str, final: bool) -> tuple[str, bool]:
        # Returns (text safe to emit now, whether a stop string ended the sequence).
        self._held += piece
        stops = self.params.stop
        if stops:
            hits = [i for i in (self._held.find(s) for s in stops) if i >= 0]
            if hits:
                out = self._held[:min(hits)]
                self._held = ""
                return out, True
        keep = 0 if final or not stops else _held_suffix(self._held, stops)
        out = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return out, False

    def _finish(self, tok: int, text: str, logprob: float, top: tuple[tuple[int, float], ...],
                reason: str) -> TokenEvent:
        self.finish_reason = reason
        return TokenEvent(tok, text, logprob, top, reason)


@functools.lru_cache(maxsize=32)
def _accepts_last_only(model_type: type) -> bool:
    try:
        return "last_only" in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


def free_cache(cache: Any) -> None:
    """A sequence is over: let its cache free what it holds elsewhere now (a pipeline's ``PipeCache``: its state
    on every stage) rather than when it is collected. Local KV caches have nothing to free."""
    free = getattr(cache, "free", None)
    if free is not None:
        free()


def forward_last(model: Any, ids: Sequence[int] | np.ndarray, cache: Any, executor: Any = None) -> np.ndarray:
    """Run ``ids`` after the cache and return the last position's logits [V] (fp32).

    Uses ``forward(..., last_only=True)`` when the model has it, so a prefill skips the output head for
    positions nobody reads."""
    kwargs: dict[str, Any] = {}
    if executor is not None:
        kwargs["executor"] = executor
    if _accepts_last_only(type(model)):
        kwargs["last_only"] = True
    return np.asarray(model.forward(np.asarray(ids, dtype=np.int64), cache, **kwargs))[-1]


def generate(model: Any, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
             cancel: threading.Event | None = None, *, executor: Any = None,
             stats: GenerationStats | None = None) -> Iterator[TokenEvent]:
    """Stream ``TokenEvent`` for one prompt. Raises ``ValueError`` now (not on iteration) for bad input."""
    check_request(model, prompt_ids, params)
    return _run(model, tokenizer, list(prompt_ids), params, cancel, executor,
                stats if stats is not None else GenerationStats())


def _run(model: Any, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
         cancel: threading.Event | None, executor: Any, stats: GenerationStats) -> Iterator[TokenEvent]:
    state = DecodeState(tokenizer, prompt_ids, params, context_length(model))
    stats.prompt_tokens = len(prompt_ids)
    stats.tokens = state.tokens
    if cancel is not None and cancel.is_set():
        stats.finish_reason = "cancelled"
        yield state.cancelled()
        return
    t0 = time.perf_counter()
    cache = model.new_cache()
    try:
        logits = forward_last(model, prompt_ids, cache, executor)
        stats.prefill_s = time.perf_counter() - t0
        t_decode = 0.0
        while True:
            t1 = time.perf_counter()
            ev = state.step(logits)
            t_decode += time.perf_counter() - t1
            stats.completion_tokens = len(state.tokens)
            if ev.finish_reason is not None:
                stats.finish_reason = ev.finish_reason
                stats.decode_s = t_decode
                free_cache(cache)  # over: its state elsewhere goes now, not when this generator is collected
                yield ev
                return
            yield ev
            if cancel is not None and cancel.is_set():
                stats.finish_reason = "cancelled"
                stats.decode_s = t_decode
                free_cache(cache)
                yield state.cancelled()
                return
            t1 = time.perf_counter()
            logits = forward_last(model, [ev.token_id], cache, executor)
            t_decode += time.perf_counter() - t1
    finally:  # an error, or the caller stopped early
        free_cache(cache)
