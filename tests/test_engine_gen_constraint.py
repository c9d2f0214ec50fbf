"""Constrained decoding in the engine: ``tiny`` (random weights) under a JSON schema or a tool-call grammar
always produces output that parses and validates, greedy or sampled, through ``generate`` and through the
batching scheduler (the one ``DecodeState`` both share)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.constraint import GrammarError, Matcher, check_grammar, json_schema_grammar
from engine.generate import generate
from engine.model import Model
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.tiny import ensure_tiny
from engine.tokenizer import Tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Tokenizer]:
    path = ensure_tiny(tmp_path_factory.mktemp("state"))
    return Model.load(path), Tokenizer.load(path)


def _run(tiny: tuple[Model, Tokenizer], params: SamplingParams, prompt: str = "hello") -> tuple[str, str]:
    model, tok = tiny
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    evs = list(generate(model, tok, ids, params))
    return "".join(e.text for e in evs), str(evs[-1].finish_reason)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), temp=st.sampled_from([0.0, 0.7, 1.5]))
def test_schema_output_always_validates(tiny: tuple[Model, Tokenizer], seed: int, temp: float) -> None:
    g = json_schema_grammar(SCHEMA)
    text, finish = _run(tiny, SamplingParams(max_tokens=400, temperature=temp, seed=seed, grammar=g,
                                             presence_penalty=0.5, top_k=50), prompt=f"p{seed}")
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_unconstrained_tiny_writes_no_json(tiny: tuple[Model, Tokenizer]) -> None:
    text, _ = _run(tiny, SamplingParams(max_tokens=40, temperature=0.0))
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_object_and_ignore_eos(tiny: tuple[Model, Tokenizer]) -> None:
    text, finish = _run(tiny, SamplingParams(max_tokens=300, temperature=1.0, seed=3, ignore_eos=True,
                                             grammar=json_schema_grammar(None)))
    assert finish == "stop" and isinstance(json.loads(text), dict)


def test_scheduler_batches_constrained_and_free_requests(tiny: tuple[Model, Tokenizer]) -> None:
    model, tok = tiny
    sched = Scheduler(model, tok, 4)
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": "batch"}])
        g = json_schema_grammar(SCHEMA)
        handles = [sched.submit(ids, SamplingParams(max_tokens=300, temperature=1.0, seed=s, grammar=g if s % 2 else None))
                   for s in range(4)]
        outs = ["".join(e.text for e in h) for h in handles]
    finally:
        sched.close()
    for s, text in enumerate(outs):
        if s % 2:
            jsonschema.validate(json.loads(text), SCHEMA)
    assert outs[0] != outs[2] or outs[0] == ""


def test_bad_grammars_are_named(tiny: tuple[Model, Tokenizer]) -> None:
    assert check_grammar(json_schema_grammar({"type": "object", "if": {}})) == 'Unimplemented keys: ["if"]'
    assert check_grammar(json_schema_grammar(SCHEMA)) is None
    with pytest.raises(GrammarError):
        Matcher(json_schema_grammar({"type": "nope"}), tiny[1], 768)


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "glm"])
def test_each_tool_format_grammar_agrees_with_its_parser(tiny: tuple[Model, Tokenizer], fmt: str) -> None:
    from meshd.api.schema import parse_request
    from meshd.api.tools import parse_calls, request_grammar

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["city", "n"]}
    req = parse_request("chat", json.dumps({"model": "t", "messages": [{"role": "user", "content": "x"}],
                                            "tools": [{"type": "function", "function": {"name": "w", "parameters": schema}}],
                                            "tool_choice": "required"}).encode())
    g = request_grammar(req, fmt, tiny[1])
    for seed in range(3):
        text, finish = _run(tiny, SamplingParams(max_tokens=200, temperature=1.0, seed=seed, grammar=g))
        calls = parse_calls(text, fmt)
        assert finish == "stop" and calls, text
        for c in calls:
            assert c.name == "w"
            args = json.loads(c.arguments)
            if fmt == "glm" and not isinstance(args.get("city"), str):  # a raw GLM value that reads as JSON
                args["city"] = str(args["city"])
            jsonschema.validate(args, schema)


def test_auto_with_response_format_gives_calls_or_the_document(tiny: tuple[Model, Tokenizer]) -> None:
    from meshd.api.schema import parse_request
    from meshd.api.tools import HERMES, parse_calls, request_grammar

    req = parse_request("chat", json.dumps({
        "model": "t", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "w"}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA}}}).encode())
    g = request_grammar(req, HERMES)
    for seed in range(4):
        text, _ = _run(tiny, SamplingParams(max_tokens=300, temperature=1.0, seed=seed, grammar=g))
        if text.startswith("<tool_call>"):
            assert parse_calls(text, HERMES), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_tool_call_grammar_gives_calls_that_validate(tiny: tuple[Model, Tokenizer]) -> None:
    from meshd.api.schema import parse_request
    from meshd.api.tools import HERMES, parse_calls, request_grammar

    params_schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                     "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params_schema}},
             {"type": "function", "function": {"name": "noop"}}]
    for choice, parallel in (("required", True), ({"type": "function", "function": {"name": "weather"}}, False)):
        req = parse_request("chat", json.dumps({"model": "t", "messages": [{"role": "user", "content": "x"}],
                                                "tools": tools, "tool_choice": choice,
                                                "parallel_tool_calls": parallel}).encode())
        g = request_grammar(req, HERMES)
        for seed in range(3):
            text, finish = _run(tiny, SamplingParams(max_tokens=300, temperature=1.0, seed=seed, grammar=g))
            calls = parse_calls(text, HERMES)
            assert finish == "stop" and calls, text
            assert parallel or len(calls) == 1
            for c in calls:
                assert c.name in ("weather", "noop")
                if c.name == "weather":
                    jsonschema.validate(json.loads(c.arguments), params_schema)
                if choice != "required":
                    assert c.name == "weather"


WIDE: dict[str, Any] = {  # no length caps: random weights write long strings, numbers and arrays
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
        "active": {"type": "boolean"}, "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "active", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("max_tokens", [100, 256, 1000])
def test_closing_fits_any_budget_the_document_fits_in(tiny: tuple[Model, Tokenizer], max_tokens: int) -> None:
    """The shortest WIDE document takes 81 of tiny's tokens; a fixed 64-token closing reserve cut half of
    these at 256 ("1890000..." numbers, strings ending inside a UTF-8 character)."""
    model, tok = tiny
    g = json_schema_grammar(WIDE)
    ids = tok.encode("Describe one user of the system as a JSON object with name, age and address:")
    lengths = []
    for seed in range(6):
        evs = list(generate(model, tok, ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                                                             grammar=g)))
        text = "".join(e.text for e in evs)
        assert evs[-1].finish_reason == "stop", (seed, len(evs), text[-120:])
        jsonschema.validate(json.loads(text), WIDE)
        lengths.append(len(evs))
    assert max(lengths) > max_tokens - 12, lengths  # closing starts near the end, not at once


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), free=st.integers(0, 60))
def test_closing_distance_is_the_tokens_the_steer_takes(tiny: tuple[Model, Tokenizer], seed: int, free: int) -> None:
    """Sample ``free`` tokens under the grammar, then steer: it ends the document in exactly the counted
    number of tokens."""
    import random

    import numpy as np

    _, tok = tiny
    n_vocab = 768  # tiny's padded model vocab
    m = Matcher(json_schema_grammar(WIDE), tok, n_vocab)
    r = random.Random(seed)
    for _ in range(free):
        ok = np.flatnonzero(m.allowed())
        ok = ok[[i not in tok.eos_ids for i in ok]]
        if m.stopped or not len(ok):
            return
        assert m.accept(int(r.choice(ok)))
    want = m.closing_distance(10_000)
    assert want <= 10_000
    for n in range(1, want + 1):
        only = np.flatnonzero(m.closing(m.allowed()))
        assert len(only) == 1
        tok_id = int(only[0])
        assert m.accept(tok_id)
        if tok_id in tok.eos_ids or m.stopped:
            assert n == want
            return
    raise AssertionError(f"not closed after the {want} counted tokens")
