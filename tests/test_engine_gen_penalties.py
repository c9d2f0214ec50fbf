"""Sampling extensions against vLLM's definitions: logit_bias, repetition/frequency/presence penalties,
min_p, top_k with the other knobs, a grammar mask; seeded sampling stays reproducible with all of them.

The reference below is written from vLLM's ``apply_penalties`` (model_executor/layers/utils.py): the
repetition penalty applies to every id seen in the prompt or the output (positive logits divided by it,
the others multiplied), then ``logits -= frequency_penalty * output_counts`` and
``logits -= presence_penalty * (output_counts > 0)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import Sampler, SamplingParams

V = 64


def _reference(logits: np.ndarray, prompt: list[int], out: list[int], rep: float, freq: float,
               pres: float, bias: dict[int, float]) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for t, b in bias.items():
        x[t] += b
    counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=len(x)).astype(np.float64)
    seen = np.zeros(len(x), dtype=bool)
    seen[prompt] = True
    seen[out] = True
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x -= freq * counts
    x -= pres * (counts > 0)
    return x


ids = st.lists(st.integers(0, V - 1), max_size=20)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), prompt=ids, out=ids, rep=st.floats(0.2, 5.0), freq=st.floats(-2, 2),
       pres=st.floats(-2, 2), bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=5))
def test_adjusted_logits_follow_vllm(seed: int, prompt: list[int], out: list[int], rep: float, freq: float,
                                     pres: float, bias: dict[int, float]) -> None:
    logits = np.random.default_rng(seed).standard_normal(V).astype(np.float32) * 3
    p = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                       logit_bias=tuple(sorted(bias.items())))
    s = Sampler(p, prompt)
    for t in out:
        s.accept(t)
    got = s.adjusted(logits)
    want = _reference(logits, prompt, out, rep, freq, pres, bias)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def test_penalties_off_leave_logits_alone() -> None:
    logits = np.random.default_rng(0).standard_normal(V).astype(np.float32)
    s = Sampler(SamplingParams(), [1, 2, 3])
    s.accept(5)
    assert np.array_equal(s.adjusted(logits), logits)


def test_frequency_penalty_grows_with_count_presence_does_not() -> None:
    logits = np.zeros(V, dtype=np.float32)
    f = Sampler(SamplingParams(frequency_penalty=0.5))
    p = Sampler(SamplingParams(presence_penalty=0.5))
    for _ in range(3):
        f.accept(7)
        p.accept(7)
    assert f.adjusted(logits)[7] == pytest.approx(-1.5)
    assert p.adjusted(logits)[7] == pytest.approx(-0.5)
    assert f.adjusted(logits)[8] == 0 and p.adjusted(logits)[8] == 0


def test_repetition_penalty_covers_prompt_and_output_and_keeps_sign_semantics() -> None:
    logits = np.array([2.0, -2.0, 2.0, -2.0, 2.0], dtype=np.float32)
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1])
    s.accept(3)
    assert list(s.adjusted(logits)) == [1.0, -4.0, 2.0, -4.0, 2.0]  # prompt ids 0,1 and output id 3


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), freq=st.floats(0.5, 2.0))
def test_greedy_with_a_large_frequency_penalty_prefers_unseen_tokens(seed: int, freq: float) -> None:
    # Logits spread < freq: once a token is used it falls below every unused one.
    logits = np.random.default_rng(seed).uniform(0, freq * 0.99, V).astype(np.float32)
    s = Sampler(SamplingParams(frequency_penalty=freq))
    picked = []
    for _ in range(V):
        t = s.pick(logits)
        s.accept(t)
        picked.append(t)
    assert len(set(picked)) == V


def test_logit_bias_forces_and_bans() -> None:
    logits = np.random.default_rng(1).standard_normal(V).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=3, logit_bias=((9, 100.0),)))
    assert {s.pick(logits) for _ in range(200)} == {9}
    best = int(np.argmax(logits))
    s = Sampler(SamplingParams(logit_bias=((best, -100.0),)))
    assert s.pick(logits) != best


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), min_p=st.floats(0.01, 1.0), temp=st.floats(0.3, 2.0))
def test_min_p_keeps_only_ids_near_the_top(seed: int, min_p: float, temp: float) -> None:
    logits = np.random.default_rng(seed).standard_normal(V).astype(np.float32) * 2
    s = Sampler(SamplingParams(temperature=temp, min_p=min_p, seed=seed))
    probs = np.exp((logits - logits.max()) / temp)  # relative to the top id
    for _ in range(30):
        t = s.pick(logits)
        assert probs[t] >= min_p * (1 - 1e-5)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 10))
def test_top_k_with_penalties_draws_from_the_k_best_adjusted(seed: int, k: int) -> None:
    logits = np.random.default_rng(seed).standard_normal(V).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=k, presence_penalty=1.0, seed=seed), [1, 2])
    for _ in range(20):
        adj = s.adjusted(logits)
        t = s.pick(logits)
        assert adj[t] >= np.sort(adj)[-k]
        s.accept(t)


def test_seeded_sampling_with_every_knob_is_reproducible() -> None:
    logits_seq = np.random.default_rng(5).standard_normal((50, V)).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2, logit_bias=((3, 2.0),), seed=11)

    def run(params: SamplingParams) -> list[int]:
        s = Sampler(params, [1, 2, 3])
        out = []
        for row in logits_seq:
            t = s.pick(row)
            s.accept(t)
            out.append(t)
        return out

    assert run(p) == run(p)
    from dataclasses import replace

    assert run(replace(p, seed=12)) != run(p)
    assert run(replace(p, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0)) != run(p)


def test_allowed_mask_is_respected_greedy_and_sampled() -> None:
    logits = np.random.default_rng(2).standard_normal(V).astype(np.float32)
    allowed = np.zeros(V, dtype=bool)
    allowed[[4, 40]] = True
    assert Sampler(SamplingParams()).pick(logits, allowed) == (4 if logits[4] >= logits[40] else 40)
    s = Sampler(SamplingParams(temperature=2.0, seed=1))
    assert {s.pick(logits, allowed) for _ in range(100)} == {4, 40}
    with pytest.raises(ValueError):
        Sampler(SamplingParams()).pick(logits, np.zeros(V, dtype=bool))


@pytest.mark.parametrize(("field", "value"), [("min_p", 1.5), ("repetition_penalty", 0.0),
                                              ("frequency_penalty", float("nan")), ("logit_bias", ((-1, 1.0),))])
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]
