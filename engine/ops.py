"""Numerical building blocks, fp32 throughout: RMSNorm, rotary embeddings, causal GQA attention.

Pure functions over numpy arrays, shapes in comments. ``T`` new tokens, ``L`` cached + new positions,
``H`` query heads, ``KV`` key/value heads (``H % KV == 0``; ``KV == 1`` is multi-query), ``hd`` head dim.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from engine.limits import ATTENTION_QUERY_BLOCK

from . import prefill_threads
from .config import RopeConfig

F32 = np.float32


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """[.., n] -> [.., n]: ``weight * x / sqrt(mean(x**2) + eps)`` over the last axis, in fp32."""
    var = np.einsum("...i,...i->...", x, x)[..., None]  # [.., 1] sum of squares
    var *= F32(1.0 / x.shape[-1])
    var += F32(eps)
    np.sqrt(var, out=var)
    out = x / var
    out *= weight
    return out


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN inverse frequencies [dim/2], in fp32 step by step as transformers computes them."""
    base = rope.theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no singular ramp
    pos_freqs = np.power(F32(base), np.arange(0, dim, 2).astype(F32) / F32(dim), dtype=F32)
    extra = F32(1.0) / pos_freqs
    inter = F32(1.0) / (F32(rope.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    extra_factor = F32(1.0) - ramp
    return inter * (F32(1.0) - extra_factor) + extra * extra_factor


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [hd/2] (float64), with linear, llama3 or yarn scaling applied (``head_dim``: the
    rotated width)."""
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim).astype(np.float64)
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv


class RopeTable:
    """cos/sin of every position up to a capacity that grows by doubling.

    Safe to share between threads: a growth swaps one (cos, sin) tuple, so a reader never pairs a new cos
    with an old sin.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, capacity: int = 512) -> None:
        self.inv_freq = rope_inv_freq(rope, head_dim).astype(np.float32)  # fp32 like the reference
        self.attention_factor = F32(rope.attention_factor)  # yarn scales cos and sin (1.0 otherwise)
        self._table = self._make(capacity)

    def _make(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(capacity, dtype=np.float32)
        ang = np.outer(pos, self.inv_freq).astype(np.float32)  # [cap, hd/2], fp32 product like the reference
        cos, sin = np.cos(ang).astype(F32), np.sin(ang).astype(F32)
        if self.attention_factor != 1:
            cos *= self.attention_factor
            sin *= self.attention_factor
        return cos, sin

    def _at_least(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        table = self._table
        if n > table[0].shape[0]:
            table = self._make(max(n, 2 * table[0].shape[0]))
            self._table = table
        return table

    def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin for positions start..stop-1: [n, hd/2] each."""
        cos, sin = self._at_least(stop)
        return cos[start:stop], sin[start:stop]

    def gather(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin for arbitrary positions [n]: [n, hd/2] each."""
        cos, sin = self._at_least(int(positions.max()) + 1 if positions.size else 0)
        return cos[positions], sin[positions]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: x [T, heads, hd], cos/sin [T, r/2] -> [T, heads, hd] (new array). Partial rotary
    (r < hd): the first r dims are rotated (rotate-half within them), the rest pass through."""
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        out = np.empty_like(x)
        out[..., : 2 * half] = apply_rope(x[..., : 2 * half], cos, sin)
        out[..., 2 * half :] = x[..., 2 * half :]
        return out
    c = cos[:, None, :]
    s = sin[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = np.empty_like(x)
    np.multiply(x1, c, out=out[..., :half])
    out[..., :half] -= x2 * s
    np.multiply(x2, c, out=out[..., half:])
    out[..., half:] += x1 * s
    return out


def softmax_(x: np.ndarray) -> np.ndarray:
    """In-place softmax over the last axis (fp32). Returns x."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def causal_mask(past: int, t: int, window: int | None = None) -> np.ndarray:
    """Additive mask [T, past+T]: query i (position past+i) sees key j iff j <= past+i
    (and j > past+i-window)."""
    q = np.arange(past, past + t)[:, None]
    k = np.arange(past + t)[None, :]
    visible = k <= q
    if window is not None:
        visible &= k > q - window
    return np.where(visible, F32(0.0), F32(-np.inf)).astype(F32)


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, scale: float, window: int | None = None
) -> np.ndarray:
    """Causal grouped-query attention for T new queries over L = past + T keys.

    q [T, H, hd], k/v [KV, L, hd] (the cache, new keys already written) -> [T, H * hd]. Long prompts are
    processed in blocks of ``ATTENTION_QUERY_BLOCK`` queries so the score matrix stays bounded.
    """
    t, h, hd = q.shape
    if t > 1:
        return _attention_pieces(q, k, v, past, scale, window)
    kv, length, _ = k.shape
    g = h // kv
    # [T, H, hd] -> [KV, G*T, hd]: queries of one KV group side by side.
    qg = q.reshape(t, kv, g, hd).transpose(1, 2, 0, 3).reshape(kv, g * t, hd)
    scores = np.matmul(qg, k.transpose(0, 2, 1))  # [KV, G*T, L]
    scores *= F32(scale)
    if t > 1 or window is not None:
        scores = scores.reshape(kv, g, t, length)
        scores += causal_mask(past, t, window)
        scores = scores.reshape(kv, g * t, length)
    softmax_(scores)
    out = np.matmul(scores, v)  # [KV, G*T, hd]
    return out.reshape(kv, g, t, hd).transpose(2, 0, 1, 3).reshape(t, h * hd)


def _attention_pieces(q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, scale: float,
                      window: int | None) -> np.ndarray:
    """:func:`attention` of T > 1 queries as independent pieces, one per block of ``ATTENTION_QUERY_BLOCK``
    queries, on the prefill threads (``engine.prefill_threads``). A piece computes its rows of ``attention``'s
    stacked products (every KV group in one batched ``matmul``: the same BLAS product per group as a call per
    group) and softmax (per row), so the same bits as one call over every group and block.

    One piece per block, not per block and KV group: the pieces' numpy calls hand the GIL between the threads,
    and a quarter of the calls (4 KV groups) scaled a two-thread prefill's attention 1.1x -> see
    docs/engine-model.md "Session 12 (prefill4)". A block's work grows with its keys (1 : 2 : 3 : 4 for a
    256-token prefill), so the largest first leave two threads even."""
    t, h, hd = q.shape
    kv = k.shape[0]
    g = h // kv
    out = np.empty((t, h * hd), dtype=F32)
    blocks = [(a, min(t, a + ATTENTION_QUERY_BLOCK)) for a in range(0, t, ATTENTION_QUERY_BLOCK)]

    def piece(a: int, b: int) -> None:
        n = b - a
        # queries a..b-1 (positions past+a..past+b-1) see keys up to past+b-1
        qg = q[a:b].reshape(n, kv, g, hd).transpose(1, 2, 0, 3).reshape(kv, g * n, hd)  # [KV, G*n, hd]
        scores = np.matmul(qg, k[:, : past + b].transpose(0, 2, 1))  # [KV, G*n, L]
        scores *= F32(scale)
        if n > 1 or window is not None:
            scores = scores.reshape(kv, g, n, past + b)
            scores += causal_mask(past + a, n, window)
            scores = scores.reshape(kv, g * n, past + b)
        softmax_(scores)
        o = np.matmul(scores, v[:, : past + b])  # [KV, G*n, hd]
        out[a:b] = o.reshape(kv, g, n, hd).transpose(2, 0, 1, 3).reshape(n, h * hd)

    # the last blocks (the most keys) first, so the threads end on small pieces
    prefill_threads.run([functools.partial(piece, a, b) for a, b in reversed(blocks)])
    return out


def naive_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, scale: float, window: int | None = None
) -> np.ndarray:
    """Reference loop for :func:`attention` (tests only): same shapes, one query head at a time."""
    t, h, hd = q.shape
    kv = k.shape[0]
    g = h // kv
    out = np.zeros((t, h * hd), dtype=np.float64)
    for i in range(t):
        pos = past + i
        for head in range(h):
            kh = head // g
            lo = 0 if window is None else max(0, pos - window + 1)
            s = np.array([np.dot(q[i, head], k[kh, j]) * scale for j in range(lo, pos + 1)], dtype=np.float64)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, head * hd : (head + 1) * hd] = sum(p[j - lo] * v[kh, j] for j in range(lo, pos + 1))
    return out.astype(F32)
