"""Membership configuration and the timing formulas derived from it. Pure.

Presets are written as deltas from :meth:`MembershipConfig.default` so the difference is reviewable.
The formulas follow SWIM with Lifeguard-style suspicion (as memberlist does): timeouts and retransmit
counts grow with log10 of the cluster size so that a rumour reaches everyone before it is acted on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    probe_interval_s: float = 1.0
    """One direct probe of one member (round-robin over a shuffled list) per interval."""
    probe_timeout_s: float = 0.5
    """Wait this long for the direct ack before asking ``indirect_checks`` members to probe."""
    indirect_checks: int = 3
    """Members asked to probe an unresponsive node on our behalf."""
    suspicion_mult: int = 4
    """Minimum suspicion timeout = mult * max(1, log10 N) * probe interval."""
    suspicion_max_timeout_mult: int = 3
    """Suspicion starts at max = this * minimum and shrinks with independent confirmations."""
    retransmit_mult: int = 4
    """Each rumour is sent retransmit_mult * ceil(log10(N + 1)) times by each node that learns it."""
    gossip_interval_s: float = 1.0
    """One gossip round (deltas + state digest) per interval."""
    gossip_fanout: int = 3
    """Members contacted per gossip round."""
    anti_entropy_min_gap_s: float = 1.0
    """At most one digest exchange answered per peer per this many seconds."""
    reconnect_interval_s: float = 10.0
    """Every interval, one dead member is sent our digest (heals partitions, finds restarted nodes)."""
    tombstone_ttl_s: float = 3600.0
    """Dead and left records are kept this long so stale gossip never revives them, then purged."""
    max_piggyback_bytes: int = 8 * 1024
    """Gossip carried on one probe or ack."""

    @classmethod
    def default(cls) -> MembershipConfig:
        """Defaults for a mesh spanning networks (about 1 s rounds, fanout 3)."""
        return cls()

    @classmethod
    def lan(cls) -> MembershipConfig:
        """A LAN: faster probes so a killed node is suspected everywhere within ~3 s, and a dead member is
        sent our digest every 2 s, so a healed partition agrees again within ~5 s (the chaos test's bound;
        with 10 s, 1 heal in ~8 took 9 s)."""
        return replace(cls.default(), probe_interval_s=0.5, probe_timeout_s=0.25, gossip_interval_s=0.5,
                       reconnect_interval_s=2.0)

    @classmethod
    def local(cls) -> MembershipConfig:
        """Nodes on one host (loopback): LAN probing, faster gossip rounds and reconnects."""
        return replace(cls.lan(), gossip_interval_s=0.2, reconnect_interval_s=2.0, anti_entropy_min_gap_s=0.2)


def suspicion_timeout_s(suspicion_mult: int, n: int, probe_interval_s: float) -> float:
    """Minimum time a suspicion lasts before the node is declared dead, for a cluster of ``n`` nodes."""
    scale = max(1.0, math.log10(max(1, n)))
    return suspicion_mult * scale * probe_interval_s


def retransmit_limit(retransmit_mult: int, n: int) -> int:
    """How many times each node re-sends one rumour, for a cluster of ``n`` nodes."""
    return retransmit_mult * math.ceil(math.log10(n + 1))


def remaining_suspicion_s(
    confirmations: int, needed: int, elapsed_s: float, min_s: float, max_s: float
) -> float:
    """Time left on a suspicion that ``confirmations`` other members independently confirmed.

    Starts at ``max_s`` and falls logarithmically to ``min_s`` once ``needed`` confirmations arrived
    (Lifeguard). May be negative: the suspicion is already over.
    """
    if needed < 1:
        timeout = min_s
    else:
        frac = math.log(confirmations + 1) / math.log(needed + 1)
        timeout = max(min_s, max_s - frac * (max_s - min_s))
    return timeout - elapsed_s


def confirmations_needed(indirect_checks: int, n: int) -> int:
    """Independent suspicions that shrink a suspicion to its minimum: bounded by other members."""
    return max(0, min(indirect_checks, n - 2))
