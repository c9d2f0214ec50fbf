"""A small deterministic numpy language model with the Engine API shape (new_cache/forward/forward_batch).

Used by the engine-gen tests to exercise generation and scheduling independently of engine/model.py.
Each position's logits depend on the whole history through a running state, so a wrong cache shows up
as different tokens. ``forward_batch`` computes each row with the same function as ``forward``, so both
are bit-identical; ``calls`` counts forwards for cancellation and batching tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ToyConfig:
    vocab_size: int
    max_position_embeddings: int = 4096


@dataclass
class ToyCache:
    state: np.ndarray
    length: int = 0


@dataclass
class ToyModel:
    vocab_size: int
    hidden: int = 32
    seed: int = 0
    max_positions: int = 4096
    calls: list[tuple[str, int]] = field(default_factory=list)
    fail_after: int | None = None
    gate: threading.Event | None = None  # when set to a cleared Event, forwards block until it is set

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.config = ToyConfig(self.vocab_size, self.max_positions)
        self.emb = rng.standard_normal((self.vocab_size, self.hidden)).astype(np.float32)
        self.mix = (rng.standard_normal((self.hidden, self.hidden)) / np.sqrt(self.hidden)).astype(np.float32)
        self.out = (rng.standard_normal((self.hidden, self.vocab_size)) * 0.8).astype(np.float32)

    def new_cache(self) -> ToyCache:
        return ToyCache(np.zeros(self.hidden, dtype=np.float32))

    def _step(self, tok: int, cache: ToyCache) -> np.ndarray:
        if cache.length >= self.max_positions:
            raise RuntimeError("toy cache overflow")
        cache.state = np.tanh(cache.state @ self.mix + self.emb[tok]).astype(np.float32)
        cache.length += 1
        return (cache.state @ self.out).astype(np.float32)  # [V]

    def _tick(self, kind: str, n: int) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append((kind, n))
        if self.fail_after is not None and len(self.calls) > self.fail_after:
            raise RuntimeError("toy model failure")

    def forward(self, ids: np.ndarray, cache: ToyCache, executor: object = None, *,
                last_only: bool = False) -> np.ndarray:
        self._tick("forward", len(ids))
        out = np.stack([self._step(int(t), cache) for t in ids])  # [T, V]
        return out[-1:] if last_only else out

    def forward_batch(self, ids: np.ndarray, caches: list[ToyCache]) -> np.ndarray:
        self._tick("batch", len(ids))
        return np.stack([self._step(int(t), c) for t, c in zip(ids, caches)])  # [B, V]
