"""Validation of ``/v1/chat/completions`` and ``/v1/completions`` bodies into ``GenRequest``.

``parse_request(kind, body_bytes)`` returns a ``GenRequest`` or raises ``ApiError(400, ...)`` naming the
offending parameter. Nothing is silently ignored: a field this API does not implement is refused with a
400 naming it (``param``), unless its value is null or the value that means "off" (``n: 1``,
``store: false``, ``echo: false``, ...). docs/api.md lists the fields. The raw JSON object is kept so that
pass-through backends (``openai:URL``, the tunnel) forward what the client sent.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from meshd.api import structured
from meshd.api.errors import ApiError
from meshd.api.limits import API_MAX_LOGIT_BIAS, API_MAX_LOGIT_BIAS_VALUE, API_MAX_REPETITION_PENALTY
from transport.limits import (
    API_MAX_MESSAGES,
    API_MAX_STOP,
    API_MAX_STOP_CHARS,
    API_MAX_TOKENS,
    API_MAX_TOP_LOGPROBS,
)

Kind = Literal["chat", "completion"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_COMPLETION_LOGPROBS = 5

# Fields each endpoint implements. ``user`` is an end-user id for abuse tracking: accepted and unused.
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user", "response_format",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "store",
})
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


@dataclass
class GenRequest:
    """One validated generation request. ``logprobs`` is True/False for chat; ``top_logprobs`` is the
    number of alternatives per token (chat ``top_logprobs``, completions integer ``logprobs``)."""

    kind: Kind
    model: str
    raw: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] = ""
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    response_format: structured.ResponseFormat | None = None  # None: free text
    tools: list[structured.Tool] = field(default_factory=list)
    tool_choice: str | None = None  # "none", "auto", "required", or a function's name (None: no tools)
    parallel_tool_calls: bool = True

    @property
    def tools_active(self) -> bool:
        """Tools are offered to the model (given, and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"'{name}' must be a number")
    if v < lo or v > hi or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(name, f"'{name}' must be in {bound}, got {v}")
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"'{name}' must be an integer")
    if v < lo or v > hi:
        raise _bad(name, f"'{name}' must be between {lo} and {hi}, got {v}")
    return v


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean")
    return v


def _content_text(content: Any, idx: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{idx}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{idx}].content", "message content must be a string or a list of text parts")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty array")
    if len(msgs) > API_MAX_MESSAGES:
        raise _bad("messages", f"at most {API_MAX_MESSAGES} messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"role must be one of {', '.join(sorted(ROLES))}")
        for k, v in m.items():
            if k not in MESSAGE_FIELDS and v is not None:
                raise _unsupported(f"messages[{i}].{k}")
        msg: dict[str, Any] = {"role": role, "content": _content_text(m.get("content"), i)}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _bad(f"messages[{i}].name", "'name' must be a string")
            msg["name"] = name
        msg.update(structured.message_tool_fields(m, i))
        out.append(msg)
    return out


def _prompt(body: dict[str, Any]) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        return p[0]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return list(p)
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
        inner = p[0]
        if inner and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in inner):
            return list(inner)
    raise _bad("prompt", "'prompt' must be a string, one string in an array, or an array of token ids "
               "(batches of prompts are not supported)")


def _stop(body: dict[str, Any]) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    items = [s] if isinstance(s, str) else s
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise _bad("stop", "'stop' must be a string or an array of strings")
    if len(items) > API_MAX_STOP:
        raise _bad("stop", f"at most {API_MAX_STOP} stop sequences")
    for x in items:
        if not x or len(x) > API_MAX_STOP_CHARS:
            raise _bad("stop", f"stop sequences must have 1 to {API_MAX_STOP_CHARS} characters")
    return list(items)


