"""Sampling: greedy, temperature, top-k/top-p masks against naive versions, seeds, distributions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from engine.sampling import (Sampler, SamplingParams, _draw, log_softmax, logsumexp, top_k_mask, top_n,
                             top_p_mask)


def _draws(params: SamplingParams, logits: np.ndarray, n: int) -> list[int]:
    s = Sampler(params)
    return [s.pick(logits) for _ in range(n)]


def test_greedy_is_argmax_lowest_id_on_ties() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert _draws(SamplingParams(), logits, 3) == [1, 1, 1]


def test_same_seed_same_tokens_other_seed_differs() -> None:
    logits = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=42)
    a, b = _draws(p, logits, 200), _draws(p, logits, 200)
    assert a == b
    assert _draws(SamplingParams(temperature=1.0, seed=43), logits, 200) != a
    # No seed: fresh entropy each time.
    fresh = SamplingParams(temperature=1.0)
    assert _draws(fresh, logits, 200) != _draws(fresh, logits, 200)


def test_distribution_matches_softmax_with_temperature() -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    for temp in (1.0, 0.5):
        n = 20000
        counts = np.bincount(_draws(SamplingParams(temperature=temp, seed=7), logits, n), minlength=4)
        p = np.exp(logits / temp)
        p /= p.sum()
        # 5 standard deviations of a binomial count.
        assert np.all(np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1), (temp, counts, n * p)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=1), logits, 2000)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.65, seed=1), logits, 2000)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.75, seed=1), logits, 2000)) == {0, 1, 2}
    counts = np.bincount(_draws(SamplingParams(temperature=1.0, top_k=2, seed=3), logits, 20000), minlength=4)
    assert abs(counts[0] / 20000 - 0.4 / 0.7) < 0.02  # renormalised over the kept set


def _naive_top_k(x: np.ndarray, k: int) -> np.ndarray:
    kth = sorted(x.tolist(), reverse=True)[k - 1]
    return np.array([v >= kth for v in x])


def _naive_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    if top_p >= 1.0:  # top_p = 1 disables the filter (as in OpenAI's and HF's samplers)
        return p > 0
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep, acc = [], 0.0
    for i in order:
        keep.append(i)
        acc += p[i]
        if acc >= top_p * p.sum():
            break
    m = np.zeros(len(p), dtype=bool)
    m[keep] = True
    return m


@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, st.integers(1, 40), elements=st.floats(-20, 20)), st.integers(1, 45),
       st.floats(0.01, 1.0))
def test_masks_match_naive(x: np.ndarray, k: int, top_p: float) -> None:
    k = min(k, len(x))
    assert np.array_equal(top_k_mask(x, k), _naive_top_k(x, k))
    p = np.exp(x - x.max())
    p /= p.sum()
    got, want = top_p_mask(p, top_p), _naive_top_p(p, top_p)
    # cumsum order may differ from the naive running sum in the last ulp; allow a boundary tie only then.
    if not np.array_equal(got, want):
        assert abs(int(got.sum()) - int(want.sum())) == 1
        smaller = min(int(got.sum()), int(want.sum()))
        # Only at a rounding tie: the smaller set reaches p up to rounding.
        assert abs(np.sort(p)[::-1][:smaller].sum() - top_p) < 1e-9


def test_logprobs_and_top_n() -> None:
    logits = np.array([1.0, 3.0, 3.0, -2.0, 0.5], dtype=np.float32)
    lp = log_softmax(logits)
    assert np.isclose(np.exp(lp).sum(), 1.0)
    big = np.random.default_rng(0).standard_normal(150_000).astype(np.float32) * 4
    assert logsumexp(big) == pytest.approx(float(np.log(np.exp(big.astype(np.float64)).sum())), abs=1e-5)
    assert [t for t, _ in top_n(logits, 3, offset=logsumexp(logits))] == [1, 2, 0]
    assert top_n(logits, 1, offset=logsumexp(logits))[0][1] == pytest.approx(float(lp[1]), abs=1e-6)
    top = top_n(lp, 3)
    assert [t for t, _ in top] == [1, 2, 0]  # tie broken by lower id
    assert top[0][1] == pytest.approx(float(lp[1]))
    assert top_n(lp, 0) == []
    assert len(top_n(lp, 10)) == 5


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"seed": -5}, {"stop": ("",)}, {"top_logprobs": 21}])
def test_validate_rejects(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).validate()


def test_blocked_draw_matches_inverse_cdf() -> None:
    # The two-level draw picks the same index as a plain cumsum inverse CDF, including zero weights and
    # a vocabulary that is not a multiple of the block.
    rng = np.random.default_rng(5)
    w = rng.random(5000).astype(np.float32)
    w[rng.random(5000) < 0.5] = 0
    w[:1500] = 0
    cum = np.cumsum(w, dtype=np.float64)
    for u in list(rng.random(300)) + [0.0, 1 - 1e-16]:
        want = min(int(np.searchsorted(cum, u * cum[-1], side="right")), int(np.flatnonzero(w)[-1]))
        got = _draw(w, u)
        assert w[got] > 0
        assert got == want or abs(cum[got] - u * cum[-1]) < 1e-9 * cum[-1]


def test_large_vocab_distribution() -> None:
    # Mass spread over many blocks: empirical frequency of a block of ids matches its probability.
    logits = np.zeros(10_000, dtype=np.float32)
    logits[7000:7100] = 3.0
    n = 4000
    draws = np.array(_draws(SamplingParams(temperature=1.0, seed=11), logits, n))
    p = 100 * np.e**3 / (100 * np.e**3 + 9900)
    frac = np.mean((draws >= 7000) & (draws < 7100))
    assert abs(frac - p) < 5 * np.sqrt(p * (1 - p) / n)
