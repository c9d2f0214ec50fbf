"""Every buffer, queue, cache and size bound in meshd, with units and the reason for its value.

One module so that limits are reviewed together. Sections per subsystem; add, do not scatter.
"""

from __future__ import annotations

# --- credentials / identity -------------------------------------------------------------------
MAX_CREDENTIAL_BYTES = 4096  # a genesis or member certificate is ~400 B; refuse anything 10x larger

# --- framing / transport (issue 2) ------------------------------------------------------------

# --- membership / gossip (issue 3) ------------------------------------------------------------

# --- API / tunnel (issue 5) -------------------------------------------------------------------
API_MAX_BODY_BYTES = 4 * 1024 * 1024  # one chat/completions body; 4096-token contexts are ~100 KiB of JSON
API_MAX_HEADER_BYTES = 16 * 1024  # request head carried through the tunnel (method, path, kept headers)
API_MAX_MESSAGES = 4096  # chat messages in one request; more is a client bug, not a conversation
API_MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
API_MAX_STOP_CHARS = 256  # characters of one stop sequence; bounds the hold-back buffer in streaming
API_MAX_TOKENS = 1 << 20  # upper bound accepted for max_tokens (the model's context bounds it further)
API_MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI allows 0-20); completions logprobs allow 0-5
API_MAX_KEYS = 1024  # lines read from --api-key-file; each key is compared in constant time
API_MAX_KEY_FILE_BYTES = 256 * 1024  # the key file itself
TUNNEL_CHUNK_BYTES = 16 * 1024  # body bytes per tunnel frame: small enough to interleave, big enough to amortise
TUNNEL_MAX_FRAME_BYTES = TUNNEL_CHUNK_BYTES + API_MAX_HEADER_BYTES  # largest frame a tunnel peer may send
TUNNEL_MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # buffered non-streaming response (JSON of a long generation)
TUNNEL_CONNECT_TIMEOUT_S = 5.0  # opening a tunnel stream to a connected peer; then try the next node
TUNNEL_FIRST_BYTE_TIMEOUT_S = 600.0  # a model may think for minutes before its first byte (keep-alive covers the wire)
TUNNEL_HEARTBEAT_INTERVAL_S = 0.3  # serving side: a frame at least this often, even while the model thinks
TUNNEL_HEARTBEAT_TIMEOUT_S = 1.8  # front side: silence this long means the serving node is gone (SPEC: error within 2 s)
TUNNEL_POLL_INTERVAL_S = 2.0  # directory refresh of peers' served models over the tunnel (until membership)
TUNNEL_POLL_TIMEOUT_S = 3.0  # one directory poll; a peer that does not answer is left out (no phantoms)
OPENAI_BACKEND_CONNECT_TIMEOUT_S = 5.0  # connect to an external openai:URL server
OPENAI_BACKEND_FIRST_BYTE_TIMEOUT_S = 600.0  # headers from an external server (long prompts on big models)
OPENAI_BACKEND_IDLE_TIMEOUT_S = 120.0  # silence between streamed chunks from an external server
OPENAI_BACKEND_HEALTH_INTERVAL_S = 5.0  # re-discovery of an external server's models (URL/models)
OPENAI_BACKEND_HEALTH_TIMEOUT_S = 3.0  # one health probe
OPENAI_BACKEND_MAX_MODELS = 256  # models accepted from one external server's /models

# --- engine (issue 4) -------------------------------------------------------------------------

# --- expert RPC (issue 6) ---------------------------------------------------------------------
