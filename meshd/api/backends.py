"""Local backends behind the API: token generators (the engine) and external ``openai:URL`` servers.

A backend serves a set of model names and turns a validated ``GenRequest`` into a ``Reply``:

- ``open(req, model)`` raises ``ApiError`` before the first byte (429 when full, 502 when the external
  server fails, 400 when the prompt does not fit); afterwards, failures come out of ``Reply.body``.
- ``models()`` lists only what can be served right now (an external server that is down serves nothing).
- ``in_flight()`` / ``capacity()`` feed the router's load decision and gossip.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import structlog

from meshd.api import limits as http_limits
from meshd.api.errors import ApiError
from meshd.api.reply import OpenAIFormatter, Reply, StopMatcher, TokenOut
from meshd.api.schema import GenRequest
from meshd.api.tools import HERMES, ToolStreamer
from transport import limits

log = structlog.get_logger(__name__)


class BackendBusy(Exception):
    """The backend has no free slot; the API answers 429 with Retry-After (or tries another node)."""


class Backend(Protocol):
    kind: str

    def models(self) -> list[str]: ...
    def in_flight(self) -> int: ...
    def capacity(self) -> int: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def open(self, req: GenRequest, model: str) -> Reply: ...
    def status(self) -> list[dict[str, Any]]: ...


# --- token generators (the engine, and stand-ins with the same shape) ---------------------------------

@dataclass
class GenToken:
    """One token from a generator; ``finish_reason`` ("stop" or "length") is set on the last one."""

    token_id: int
    text: str
    logprob: float | None = None
    top: list[tuple[str, float]] | None = None
    finish_reason: str | None = None
    piece: str | None = None  # the token's own string, when ``text`` (incremental detokenizer) differs


class TokenRun(Protocol):
    """One submitted generation: async-iterate its tokens; ``cancel()`` stops it within one step."""

    def __aiter__(self) -> AsyncIterator[GenToken]: ...
    def cancel(self) -> None: ...


class TokenSource(Protocol):
    """What the API needs from a generator (the engine adapter implements it over the Scheduler)."""

    name: str
    fingerprint: str

    def prompt_ids(self, req: GenRequest) -> list[int]: ...  # chat template / encode; ApiError(400) if too long
    def submit(self, prompt_ids: list[int], req: GenRequest) -> TokenRun: ...  # raises BackendBusy
    def in_flight(self) -> int: ...
    def capacity(self) -> int: ...


_PROMPT_POOL: ThreadPoolExecutor | None = None


def _prompt_pool() -> ThreadPoolExecutor:
    """The threads that build prompts (``API_PROMPT_THREADS``), shared by every backend of the process."""
    global _PROMPT_POOL
    if _PROMPT_POOL is None:
        _PROMPT_POOL = ThreadPoolExecutor(max_workers=http_limits.API_PROMPT_THREADS,
                                          thread_name_prefix="meshd-prompt")
    return _PROMPT_POOL


class GenBackend:
    """Serves one ``TokenSource`` under its name, formatting tokens as OpenAI JSON or SSE."""

    kind = "engine"

    def __init__(self, source: TokenSource, name: str | None = None) -> None:
        self.source = source
        self.name = name or source.name

    def models(self) -> list[str]:
        return [self.name]

    def in_flight(self) -> int:
        return self.source.in_flight()

    def capacity(self) -> int:
        return self.source.capacity()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def status(self) -> list[dict[str, Any]]:
        return [{"name": self.name, "fingerprint": self.source.fingerprint, "kind": self.kind}]

    async def open(self, req: GenRequest, model: str) -> Reply:
        # On a worker thread: a 4 MiB prompt takes seconds to template and tokenize, which on the loop
        # would stall every other request and the node's QUIC and membership with it.
        ids = await asyncio.get_running_loop().run_in_executor(_prompt_pool(), self.source.prompt_ids, req)
        try:
            run = self.source.submit(ids, req)
        except BackendBusy:
            raise ApiError(429, f"model '{self.name}' is at capacity on this node", retry_after_s=1) from None
        fmt = OpenAIFormatter(req, self.name)
        reply = Reply(200, {}, _empty(), stream=req.stream)
        reply.headers["Content-Type"] = "text/event-stream" if req.stream else "application/json"
        reply.body = self._body(run, fmt, req, len(ids), reply)

        async def cancel() -> None:  # also when the body was never iterated
            run.cancel()

        reply.on_close = cancel
        return reply

    async def _body(self, run: TokenRun, fmt: OpenAIFormatter, req: GenRequest, n_prompt: int,
                    reply: Reply) -> AsyncIterator[bytes]:
        stops = StopMatcher(req.stop)
        tools = ToolStreamer(getattr(self.source, "tool_format", HERMES), req.parallel_tool_calls) \
            if req.tools_active else None
        content: list[str] = []  # tool mode: the text outside tool calls
        sent_calls = 0  # tool calls streamed so far
        toks: list[TokenOut] = []
        n_gen = 0
        finish = "stop"
        done = False
        try:
            if req.stream:
                first = fmt.first_chunk()
                if first:
                    yield first
            async for g in run:
                n_gen += 1
                out, stopped = stops.push(TokenOut(g.text, g.logprob, list(g.top or []), g.piece))
                if stopped:
                    finish = "stop"
                elif g.finish_reason is not None:
                    finish = g.finish_reason
                    out = out + stops.flush()
                elif req.max_tokens is not None and n_gen >= req.max_tokens:
                    finish = "length"
                    out = out + stops.flush()
                    stopped = True
                if out:
                    if tools is not None:
                        shown = tools.feed("".join(t.text for t in out))
                        content.append(shown)
                        if req.stream:
                            if shown:
                                yield fmt.content_chunk(shown)
                            for c in tools.take():
                                yield fmt.tool_chunk(sent_calls, c)
                                sent_calls += 1
                    elif req.stream:
                        yield fmt.token_chunk(out)
                    else:
                        toks.extend(out)
                if stopped or g.finish_reason is not None:
                    break
            else:
                rest = stops.flush()
                if rest:
                    if tools is not None:
                        content.append(tools.feed("".join(t.text for t in rest)))
                        if req.stream and content[-1]:
                            yield fmt.content_chunk(content[-1])
                    elif req.stream:
                        yield fmt.token_chunk(rest)
                    else:
                        toks.extend(rest)
            calls = []
            if tools is not None:
                tail = tools.finish()
                content.append(tail)
                if tail and req.stream:
                    yield fmt.content_chunk(tail)
                calls = tools.calls
                if calls and finish == "stop":
                    finish = "tool_calls"
                if req.stream:
                    for c in tools.take():
                        yield fmt.tool_chunk(sent_calls, c)
                        sent_calls += 1
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
            reply.usage = usage
            done = True
            if req.stream:
                yield fmt.final_chunk(finish, usage if req.include_usage else None)
            elif tools is not None:
                yield fmt.full([], finish, usage, tool_calls=calls, content="".join(content))
            else:
                yield fmt.full(toks, finish, usage)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine failed mid-generation
            log.warning("generation_failed", model=self.name, error=type(e).__name__)
            raise ApiError(500, f"generation failed on this node ({type(e).__name__})") from None
        finally:
            run.cancel()  # idempotent; stops the engine at once when the client went away (not done)


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover


# --- external OpenAI-compatible servers (openai:URL) ---------------------------------------------------

def _rewrite_model(data: bytes, name: str) -> bytes:
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if isinstance(obj, dict) and "model" in obj:
        obj["model"] = name
        return json.dumps(obj, separators=(",", ":")).encode()
    return data


class OpenAIBackend:
    """An external OpenAI-compatible server (llama-server, vLLM, Ollama) at ``url`` (ending in ``/v1``).

    Its models come from ``url/models``, re-read every ``health_interval_s``; while it does not answer,
    this backend serves nothing (no phantom models). ``alias`` serves the server's first model under
    another name (the ``NAME=openai:URL`` form).
    """

    kind = "openai"

    def __init__(
        self,
        url: str,
        *,
        alias: str | None = None,
        max_in_flight: int = 64,
        connect_timeout_s: float = limits.OPENAI_BACKEND_CONNECT_TIMEOUT_S,
        first_byte_timeout_s: float = limits.OPENAI_BACKEND_FIRST_BYTE_TIMEOUT_S,
        idle_timeout_s: float = limits.OPENAI_BACKEND_IDLE_TIMEOUT_S,
        health_interval_s: float = limits.OPENAI_BACKEND_HEALTH_INTERVAL_S,
        health_timeout_s: float = limits.OPENAI_BACKEND_HEALTH_TIMEOUT_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.alias = alias
        self.max_in_flight = max_in_flight
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self._upstream: dict[str, str] = {}  # served name -> upstream name
        self._in_flight = 0
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.healthy = False

    def models(self) -> list[str]:
        return sorted(self._upstream)

    def in_flight(self) -> int:
        return self._in_flight

    def capacity(self) -> int:
        return self.max_in_flight

    def status(self) -> list[dict[str, Any]]:
        return [{"name": n, "fingerprint": f"openai:{self.url}#{u}", "kind": self.kind}
                for n, u in sorted(self._upstream.items())]

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            auto_decompress=True,
        )
        await self.refresh()
        self._task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self._session is not None:
            await self._session.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        """Re-read ``url/models``; on any failure serve nothing until the next success."""
        assert self._session is not None, "start() first"
        try:
            async with self._session.get(
                self.url + "/models", timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
                data = await resp.content.read(1024 * 1024)
            obj = json.loads(data)
            names = [m["id"] for m in obj["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
            names = names[: limits.OPENAI_BACKEND_MAX_MODELS]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, OSError) as e:
            if self.healthy or not self._upstream:
                log.warning("openai_backend_down", url=self.url, reason=str(e) or type(e).__name__)
            self.healthy = False
            self._upstream = {}
            return
        if self.alias is not None:
            upstream = {self.alias: names[0]} if names else {}
        else:
            upstream = {n: n for n in names}
        if not self.healthy or upstream != self._upstream:
            log.info("openai_backend_models", url=self.url, models=sorted(upstream))
        self.healthy = True
        self._upstream = upstream

    async def open(self, req: GenRequest, model: str) -> Reply:
        upstream = self._upstream.get(model)
        if upstream is None or self._session is None:
            raise ApiError(503, f"model '{model}' is not available on its external server right now")
        if self._in_flight >= self.max_in_flight:
            raise ApiError(429, f"model '{model}' is at capacity on this node", retry_after_s=1)
        body = dict(req.raw)
        body["model"] = upstream
        path = "/chat/completions" if req.kind == "chat" else "/completions"
        self._in_flight += 1
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_flight -= 1

        try:
            resp = await asyncio.wait_for(
                self._session.post(self.url + path, json=body,
                                   timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)),
                self.first_byte_timeout_s,
            )
        except asyncio.TimeoutError:
            await release()
            raise ApiError(502, f"external server for '{model}' did not answer in time",
                           code="upstream_timeout") from None
        except (aiohttp.ClientError, OSError) as e:
            await release()
            raise ApiError(502, f"external server for '{model}' is unreachable ({type(e).__name__})") from None
        except BaseException:  # cancelled: the client went away before the external server answered
            await release()
            raise
        if resp.status != 200:
            try:
                data = await asyncio.wait_for(resp.content.read(64 * 1024), self.idle_timeout_s)
                payload: Any = json.loads(data)
            except (ValueError, asyncio.TimeoutError, aiohttp.ClientError):
                payload = None
            resp.release()
            await release()
            if resp.status >= 500:
                raise ApiError(502, f"external server for '{model}' failed with status {resp.status}")
            err = ApiError.from_payload(resp.status, payload)
            if resp.status == 429:
                err.retry_after_s = 1
            raise err
        stream = req.stream
        reply = Reply(200, {"Content-Type": "text/event-stream" if stream else "application/json"},
                      _empty(), stream=stream, on_close=release)
        rename = model != upstream
        reply.body = self._relay(resp, stream, rename, model, reply, release)
        return reply

    async def _relay(self, resp: aiohttp.ClientResponse, stream: bool, rename: bool, model: str,
                     reply: Reply, release: Any) -> AsyncIterator[bytes]:
        try:
            if not stream:
                buf = bytearray()
                while True:
                    chunk = await asyncio.wait_for(resp.content.readany(), self.idle_timeout_s)
                    if not chunk:
                        break
                    buf += chunk
                    if len(buf) > limits.TUNNEL_MAX_RESPONSE_BYTES:
                        raise ApiError(502, "external server's response is too large")
                data = bytes(buf)
                try:
                    usage = json.loads(data).get("usage")
                    if isinstance(usage, dict):
                        reply.usage = {k: v for k, v in usage.items() if isinstance(v, int)}
                except (ValueError, AttributeError):
                    pass
                yield _rewrite_model(data, model) if rename else data
                return
            pending = b""
            tail = b""  # the last bytes seen: did the stream end properly ([DONE] or an error event)?
            while True:
                try:
                    chunk = await asyncio.wait_for(resp.content.readany(), self.idle_timeout_s)
                except asyncio.TimeoutError:
                    raise ApiError(502, f"external server for '{model}' went silent mid-stream",
                                   code="upstream_timeout") from None
                if not chunk:
                    if pending.strip():
                        yield pending
                    last_event = tail.strip().rsplit(b"\n\n", 1)[-1]
                    if b"[DONE]" not in last_event and b'"error"' not in last_event:
                        raise ApiError(502, f"external server for '{model}' ended the stream early")
                    break
                tail = (tail + chunk)[-4096:]
                if not rename:
                    yield chunk
                    continue
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                out = bytearray()
                for ev in events:
                    if ev.startswith(b"data: ") and ev[6:] != b"[DONE]":
                        out += sse_raw(_rewrite_model(ev[6:], model))
                    else:
                        out += ev + b"\n\n"
                if out:
                    yield bytes(out)
        except (aiohttp.ClientError, OSError) as e:
            raise ApiError(502, f"external server for '{model}' failed mid-response ({type(e).__name__})") from None
        finally:
            resp.release()
            await release()


def sse_raw(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


__all__ = ["Backend", "BackendBusy", "GenBackend", "GenToken", "OpenAIBackend", "TokenRun", "TokenSource"]
