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
MAX_PIPELINE_FRAME_BYTES = 2 * 1024 * 1024  # a slice of a stage frame (the stage protocol writes 1 MiB slices)
MAX_REFUSAL_REASON_BYTES = 200  # refusal/close reasons are one short line
# Per-connection and per-transport caps.
MAX_CONNECTIONS = 256  # simultaneous QUIC connections (admitted or handshaking) per transport
MAX_STREAMS_PER_PEER = 256  # concurrently open application streams per connection (each way)
UDP_RECV_BUFFER_BYTES = 4 * 1024 * 1024  # kernel receive buffer asked for on each UDP socket (the kernel caps
#   it, Linux at net.core.rmem_max): the default (~208 KiB on Linux) overflows on a burst of a dozen 16 KiB
#   loopback datagrams, and a dropped tail packet waits for a probe timeout (>= max_ack_delay, 25 ms)
STREAM_SEND_BUFFER_BYTES = 512 * 1024  # unacknowledged bytes queued per stream before send() waits
STREAM_RECV_QUEUE_FRAMES = 1024  # frames received but not yet read per stream before it is reset
STREAM_RECV_QUEUE_BYTES = 8 * 1024 * 1024  # bytes received but not yet read per stream before reset
MAX_PENDING_HANDSHAKES = 64  # connections still proving membership; a new one evicts the least promising
MAX_PENDING_HANDSHAKES_PER_SOURCE = 8  # ... from one source address: a stranger's share; a NAT'd office of
#   members dials a few at a time, and an evicted member handshake is redialled
HINT_WINDOW_S = 60.0  # a member's Initial hint is honoured this long either side of its timestamp (clock skew)
MAX_REMEMBERED_HINTS = 4096  # hint nonces remembered (each counts once); when full, hints are ignored
RETRY_ABOVE_PENDING_HANDSHAKES = 16  # handshakes in progress beyond which new clients must pass QUIC address
#   validation (a Retry round trip) first: a spoofed source then creates nothing
MAX_EARLY_STREAM_BYTES = 1024 * 1024  # server stream data a client holds while its ACCEPT is in flight

# --- data lane (issue 19: TLS over TCP between members, transport.lane) --------------------------
MAX_RELAY_FRAME_BYTES = 64 * 1024  # a path-control request/reply (the lane's port) is a few bytes
LANE_MUX_HEADER_BYTES = 9  # kind(1) stream id(4) length(4); fixed by transport.lane_wire
LANE_AUTH_TIMEOUT_S = 1.0  # a lane connection must finish TLS and prove a member's key within this; a
#   stranger is refused (and forgotten) by then. A member on a LAN needs ~3 round trips
LANE_MAX_PENDING = 32  # lane connections still authenticating, in all; more are refused at once
LANE_MAX_PENDING_PER_SOURCE = 4  # ...and from one source address (a member dials one lane at a time)
LANE_MAX_CONNECTIONS = 256  # authenticated lanes (one per connected member, as MAX_CONNECTIONS)
LANE_KEEPALIVE_S = 2.0  # a PING after this much silence on a lane...
LANE_DEAD_S = 6.0  # ...and a lane silent this long is closed (its streams fail; QUIC carries on)
LANE_RETRY_MIN_S = 0.2  # redial a lost lane after this at first...
LANE_RETRY_MAX_S = 10.0  # ...doubling up to this while dials keep failing
LANE_SEND_BUFFER_BYTES = 4 * 1024 * 1024  # unsent bytes on one lane before senders wait (send_now refuses)
LANE_DIRECT_MAGIC_BYTES = 8  # b"MDIRECT" | service u8, in clear before a direct channel's TLS
LANE_DIRECT_MAX_PENDING = 8  # direct channels still authenticating (each holds a thread), in all...
LANE_DIRECT_MAX_PENDING_PER_SOURCE = 2  # ...and from one source address: a member dials one channel per
#   service at a time (experts, pipeline); a stranger sending the magic and then nothing holds at most this
#   many slots (for LANE_AUTH_TIMEOUT_S each), not all of them
LANE_DIRECT_MAX_CHANNELS = 64  # authenticated direct channels served by this node (a thread each)...
LANE_DIRECT_MAX_CHANNELS_PER_PEER = 8  # ...and for one member: one per service and direction in use, with
#   room for redials while a dropped one is still being noticed; one member cannot take them all
LANE_DIRECT_MAX_RECORD_BYTES = 8 * 1024 * 1024  # one message on a direct channel (a decode-sized expert
#   request or reply is ~10 KB; a fast-path request is at most 1 MiB)

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
API_MAX_BODY_BYTES = 4 * 1024 * 1024  # one chat/completions body; 4096-token contexts are ~100 KiB of JSON
API_MAX_HEADER_BYTES = 16 * 1024  # request head carried through the tunnel (method, path, kept headers)
API_MAX_MESSAGES = 4096  # chat messages in one request; more is a client bug, not a conversation
API_MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
API_MAX_STOP_CHARS = 256  # characters of one stop sequence; bounds the hold-back buffer in streaming
API_MAX_TOKENS = 1 << 20  # upper bound accepted for max_tokens (the model's context bounds it further)
API_MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI allows 0-20); completions logprobs allow 0-5
API_RECENT_MODEL_S = 300.0  # a model routable this recently is "known": 503 + Retry-After, not 404
API_SSE_KEEPALIVE_S = 15.0  # a streamed reply silent this long gets an SSE comment (proxies cut idle ~60 s)
API_MAX_KEYS = 1024  # lines read from --api-key-file; each key is compared in constant time
API_MAX_KEY_FILE_BYTES = 256 * 1024  # the key file itself
TUNNEL_CHUNK_BYTES = 16 * 1024  # body bytes per tunnel frame: small enough to interleave, big enough to amortise
TUNNEL_COALESCE_CHUNKS = 256  # streamed chunks (SSE events) queued on the serving side while a send is in progress
TUNNEL_COALESCE_WINDOW_S = 0.005  # a fast stream (> 200 chunks/s) is framed every 5 ms, not per token
TUNNEL_MAX_FRAME_BYTES = TUNNEL_CHUNK_BYTES + API_MAX_HEADER_BYTES  # largest frame a tunnel peer may send
TUNNEL_MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # buffered non-streaming response (JSON of a long generation)
TUNNEL_CONNECT_TIMEOUT_S = 5.0  # opening a tunnel stream to a connected peer; then try the next node
TUNNEL_FIRST_BYTE_TIMEOUT_S = 600.0  # a model may think for minutes before its first byte (keep-alive covers the wire)
TUNNEL_REQUEST_TIMEOUT_S = 30.0  # serving side: the whole request (head + body) must arrive within this
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
