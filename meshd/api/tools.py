"""Tool calls in the model's own format: the grammar that forces them, and the parser that reads them.

Formats (``tool_format_of(chat_template)`` picks one from the template's text):

- ``hermes`` (Qwen2.5/Qwen3, and the default): ``<tool_call>\\n{"name": F, "arguments": {...}}\\n</tool_call>``,
  one block per call, separated by a newline.
- ``mistral``: ``[TOOL_CALLS][{"name": F, "arguments": {...}}, ...]``.
- ``glm`` (GLM-4.5/4.6): ``<tool_call>F\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>``,
  string values raw, other values as JSON.

``request_grammar(req, fmt)`` is the grammar the sampler enforces: the JSON schema of ``response_format``;
for ``tool_choice`` "required" or a named function, one call (or, with ``parallel_tool_calls``, one or
more) whose arguments validate against that function's ``parameters``; for "auto" with a
``response_format``, either calls or the JSON document. ``ToolStreamer`` splits generated text into
content (streamed as it comes; text that may start a call is held back) and ``ToolCall`` s (each
emitted once complete). A call that does not parse stays content, so no output is lost.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from meshd.api.schema import GenRequest
from meshd.api.structured import Tool

HERMES, MISTRAL, GLM = "hermes", "mistral", "glm"
_START = {HERMES: "<tool_call>", GLM: "<tool_call>", MISTRAL: "[TOOL_CALLS]"}


def tool_format_of(template: str | None) -> str:
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<arg_key>" in t:
        return GLM
    return HERMES


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


def _new_id() -> str:
    return "call_" + secrets.token_hex(12)


# -- grammars --------------------------------------------------------------------------------------------

def _call_schema(t: Tool) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _glm_call(t: Tool, rule: str, out: list[str]) -> str:
    """Lark rules for one GLM call of ``t``: its required arguments in declared order."""
    from engine.constraint import lark_json, lark_string

    props = t.parameters.get("properties") or {}
    required = [k for k in (t.parameters.get("required") or []) if isinstance(k, str)]
    parts = [lark_string(f"<tool_call>{t.name}\n")]
    for j, k in enumerate(required):
        ps = props.get(k) if isinstance(props.get(k), dict) else {}
        if ps.get("type") == "string" and set(ps) <= {"type", "description", "title"}:
            value = "/[^<]*/"
        else:
            out.append(f"{rule}_v{j}: {lark_json(ps)}")
            value = f"{rule}_v{j}"
        parts += [lark_string(f"<arg_key>{k}</arg_key>\n<arg_value>"), value, lark_string("</arg_value>\n")]
    parts.append(lark_string("</tool_call>"))
    return " ".join(parts)


def _calls_lark(tools: list[Tool], parallel: bool, fmt: str, tokenizer: Any) -> tuple[str, list[str]]:
    """(the start alternative for one-or-more calls, the rules it needs)."""
    from engine.constraint import lark_json, lark_string

    rules: list[str] = []
    if fmt == GLM:
        alts = []
        for i, t in enumerate(tools):
            rules.append(f"call{i}: {_glm_call(t, f'call{i}', rules)}")
            alts.append(f"call{i}")
        rules.append("call: " + " | ".join(alts))
        return ('call ("\\n" call)*' if parallel else "call"), rules
    obj = {"anyOf": [_call_schema(t) for t in tools]} if len(tools) > 1 else _call_schema(tools[0])
    rules.append(f"obj: {lark_json(obj)}")
    if fmt == MISTRAL:
        tid = tokenizer.token_to_id("[TOOL_CALLS]") if tokenizer is not None else None
        head = f"<[{tid}]>" if tid is not None else lark_string("[TOOL_CALLS]")
        return (f'{head} "[" obj ("," obj)* "]"' if parallel else f'{head} "[" obj "]"'), rules
    rules.append(f'call: {lark_string("<tool_call>" + chr(10))} obj {lark_string(chr(10) + "</tool_call>")}')
    return ('call ("\\n" call)*' if parallel else "call"), rules


def request_grammar(req: GenRequest, fmt: str, tokenizer: Any = None) -> str | None:
    """The llguidance grammar ``req`` must be decoded under, or None for free text."""
    from engine.constraint import json_schema_grammar, lark_grammar, lark_json

    rf = req.response_format
    doc_schema = (rf.schema if rf.kind == "json_schema" else {"type": "object"}) if rf is not None else None
    choice = req.tool_choice if req.tools_active else None
    if choice is None or (choice == "auto" and rf is None):
        return json_schema_grammar(doc_schema) if rf is not None else None
    tools = req.tools if choice in ("auto", "required") else [t for t in req.tools if t.name == choice]
    start, rules = _calls_lark(tools, req.parallel_tool_calls, fmt, tokenizer)
    if choice == "auto":  # with a response_format: calls or the document
        rules.append(f"doc: {lark_json(doc_schema or {'type': 'object'})}")
        start = f"({start}) | doc"
    return lark_grammar("\n".join([f"start: {start}", *rules]))


# -- parsing ---------------------------------------------------------------------------------------------

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_GLM_CALL = re.compile(r"<tool_call>\s*([^\n<]*?)\s*\n(.*?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _json_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), _new_id())


def _glm_value(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v


def parse_calls(text: str, fmt: str) -> list[ToolCall] | None:
    """The calls in ``text`` (which starts at a call marker), or None if it does not parse."""
    if fmt == MISTRAL:
        body = text.split("[TOOL_CALLS]", 1)[1].strip() if "[TOOL_CALLS]" in text else text
        try:
            objs = json.loads(body)
        except ValueError:
            return None
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_json_call(o) for o in objs]
        return None if not calls or any(c is None for c in calls) else [c for c in calls if c]
    if fmt == GLM:
        out = []
        for m in _GLM_CALL.finditer(text):
            args = {k.strip(): _glm_value(v) for k, v in _GLM_ARG.findall(m.group(2))}
            out.append(ToolCall(m.group(1).strip(), json.dumps(args, ensure_ascii=False), _new_id()))
        return out or None
    out = []
    for m in _HERMES_CALL.finditer(text):
        try:
            c = _json_call(json.loads(m.group(1)))
        except ValueError:
            return None
        if c is None:
            return None
        out.append(c)
    return out or None


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolStreamer:
    """Splits streamed text into content and tool calls (see module docstring).

    ``feed(text)`` returns content to show now; ``take()`` the calls completed since the last call (a
    ``<tool_call>`` block is complete at its ``</tool_call>``; Mistral's list at the end); ``finish()``
    parses what is left and returns content still to show. ``calls`` holds every call so far.
    """

    def __init__(self, fmt: str, parallel: bool = True) -> None:
        self.fmt = fmt
        self.marker = _START[fmt]
        self.parallel = parallel
        self._pending = ""  # content held back: it may begin a call marker
        self._calls_text: str | None = None  # everything from the first marker on
        self._cursor = 0  # how much of _calls_text has become calls
        self._given = 0  # how many calls take() has handed out
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> str:
        """Content that can be shown now."""
        if self._calls_text is not None:
            self._calls_text += text
            self._blocks()
            return ""
        self._pending += text
        i = self._pending.find(self.marker)
        if i >= 0:
            out, self._calls_text, self._pending = self._pending[:i], self._pending[i:], ""
            self._blocks()
            return out
        keep = _held(self._pending, self.marker)
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return out

    def _full(self) -> bool:
        return not self.parallel and len(self.calls) >= 1

    def _blocks(self) -> None:
        assert self._calls_text is not None
        if self.fmt == MISTRAL:
            return
        while not self._full():
            end = self._calls_text.find("</tool_call>", self._cursor)
            if end < 0:
                return
            end += len("</tool_call>")
            calls = parse_calls(self._calls_text[self._cursor:end], self.fmt)
            if calls is None:
                return  # left for finish(), which keeps it as content
            self.calls += calls
            self._cursor = end

    def take(self) -> list[ToolCall]:
        """Calls completed since the last ``take()``."""
        out = self.calls[self._given:]
        self._given = len(self.calls)
        return out

    def finish(self) -> str:
        """Parse what is held; returns content still to show (call text that did not parse)."""
        rest, self._pending = self._pending, ""
        if self._calls_text is None:
            return rest
        tail = self._calls_text[self._cursor:]
        self._cursor = len(self._calls_text)
        if self._full() or not tail.strip():
            return rest
        calls = parse_calls(tail, self.fmt)
        if calls is None:
            return tail + rest
        self.calls += calls
        if not self.parallel:
            self.calls = self.calls[:1]
        return rest
