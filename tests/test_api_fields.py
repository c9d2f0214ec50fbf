"""Request validation: every field is implemented or refused with a 400 naming it (``param``); the
structured-output and tool fields are checked before routing; tool-call text parses in each format."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshd.api.errors import ApiError
from meshd.api.schema import CHAT_FIELDS, COMPLETION_FIELDS, parse_request
from meshd.api.tools import GLM, HERMES, MISTRAL, ToolStreamer, parse_calls, tool_format_of

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat(**fields: Any) -> Any:
    return parse_request("chat", json.dumps({"model": "m", "messages": MSGS, **fields}).encode())


def refused(kind: str, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(kind, json.dumps(body).encode())  # type: ignore[arg-type]
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("field", ["functions", "function_call", "modalities", "audio", "prediction",
                                   "reasoning_effort", "web_search_options", "metadata", "service_tier",
                                   "guided_json", "max_token", "mirostat"])
def test_unknown_or_unimplemented_field_is_a_400_naming_it(field: str) -> None:
    e = refused("chat", {"model": "m", "messages": MSGS, field: {"x": 1}})
    assert e.param == field and field in e.message and e.code == "unsupported_parameter"
    e = refused("completion", {"model": "m", "prompt": "x", field: 1})
    assert e.param == field


def test_null_means_unset_and_off_values_are_accepted() -> None:
    req = chat(functions=None, n=1, store=False, user="u-1", parallel_tool_calls=None, response_format={"type": "text"})
    assert req.response_format is None
    assert refused("chat", {"model": "m", "messages": MSGS, "store": True}).param == "store"
    assert refused("completion", {"model": "m", "prompt": "x", "best_of": 2}).param == "best_of"
    assert refused("completion", {"model": "m", "prompt": "x", "suffix": "y"}).param == "suffix"
    assert refused("completion", {"model": "m", "prompt": "x", "tools": TOOLS}).param == "tools"


def test_message_fields_are_checked() -> None:
    e = refused("chat", {"model": "m", "messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]})
    assert e.param == "messages[0].audio"
    e = refused("chat", {"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]})
    assert e.param == "messages[0].tool_calls"
    req = chat(messages=[{"role": "user", "content": "x"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                         {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert req.messages[2]["tool_call_id"] == "c1"


def test_every_documented_field_is_known() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    for f in CHAT_FIELDS | COMPLETION_FIELDS:
        assert f"`{f}`" in doc, f"docs/api.md does not list {f}"


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5),
    ("top_k", -2), ("top_k", 1.5), ("ignore_eos", "yes"), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", [1]), ("parallel_tool_calls", "no"),
])
def test_sampling_extension_values_are_checked(field: str, value: Any) -> None:
    assert refused("chat", {"model": "m", "messages": MSGS, field: value}).param == field


def test_sampling_extensions_are_parsed() -> None:
    req = chat(frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.2, min_p=0.1, top_k=-1,
               ignore_eos=True, logit_bias={"5": -100, "7": 3.5})
    assert (req.frequency_penalty, req.presence_penalty, req.repetition_penalty, req.min_p, req.top_k) == \
        (0.5, -0.5, 1.2, 0.1, 0)
    assert req.ignore_eos and req.logit_bias == {5: -100.0, 7: 3.5}


def test_response_format_is_validated_and_unsupported_schema_features_are_named() -> None:
    rf = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
    assert rf.response_format.kind == "json_schema" and rf.response_format.strict
    assert chat(response_format={"type": "json_object"}).response_format.schema is None
    e = refused("chat", {"model": "m", "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "if": {"properties": {}}}}}})
    assert e.param == "response_format.json_schema.schema" and "if" in e.message
    e = refused("chat", {"model": "m", "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "string", "pattern": "(?=x)"}}}})
    assert "look-around" in e.message
    assert refused("chat", {"model": "m", "messages": MSGS, "response_format": {"type": "yaml"}}).param == \
        "response_format.type"
    assert refused("chat", {"model": "m", "messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {}}}}).param == "response_format.json_schema.name"


def test_tools_and_tool_choice_are_validated() -> None:
    req = chat(tools=TOOLS)
    assert req.tool_choice == "auto" and req.tools_active and req.tools[0].name == "get_weather"
    assert chat(tools=TOOLS, tool_choice="none").tools_active is False
    assert chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_choice == \
        "get_weather"
    assert refused("chat", {"model": "m", "messages": MSGS, "tool_choice": "auto"}).param == "tool_choice"
    assert refused("chat", {"model": "m", "messages": MSGS, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}).param == "tool_choice"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    e = refused("chat", {"model": "m", "messages": MSGS, "tools": bad})
    assert e.param == "tools[0].function.parameters" and "not" in e.message
    assert refused("chat", {"model": "m", "messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "has space"}}]}).param == "tools[0].function.name"
    assert refused("chat", {"model": "m", "messages": MSGS, "tools": TOOLS, "logprobs": True}).param == "logprobs"
    assert refused("chat", {"model": "m", "messages": MSGS, "tools": TOOLS, "tool_choice": "required",
                            "response_format": {"type": "json_object"}}).param == "response_format"


def test_tool_call_formats_parse() -> None:
    assert tool_format_of("... {{ '<tool_call>' }} ...") == HERMES
    assert tool_format_of("[TOOL_CALLS] ...") == MISTRAL
    assert tool_format_of("<arg_key>{{ k }}</arg_key>") == GLM
    (c,) = parse_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', HERMES)  # type: ignore[misc]
    assert c.name == "f" and json.loads(c.arguments) == {"a": 1} and c.id.startswith("call_")
    calls = parse_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": "y"}}]', MISTRAL)
    assert calls is not None and [x.name for x in calls] == ["f", "g"]
    (g,) = parse_calls("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"  # type: ignore[misc]
                       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", GLM)
    assert g.name == "get_weather" and json.loads(g.arguments) == {"city": "Paris", "days": 3}
    assert parse_calls("<tool_call>\n{not json}\n</tool_call>", HERMES) is None


def test_streamer_holds_a_possible_marker_and_keeps_unparsable_calls_as_content() -> None:
    s = ToolStreamer(HERMES)
    shown = "".join(s.feed(p) for p in ["Let me ", "check <tool", "_call>\n{\"name\": \"f\", ",
                                        "\"arguments\": {}}\n</tool_call>"])
    assert shown == "Let me check " and s.finish() == "" and [c.name for c in s.calls] == ["f"]
    s = ToolStreamer(HERMES)
    assert s.feed("a <tool") == "a " and s.feed("box>") == "<toolbox>" and s.finish() == ""
    s = ToolStreamer(HERMES)
    s.feed("<tool_call>\nbroken")
    assert s.finish() == "<tool_call>\nbroken" and s.calls == []
    s = ToolStreamer(HERMES)  # each block is handed out as soon as it closes
    s.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool')
    assert s.take() == []
    s.feed('_call>\n<tool_call>\n{"name": "g", "arguments": {"a": 1}}')
    assert [c.name for c in s.take()] == ["f"]
    s.feed("\n</tool_call>")
    assert [c.name for c in s.take()] == ["g"] and s.finish() == "" and s.take() == []
    s = ToolStreamer(HERMES, parallel=False)
    s.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}'
           '\n</tool_call>')
    s.finish()
    assert [c.name for c in s.calls] == ["f"]
