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

from engine.limits import MAX_TOP_LOGPROBS


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
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                             f"got {self.top_logprobs!r}")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[V] -> [V] float64 log-probabilities (reference; the decode loop uses ``logsumexp``)."""
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of a [V] fp32 vector: fp32 exp (vectorised), fp64 sum. ~0.2 ms at V=152k."""
    x = logits.astype(np.float32, copy=False)
    m = float(x.max())
    return m + float(np.log(np.exp(x - np.float32(m)).sum(dtype=np.float64)))


def top_n(values: np.ndarray, n: int, offset: float = 0.0) -> list[tuple[int, float]]:
    """The n largest entries as (id, value - offset), descending, ties by lower id.

    Pass logits and ``offset=logsumexp(logits)`` to get log-probabilities. n argmax passes (n <= 20)
    cost far less than a partition or sort of the vocabulary.
    """
    if n <= 0:
        return []
    x = np.array(values, dtype=np.float64 if values.dtype == np.float64 else np.float32)
    out = []
    for _ in range(min(n, x.shape[0])):
        i = int(np.argmax(x))  # first maximum: lowest id on ties
        out.append((i, float(x[i]) - offset))
        x[i] = -np.inf
    return out


def _kth_largest(x: np.ndarray, k: int) -> float:
    if k <= 64:
        y = np.array(x)
        for _ in range(k - 1):
            y[int(np.argmax(y))] = -np.inf
        return float(y.max())
    return float(np.partition(x, -k)[-k])


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """[V] -> bool [V]: True for ids whose logit is >= the k-th largest (k <= 0 keeps all)."""
    if k <= 0 or k >= logits.shape[0]:
        return np.ones(logits.shape[0], dtype=bool)
    return logits >= _kth_largest(logits, k)


def _nucleus(probs: np.ndarray, p: float) -> np.ndarray:
    """Ids of the smallest most-likely set whose mass reaches ``p`` of the total, in descending
    probability (ties by id). Only candidates above a threshold are sorted: {probs >= t} is a prefix of
    the sorted order, so if its mass reaches the target it contains the whole nucleus."""
    total = float(probs.sum(dtype=np.float64))
    target = p * total
    v = probs.shape[0]
    top = float(probs.max())
    floor = (1.0 - p) * total / v  # mass below this threshold is < (1 - p) * total: always enough
    t = top * 1e-2
    while True:
        if t <= floor:
            t = floor
        cand = np.flatnonzero(probs >= t)
        if t == floor or float(probs[cand].sum(dtype=np.float64)) >= target:
            break
        t *= 1e-2
    order = cand[np.lexsort((cand, -probs[cand]))]
    cum = np.cumsum(probs[order], dtype=np.float64)
    n = min(int(np.searchsorted(cum, target, side="left")) + 1, order.shape[0])
    return order[:n]


def top_p_mask(probs: np.ndarray, p: float) -> np.ndarray:
    """[V] -> bool [V]: the smallest most-likely set whose mass reaches p (at least one id)."""
    if p >= 1.0:
        return probs > 0
    mask = np.zeros(probs.shape[0], dtype=bool)
    mask[_nucleus(probs, p)] = True
    return mask


_BLOCK = 1024  # two-level inverse-CDF draw: block sums, then a cumsum inside one block


def _draw(weights: np.ndarray, u: float) -> int:
    """Index drawn with probability proportional to ``weights`` (>= 0, some > 0) for a uniform u in [0, 1)."""
    v = weights.shape[0]
    pad = (-v) % _BLOCK
    w = np.concatenate([weights, np.zeros(pad, dtype=weights.dtype)]) if pad else weights
    sums = w.reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    cb = np.cumsum(sums)
    target = u * cb[-1]
    nz_blocks = np.flatnonzero(sums > 0)
    b = min(int(np.searchsorted(cb, target, side="right")), int(nz_blocks[-1]))
    within = target - (cb[b - 1] if b > 0 else 0.0)
    block = w[b * _BLOCK:(b + 1) * _BLOCK]
    cw = np.cumsum(block, dtype=np.float64)
    nz = np.flatnonzero(block > 0)
    j = min(int(np.searchsorted(cw, within, side="right")), int(nz[-1]))
    if block[j] <= 0:  # rounding put us on a zero entry at the start of a block
        j = int(nz[0])
    return b * _BLOCK + j


class Sampler:
    """Picks tokens for one sequence under ``params``; one instance per request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def pick(self, logits: np.ndarray) -> int:
        """[V] logits -> token id. Greedy costs one argmax; sampling is O(V) (no full sort)."""
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        x = logits.astype(np.float32) / np.float32(p.temperature)
        if 0 < p.top_k < x.shape[0]:
            x = np.where(x >= np.float32(_kth_largest(x, p.top_k)), x, np.float32(-np.inf))
        w = np.exp(x - x.max())  # [V] fp32 weights, max 1
        u = self._rng.random()
        if p.top_p < 1.0:
            keep = _nucleus(w, p.top_p)  # descending probability
            cum = np.cumsum(w[keep], dtype=np.float64)
            i = min(int(np.searchsorted(cum, u * cum[-1], side="right")), keep.shape[0] - 1)
            return int(keep[i])
        return _draw(w, u)
