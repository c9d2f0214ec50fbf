"""A response in flight between a backend (or a tunnel) and the HTTP writer, plus OpenAI formatting.

``Reply`` is what every producer returns once it knows the status: the engine backend, the ``openai:URL``
backend and the tunnel client. Its ``body`` yields raw bytes (one JSON document, or SSE events); it may
raise ``ApiError`` (or any exception) after it started, which the writer turns into an SSE error event.
``aclose()`` must be called when the consumer stops early: it cancels the generation behind it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from meshd.api.schema import GenRequest

SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: AsyncIterator[bytes]
    stream: bool
    node_id: str = ""
    route: str = "local"
    on_close: Callable[[], Awaitable[None]] | None = None
    usage: dict[str, int] = field(default_factory=dict)  # filled by producers that know token counts
    model: str = ""  # the model that answered (what "auto" resolved to), for the request log
    events: int = 0  # SSE data events passed through from a peer (about tokens), for the request log

    async def aclose(self) -> None:
        aclose = getattr(self.body, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:  # noqa: BLE001 - closing must not fail the caller
                pass
        if self.on_close is not None:
            cb, self.on_close = self.on_close, None
            await cb()


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


@dataclass
class TokenOut:
    """One generated token as the formatter needs it. ``top`` holds (token text, logprob) alternatives."""

    text: str
    logprob: float | None = None
    top: list[tuple[str, float]] = field(default_factory=list)
    token: str | None = None  # the token's own string for logprobs (text may hold a partial character)

    @property
    def shown(self) -> str:
        return self.token if self.token is not None else self.text


class OpenAIFormatter:
    """Builds OpenAI chat/completions JSON objects and SSE chunks for one request."""

    def __init__(self, req: GenRequest, model: str, *, now: float | None = None) -> None:
        self.req = req
        self.model = model
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(now if now is not None else time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self._text_offset = 0

    # -- logprobs ----------------------------------------------------------------------------------
    def _chat_lp(self, toks: list[TokenOut]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        content = []
        for t in toks:
            content.append({
                "token": t.shown, "logprob": t.logprob if t.logprob is not None else 0.0,
                "bytes": _token_bytes(t.shown),
                "top_logprobs": [{"token": s, "logprob": lp, "bytes": _token_bytes(s)}
                                 for s, lp in t.top[: self.req.top_logprobs]],
            })
        return {"content": content}

    def _completion_lp(self, toks: list[TokenOut]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in toks:
            out["tokens"].append(t.shown)
            out["token_logprobs"].append(t.logprob if t.logprob is not None else 0.0)
            out["top_logprobs"].append({s: lp for s, lp in t.top[: self.req.top_logprobs]})
            out["text_offset"].append(self._text_offset)
            self._text_offset += len(t.text)
        return out

    def _lp(self, toks: list[TokenOut]) -> dict[str, Any] | None:
        return self._chat_lp(toks) if self.chat else self._completion_lp(toks)

    # -- streaming -----------------------------------------------------------------------------------
    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def first_chunk(self) -> bytes | None:
        if not self.chat:
            return None
        return sse(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}))

    def token_chunk(self, toks: list[TokenOut]) -> bytes:
        text = "".join(t.text for t in toks)
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": self._lp(toks), "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._lp(toks), "finish_reason": None}
        return sse(self._chunk(choice))

    def content_chunk(self, text: str) -> bytes:
        """A chat delta of plain content (tool mode: text outside tool calls, without logprobs)."""
        return sse(self._chunk({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}))

    def tool_chunk(self, index: int, call: Any) -> bytes:
        """One complete tool call as OpenAI's delta (``call`` is a ``meshd.api.tools.ToolCall``)."""
        return sse(self._chunk({"index": 0, "delta": {"tool_calls": [call.openai(index)]}, "logprobs": None,
                                "finish_reason": None}))

    def final_chunk(self, finish_reason: str, usage: dict[str, int] | None) -> bytes:
        if self.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        out = sse(self._chunk(choice))
        if usage is not None:
            u = self._chunk({"index": 0, "delta": {}, "finish_reason": None})
            u["choices"] = []
            u["usage"] = usage
            out += sse(u)
        return out + SSE_DONE

    # -- whole response ------------------------------------------------------------------------------
    def full(self, toks: list[TokenOut], finish_reason: str, usage: dict[str, int],
             tool_calls: list[Any] | None = None, content: str | None = None) -> bytes:
        """The whole response. With ``tool_calls`` (``meshd.api.tools.ToolCall``), ``content`` is the text
        outside them (None when empty, as OpenAI sends it)."""
        text = "".join(t.text for t in toks) if content is None else content
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": [c.openai() for c in tool_calls]}
            choice: dict[str, Any] = {"index": 0, "message": message,
                                      "logprobs": self._lp(toks), "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._lp(toks), "finish_reason": finish_reason}
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": [choice], "usage": usage}
        return json.dumps(obj, separators=(",", ":")).encode()


class StopMatcher:
    """Holds back generated tokens that might begin a stop sequence.

    ``push(tok)`` returns ``(tokens safe to emit, stopped)``. When a stop sequence appears, the text up to
    it is emitted (the token holding it is cut) and ``stopped`` is True. ``flush()`` returns what is held
    when generation ends for another reason.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._held: list[TokenOut] = []

    def _hold_len(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    best = max(best, k)
                    break
        return best

    def push(self, tok: TokenOut) -> tuple[list[TokenOut], bool]:
        if not self.stops:
            return [tok], False
        self._held.append(tok)
        text = "".join(t.text for t in self._held)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out: list[TokenOut] = []
            pos = 0
            for t in self._held:
                if pos + len(t.text) <= cut:
                    out.append(t)
                elif pos < cut:
                    out.append(TokenOut(t.text[: cut - pos], t.logprob, t.top, t.token))
                pos += len(t.text)
            self._held = []
            return out, True
        keep_from = len(text) - self._hold_len(text)
        out, pos, i = [], 0, 0
        while i < len(self._held) and pos + len(self._held[i].text) <= keep_from:
            pos += len(self._held[i].text)
            out.append(self._held[i])
            i += 1
        self._held = self._held[i:]
        return out, False

    def flush(self) -> list[TokenOut]:
        out, self._held = self._held, []
        return out
