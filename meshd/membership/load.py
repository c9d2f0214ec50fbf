"""When a node re-signs its record for a load change. Pure.

Load (requests in flight, queue, recent tokens/s, free memory) changes all the time, but every re-signed
record is a rumour that each member forwards ``retransmit_limit(N)`` times, so the mesh-wide rate of
load re-signs sets every node's gossip bandwidth. Two rules keep that flat in N:

- a node re-signs for load only when it changed materially (``load_changed``): in flight, queue or slots
  differ, tokens/s moved by more than ``TOK_S_STEP`` (relative), or free memory by more than
  ``FREE_MB_STEP`` (relative);
- and at most once per ``load_interval_s(n, record_bytes)``. One re-signed record costs every member
  about ``retransmit_limit(N) * record_bytes`` (times a factor below 1 that piggybacking gives), so the
  interval is ``n * retransmit_limit(n) * record_bytes / LOAD_RESIGN_BUDGET``: the mesh as a whole
  re-signs for load at a rate that keeps each node's added gossip about constant (never more often than
  every ``LOAD_MIN_INTERVAL_S`` per node). ``LOAD_RESIGN_BUDGET`` is calibrated with
  ``bench/gossip.py`` so that bytes per node per second with load stay within 2x of a quiet mesh's.
  The price is freshness: with ~800-byte records a node of a 10-node mesh re-signs its load about once
  a minute, of a 100-node mesh every ~15 minutes, of 1,000 nodes every ~3 hours; between re-signs the
  router counts its own requests on each node and steers away from nodes that fail or answer 429.

Changes of what a node serves (models, expert shards, stages, API address) are not rate limited: they
are rare and routing depends on them.
"""

from __future__ import annotations

from meshd.membership.config import retransmit_limit
from meshd.membership.records import Capacity, Load

LOAD_MIN_INTERVAL_S = 2.0  # a node re-signs for load at most this often, whatever the mesh size
LOAD_RESIGN_BUDGET = 1100.0  # calibrated with bench/gossip.py (see module docstring)
TYPICAL_RECORD_BYTES = 1200  # a record with one model and its member certificate
TOK_S_STEP = 0.25  # relative change of tokens/s worth a re-sign
FREE_MB_STEP = 0.10  # relative change of free memory worth a re-sign


def load_interval_s(n: int, record_bytes: int = TYPICAL_RECORD_BYTES, retransmit_mult: int = 4) -> float:
    """Minimum seconds between two load re-signs of one node in a mesh of ``n`` nodes."""
    n = max(1, n)
    cost = n * retransmit_limit(retransmit_mult, n) * max(1, record_bytes)
    return max(LOAD_MIN_INTERVAL_S, cost / LOAD_RESIGN_BUDGET)


def _moved(old: float, new: float, step: float) -> bool:
    if old == new:
        return False
    return abs(new - old) > step * max(abs(old), abs(new), 1.0)


def load_changed(old_cap: Capacity, old: Load, new_cap: Capacity, new: Load) -> bool:
    """Whether the new load is worth re-signing the record for (see module docstring)."""
    return (old_cap.in_flight != new_cap.in_flight or old.queue != new.queue or old.slots != new.slots
            or _moved(old.tok_s, new.tok_s, TOK_S_STEP)
            or _moved(float(old_cap.free_mb), float(new_cap.free_mb), FREE_MB_STEP))


def free_mb() -> int:
    """Available memory in MiB (``MemAvailable``), 0 if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
