"""Validation of the structured-output and tool fields of a chat request: ``response_format``, ``tools``,
``tool_choice`` and the tool parts of messages (``tool_calls``, ``tool_call_id``).

Each ``parse_*`` returns plain values or raises ``ApiError(400)`` naming the parameter. JSON schemas are
compiled by llguidance here, on the node that receives the request, so an unsupported schema feature is a
400 naming it (``Unimplemented keys: ["if"]``) before the request is routed anywhere.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from meshd.api.errors import ApiError
from meshd.api.limits import API_MAX_FUNCTION_NAME, API_MAX_TOOLS

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,%d}$" % API_MAX_FUNCTION_NAME)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ResponseFormat:
    """``json_object`` (any JSON object) or ``json_schema`` (``schema`` given). Both are enforced by
    constrained decoding whether ``strict`` is true or not."""

    kind: str
    schema: dict[str, Any] | None = None
    name: str = ""
    strict: bool = False


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(_EMPTY_PARAMETERS))
    description: str | None = None
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request shape (what chat templates iterate over)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def check_schema(schema: dict[str, Any], param: str) -> None:
    """Raise a 400 naming ``param`` if llguidance cannot enforce ``schema``."""
    from engine.constraint import check_grammar, json_schema_grammar

    try:
        err = check_grammar(json_schema_grammar(schema))
    except ValueError as e:
        err = str(e)
    if err is not None:
        raise ApiError(400, f"unsupported JSON schema in '{param}': {err}", code="unsupported_schema",
                       param=param)


def _keys(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    for k, v in obj.items():
        if k not in allowed and v is not None:
            raise ApiError(400, f"unsupported parameter '{param}.{k}'", code="unsupported_parameter",
                           param=f"{param}.{k}")


def parse_response_format(v: Any) -> ResponseFormat | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("response_format", "'response_format' must be an object")
    kind = v.get("type")
    if kind == "text":
        _keys(v, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _keys(v, {"type"}, "response_format")
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise _bad("response_format.type", "'response_format.type' must be 'text', 'json_object' or 'json_schema'")
    _keys(v, {"type", "json_schema"}, "response_format")
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema", "'response_format.json_schema' must be an object")
    _keys(js, {"name", "schema", "strict", "description"}, "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad("response_format.json_schema.name", "'response_format.json_schema.name' must be 1 to "
                   f"{API_MAX_FUNCTION_NAME} characters of a-z, A-Z, 0-9, _ and -")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "'response_format.json_schema.schema' must be an object")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict", "'strict' must be a boolean")
    if js.get("description") is not None and not isinstance(js.get("description"), str):
        raise _bad("response_format.json_schema.description", "'description' must be a string")
    check_schema(schema, "response_format.json_schema.schema")
    return ResponseFormat("json_schema", schema, name, bool(strict))


def parse_tools(v: Any) -> list[Tool]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _bad("tools", "'tools' must be an array")
    if len(v) > API_MAX_TOOLS:
        raise _bad("tools", f"at most {API_MAX_TOOLS} tools")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(p, "each tool must be {\"type\": \"function\", \"function\": {...}}")
        _keys(t, {"type", "function"}, p)
        fn = t["function"]
        _keys(fn, {"name", "description", "parameters", "strict"}, f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{p}.function.name", f"a function name must be 1 to {API_MAX_FUNCTION_NAME} characters "
                       "of a-z, A-Z, 0-9, _ and -")
        if name in seen:
            raise _bad(f"{p}.function.name", f"function '{name}' is defined twice")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{p}.function.description", "'description' must be a string")
        params = fn.get("parameters")
        if params is None:
            params = dict(_EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise _bad(f"{p}.function.parameters", "'parameters' must be a JSON schema object")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"{p}.function.strict", "'strict' must be a boolean")
        check_schema(params, f"{p}.function.parameters")
        out.append(Tool(name, params, desc, bool(strict)))
    return out


def parse_tool_choice(v: Any, tools: list[Tool]) -> str | None:
    """"none", "auto", "required" or a function name; None when there are no tools."""
    if v is None:
        return "auto" if tools else None
    if not tools:
        raise _bad("tool_choice", "'tool_choice' needs 'tools'")
    if v in ("none", "auto", "required"):
        return str(v)
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if not any(t.name == name for t in tools):
            raise _bad("tool_choice", f"tool_choice names function {name!r}, which is not in 'tools'")
        return str(name)
    raise _bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
               "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def message_tool_fields(m: dict[str, Any], i: int) -> dict[str, Any]:
    """The tool parts of history message ``i``, as chat templates take them (arguments as objects)."""
    out: dict[str, Any] = {}
    role = m.get("role")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _bad(f"messages[{i}].tool_calls", "only assistant messages carry 'tool_calls'")
        if not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls", "'tool_calls' must be an array")
        parsed = []
        for j, c in enumerate(calls):
            p = f"messages[{i}].tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or c.get("type", "function") != "function":
                raise _bad(p, "each tool call must be {\"id\", \"type\": \"function\", \"function\": "
                           "{\"name\", \"arguments\"}}")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise _bad(f"{p}.function.arguments", "'arguments' must be a JSON string") from None
            call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            if isinstance(c.get("id"), str):
                call["id"] = c["id"]
            parsed.append(call)
        if parsed:
            out["tool_calls"] = parsed
    tcid = m.get("tool_call_id")
    if tcid is not None:
        if role != "tool" or not isinstance(tcid, str):
            raise _bad(f"messages[{i}].tool_call_id", "'tool_call_id' is a string on tool messages")
        out["tool_call_id"] = tcid
    return out
