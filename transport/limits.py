"""Every buffer, queue, cache and size bound in meshd, with units and the reason for its value.

One module so that limits are reviewed together. Sections per subsystem; add, do not scatter.
"""

from __future__ import annotations

# --- credentials / identity -------------------------------------------------------------------
MAX_CREDENTIAL_BYTES = 4096  # a genesis or member certificate is ~400 B; refuse anything 10x larger

# --- framing / transport (issue 2) ------------------------------------------------------------
FRAME_HEADER_BYTES = 9  # magic(2) version(1) type(1) flags(1) length(4); fixed by transport.framing
STREAM_PREAMBLE_BYTES = 4  # magic(2) stream type(1) protocol version(1)
# Largest frame payload accepted per stream type (bytes), checked from the header before buffering.
MAX_HANDSHAKE_FRAME_BYTES = 16 * 1024  # hello 64 B, auth = 64 B sig + cert (<= 4 KiB); 4x headroom
MAX_JOIN_FRAME_BYTES = 64 * 1024  # opaque join request/reply: a token or genesis+cert is ~2 KiB
MAX_GOSSIP_FRAME_BYTES = 1024 * 1024  # a batch of signed membership records
MAX_RPC_FRAME_BYTES = 4 * 1024 * 1024  # generic request/response messages
MAX_HTTP_TUNNEL_FRAME_BYTES = 1024 * 1024  # one chunk of a tunnelled HTTP body; bodies are chunked
MAX_EXPERT_FRAME_BYTES = 16 * 1024 * 1024  # activations of a prefill batch (e.g. 512 x 4096 x fp32 = 8 MiB)
MAX_REFUSAL_REASON_BYTES = 200  # refusal/close reasons are one short line
# Per-connection and per-transport caps.
MAX_CONNECTIONS = 256  # simultaneous QUIC connections (admitted or handshaking) per transport
MAX_STREAMS_PER_PEER = 256  # concurrently open application streams per connection (each way)
STREAM_SEND_BUFFER_BYTES = 512 * 1024  # unacknowledged bytes queued per stream before send() waits
STREAM_RECV_QUEUE_FRAMES = 1024  # frames received but not yet read per stream before it is reset
STREAM_RECV_QUEUE_BYTES = 8 * 1024 * 1024  # bytes received but not yet read per stream before reset
MAX_PENDING_HANDSHAKES = 64  # connections still proving membership; more are refused at once
MAX_EARLY_STREAM_BYTES = 1024 * 1024  # server stream data a client holds while its ACCEPT is in flight

# --- daemon: control socket (issue 2, daemon) ------------------------------------------------
MAX_CONTROL_LINE_BYTES = 1 << 20  # one control request/reply line; status of a big mesh is ~100 KiB
MAX_CONTROL_CONNECTIONS = 64  # concurrent local CLI clients; more means something is looping

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
EXPERT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # one expert request/reply; a 4096-token prefill slice at
#   D=4096 fp32 is 64 MiB of rows; bigger layers are split by work item, so 256 MiB is never reached by a
#   well-behaved coordinator and bounds what a peer can make us buffer
EXPERT_MAX_ROWS = 65536  # hidden rows in one request: more than any prefill chunk the engine runs
EXPERT_MAX_PAIRS = 65536 * 16  # (row, expert) pairs in one request: rows x the largest top-k we know (8) x2
EXPERT_MAX_DIM = 65536  # hidden size: the largest published MoE (DeepSeek-V3, 7168) with headroom
EXPERT_MAX_ERROR_TEXT_BYTES = 1024  # an error's human text: one line naming what failed
EXPERT_MAX_SHARD_RANGES = 1024  # (layer, expert) rectangles a worker advertises in its hello
EXPERT_MAX_ECHO_BYTES = 1024 * 1024  # echo payload used to measure round trips; 4 KB is the norm
EXPERT_SEND_CHUNK_BYTES = 1024 * 1024  # a message is written to the stream in slices of this size, so a
#   transport frame limit below the message size never matters and other streams interleave
EXPERT_WINDOW_BYTES = 4 * 1024 * 1024  # request bytes in flight to one worker within a layer: half the
#   transport's unread-bytes limit per stream (STREAM_RECV_QUEUE_BYTES), which a worker busy computing
#   would otherwise overrun when a big layer is split into several requests
EXPERT_MAX_ADVERTISED_RANGES = 128  # shard rectangles put into our gossip record (the membership record's
#   own cap on expert entries); discovery only: the hello tells the coordinator exactly what is held
EXPERT_MAX_INFLIGHT_PER_WORKER = 64  # outstanding requests on one worker link (engine threads x layers)
