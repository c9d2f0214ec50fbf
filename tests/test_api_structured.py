"""Structured outputs, tools and sampling extensions as a user meets them: the official ``openai`` SDK
against real daemons serving ``tiny`` (random weights: only constrained decoding can make JSON come out),
each test run four ways: on the serving node (``local``), through a headless client node joined by
invite (``tunnel``), on a ``--remote-experts on`` coordinator whose routed experts a worker daemon
computes (``experts``), and on a ``--pipeline on`` node whose layers 2-3 a ``--stage`` daemon runs
(``pipeline``; the serving node samples, so it holds the grammar state).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

pytest.importorskip("meshd.membership.service")

from api_helpers import wait_models  # noqa: E402
from conftest import meshd_cmd, meshd_env  # noqa: E402
from daemon_testlib import Node, start_node  # noqa: E402

TARGETS = ("local", "tunnel", "experts", "pipeline")
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                    "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]


class Person(pydantic.BaseModel):
    name: str
    age: int
    member: bool
    level: Literal["low", "high"]


class Lookup(pydantic.BaseModel):
    """Look a word up."""

    word: str
    limit: int


def _invite(state: Path) -> str:
    return subprocess.run(meshd_cmd("invite", "--state-dir", str(state)), env=meshd_env(), capture_output=True,
                          text=True, timeout=20, check=True).stdout.strip()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("structured")
    nodes: list[Node] = []
    try:
        a = start_node(tmp / "a", "--model", "tiny")
        nodes.append(a)
        c = start_node(tmp / "c", "--join", _invite(tmp / "a"), command="client")
        nodes.append(c)
        coord = start_node(tmp / "coord", "--model", "tiny", "--remote-experts", "on")
        nodes.append(coord)
        w = start_node(tmp / "w", "--experts", "tiny", "--join", _invite(tmp / "coord"))
        nodes.append(w)
        head = start_node(tmp / "head", "--model", "tiny", "--pipeline", "on")
        nodes.append(head)
        st = start_node(tmp / "st", "--stage", "tiny@2-3", "--join", _invite(tmp / "head"))
        nodes.append(st)
        urls = {"local": f"http://{a.run['api']}/v1", "tunnel": f"http://{c.run['api']}/v1",
                "experts": f"http://{coord.run['api']}/v1", "pipeline": f"http://{head.run['api']}/v1"}
        assert wait_models(urls["tunnel"], {"tiny"}, timeout=30) == {"tiny"}
        routes = {"local": ("local", a), "tunnel": ("tunnel", a), "experts": ("local", coord),
                  "pipeline": ("local", head)}
        deadline = time.monotonic() + 30
        for name, url in urls.items():
            cl = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
            while True:  # the coordinator (pipeline head) answers 503 until its worker (stage) has joined
                try:
                    raw = cl.chat.completions.with_raw_response.create(model="tiny", messages=MSGS, max_tokens=2)
                    break
                except openai.APIStatusError as e:
                    if e.status_code != 503 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.3)
            route, node = routes[name]
            assert raw.headers["x-meshd-route"] == route and raw.headers["x-meshd-node"] == node.run["node_id"]
        yield {"urls": urls, "a": a, "coord": coord, "w": w, "head": head, "stage": st, "tiny": a.state_dir}
    finally:
        for n in reversed(nodes):
            n.stop()


def client(mesh: dict[str, Any], target: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh["urls"][target], api_key="x", max_retries=0, timeout=120)


def _parse_fn() -> Any:
    cc = openai.OpenAI(api_key="x").chat.completions
    return "parse" if hasattr(cc, "parse") else None


@pytest.mark.parametrize("target", TARGETS)
def test_sdk_parse_returns_a_pydantic_object(mesh: dict[str, Any], target: str) -> None:
    cl = client(mesh, target)
    parse = cl.chat.completions.parse if _parse_fn() else cl.beta.chat.completions.parse  # type: ignore[attr-defined]
    for temperature in (0.0, 1.0):
        r = parse(model="tiny", messages=MSGS, response_format=Person, max_tokens=200, temperature=temperature,
                  seed=3)
        got = r.choices[0].message.parsed
        assert isinstance(got, Person), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_output_validates(mesh: dict[str, Any], target: str, stream: bool) -> None:
    cl = client(mesh, target)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": SCHEMA}}
    for seed in (1, 2):
        kw: dict[str, Any] = dict(model="tiny", messages=MSGS, response_format=rf, max_tokens=300, temperature=1.0,
                                  seed=seed)
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in cl.chat.completions.create(stream=True, **kw)
                           if ch.choices)
        else:
            text = cl.chat.completions.create(**kw).choices[0].message.content or ""
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = cl.chat.completions.create(model="tiny", messages=MSGS, response_format={"type": "json_object"},
                                     max_tokens=200, temperature=1.0, seed=4)
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_completions_take_response_format_too(mesh: dict[str, Any]) -> None:
    cl = client(mesh, "tunnel")
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = cl.completions.create(model="tiny", prompt="A person:", max_tokens=300, temperature=1.0, seed=9,
                              extra_body={"response_format": rf})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("target", TARGETS)
def test_tool_choice_required_and_named_give_calls_that_validate(mesh: dict[str, Any], target: str) -> None:
    cl = client(mesh, target)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = cl.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}],
                                       tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=1.0, seed=7)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.id.startswith("call_") and call.type == "function"
            if call.function.name == "get_weather":
                jsonschema.validate(args, WEATHER)
            else:
                assert choice == "required" and call.function.name == "get_time" and isinstance(args["tz"], str)
    one = cl.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=8)
    assert len(one.choices[0].message.tool_calls or []) == 1


@pytest.mark.parametrize("target", TARGETS)
def test_streamed_tool_call_reassembles_in_the_sdk(mesh: dict[str, Any], target: str) -> None:
    cl = client(mesh, target)
    stream_fn = cl.chat.completions.stream if hasattr(cl.chat.completions, "stream") \
        else cl.beta.chat.completions.stream  # type: ignore[attr-defined]
    with stream_fn(model="tiny", messages=[{"role": "user", "content": "look up 'mesh'"}],
                   tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required", max_tokens=200,
                   temperature=1.0, seed=2) as s:
        final = s.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    call = msg.tool_calls[0]
    assert call.function.name == "Lookup" and isinstance(call.function.parsed_arguments, Lookup)


def _prompt_tokens(mesh: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    from engine.tiny import ensure_tiny
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.load(ensure_tiny(mesh["tiny"]))
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools))


@pytest.mark.parametrize("target", TARGETS)
def test_tool_result_in_history_goes_through_the_template(mesh: dict[str, Any], target: str) -> None:
    cl = client(mesh, target)
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C, light wind from the west"}]
    r = cl.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=3)  # type: ignore[arg-type]
    rendered = [history[0], {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "sunny, 21 C, light wind from the west"}]
    tools = [{"type": t["type"], "function": {k: v for k, v in t["function"].items()}} for t in TOOLS]
    want = _prompt_tokens(mesh, rendered, tools)
    assert r.usage is not None and r.usage.prompt_tokens == want
    assert want > _prompt_tokens(mesh, rendered[:2], tools) + 10  # the tool result is in there


@pytest.mark.parametrize("target", TARGETS)
def test_unknown_and_unsupported_fields_are_400_naming_them(mesh: dict[str, Any], target: str) -> None:
    cl = client(mesh, target)
    for extra, param in (({"guided_json": {"type": "object"}}, "guided_json"),
                         ({"reasoning_effort": "high"}, "reasoning_effort"),
                         ({"response_format": {"type": "json_schema", "json_schema": {
                             "name": "x", "schema": {"type": "object", "if": {}}}}}, "response_format.json_schema.schema")):
        with pytest.raises(openai.BadRequestError) as e:
            cl.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, extra_body=extra)
        assert e.value.param == param, e.value.body
    assert cl.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as nf:
        cl.models.retrieve("no-such-model")
    assert nf.value.code == "model_not_found" and "served models: tiny" in nf.value.message  # as chat's 404


@pytest.mark.parametrize("target", TARGETS)
def test_ignore_eos_and_logit_bias(mesh: dict[str, Any], target: str) -> None:
    cl = client(mesh, target)
    from engine.tiny import ensure_tiny
    from engine.tokenizer import Tokenizer

    eos = Tokenizer.load(ensure_tiny(mesh["tiny"])).token_to_id("<|im_end|>")
    bias = {str(eos): 100}
    r = cl.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, logit_bias=bias)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "stop" and r.usage is not None and r.usage.completion_tokens == 1
    r = cl.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, logit_bias=bias,  # type: ignore[arg-type]
                                   extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 8


@pytest.mark.parametrize("target", TARGETS)
def test_penalties_reach_the_sampler(mesh: dict[str, Any], target: str) -> None:
    """The node's output equals the engine run in this process with the same knobs (and differs without
    them): the fields reach the sampler on every path."""
    from engine.generate import generate
    from engine.model import Model
    from engine.sampling import SamplingParams
    from engine.tiny import ensure_tiny
    from engine.tokenizer import Tokenizer

    path = ensure_tiny(mesh["tiny"])
    model, tok = Model.load(path), Tokenizer.load(path)
    ids = tok.encode("the mesh wakes before the sun")
    knobs = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3, top_k=40, min_p=0.05)

    def ref(**kw: Any) -> str:
        p = SamplingParams(max_tokens=16, temperature=0.8, seed=5, **kw)
        return "".join(e.text for e in generate(model, tok, ids, p))

    cl = client(mesh, target)
    got = cl.completions.create(model="tiny", prompt="the mesh wakes before the sun", max_tokens=16,
                                temperature=0.8, seed=5, frequency_penalty=1.5, presence_penalty=0.5,
                                extra_body={"repetition_penalty": 1.3, "top_k": 40, "min_p": 0.05})
    assert got.choices[0].text == ref(**knobs)
    assert ref(**knobs) != ref()


def test_experts_target_had_its_experts_computed_by_the_worker(mesh: dict[str, Any]) -> None:
    out = subprocess.run(meshd_cmd("status", "--json", "--state-dir", str(mesh["coord"].state_dir)), env=meshd_env(),
                         capture_output=True, text=True, timeout=20, check=True)
    st = json.loads(out.stdout)["services"]["experts"]["coordinators"][0]
    assert st["layers_delegated"] > 0 and st["items_local"] == 0, st


def test_pipeline_target_ran_its_last_layers_on_the_stage(mesh: dict[str, Any]) -> None:
    st = mesh["stage"].status()["services"]["pipeline"]["pipeline"]["stages"][0]
    assert st["loaded"] == [[2, 3]] and st["steps"] > 0, st
    plan = mesh["head"].status()["services"]["pipeline"]["pipeline"]["models"]["tiny"]["plan"]
    assert [s["layers"] for s in plan] == [[0, 1], [2, 3]] and plan[1]["node_id"] == mesh["stage"].run["node_id"]
