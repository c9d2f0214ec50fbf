"""Validation of ``/v1/chat/completions`` and ``/v1/completions`` bodies into ``GenRequest``.

``parse_request(kind, body_bytes)`` returns a ``GenRequest`` or raises ``ApiError(400, ...)`` naming the
offending parameter. Unknown fields are ignored (clients send many), known ones are type-checked. The raw
JSON object is kept so that pass-through backends (``openai:URL``, the tunnel) forward what the client sent.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from meshd.api.errors import ApiError
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


@dataclass
class GenRequest:
    """One validated generation request. ``logprobs`` is True/False for chat; ``top_logprobs`` is the
    number of alternatives per token (chat ``top_logprobs``, completions integer ``logprobs``)."""

    kind: Kind
    model: str
    raw: dict[str, Any]
    messages: list[dict[str, str]] = field(default_factory=list)
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


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty array")
    if len(msgs) > API_MAX_MESSAGES:
        raise _bad("messages", f"at most {API_MAX_MESSAGES} messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"role must be one of {', '.join(sorted(ROLES))}")
        out.append({"role": role, "content": _content_text(m.get("content"), i)})
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


def parse_request(kind: Kind, data: bytes) -> GenRequest:
    """Validate a request body (see module docstring)."""
    body = parse_json_object(data)
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
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, 0.0, -2.0, 2.0)
    return req
