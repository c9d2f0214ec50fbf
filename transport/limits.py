"""Every buffer, queue, cache and size bound in meshd, with units and the reason for its value.

One module so that limits are reviewed together. Sections per subsystem; add, do not scatter.
"""

from __future__ import annotations

# --- credentials / identity -------------------------------------------------------------------
MAX_CREDENTIAL_BYTES = 4096  # a genesis or member certificate is ~400 B; refuse anything 10x larger

# --- framing / transport (issue 2) ------------------------------------------------------------

# --- membership / gossip (issue 3) ------------------------------------------------------------

# --- API / tunnel (issue 5) -------------------------------------------------------------------

# --- engine (issue 4) -------------------------------------------------------------------------
# model forward pass (engine-model)
# queries per attention score matrix: bounds it to H*256*L*4 bytes (48 MB at H=12 heads, L=4096)
ATTENTION_QUERY_BLOCK = 256
# generation / scheduling (engine-gen)
MAX_ACTIVE_SEQUENCES = 8  # sequences a Scheduler runs at once per model: each holds a KV cache; more waits as 429
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's cap); bounds per-token work and response size
PREFILL_CHUNK_TOKENS = 512  # prompt tokens per scheduler step: bounds how long a new prompt stalls running streams
MAX_MODEL_SPEC_CHARS = 4096  # a --model SPEC (path or URL) longer than this is a mistake

# --- expert RPC (issue 6) ---------------------------------------------------------------------
