"""Every buffer, queue, cache and size bound of the engine (model, generation, expert RPC), with units
and the reason for its value.

The engine's own limits live here (not in ``transport/limits.py``), so ``engine/`` imports no other
package for a constant. Sections per subsystem; add, do not scatter.
"""

from __future__ import annotations

# --- engine (issue 4) -------------------------------------------------------------------------
# model forward pass (engine-model)
# queries per attention score matrix: bounds it to H*64*L*4 bytes (12 MB at H=12 heads, L=4096); a block sees only
# the keys up to its last query, so smaller blocks skip more of the causal mask's upper triangle (a 256-token
# prefill's attention: 64 -> 5/8 of the products and softmax of one 256 block, 1.5x faster on one core). Part of the
# numerics (softmax sums rows of other lengths): every node blocks by this constant
ATTENTION_QUERY_BLOCK = 64
# weights dequantized per tile in a matmul over packed (bf16/f16/GGUF-quantized) weights: 64 Ki weights are a
# 256 KiB fp32 tile, which stays in a core's L2 (1 MiB here) while the BLAS product reads it
MATMUL_TILE_WEIGHTS = 64 * 1024
# weights per tile when more than KERNEL_MAX_ROWS activation rows (prefill) share it: 1 Mi weights are a 4 MiB
# transient fp32 tile (one per product in flight; small next to any real model's weights); dequantizing costs
# ~1/T of the GEMM then, and BLAS gets ~1,000-row GEMMs instead of ~100-row ones
MATMUL_PREFILL_TILE_WEIGHTS = 1024 * 1024
# activation rows up to which a product over K-quant/Q4_0 weights uses the compiled kernel (engine.kernels, if
# numba is installed) instead of the numpy tiles: the kernel re-reads the weights per row, the tiles once per tile
KERNEL_MAX_ROWS = 4
# products of more than KERNEL_MAX_ROWS rows (engine.products) are cut into column pieces of about this many
# multiply-adds (~1 ms on one core at ~35 GFLOP/s), each one single-threaded BLAS product on the prefill threads: a
# 256-token q or o projection of a 768-wide model is 4 pieces, k/v 2 each, a 64-row expert product 1. Part of the
# numerics (the cut changes the last bits of most products): every node cuts by this rule, whatever its cores
PRODUCT_PIECE_MACS = 1 << 25
# piece widths are a multiple of this many output columns (whole register tiles of the BLAS kernels)
PRODUCT_PIECE_COLUMNS = 64
# products of at most this many rows and at least PRODUCT_TRANSPOSED_MIN_COLUMNS columns (engine.products) run as
# ``w @ x.T`` (the output transposed into place) rather than ``x @ w.T``: OpenBLAS's SkylakeX sgemm is 1.2-2x
# faster that way round for 5-64 rows (a prefill's lightly routed experts), 0.8-1.1x from ~96 rows, and slower
# for a narrow output (a 16-expert router). Part of the numerics: the two give equal bits with SkylakeX kernels,
# other last bits with Haswell/Zen ones (80 of 104 shapes tried)
PRODUCT_TRANSPOSED_MAX_ROWS = 64
PRODUCT_TRANSPOSED_MIN_COLUMNS = 128
# a model load that spends longer than this loading the compiled kernels logs that it is compiling them (the
# first load on a machine), so a starting daemon does not sit silent for minutes
KERNELS_SLOW_NOTICE_S = 5.0
# kernel products (engine.kernels): rows are handed to threads in chunks of about this many weights (~3-6 us of
# work each at 10-20 G weights/s; claiming one is a compare-and-swap in compiled code, ~50 ns)
KERNEL_CHUNK_WEIGHTS = 64 * 1024
# the last chunk's worth of rows of a round (its last product) is claimed in this many finer chunks: a round ends when
# its slowest thread's last chunk does, and a 64 Ki-weight fp32 chunk is ~10-20 us at one core's share of the bandwidth
KERNEL_TAIL_SPLIT = 4
# a kernel helper thread with no round to compute waits this long spinning (GIL released) before it blocks:
# decode issues a round every ~50-200 us, so through a forward pass no round waits for an OS wake-up
KERNEL_SPIN_US = 200
# a round of kernel products smaller than this runs on the calling thread alone: waking a helper costs ~10-20 us
KERNEL_POOL_MIN_WEIGHTS = 512 * 1024
# a decode step's attention (one new position) of at least this many multiply-adds (query heads x cached positions x
# (key + value width)) is split by KV head over the kernel threads; below, a round's hand-off (~3-5 us) costs more
# than the second thread saves (the bench model's 12 heads of 64: from ~85 cached positions on)
ATTEND_POOL_MIN_MACS = 128 * 1024
# threads computing kernel products at most (MESHD_KERNEL_THREADS picks fewer): decode-sized products feed no more
KERNEL_MAX_THREADS = 8
# fp32 weights from this many weights up use the compiled decode kernel (engine.dense) for <= KERNEL_MAX_ROWS rows, and
# models whose q projection has this many take the compiled decode step: 160 Ki weights (640 KiB) is below the
# smallest matrix of a published model (and the bench's 256x768 k/v), above the test-sized models' (at most 128 Ki
# weights), which keep BLAS and never import numba (nor compile it, ~10-25 s once per machine, while a daemon starts)
DENSE_KERNEL_MIN_WEIGHTS = 160 * 1024
# a KV cache of at least this many bytes (all layers, keys and values) is one anonymous memory mapping (engine.model.
# KVCache): untouched capacity stays zero pages, not resident; smaller ones (tests' models) stay ordinary arrays
KV_MAP_MIN_BYTES = 1 << 20
# rows a prefill's routed layer runs through its local experts per group (engine.moe.local_executor): bounds the
# gathered rows and gate/up activations alive at once to ~rows * (D + 2I) * 4 bytes (1.5 MiB for D 768, I 384)
# instead of the whole layer's T * top_k rows; a decode step (a few rows) is always one group, one kernel round
EXPERT_GROUP_ROWS = 256
# tokens per block of a prefill's MoE combination (engine.moe.combine): each block's Y [rows, top_k, D] is gathered
# from the expert outputs and summed on its own, so rows * top_k * D * 4 bytes (768 KiB at 64 rows, k 4, D 768) are
# alive per prefill thread instead of the layer's whole Y (3 MiB at 256 tokens). Per block and work item the gather
# costs a few numpy calls: 64 rows cost +0.3 ms per 256-token layer against the whole gather (32 rows +0.44-0.61,
# 128 rows +0.13 but as much memory as the whole Y on two threads; bench in docs/engine-model.md, session 10)
COMBINE_BLOCK_ROWS = 64
# Python threads a prefill spreads its independent pieces over (engine.prefill_threads; default BLAS's own thread
# count): a routed layer has at most a few dozen work items and attention a few KV groups per block, so more
# threads than that find nothing to claim, and each is a daemon thread for the process's life
PREFILL_MAX_THREADS = 8
# GGUF reading (engine/gguf_file.py)
GGUF_MAX_SPLITS = 256  # files of one split GGUF set (-00001-of-0000N.gguf); published sets use < 100
GGUF_MAX_ARRAY_ITEMS = 1 << 22  # items in one metadata array (tokens, scores, merges): published files hold
#   <= ~300 Ki merges; the reader walks items one by one in Python, so 4 Mi items is already ~10-20 s
GGUF_MAX_VOCAB = 1 << 20  # tokens in tokenizer.ggml.tokens; the largest published vocabularies are ~260 Ki
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
EXPERT_MAX_TOP_K = 64  # slots per token a worker may be asked to combine: published MoEs route to <= 8
EXPERT_MAX_DIM = 65536  # hidden size: the largest published MoE (DeepSeek-V3, 7168) with headroom
EXPERT_MAX_ERROR_TEXT_BYTES = 1024  # an error's human text: one line naming what failed
EXPERT_MAX_SHARD_RANGES = 1024  # (layer, expert) rectangles a worker advertises in its hello
EXPERT_MAX_ECHO_BYTES = 1024 * 1024  # echo payload used to measure round trips; 4 KB is the norm
EXPERT_SEND_CHUNK_BYTES = 1024 * 1024  # a message is written to the stream in slices of this size, so a
#   transport frame limit below the message size never matters and other streams interleave
EXPERT_WINDOW_BYTES = 4 * 1024 * 1024  # request bytes in flight to one worker within a layer: half the
#   transport's unread-bytes limit per stream (transport.limits.STREAM_RECV_QUEUE_BYTES, 8 MiB; a test keeps
#   the two in step), which a worker busy computing
#   would otherwise overrun when a big layer is split into several requests
EXPERT_MAX_ADVERTISED_RANGES = 128  # shard rectangles put into our gossip record (the membership record's
#   own cap on expert entries); discovery only: the hello tells the coordinator exactly what is held
EXPERT_MAX_INFLIGHT_PER_WORKER = 64  # outstanding requests on one worker link (engine threads x layers)
EXPERT_POLL_S = 0.002  # default time a coordinator polls for a layer's replies, and a worker for the next
#   request, instead of sleeping (transport.poll; --experts-poll): a decode layer's wait is ~0.5-2 ms, and
#   for waits much longer than this the ~0.1 ms a wake-up costs no longer matters
EXPERT_MAX_POLL_S = 0.1  # the most --experts-poll takes: a poll keeps a core busy for its whole length

# --- numerics tag (engine/numerics.py) --------------------------------------------------------
NUMERICS_MAX_CHARS = 200  # a node's numerics tag in gossip and hellos: ~70 chars today ("kernels=numba-0.68.1+int;
#   numpy=2.3.5;blas=scipy-openblas-0.3.31.188.0:SkylakeX"); a longer one from a peer is malformed
