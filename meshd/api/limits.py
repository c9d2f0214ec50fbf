"""Limits of the HTTP API: its connection layer (``meshd.api.http``: deadlines and connection caps) and its
request schema (structured outputs, tools, sampling extensions).

The request-level limits (body size, keys, tokens) live in ``transport.limits`` with the rest of the
wire limits; these are the ones that protect the HTTP server itself from clients that hold connections
open without finishing a request (slowloris, slow bodies, idle keep-alive).
"""

from __future__ import annotations

API_HEAD_TIMEOUT_S = 10.0
"""From a connection's opening (or, on a kept-alive connection, the first byte of the next request) to
the end of the request head. A real client sends its head in one write; nginx allows 60 s, Node 60 s.
10 s leaves room for a loaded machine and closes slowloris connections well within 30 s."""

API_BODY_TIMEOUT_S = 20.0
"""From the end of the head to the end of the body. The largest body (``API_MAX_BODY_BYTES``, 4 MiB) takes
well under a second on any LAN; 20 s allows a 2 Mbit/s link."""

API_KEEPALIVE_IDLE_S = 15.0
"""How long a kept-alive connection may sit idle between requests (nginx: 75 s, Node: 5 s)."""

API_WRITE_STALL_S = 30.0
"""How long one write of a streamed answer may wait for the client to read (the socket buffers full, a
few MB on loopback) before the connection is aborted and the generation cancelled. A client that stops
reading without closing used to hold its connection, and count as a request in progress, for ever.
Longer than the body deadline: a reader that is merely slow makes progress well within it."""

API_PROMPT_THREADS = 2
"""Threads that template and tokenize prompts (off the event loop). Tokenizing a 4 MiB prompt takes seconds
and ~400 MB at its peak (the Rust tokenizer's encoding of ~2 million tokens), so this bounds what a burst of
huge prompts costs: 32 at once peaked at 5.3 GB on asyncio's default pool of 6 threads. Two keep one
huge prompt from holding up everyone else's."""

API_LINGER_S = 2.0
"""After answering without reading the whole body (an error), how long the rest is read and dropped
before the connection is closed (aiohttp's default is 10 s)."""

API_MAX_CONNECTIONS_PER_ADDRESS = 256
"""Open connections from one IP address: above the 200 concurrent requests a client (or a reverse proxy,
where every client shares one address) was seen to make. A new connection over the cap evicts that
address's oldest connection that has no request in progress; only if all are busy is it refused (429)."""

API_MAX_CONNECTIONS = 512
"""Open connections in total, same eviction as above. Each costs a file descriptor: systemd's default
soft limit is 1024 per process, and the node needs some for itself."""

API_MAX_HEAD_LINE_BYTES = 8190
"""Longest request line or header line (aiohttp's default; an oversize head is a 400 in OpenAI's shape)."""

# ----- request schema (meshd.api.schema) ---------------------------------------------------------
API_MAX_TOOLS = 128  # functions in one request's ``tools`` (OpenAI's limit)
API_MAX_LOGIT_BIAS = 1024  # entries in ``logit_bias``: each is a scatter into the [V] logits every step
API_MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| (OpenAI: -100..100; +-100 bans or forces a token)
API_MAX_REPETITION_PENALTY = 10.0  # above this every seen token is effectively banned
API_MAX_FUNCTION_NAME = 64  # characters of a function or response_format name (OpenAI: a-zA-Z0-9_-, 64)
