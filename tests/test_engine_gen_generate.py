"""Generation loop: eos, max tokens, stop strings across token boundaries, cancellation, logprobs."""

from __future__ import annotations

import threading
from typing import Any
from pathlib import Path

import numpy as np
import pytest
from engine_gen_toy import ToyModel

from engine.generate import GenerationStats, SamplingParams, TokenEvent, generate
from engine.sampling import log_softmax
from engine.tiny import create_tiny
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.load(create_tiny(tmp_path_factory.mktemp("tiny")))


def _model(tok: Tokenizer, **kw: object) -> ToyModel:
    return ToyModel(vocab_size=768, **kw)  # type: ignore[arg-type]


PROMPT = "The mesh wakes"


def _run(tok: Tokenizer, model: ToyModel, params: SamplingParams, **kw: Any) -> list[TokenEvent]:
    return list(generate(model, tok, tok.encode(PROMPT), params, **kw))


def _text(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def test_max_tokens_and_text(tok: Tokenizer) -> None:
    evs = _run(tok, _model(tok), SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(evs) == 12
    assert [e.finish_reason for e in evs] == [None] * 11 + ["length"]
    ids = [e.token_id for e in evs]
    assert _text(evs) == tok.decode(ids)


def test_greedy_logprobs_are_the_models(tok: Tokenizer) -> None:
    model, ref = _model(tok), _model(tok)
    prompt = tok.encode(PROMPT)
    evs = list(generate(model, tok, prompt, SamplingParams(max_tokens=5, ignore_eos=True, top_logprobs=3)))
    cache = ref.new_cache()
    logits = ref.forward(np.array(prompt), cache)[-1]
    for ev in evs:
        lp = log_softmax(logits)
        assert ev.token_id == int(np.argmax(logits))
        assert ev.logprob == pytest.approx(float(lp[ev.token_id]), abs=1e-5)
        assert ev.top_logprobs[0][0] == ev.token_id and len(ev.top_logprobs) == 3
        logits = ref.forward(np.array([ev.token_id]), cache)[-1]


def test_logprobs_ignore_temperature(tok: Tokenizer) -> None:
    # logprob of each token under the model, before temperature/top-p change the distribution.
    model, ref = _model(tok), _model(tok)
    evs = _run(tok, model, SamplingParams(max_tokens=4, temperature=0.3, top_p=0.5, seed=1, ignore_eos=True))
    cache = ref.new_cache()
    logits = ref.forward(np.array(tok.encode(PROMPT)), cache)[-1]
    for ev in evs:
        assert ev.logprob == pytest.approx(float(log_softmax(logits)[ev.token_id]), abs=1e-5)
        logits = ref.forward(np.array([ev.token_id]), cache)[-1]


def test_seed_determinism(tok: Tokenizer) -> None:
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=123, ignore_eos=True)
    a = [e.token_id for e in _run(tok, _model(tok), p)]
    b = [e.token_id for e in _run(tok, _model(tok), p)]
    assert a == b


def test_eos_stops_unless_ignored(tok: Tokenizer) -> None:
    # Find where the greedy continuation would go, then declare that token an eos.
    free = [e.token_id for e in _run(tok, _model(tok), SamplingParams(max_tokens=10, ignore_eos=True))]
    eos = free[3]
    tok2 = Tokenizer(tok._hf, tok.config, tok.chat_template_source, [eos])
    evs = list(generate(_model(tok), tok2, tok.encode(PROMPT), SamplingParams(max_tokens=10)))
    assert [e.token_id for e in evs] == free[: free.index(eos) + 1]
    assert evs[-1].finish_reason == "stop"
    assert _text(evs) == tok.decode(free[: free.index(eos)])  # the eos token's own text is not emitted
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    evs = list(generate(_model(tok), tok2, tok.encode(PROMPT), params))
    assert [e.token_id for e in evs] == free


def test_stop_string_across_token_boundary_is_trimmed_and_never_emitted(tok: Tokenizer) -> None:
    free = _run(tok, _model(tok), SamplingParams(max_tokens=30, ignore_eos=True))
    full = _text(free)
    # A stop string that spans the boundary between two tokens' texts.
    starts = np.cumsum([0] + [len(e.text) for e in free])
    k = next(i for i in range(3, len(free) - 2) if len(free[i].text) >= 2 and len(free[i + 1].text) >= 2)
    stop = full[starts[k + 1] - 2: starts[k + 1] + 2]
    cut = full.find(stop)
    evs = _run(tok, _model(tok), SamplingParams(max_tokens=30, ignore_eos=True, stop=("zzz-never", stop)))
    assert _text(evs) == full[:cut]
    assert evs[-1].finish_reason == "stop"
    assert len(evs) <= k + 2  # stopped at the token that completed the stop string
    # Never partially emitted: at every event, what was emitted so far stays inside the text before the stop.
    emitted = ""
    for e in evs:
        emitted += e.text
        assert full[:cut].startswith(emitted)


def test_held_back_text_is_flushed_at_length(tok: Tokenizer) -> None:
    free = _run(tok, _model(tok), SamplingParams(max_tokens=8, ignore_eos=True))
    full = _text(free)
    # A stop string whose first char matches the end: held back, then released when length ends it.
    stop = full[-1] + "\x01"
    evs = _run(tok, _model(tok), SamplingParams(max_tokens=8, ignore_eos=True, stop=(stop,)))
    assert _text(evs) == full and evs[-1].finish_reason == "length"


def test_cancel_stops_within_one_step(tok: Tokenizer) -> None:
    model = _model(tok)
    cancel = threading.Event()
    stats = GenerationStats()
    it = generate(model, tok, tok.encode(PROMPT), SamplingParams(max_tokens=100, ignore_eos=True), cancel,
                  stats=stats)
    for _ in range(5):
        next(it)
    calls = len(model.calls)
    cancel.set()
    rest = list(it)
    assert [e.finish_reason for e in rest] == ["cancelled"] and rest[0].token_id is None
    assert len(model.calls) == calls  # no forward after the cancel
    assert stats.finish_reason == "cancelled" and stats.completion_tokens == 5


def test_cancel_before_start_runs_nothing(tok: Tokenizer) -> None:
    model = _model(tok)
    cancel = threading.Event()
    cancel.set()
    evs = list(generate(model, tok, tok.encode(PROMPT), SamplingParams(), cancel))
    assert [e.finish_reason for e in evs] == ["cancelled"] and model.calls == []


def test_context_limit(tok: Tokenizer) -> None:
    model = ToyModel(vocab_size=768, max_positions=10)
    prompt = tok.encode(PROMPT)
    evs = list(generate(model, tok, prompt, SamplingParams(max_tokens=100, ignore_eos=True)))
    assert len(prompt) + len(evs) == 10 and evs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="context is 10"):
        generate(model, tok, list(range(10)), SamplingParams())


def test_bad_requests_raise_before_iteration(tok: Tokenizer) -> None:
    model = _model(tok)
    with pytest.raises(ValueError, match="empty"):
        generate(model, tok, [], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        generate(model, tok, [1], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, tok, [1, 768], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, tok, [-1], SamplingParams())
    with pytest.raises(ValueError, match="integers"):
        generate(model, tok, [1, "2"], SamplingParams())  # type: ignore[list-item]
    assert model.calls == []


def test_stats(tok: Tokenizer) -> None:
    stats = GenerationStats()
    evs = _run(tok, _model(tok), SamplingParams(max_tokens=6, ignore_eos=True), stats=stats)
    assert stats.prompt_tokens == len(tok.encode(PROMPT)) and stats.completion_tokens == 6
    assert stats.tokens == [e.token_id for e in evs] and stats.finish_reason == "length"
    assert stats.prefill_s > 0 and stats.decode_s > 0
