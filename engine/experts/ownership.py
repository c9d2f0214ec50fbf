"""Which worker owns each (layer, expert): weighted rendezvous (HRW) hashing (pure).

For a key ``(layer, expert)`` every live worker holding it scores
``capacity / -ln(u)`` with ``u = (h + 0.5) / 2**64`` and ``h`` the first 8 bytes of
``SHA-256(b"meshd/experts-hrw/v1" || node_id || layer || expert)``; the highest score owns it (ties, which
need equal hashes, go to the lower node id). This is the logarithmic method for weighted rendezvous
hashing: each worker gets a share proportional to its capacity, and adding or removing a worker moves only
the keys it wins or held. Maps are immutable: the coordinator builds a new one between requests.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_DOMAIN = b"meshd/experts-hrw/v1\x00"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A live worker as the ownership map sees it."""

    node_id: str
    capacity: float
    holds: frozenset[tuple[int, int]]


def score(node_id: str, layer: int, expert: int, capacity: float) -> float:
    digest = hashlib.sha256(_DOMAIN + node_id.encode() + struct.pack("<II", layer, expert)).digest()
    u = (int.from_bytes(digest[:8], "big") + 0.5) / 18446744073709551616.0
    return capacity / -math.log(u)


def rank(workers: Iterable[WorkerInfo], layer: int, expert: int) -> list[str]:
    """Node ids of the workers holding (layer, expert), best first (owner, then fallbacks)."""
    scored = [(-score(w.node_id, layer, expert, w.capacity), w.node_id) for w in workers
              if (layer, expert) in w.holds]
    return [node for _, node in sorted(scored)]


@dataclass(frozen=True, slots=True)
class OwnershipMap:
    """An immutable assignment of (layer, expert) to a ranked list of holders."""

    ranked: Mapping[tuple[int, int], tuple[str, ...]]
    workers: tuple[str, ...]

    def owner(self, layer: int, expert: int) -> str | None:
        r = self.ranked.get((layer, expert))
        return r[0] if r else None

    def holders(self, layer: int, expert: int) -> tuple[str, ...]:
        return self.ranked.get((layer, expert), ())

    def missing(self, keys: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        return [k for k in keys if not self.ranked.get(k)]

    def shares(self) -> dict[str, int]:
        out = {w: 0 for w in self.workers}
        for r in self.ranked.values():
            out[r[0]] += 1
        return out


def build_map(workers: Iterable[WorkerInfo], keys: Iterable[tuple[int, int]]) -> OwnershipMap:
    """The ownership map of ``keys`` over ``workers`` (workers with non-positive capacity are skipped)."""
    live = tuple(w for w in workers if w.capacity > 0 and math.isfinite(w.capacity))
    ranked = {}
    for layer, expert in keys:
        r = rank(live, layer, expert)
        if r:
            ranked[(layer, expert)] = tuple(r)
    return OwnershipMap(ranked=ranked, workers=tuple(sorted(w.node_id for w in live)))