def parse_json_object(data: bytes) -> dict[str, Any]:
    """A JSON object of valid Unicode, or ``ApiError(400, code="invalid_json")``: not JSON, not an object,
    nested deeper than the parser's recursion limit, or holding a lone UTF-16 surrogate escape
    (``"\\ud800"``, which JSON allows but no UTF-8 text can hold)."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(data):  # paired escapes (emoji) decode to one code point and pass
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                           "valid Unicode", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_request(kind: Kind, data: bytes, extra_fields: frozenset[str] = frozenset()) -> GenRequest:
    """Validate a request body (see module docstring). ``extra_fields`` are accepted unchecked (a test
    backend's own knobs); backends read them from ``raw``."""
    body = parse_json_object(data)
    known = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    for k, v in body.items():
        if k not in known and k not in extra_fields and v is not None:
            raise _unsupported(k)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' must be a non-empty string")
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("n", "only n=1 is supported")
    req = GenRequest(kind=kind, model=model, raw=body)
    if kind == "chat":
        req.messages = _messages(body)
        mt = _int(body, "max_completion_tokens", 1, API_MAX_TOKENS)
        req.max_tokens = mt if mt is not None else _int(body, "max_tokens", 1, API_MAX_TOKENS)
        req.logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, API_MAX_TOP_LOGPROBS)
        if top is not None and not req.logprobs:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        req.top_logprobs = top or 0
    else:
        req.prompt = _prompt(body)
        req.max_tokens = _int(body, "max_tokens", 1, API_MAX_TOKENS)
        lp = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        req.logprobs = lp is not None
        req.top_logprobs = lp or 0
        req.echo = _bool(body, "echo")
        if req.echo:
            raise _bad("echo", "'echo' is not supported")
        if body.get("best_of") not in (None, 1):
            raise _bad("best_of", "only best_of=1 is supported")
        if body.get("suffix") not in (None, ""):
            raise _unsupported("suffix")
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    req.seed = _int(body, "seed", -(2**63), 2**64 - 1)
    req.stop = _stop(body)
    req.stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        if not req.stream:
            raise _bad("stream_options", "'stream_options' needs 'stream': true")
        inc = so.get("include_usage", False)
        if not isinstance(inc, bool):
            raise _bad("stream_options.include_usage", "'include_usage' must be a boolean")
        req.include_usage = inc
    if _bool(body, "store"):
        raise _bad("store", "'store' is not supported (nothing is stored); leave it out or false")
    req.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    req.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    req.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, API_MAX_REPETITION_PENALTY,
                                     lo_open=True)
    req.min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    top_k = _int(body, "top_k", -1, 2**31 - 1)
    req.top_k = max(0, top_k or 0)  # -1 and 0 mean off (vLLM)
    req.ignore_eos = _bool(body, "ignore_eos")
    req.logit_bias = _logit_bias(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "'user' must be a string")
    req.response_format = structured.parse_response_format(body.get("response_format"))
    if kind == "chat":
        req.tools = structured.parse_tools(body.get("tools"))
        req.tool_choice = structured.parse_tool_choice(body.get("tool_choice"), req.tools)
        req.parallel_tool_calls = body.get("parallel_tool_calls") is not False
        if body.get("parallel_tool_calls") not in (None, True, False):
            raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
        if req.tools_active and req.logprobs:
            raise _bad("logprobs", "'logprobs' together with active 'tools' is not supported")
        if req.tools_active and req.response_format is not None and req.tool_choice != "auto":
            raise _bad("response_format", "'response_format' cannot be combined with tool_choice "
                       f"'{req.tool_choice}' (the output is then a tool call)")
    return req


def _unsupported(param: str) -> ApiError:
    return ApiError(400, f"unsupported parameter '{param}' (see docs/api.md for what is supported)",
                    code="unsupported_parameter", param=param)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    lb = body.get("logit_bias")
    if lb is None:
        return {}
    if not isinstance(lb, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    if len(lb) > API_MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"at most {API_MAX_LOGIT_BIAS} entries in 'logit_bias'")
    out: dict[int, float] = {}
    for k, v in lb.items():
        if not isinstance(k, str) or not k.isdigit() or len(k) > 12:
            raise _bad("logit_bias", f"'logit_bias' keys must be token ids, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or abs(v) > API_MAX_LOGIT_BIAS_VALUE:
            raise _bad("logit_bias", f"'logit_bias' values must be numbers in [-{API_MAX_LOGIT_BIAS_VALUE:g}, "
                       f"{API_MAX_LOGIT_BIAS_VALUE:g}], got {v!r} for {k}")
        out[int(k)] = float(v)
    return out
