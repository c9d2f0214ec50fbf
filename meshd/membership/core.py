"""The membership core: SWIM failure detection plus gossip with digest-based anti-entropy. Sans-I/O.

Drive it like aioquic's ``QuicConnection``: feed ``receive(src, data, now)`` (``src`` is the node id the
transport authenticated) and ``handle_timer(now)`` when ``get_timer()`` is due; after every input, send
``messages_to_send()`` (``(node_id, frame bytes)`` pairs) and drain ``next_event()``. The core never reads
the clock, never draws OS randomness and never raises out of ``receive``.

Per member the core keeps the newest signed record and a state (alive, suspect, dead, left) with the
incarnation it applies to. States are ordered by (incarnation, rank) with rank alive < suspect < dead <
left: a claim or record wins only if it is newer in that order. Only the node itself can make itself
alive again (by signing a record with a higher incarnation), so stale or forged gossip never revives a
dead or departed node. Dead and left entries stay as tombstones for ``tombstone_ttl_s``.

Dissemination: every change is queued as a rumour and piggybacked on probes, acks and gossip rounds,
each rumour sent ``retransmit_limit(N)`` times. Each gossip round also carries a digest (17 XOR-hashes:
16 node-id buckets plus the ban list); a receiver whose digest differs answers with its entries of the
differing buckets, and the two sides exchange exactly the newer states (DIGEST -> DELTA -> DELTA).

Handler order for every claim or record (memberlist's ``suspectNode``):
unknown -> older -> confirm -> refute -> transition.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import re
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from meshd.membership.config import (
    MembershipConfig,
    confirmations_needed,
    remaining_suspicion_s,
    retransmit_limit,
    suspicion_timeout_s,
)
from meshd.membership.events import (
    Event,
    LocalRefuted,
    NodeBanned,
    PeerDied,
    PeerJoined,
    PeerLeft,
    PeerPurged,
    PeerSuspected,
    RecordRejected,
    RecordUpdated,
    SuspicionRefuted,
)
from meshd.membership.records import (
    LocalInfo,
    NodeRecord,
    RecordError,
    RecordVerifier,
    Revocations,
    sign_record,
)
from meshd.membership.wire import BlobKind, Frame, MsgType, RemoteProtocolError, decode_frame, encode_frame
from transport.credentials import MeshCredentials
from transport.identity import NodeIdentity
from transport.limits import (
    MAX_DIGEST_ENTRIES,
    MAX_GOSSIP_BLOBS,
    MAX_GOSSIP_CLAIMS,
    MAX_MEMBERS,
    MAX_PENDING_RELAYS,
)

is_node_id = re.compile(r"[0-9a-f]{32}\Z").match  # same shape check as transport.identity, but fast
RANK = {"alive": 0, "suspect": 1, "dead": 2, "left": 3}
REV_KEY = "~rev"
_REV_BUCKET = 16
_DELTA_BYTES = 256 * 1024  # records pushed in one DELTA frame; the rest follows in later rounds


@dataclass(frozen=True, slots=True)
class MemberView:
    """A read-only view of one member for status and other services."""

    node_id: str
    state: str
    incarnation: int
    record: NodeRecord
    rtt_ms: float | None
    last_seen: float | None  # monotonic ``now`` of the last frame received from it


@dataclass(slots=True)
class _Entry:
    record: NodeRecord
    state: str
    inc: int
    since: float
    suspect_by: set[str] = field(default_factory=set)
    susp_min: float = 0.0
    susp_max: float = 0.0
    susp_k: int = 0
    last_seen: float | None = None
    rtt_ms: float | None = None


@dataclass(slots=True)
class _Probe:
    target: str
    seq: int
    sent_at: float
    timeout_at: float
    end_at: float
    acked: bool = False
    indirect_sent: bool = False


@dataclass(slots=True)
class _Rumour:
    kind: BlobKind | None  # None: a claim
    data: bytes | list[Any]
    size: int
    transmits: int = 0


@functools.lru_cache(maxsize=65536)
def _key_hash(node_id: str, inc: int, rank: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{node_id}/{inc}/{rank}".encode(), digest_size=8).digest(), "big")


def _bucket(node_id: str) -> int:
    return _REV_BUCKET if node_id == REV_KEY else int(node_id[0], 16)


class Membership:
    """One node's view of its mesh. See the module docstring for the driving contract."""

    def __init__(self, *, identity: NodeIdentity, credentials: MeshCredentials, info: LocalInfo,
                 config: MembershipConfig, rng: random.Random, now: float, incarnation: int,
                 verifier: RecordVerifier | None = None) -> None:
        self.config = config
        self.node_id = identity.node_id
        self._identity = identity
        self._creds = credentials
        self._rng = rng
        self.verifier = verifier or RecordVerifier(credentials.genesis)
        self._info = info
        self._version = incarnation
        self._leaving = False
        self._entries: dict[str, _Entry] = {}
        self._live: list[str] = []
        self._live_pos: dict[str, int] = {}
        self._hashes: dict[str, int] = {}
        self._l1 = [0] * 17
        self._bucket_ids: list[set[str]] = [set() for _ in range(17)]
        self._revocations: Revocations | None = None
        self._rumours: dict[str, _Rumour] = {}
        self._out: list[tuple[str, bytes]] = []
        self._events: deque[Event] = deque()
        self._seq = 0
        self._probe: _Probe | None = None
        self._probe_order: list[str] = []
        self._probe_idx = 0
        self._relays: dict[int, tuple[str, int, float]] = {}
        self._susp_heap: list[tuple[float, str, int]] = []
        self._tomb_heap: list[tuple[float, str, int]] = []
        self._ae_last: dict[str, float] = {}
        self._nudged: dict[str, float] = {}
        self._next_probe = now + rng.uniform(0, config.probe_interval_s)
        self._next_gossip = now + rng.uniform(0, config.gossip_interval_s)
        self._next_reconnect = now + config.reconnect_interval_s
        self.stats = {"bytes_sent": 0, "frames_sent": 0, "rejected": 0, "stale": 0, "bad_frames": 0}
        self._record_blob = b""
        self._sign_self()

    # ----- local node -------------------------------------------------------------------------
    def _sign_self(self) -> None:
        self._record_blob = sign_record(self._identity, self._creds, self._info, self._version, self._leaving)
        self.local_record = self.verifier.decode_record(self._record_blob)
        self._set_key(self.node_id, self._version, RANK["left" if self._leaving else "alive"])
        self._queue(f"r:{self.node_id}", _Rumour(BlobKind.RECORD, self._record_blob, len(self._record_blob)))

    @property
    def incarnation(self) -> int:
        return self._version

    def update_local(self, now: float, **changes: Any) -> None:
        """Change what this node advertises (fields of ``LocalInfo``); re-signs with a new incarnation."""
        self._info = replace(self._info, **changes)
        self._version += 1
        self._sign_self()

    def leave(self, now: float) -> None:
        """Sign a ``leaving`` record and send it straight to every live member (call before closing)."""
        self._leaving = True
        self._version += 1
        self._sign_self()
        for peer in self._live:
            self._send(peer, Frame(MsgType.DELTA, blobs=[(BlobKind.RECORD, self._record_blob)]), False)

    def apply_revocations(self, blob: bytes, now: float) -> bool:
        """Install an admin-signed ban list (ours from disk, or a new one). True if it was newer."""
        return self._on_revocations(blob, now)

    def add_records(self, blobs: list[bytes], now: float) -> None:
        """Learn records from outside gossip (a join's first view, remembered peers)."""
        for blob in blobs:
            self._on_record(blob, now, False)

    def _bootstrap(self, records: list[NodeRecord], now: float) -> None:
        """Simulator only: know these verified records as alive, without rumours or events."""
        for rec in records:
            if rec.node_id != self.node_id and rec.node_id not in self._entries:
                self._entries[rec.node_id] = _Entry(rec, "alive", rec.version, now)
                self._set_key(rec.node_id, rec.version, 0)
                self._set_live(rec.node_id, True)

    def sync_with(self, node_id: str, now: float) -> None:
        """Start a gossip exchange with ``node_id`` now (e.g. right after joining through it)."""
        self._send(node_id, self._gossip_frame(), True)

    def tell_revocations(self, node_id: str) -> None:
        """Send our ban list straight to ``node_id`` (e.g. to the node just banned, before cutting it off)."""
        if self._revocations is not None:
            self._send(node_id, Frame(MsgType.DELTA, blobs=[(BlobKind.REVOCATIONS, self._revocations.encoded)]),
                       False)

    # ----- views ------------------------------------------------------------------------------
    @property
    def revocations(self) -> Revocations | None:
        return self._revocations

    def is_banned(self, node_id: str) -> bool:
        return self._revocations is not None and node_id in self._revocations.banned

    def member(self, node_id: str) -> MemberView | None:
        e = self._entries.get(node_id)
        return None if e is None else MemberView(node_id, e.state, e.inc, e.record, e.rtt_ms, e.last_seen)

    def members(self) -> list[MemberView]:
        return [MemberView(i, e.state, e.inc, e.record, e.rtt_ms, e.last_seen) for i, e in self._entries.items()]

    def live_ids(self) -> list[str]:
        """Members currently alive or suspect (not dead, left or banned)."""
        return list(self._live)

    def digest_root(self) -> int:
        r = 0
        for h in self._l1:
            r ^= h
        return r

    def cluster_size(self) -> int:
        return len(self._live) + 1

    # ----- outputs ----------------------------------------------------------------------------
    def messages_to_send(self) -> list[tuple[str, bytes]]:
        out, self._out = self._out, []
        return out

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float:
        t = min(self._next_probe, self._next_gossip, self._next_reconnect)
        p = self._probe
        if p is not None and not p.acked:
            t = min(t, p.end_at if p.indirect_sent else p.timeout_at)
        if self._susp_heap:
            t = min(t, self._susp_heap[0][0])
        if self._tomb_heap:
            t = min(t, self._tomb_heap[0][0])
        return t

    # ----- bookkeeping ------------------------------------------------------------------------
    def _set_key(self, node_id: str, inc: int | None, rank: int = 0) -> None:
        b = _bucket(node_id)
        old = self._hashes.pop(node_id, None)
        if old is not None:
            self._l1[b] ^= old
            self._bucket_ids[b].discard(node_id)
        if inc is not None:
            h = _key_hash(node_id, inc, rank)
            self._hashes[node_id] = h
            self._l1[b] ^= h
            self._bucket_ids[b].add(node_id)

    def _set_live(self, node_id: str, live: bool) -> None:
        pos = self._live_pos.get(node_id)
        if live and pos is None:
            self._live_pos[node_id] = len(self._live)
            self._live.append(node_id)
        elif not live and pos is not None:
            last = self._live.pop()
            if last != node_id:
                self._live[pos] = last
                self._live_pos[last] = pos
            del self._live_pos[node_id]

    def _queue(self, key: str, rumour: _Rumour) -> None:
        self._rumours[key] = rumour

    def _claim_rumour(self, claim: list[Any]) -> None:
        self._queue(f"c:{claim[1]}", _Rumour(None, claim, 48 + len(claim[1]) + len(claim[3])))

    def _send(self, dest: str, frame: Frame, piggyback: bool) -> None:
        if piggyback and self._rumours:
            self._attach_rumours(frame, self.config.max_piggyback_bytes)
        data = encode_frame(frame)
        self.stats["bytes_sent"] += len(data)
        self.stats["frames_sent"] += 1
        self._out.append((dest, data))

    def _attach_rumours(self, frame: Frame, budget: int) -> None:
        limit = retransmit_limit(self.config.retransmit_mult, self.cluster_size())
        used = 0
        for key, r in sorted(self._rumours.items(), key=lambda kv: kv[1].transmits):
            if used + r.size > budget:
                continue
            if r.kind is None:
                if len(frame.claims) >= MAX_GOSSIP_CLAIMS:
                    continue
                frame.claims.append(r.data)  # type: ignore[arg-type]
            else:
                if len(frame.blobs) >= MAX_GOSSIP_BLOBS:
                    continue
                frame.blobs.append((r.kind, r.data))  # type: ignore[arg-type]
            used += r.size
            r.transmits += 1
            if r.transmits >= limit:
                del self._rumours[key]

    def _state_items(self, node_id: str, frame: Frame) -> int:
        """Append the full state we hold for ``node_id`` to ``frame``; returns bytes added."""
        if node_id == REV_KEY:
            if self._revocations is None:
                return 0
            frame.blobs.append((BlobKind.REVOCATIONS, self._revocations.encoded))
            return len(self._revocations.encoded)
        if node_id == self.node_id:
            frame.blobs.append((BlobKind.RECORD, self._record_blob))
            return len(self._record_blob)
        e = self._entries.get(node_id)
        if e is None:
            return 0
        frame.blobs.append((BlobKind.RECORD, e.record.encoded))
        if e.state in ("suspect", "dead"):
            by = next(iter(e.suspect_by), self.node_id) if e.state == "suspect" else self.node_id
            frame.claims.append([e.state, node_id, e.inc, by])
        return len(e.record.encoded)

    def _key_of(self, node_id: str) -> tuple[int, int] | None:
        if node_id == self.node_id:
            return (self._version, RANK["left" if self._leaving else "alive"])
        if node_id == REV_KEY:
            return None if self._revocations is None else (self._revocations.version, 0)
        e = self._entries.get(node_id)
        return None if e is None else (e.inc, RANK[e.state])

    # ----- inputs -----------------------------------------------------------------------------
    def receive(self, src: str, data: bytes, now: float) -> None:
        """Handle one frame from the authenticated member ``src``. Never raises."""
        if self.is_banned(src):
            return
        try:
            frame = decode_frame(data)
        except RemoteProtocolError:
            self.stats["bad_frames"] += 1
            return
        try:
            self._handle(src, frame, now)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            self.stats["bad_frames"] += 1

    def _handle(self, src: str, frame: Frame, now: float) -> None:
        ae = frame.type in (MsgType.DIGEST, MsgType.DELTA)
        for kind, blob in frame.blobs:
            if kind == BlobKind.RECORD:
                self._on_record(blob, now, ae)
            else:
                self._on_revocations(blob, now)
        for state, node_id, inc, by in frame.claims:
            if is_node_id(node_id) and is_node_id(by):
                self._on_claim(state, node_id, inc, by, now, ae)
        e = self._entries.get(src)
        if e is not None:
            e.last_seen = now
            if e.state in ("suspect", "dead") and now - self._nudged.get(src, -1e18) >= self.config.probe_interval_s:
                # It is talking to us, so it is alive but has not refuted yet: tell it what we believe.
                self._nudged[src] = now
                nudge = Frame(MsgType.DELTA)
                self._state_items(src, nudge)
                self._send(src, nudge, False)
        f = frame.fields
        if frame.type == MsgType.PING:
            if f.get("target") == self.node_id and isinstance(f.get("seq"), int):
                self._send(src, Frame(MsgType.ACK, {"seq": f["seq"]}), True)
        elif frame.type == MsgType.ACK:
            self._on_ack(src, f.get("seq"), now)
        elif frame.type == MsgType.PING_REQ:
            target, seq = f.get("target"), f.get("seq")
            if isinstance(seq, int) and isinstance(target, str) and target in self._live_pos:
                self._expire_relays(now)
                if len(self._relays) < MAX_PENDING_RELAYS:
                    self._seq += 1
                    self._relays[self._seq] = (src, seq, now + self.config.probe_interval_s)
                    self._send(target, Frame(MsgType.PING, {"seq": self._seq, "target": target}), True)
        elif frame.type == MsgType.GOSSIP:
            self._on_gossip_digest(src, f, now)
        elif frame.type == MsgType.DIGEST:
            self._on_digest(src, f)
        elif frame.type == MsgType.DELTA:
            want = f.get("want")
            if isinstance(want, list) and want:
                reply = Frame(MsgType.DELTA)
                used = 0
                for node_id in want[:MAX_GOSSIP_BLOBS]:
                    if isinstance(node_id, str) and used < _DELTA_BYTES:
                        used += self._state_items(node_id, reply)
                self._send(src, reply, False)

    def _on_ack(self, src: str, seq: Any, now: float) -> None:
        p = self._probe
        if p is not None and p.seq == seq and not p.acked:
            p.acked = True
            e = self._entries.get(p.target)
            if e is not None:
                e.last_seen = now
                if src == p.target:
                    e.rtt_ms = (now - p.sent_at) * 1000.0
            return
        relay = self._relays.pop(seq, None) if isinstance(seq, int) else None
        if relay is not None:
            self._send(relay[0], Frame(MsgType.ACK, {"seq": relay[1]}), False)

    def _expire_relays(self, now: float) -> None:
        for s in [s for s, r in self._relays.items() if r[2] <= now]:
            del self._relays[s]

    # ----- anti-entropy -----------------------------------------------------------------------
    def _gossip_frame(self) -> Frame:
        return Frame(MsgType.GOSSIP, {"root": f"{self.digest_root():x}", "l1": [f"{h:x}" for h in self._l1]})

    def _on_gossip_digest(self, src: str, f: dict[str, Any], now: float) -> None:
        if f.get("root") == f"{self.digest_root():x}":
            return
        l1 = f.get("l1")
        if not isinstance(l1, list) or len(l1) != 17:
            return
        if now - self._ae_last.get(src, -1e18) < self.config.anti_entropy_min_gap_s:
            return
        self._ae_last[src] = now
        buckets = [b for b in range(17) if l1[b] != f"{self._l1[b]:x}"]
        entries: list[list[Any]] = []
        for b in buckets:
            for node_id in self._bucket_ids[b]:
                key = self._key_of(node_id)
                if key is not None and len(entries) < MAX_DIGEST_ENTRIES:
                    entries.append([node_id, key[0], key[1]])
        self._send(src, Frame(MsgType.DIGEST, {"buckets": buckets, "entries": entries}), False)

    def _on_digest(self, src: str, f: dict[str, Any]) -> None:
        buckets, entries = f.get("buckets"), f.get("entries")
        if not isinstance(buckets, list) or not isinstance(entries, list):
            return
        theirs: dict[str, tuple[int, int]] = {}
        for item in entries[:MAX_DIGEST_ENTRIES]:
            if isinstance(item, list) and len(item) == 3 and isinstance(item[0], str):
                theirs[item[0]] = (int(item[1]), int(item[2]))
        reply = Frame(MsgType.DELTA)
        want: list[str] = []
        used = 0
        for b in buckets:
            if not isinstance(b, int) or not 0 <= b <= 16:
                continue
            for node_id in list(self._bucket_ids[b]):
                mine = self._key_of(node_id)
                if mine is not None and (node_id not in theirs or mine > theirs[node_id]):
                    if used < _DELTA_BYTES and len(reply.blobs) < MAX_GOSSIP_BLOBS:
                        used += self._state_items(node_id, reply)
        for node_id, key in theirs.items():
            if not (node_id == REV_KEY or is_node_id(node_id)) or self.is_banned(node_id):
                continue
            mine = self._key_of(node_id)
            if (mine is None or key > mine) and len(want) < MAX_GOSSIP_BLOBS:
                want.append(node_id)
        if want:
            reply.fields["want"] = want
        if reply.blobs or reply.claims or want:
            self._send(src, reply, False)

    # ----- records and claims (order: unknown -> older -> confirm -> refute -> transition) -----
    def _reject(self, node_id: str | None, reason: str) -> None:
        self.stats["rejected"] += 1
        self._events.append(RecordRejected(node_id, reason))

    def _on_record(self, blob: bytes, now: float, anti_entropy: bool) -> None:
        try:
            rec = self.verifier.decode_record(blob)
        except RecordError as e:
            self._reject(None, str(e))
            return
        node_id = rec.node_id
        if self.is_banned(node_id):
            self._reject(node_id, "node is banned")
            return
        new_state = "left" if rec.leaving else "alive"
        if node_id == self.node_id:  # a record of ours from a previous life: refute it
            newer = rec.version > self._version
            if (newer or (rec.version == self._version and blob != self._record_blob)) and not self._leaving:
                self._refute(rec.version)
            return
        e = self._entries.get(node_id)
        if e is None:  # unknown
            if len(self._entries) >= MAX_MEMBERS:
                self._reject(node_id, "member table full")
                return
            e = self._entries[node_id] = _Entry(rec, new_state, rec.version, now)
            self._set_key(node_id, rec.version, RANK[new_state])
            self._queue(f"r:{node_id}", _Rumour(BlobKind.RECORD, blob, len(blob)))
            if new_state == "alive":
                self._set_live(node_id, True)
                self._events.append(PeerJoined(node_id, rec))
            else:
                self._tombstone(node_id, e, now)
            return
        if (rec.version, RANK[new_state]) <= (e.inc, RANK[e.state]):  # older (or the same)
            self.stats["stale"] += 1
            return
        prev = e.state  # transition
        e.record, e.inc, e.state, e.since = rec, rec.version, new_state, now
        e.suspect_by.clear()
        self._set_key(node_id, rec.version, RANK[new_state])
        self._queue(f"r:{node_id}", _Rumour(BlobKind.RECORD, blob, len(blob)))
        self._rumours.pop(f"c:{node_id}", None)
        if new_state == "left":
            self._set_live(node_id, False)
            self._tombstone(node_id, e, now)
            self._events.append(PeerLeft(node_id, rec.version))
            return
        self._set_live(node_id, True)
        if prev in ("dead", "left"):
            self._events.append(PeerJoined(node_id, rec))
        elif prev == "suspect":
            self._events.append(SuspicionRefuted(node_id, rec.version))
        else:
            self._events.append(RecordUpdated(node_id, rec))

    def _on_claim(self, state: str, node_id: str, inc: int, by: str, now: float, anti_entropy: bool) -> None:
        if node_id == self.node_id:
            if inc >= self._version and not self._leaving:  # refute
                self._refute(inc)
            return
        e = self._entries.get(node_id)
        if e is None:  # unknown
            return
        if inc < e.inc or (inc == e.inc and RANK[state] < RANK[e.state]) or e.state in ("dead", "left"):
            return  # older
        if state == "dead" and anti_entropy and e.state == "alive":
            state = "suspect"  # a digest exchange only makes us suspect; the node may still refute
        if state == "suspect":
            if e.state == "suspect":  # confirm
                if by not in e.suspect_by:
                    e.suspect_by.add(by)
                    self._push_suspicion(node_id, e)
                    self._claim_rumour(["suspect", node_id, e.inc, by])
                return
            e.state, e.inc, e.since = "suspect", inc, now  # transition
            e.suspect_by = {by}
            n = self.cluster_size()
            e.susp_min = suspicion_timeout_s(self.config.suspicion_mult, n, self.config.probe_interval_s)
            e.susp_max = self.config.suspicion_max_timeout_mult * e.susp_min
            e.susp_k = confirmations_needed(self.config.indirect_checks, n)
            self._set_key(node_id, inc, RANK["suspect"])
            self._push_suspicion(node_id, e)
            self._claim_rumour(["suspect", node_id, inc, by])
            self._events.append(PeerSuspected(node_id, inc, by))
            return
        self._declare_dead(node_id, e, inc, now)

    def _declare_dead(self, node_id: str, e: _Entry, inc: int, now: float) -> None:
        e.state, e.inc, e.since = "dead", inc, now
        e.suspect_by.clear()
        self._set_key(node_id, inc, RANK["dead"])
        self._set_live(node_id, False)
        self._tombstone(node_id, e, now)
        self._claim_rumour(["dead", node_id, inc, self.node_id])
        self._events.append(PeerDied(node_id, inc))

    def _refute(self, seen_inc: int) -> None:
        self._version = max(self._version, seen_inc) + 1
        self._sign_self()
        self._events.append(LocalRefuted(self._version))

    def _push_suspicion(self, node_id: str, e: _Entry) -> None:
        confirmations = len(e.suspect_by) - 1
        left = remaining_suspicion_s(confirmations, e.susp_k, 0.0, e.susp_min, e.susp_max)
        heapq.heappush(self._susp_heap, (e.since + left, node_id, e.inc))

    def suspicion_deadline(self, node_id: str) -> float | None:
        """When the current suspicion of ``node_id`` runs out (None if it is not suspect)."""
        e = self._entries.get(node_id)
        if e is None or e.state != "suspect":
            return None
        return e.since + remaining_suspicion_s(len(e.suspect_by) - 1, e.susp_k, 0.0, e.susp_min, e.susp_max)

    def _tombstone(self, node_id: str, e: _Entry, now: float) -> None:
        heapq.heappush(self._tomb_heap, (now + self.config.tombstone_ttl_s, node_id, e.inc))

    def _on_revocations(self, blob: bytes, now: float) -> bool:
        try:
            rev = self.verifier.decode_revocations(blob)
        except RecordError as e:
            self._reject(None, str(e))
            return False
        if self._revocations is not None and rev.version <= self._revocations.version:
            self.stats["stale"] += 1
            return False
        old = self._revocations.banned if self._revocations is not None else frozenset()
        self._revocations = rev
        self._set_key(REV_KEY, rev.version)
        self._queue(REV_KEY, _Rumour(BlobKind.REVOCATIONS, blob, len(blob)))
        for node_id in sorted(rev.banned - old):
            if node_id in self._entries:
                del self._entries[node_id]
                self._set_key(node_id, None)
                self._set_live(node_id, False)
                self._rumours.pop(f"r:{node_id}", None)
                self._rumours.pop(f"c:{node_id}", None)
            self._events.append(NodeBanned(node_id, rev.version))
        return True

    # ----- timers -----------------------------------------------------------------------------
    def handle_timer(self, now: float) -> None:
        cfg = self.config
        p = self._probe
        if p is not None and not p.acked:
            if not p.indirect_sent and now >= p.timeout_at:
                p.indirect_sent = True
                helpers = [i for i in self._live if i != p.target]
                for helper in self._rng.sample(helpers, min(cfg.indirect_checks, len(helpers))):
                    self._send(helper, Frame(MsgType.PING_REQ, {"seq": p.seq, "target": p.target}), True)
            # A probe ends at its own deadline, or when the next one is due, whichever comes first: probes
            # are on a fixed grid but a late-started one ends later, and the next must not overwrite it
            # unanswered (its failure would be lost; on a real loop about every other one was).
            if now >= p.end_at or now >= self._next_probe:
                self._probe = None
                e = self._entries.get(p.target)
                if e is not None and e.state in ("alive", "suspect"):
                    self._on_claim("suspect", p.target, e.inc, self.node_id, now, False)
        if now >= self._next_probe:
            self._next_probe = max(self._next_probe + cfg.probe_interval_s, now)
            self._start_probe(now)
        if now >= self._next_gossip:
            self._next_gossip = max(self._next_gossip + cfg.gossip_interval_s, now)
            for peer in self._rng.sample(self._live, min(cfg.gossip_fanout, len(self._live))):
                self._send(peer, self._gossip_frame(), True)
            self._expire_relays(now)
        if now >= self._next_reconnect:
            self._next_reconnect = max(self._next_reconnect + cfg.reconnect_interval_s, now)
            dead = [i for i, e in self._entries.items() if e.state == "dead"]
            if dead:
                self._send(self._rng.choice(dead), self._gossip_frame(), False)
        while self._susp_heap and self._susp_heap[0][0] <= now:
            _, node_id, inc = heapq.heappop(self._susp_heap)
            e = self._entries.get(node_id)
            if e is None or e.state != "suspect" or e.inc != inc:
                continue
            deadline = self.suspicion_deadline(node_id)
            if deadline is not None and deadline <= now:
                self._declare_dead(node_id, e, inc, now)
        while self._tomb_heap and self._tomb_heap[0][0] <= now:
            _, node_id, inc = heapq.heappop(self._tomb_heap)
            e = self._entries.get(node_id)
            if e is not None and e.state in ("dead", "left") and e.inc == inc:
                del self._entries[node_id]
                self._set_key(node_id, None)
                self._rumours.pop(f"r:{node_id}", None)
                self._rumours.pop(f"c:{node_id}", None)
                self._events.append(PeerPurged(node_id))

    def _start_probe(self, now: float) -> None:
        target = None
        for _ in range(2):
            while self._probe_idx < len(self._probe_order):
                cand = self._probe_order[self._probe_idx]
                self._probe_idx += 1
                if cand in self._live_pos:
                    target = cand
                    break
            if target is not None:
                break
            self._probe_order = list(self._live)
            self._rng.shuffle(self._probe_order)
            self._probe_idx = 0
        if target is None:
            return
        self._seq += 1
        cfg = self.config
        self._probe = _Probe(target, self._seq, now, now + cfg.probe_timeout_s, now + cfg.probe_interval_s)
        self._send(target, Frame(MsgType.PING, {"seq": self._seq, "target": target}), True)
