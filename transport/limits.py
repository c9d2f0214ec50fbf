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
MAX_RECORD_BYTES = 16 * 1024  # a signed node record with its cert is ~1.2 KB; 16 KB leaves room for
#                               ~64 models and ~128 expert shards, and bounds what one peer can make us store
MAX_RECORD_MODELS = 64  # served models listed in one record
MAX_RECORD_EXPERTS = 128  # expert shard entries in one record
MAX_RECORD_ADDRS = 16  # addresses in one record (all interfaces of a multi-homed host)
MAX_RECORD_STRING_CHARS = 256  # any single string field in a record (names, fingerprints, addresses)
MAX_REVOCATION_BYTES = 64 * 1024  # signed ban list; ~36 B per banned id -> ~1,700 bans
MAX_BANNED_NODES = 1024  # entries in the ban list; a mesh banning more needs a new genesis
MAX_MEMBERSHIP_FRAME_BYTES = 512 * 1024  # one membership frame (< MAX_GOSSIP_FRAME_BYTES); anti-entropy deltas carry up to 64 records
MAX_GOSSIP_JSON_BYTES = 256 * 1024  # the JSON part of a frame (claims, digests, want lists)
MAX_GOSSIP_BLOBS = 64  # records/ban lists in one frame; a larger sync continues next round
MAX_GOSSIP_CLAIMS = 256  # suspect/dead claims in one frame
MAX_DIGEST_ENTRIES = 4096  # (id, incarnation, state) triples in one anti-entropy digest reply
MAX_PIGGYBACK_BYTES = 8 * 1024  # gossip piggybacked on one probe/ack, keeps probes small and fast
MAX_MEMBERS = 10_000  # entries (incl. tombstones) one node keeps; beyond this, new records are dropped
MAX_PENDING_RELAYS = 1024  # indirect probes this node relays for others at once
MAX_VERIFY_CACHE = 8192  # verified-signature cache entries (avoid re-verifying the same record bytes)
MAX_INVITE_TOKEN_CHARS = 4096  # a token is ~300 chars; refuse pasting a whole file
MAX_JOIN_MESSAGE_BYTES = 60 * 1024  # join response (genesis, cert, first view); < MAX_JOIN_FRAME_BYTES
MAX_JOIN_VIEW_RECORDS = 32  # records handed to a joiner (~40 KB); gossip fills in the rest
MAX_REMEMBERED_PEERS = 64  # addresses kept in the state dir to rejoin after a restart without a token

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
