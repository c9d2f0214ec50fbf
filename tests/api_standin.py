"""A deterministic stand-in generator and OpenAI-compatible server process for API tests and bench.

``standin_words(prompt_ids, seed, n)`` is the seeded reference: the same request always gives the same
tokens, so a response that went through any number of nodes can be checked exactly. ``StandInSource``
implements ``meshd.api.backends.TokenSource``; a request may carry ``"standin": {"think_s", "token_delay_s",
"fail_after"}`` to make it slow or fail. Run as a program it serves these models over real HTTP:

    python tests/api_standin.py --models a,b [--port 0] [--max-active N]    # prints "PORT <n>" when ready
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshd.api.backends import BackendBusy, GenBackend, GenToken  # noqa: E402
from meshd.api.errors import ApiError  # noqa: E402
from meshd.api.schema import GenRequest  # noqa: E402

WORDS = [" alpha", " beta", " gamma", " delta", " eps", " zeta", " eta", " theta", " iota", " kappa",
         " lambda", " mu", " nu", " xi", " omicron", " pi", " rho", " sigma", " tau", " ups"]
DEFAULT_MAX_TOKENS = 16


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def prompt_ids_of(req: GenRequest) -> list[int]:
    if req.kind == "chat":
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in req.messages) + "<assistant>"
        return list(text.encode())
    if isinstance(req.prompt, list):
        return list(req.prompt)
    return list(req.prompt.encode())


def standin_words(prompt_ids: list[int], seed: int | None, n: int) -> list[tuple[int, str, float]]:
    """The reference output: (token id, text, logprob) for n tokens."""
    out = []
    for i in range(n):
        h = _h(tuple(prompt_ids), seed, i)
        tid = h % len(WORDS)
        out.append((tid, WORDS[tid], -((h >> 8) % 1000) / 1000.0 - 0.001))
    return out


class _Run:
    def __init__(self, src: StandInSource, ids: list[int], req: GenRequest) -> None:
        self.src, self.ids, self.req = src, ids, req
        opts = req.raw.get("standin") if isinstance(req.raw.get("standin"), dict) else {}
        self.think_s = float(opts.get("think_s", 0.0))
        self.delay_s = float(opts.get("token_delay_s", src.token_delay_s))
        self.fail_after = opts.get("fail_after")
        self.cancelled = False
        self.finished = False
        self.complete = False  # the last token was produced

    def cancel(self) -> None:
        if not self.cancelled and not self.complete:
            self.src.cancelled += 1
        self.cancelled = True
        self._done()

    def _done(self) -> None:
        if not self.finished:
            self.finished = True
            self.src.active -= 1

    async def __aiter__(self) -> AsyncIterator[GenToken]:
        n = self.req.max_tokens or DEFAULT_MAX_TOKENS
        try:
            if self.think_s:
                await asyncio.sleep(self.think_s)
            words = standin_words(self.ids, self.req.seed, n)
            for i, (tid, text, lp) in enumerate(words):
                if self.cancelled:
                    return
                if self.fail_after is not None and i >= int(self.fail_after):
                    raise RuntimeError("stand-in failure")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                else:
                    await asyncio.sleep(0)
                if i == n - 1:
                    self.complete = True
                top = [(text, lp)] + [(WORDS[(tid + k) % len(WORDS)], lp - k) for k in range(1, 6)]
                yield GenToken(tid, text, lp, top, "length" if i == n - 1 else None)
        finally:
            self._done()


class StandInSource:
    fingerprint = "standin"

    def __init__(self, name: str = "standin", max_active: int = 64, token_delay_s: float = 0.0) -> None:
        self.name = name
        self.max_active = max_active
        self.token_delay_s = token_delay_s
        self.active = 0
        self.cancelled = 0

    def prompt_ids(self, req: GenRequest) -> list[int]:
        ids = prompt_ids_of(req)
        if len(ids) > 100_000:
            raise ApiError(400, "prompt too long for the stand-in", code="context_length_exceeded")
        return ids

    def submit(self, prompt_ids: list[int], req: GenRequest) -> _Run:
        if self.active >= self.max_active:
            raise BackendBusy()
        self.active += 1
        return _Run(self, prompt_ids, req)

    def in_flight(self) -> int:
        return self.active

    def capacity(self) -> int:
        return self.max_active


def standin_backends(models: list[str], max_active: int = 64, token_delay_s: float = 0.0) -> list[GenBackend]:
    return [GenBackend(StandInSource(m, max_active, token_delay_s)) for m in models]


async def _serve(args: argparse.Namespace) -> None:
    import logging

    import structlog

    from meshd.api.server import ApiConfig, ApiServer

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    server = ApiServer(ApiConfig(node_id="standin-server", extra_fields=frozenset({"standin"})),
                       standin_backends(args.models.split(","), args.max_active, args.token_delay))
    host, port = await server.start("127.0.0.1", args.port)
    sys.stdout.write(f"PORT {port}\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="standin")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-active", type=int, default=64)
    ap.add_argument("--token-delay", type=float, default=0.0)
    asyncio.run(_serve(ap.parse_args()))
