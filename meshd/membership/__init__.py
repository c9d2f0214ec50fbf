"""Mesh membership: signed node records, gossip with anti-entropy, SWIM failure detection, bans.

``core`` (sans-I/O state machine), ``records`` (signed record and ban-list formats), ``wire`` (frame codec),
``config`` (settings and timing formulas), ``events`` (what the core reports); ``service`` is the asyncio
driver that runs it inside the daemon.
"""

from __future__ import annotations

from meshd.membership.config import MembershipConfig
from meshd.membership.core import Membership, MemberView
from meshd.membership.records import (
    Capacity,
    ExpertShard,
    Load,
    LocalInfo,
    ModelInfo,
    NodeRecord,
    RecordError,
    RecordVerifier,
    Revocations,
)

__all__ = [
    "Capacity", "ExpertShard", "Load", "LocalInfo", "MemberView", "Membership", "MembershipConfig", "ModelInfo",
    "NodeRecord", "RecordError", "RecordVerifier", "Revocations",
]
