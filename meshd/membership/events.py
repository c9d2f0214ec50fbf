"""Events the membership core emits (``Membership.next_event()``). Frozen, past tense."""

from __future__ import annotations

from dataclasses import dataclass

from meshd.membership.records import NodeRecord


@dataclass(frozen=True, slots=True)
class PeerJoined:
    """A node became alive in our view: first seen, or back after being dead or having left."""

    node_id: str
    record: NodeRecord


@dataclass(frozen=True, slots=True)
class RecordUpdated:
    """An alive node published a newer record (models, experts, load, addresses changed)."""

    node_id: str
    record: NodeRecord


@dataclass(frozen=True, slots=True)
class PeerSuspected:
    """A node missed its probes (here or at ``by``); it is dead unless it refutes in time."""

    node_id: str
    incarnation: int
    by: str


@dataclass(frozen=True, slots=True)
class SuspicionRefuted:
    """A suspected node proved it is alive with a newer incarnation."""

    node_id: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class PeerDied:
    """A node's suspicion ran out (or another member declared it dead); it is now a tombstone."""

    node_id: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class PeerLeft:
    """A node announced, with its own signature, that it is leaving; it is now a tombstone."""

    node_id: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class PeerPurged:
    """A dead or left node's tombstone expired and was forgotten."""

    node_id: str


@dataclass(frozen=True, slots=True)
class NodeBanned:
    """An admin-signed ban list naming this node was accepted; the node is refused from now on."""

    node_id: str
    revocations_version: int


@dataclass(frozen=True, slots=True)
class RecordRejected:
    """A received record or ban list was dropped (forged, oversize, wrong mesh, non-member, banned)."""

    node_id: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class LocalRefuted:
    """Someone claimed this node suspect or dead (or a stale record of ours circulated); we re-signed
    our record with a higher incarnation."""

    incarnation: int


Event = (
    PeerJoined | RecordUpdated | PeerSuspected | SuspicionRefuted | PeerDied | PeerLeft | PeerPurged
    | NodeBanned | RecordRejected | LocalRefuted
)
