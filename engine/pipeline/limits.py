"""Every bound of the layer pipeline, with units and the reason for its value."""

from __future__ import annotations

MAX_FRAME_BYTES = 256 * 1024 * 1024  # one stage frame: a prefill chunk's activations (512 x 8192 x fp32 =
#   16 MiB) or a chunk's logits on the last stage (512 x 152k x fp32 = 300 MiB would not fit: the serving
#   node asks only for the last row of a prefill chunk, so logits frames are [1, V])
MAX_BUFFERED_BYTES = 2 * MAX_FRAME_BYTES  # bytes of partly received frames one stage holds over all its
#   streams: a serving node sends one frame at a time per stream (a prefill chunk is ~16 MiB); without it a
#   member opening many streams, each with a frame announced at MAX_FRAME_BYTES and never finished, would
#   make the stage buffer up to 256 streams x 256 MiB
MAX_SEQS_PER_FRAME = 256  # sequences in one forward frame (a decode micro-batch); the scheduler runs <= 64
MAX_DIMS = 4  # tensor rank in a frame: activations are [T, D], logits [T, V]
MAX_DIM = 1 << 24  # one tensor dimension: vocab sizes are <= 256k, hidden <= 64k, chunks <= 64k tokens
MAX_ERROR_TEXT_BYTES = 1024  # an error's human text: one line naming what failed
MAX_FINGERPRINT_BYTES = 64  # a checkpoint fingerprint: SHA-256 (32 B) with room
MAX_LIVE_SEQUENCES = 1024  # KV caches one stage keeps at once over all runs; more are refused
SEND_CHUNK_BYTES = 1024 * 1024  # a frame is written to the stream in slices of this size
KEEPALIVE_S = (
    0.2  # a stage computing a step says so this often, so a silent stage can be told from a slow one
)
SILENCE_S = 0.8  # no frame from a stage for this long while a step (or an OPEN) is out: the stage is dead
#   (kill -9 is otherwise silent until QUIC's idle timeout). A recovery with no other capacity asks the
#   silent stage once more (an OPEN, again at most this long): 2 x 0.8 s keeps "error within 2 s"
OPEN_TIMEOUT_S = 30.0  # a stage loading its layers (mmap, page faults) before it answers READY
STEP_TIMEOUT_S = 60.0  # the serving node waits this long for the stages' answer to one step (a prefill chunk
#   on a slow stage included); a stage still sending KEEPALIVE for it then is failed by name and the step
#   recovers elsewhere (a stage that keeps alive without answering would otherwise hold the request)
SEQ_IDLE_S = 600.0  # a KV cache nobody touched for this long is freed (a serving node that went away
#   without closing its stream); generous: a paused client stream holds its sequence
SWEEP_S = 5.0  # how often a stage looks for idle caches
FAILED_RETRY_S = 3.0  # a stage that failed is left out of plans this long (or until it reconnects)
REPLAN_S = 2.0  # the serving node re-reads gossip for a better plan this often (used for new requests only)
INLINE_ROWS = 8  # a step of at most this many rows runs on the stage's event loop (decode: ~ms), larger ones
#   (prefill chunks) on a thread with KEEPALIVE frames meanwhile
OPEN_SILENCE_S = 5.0  # no frame from a stage loading its layers for this long: give up on it (a loading
#   stage sends KEEPALIVE, but its loop may starve while the load holds the GIL on a busy machine). A stage
#   asked again after it failed gets SILENCE_S instead (the serving node is then on a client's clock)
PLAN_GRACE_S = 5.0  # plans failing for less than this keep a working run for new requests (gossip about a
#   stage that just rejoined flaps for a moment); a run whose stage failed is dropped at once
PING_EVERY_S = 0.25  # the serving node measures the stage path's round trip (a KEEPALIVE the stage echoes)
#   at most this often, sent just ahead of a step while nothing else is out on that link: the round trip
#   of the same stream, loops and machine load the steps see, to set the per-hop overhead against
PING_TIMEOUT_S = 0.5  # an echo later than this is not waited for (the sample is dropped, nothing fails)
POLL_MAX_S = 0.02  # the longest a pipeline process polls for the frame it expects next (a stage for the next
#   step after answering one with FLAG_POLL, the serving node for a lone step's result): a decode step of a
#   stage is a few ms; a wait expected to be longer than this sleeps as before
POLL_MARGIN = 1.5  # poll this many times the recent wait (moving average), plus POLL_SLACK_S...
POLL_SLACK_S = 0.0005  # ...so a wait a little longer than usual is still caught polling
POLL_EMA = 0.2  # weight of the newest wait in that moving average
HANDOFF_WAIT_S = 0.0005  # in a micro-batched decode step the scheduler thread waits this long at most for the
#   loop to write a sequence's frame before it computes the next one (the loop needs the GIL to send; about
#   0.2 ms when a core is free; on a machine with no core to spare it computes on instead of waiting)
CROWDED_WINDOW_S = 0.025  # a one-token step runs its kernel products on its own thread only
#   (``kernels.single_threaded()``) while another sequence stepped this recently (on a stage) or has a step
#   out on the stages (on the serving node): with several sequences in flight both pipeline processes
#   compute at once, and each process's 2-thread kernel pool would fight the other's for the cores; a lone
#   sequence keeps the pool. Same bits either way. A sequence of a rolling decode steps every few ms to
#   tens of ms; a lone stream's steps are its own. Only with ``MESHD_PIPELINE_SERIAL=1``: off by default,
#   since two runs on the loaded VM (session 5, docs/pipeline.md) did not show a gain for 8 streams
MAX_NUMERICS_BYTES = 200  # the numerics tag in OPEN (engine/numerics.py; engine.limits.NUMERICS_MAX_CHARS, ~70 today)
DIRECT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # one frame on a pipeline direct channel: a one-row step's
#   activations (a 64k-wide hidden row is 256 KiB) or its logits (a 256k vocabulary is 1 MiB), with room;
#   anything larger is not a decode step and goes over the stream
DIRECT_TIMEOUT_S = SILENCE_S  # a direct hop's send and its reply must each come within this (the stream's
#   silence limit: there are no KEEPALIVEs on a direct channel); later, the channel is closed and the step
#   goes over the stream, where the stage answers it (the same step again: ``StageHost`` rewinds it)
DIRECT_REDIAL_S = 5.0  # a pipeline direct channel that closed is dialled again after this long at the earliest
