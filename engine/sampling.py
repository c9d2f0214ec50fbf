"""Token selection: greedy, temperature, top-k, top-p, seeded; log-probabilities with top-n alternatives.

Order of operations (as transformers' logits warpers): temperature, then top-k, then top-p, then one draw.
``temperature == 0`` is greedy (argmax, lowest id on ties). Log-probabilities are always taken from the
raw logits (``log_softmax(logits)``), before temperature or masks change them.

Determinism: a ``Sampler`` owns a ``numpy.random.Generator(PCG64(seed))`` and draws exactly one uniform
per sampled token, so the same seed and the same logits give the same tokens. Candidates are ordered by
descending probability with ties broken by the lower id, so the result never depends on sort internals.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np

from transport.limits import MAX_TOP_LOGPROBS


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate. ``validate()`` raises ``ValueError`` with a user-readable message."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = fresh entropy per request
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives reported per token (the chosen token's logprob is always there)

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not np.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[V] -> [V] float64 log-probabilities."""
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_n(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely ids as (id, logprob), descending, ties by lower id."""
    if n <= 0:
        return []
    n = min(n, logprobs.shape[0])
    cand = np.argpartition(-logprobs, n - 1)[:n] if n < logprobs.shape[0] else np.arange(logprobs.shape[0])
    # Include every id tied with the n-th value so the tie-break by id is exact.
    kth = logprobs[cand].min()
    cand = np.flatnonzero(logprobs >= kth)
    order = np.lexsort((cand, -logprobs[cand]))[:n]
    return [(int(cand[i]), float(logprobs[cand[i]])) for i in order]


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """[V] -> bool [V]: True for ids whose logit is >= the k-th largest (k <= 0 keeps all)."""
    if k <= 0 or k >= logits.shape[0]:
        return np.ones(logits.shape[0], dtype=bool)
    kth = np.partition(logits, -k)[-k]
    return logits >= kth


def top_p_mask(probs: np.ndarray, p: float) -> np.ndarray:
    """[V] -> bool [V]: the smallest most-likely set whose mass reaches p (at least one id)."""
    if p >= 1.0:
        return probs > 0
    order = np.lexsort((np.arange(probs.shape[0]), -probs))  # descending prob, ties by id
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, p * cum[-1], side="left")) + 1
    mask = np.zeros(probs.shape[0], dtype=bool)
    mask[order[:n]] = True
    return mask


class Sampler:
    """Picks tokens for one sequence under ``params``; one instance per request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def pick(self, logits: np.ndarray) -> int:
        """[V] logits -> token id."""
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / p.temperature
        if p.top_k > 0:
            x = np.where(top_k_mask(x, p.top_k), x, -np.inf)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            probs = np.where(top_p_mask(probs, p.top_p), probs, 0.0)
        order = np.flatnonzero(probs > 0)
        order = order[np.lexsort((order, -probs[order]))]
        cum = np.cumsum(probs[order])
        u = self._rng.random() * cum[-1]
        i = int(np.searchsorted(cum, u, side="right"))
        return int(order[min(i, order.shape[0] - 1)])
