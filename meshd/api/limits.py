"""Limits of the HTTP API's connection layer (``meshd.api.http``): deadlines and connection caps.

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
