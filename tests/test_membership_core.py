"""Membership core on a fake clock: every handler branch, exact timers, refutation, tombstones, bans."""

from __future__ import annotations

import math
import random
from dataclasses import fields, replace

import pytest
from membership_helpers import QUIET, Mesh

from meshd.membership.config import (
    MembershipConfig,
    confirmations_needed,
    remaining_suspicion_s,
    retransmit_limit,
    suspicion_timeout_s,
)
from meshd.membership.events import (
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
from meshd.membership.records import ModelInfo, Revocations
from meshd.membership.wire import BlobKind, Frame, MsgType, decode_frame, encode_frame
from transport.identity import NodeIdentity


# ----- formulas, from a table ------------------------------------------------------------------
@pytest.mark.parametrize(("mult", "n", "interval", "want"), [
    (4, 1, 1.0, 4.0), (4, 5, 1.0, 4.0), (4, 10, 1.0, 4.0), (4, 100, 1.0, 8.0), (4, 1000, 1.0, 12.0),
    (4, 1000, 0.5, 6.0), (5, 0, 2.0, 10.0),
])
def test_suspicion_timeout_table(mult: int, n: int, interval: float, want: float) -> None:
    assert suspicion_timeout_s(mult, n, interval) == pytest.approx(want)


@pytest.mark.parametrize(("mult", "n", "want"), [(4, 1, 4), (4, 9, 4), (4, 10, 8), (4, 99, 8), (4, 100, 12),
                                                 (4, 1000, 16), (3, 5, 3)])
def test_retransmit_limit_table(mult: int, n: int, want: int) -> None:
    assert retransmit_limit(mult, n) == want


@pytest.mark.parametrize(("c", "k", "elapsed", "lo", "hi", "want"), [
    (0, 3, 0.0, 4.0, 12.0, 12.0),
    (3, 3, 0.0, 4.0, 12.0, 4.0),
    (1, 3, 0.0, 4.0, 12.0, 12.0 - math.log(2) / math.log(4) * 8.0),
    (5, 3, 0.0, 4.0, 12.0, 4.0),  # more confirmations than needed never go below the minimum
    (0, 0, 0.0, 4.0, 12.0, 4.0),  # nobody can confirm: minimum
    (0, 3, 13.0, 4.0, 12.0, -1.0),
])
def test_remaining_suspicion_table(c: int, k: int, elapsed: float, lo: float, hi: float, want: float) -> None:
    assert remaining_suspicion_s(c, k, elapsed, lo, hi) == pytest.approx(want)


@pytest.mark.parametrize(("checks", "n", "want"), [(3, 1, 0), (3, 2, 0), (3, 3, 1), (3, 5, 3), (3, 100, 3)])
def test_confirmations_needed_table(checks: int, n: int, want: int) -> None:
    assert confirmations_needed(checks, n) == want


def test_presets_are_small_deltas() -> None:
    base = MembershipConfig.default()
    assert (base.gossip_interval_s, base.gossip_fanout) == (1.0, 3)
    changed = {f.name for f in fields(base) if getattr(base, f.name) != getattr(MembershipConfig.lan(), f.name)}
    assert changed == {"probe_interval_s", "probe_timeout_s", "gossip_interval_s", "reconnect_interval_s"}


# ----- probes and exact timers ----------------------------------------------------------------
def _frames(out: list[tuple[str, bytes]]) -> list[tuple[str, Frame]]:
    return [(d, decode_frame(b)) for d, b in out]


def test_probe_ack_timers_and_rtt() -> None:
    m = Mesh(2)
    m.introduce_all()
    a, b = m.names
    ca = m.cores[a]
    t0 = ca.get_timer()
    assert 0.0 <= t0 < QUIET.probe_interval_s  # jittered first probe
    ca.handle_timer(t0)
    [(dest, ping)] = _frames(ca.messages_to_send())
    assert dest == b and ping.type == MsgType.PING and ping.fields["target"] == b
    assert ca.get_timer() == pytest.approx(t0 + QUIET.probe_timeout_s)
    m.cores[b].receive(a, encode_frame(ping), t0 + 0.01)
    [(dest, ack)] = _frames(m.cores[b].messages_to_send())
    assert dest == a and ack.type == MsgType.ACK and ack.fields["seq"] == ping.fields["seq"]
    ca.receive(b, encode_frame(ack), t0 + 0.02)
    view = ca.member(b)
    assert view is not None and view.rtt_ms == pytest.approx(20.0) and view.last_seen == t0 + 0.02
    assert ca.get_timer() == pytest.approx(t0 + QUIET.probe_interval_s)  # next probe, nothing pending
    ca.handle_timer(t0 + QUIET.probe_interval_s)
    assert [e for e in m.take_events(a) if isinstance(e, PeerSuspected)] == []


def test_unanswered_probe_goes_indirect_then_suspects_with_exact_deadline() -> None:
    m = Mesh(5)
    m.introduce_all()
    a = m.names[0]
    ca = m.cores[a]
    t0 = ca.get_timer()
    ca.handle_timer(t0)
    [(target, ping)] = _frames(ca.messages_to_send())
    ca.handle_timer(t0 + QUIET.probe_timeout_s)
    reqs = _frames(ca.messages_to_send())
    assert len(reqs) == QUIET.indirect_checks
    assert all(f.type == MsgType.PING_REQ and f.fields["target"] == target and d != target for d, f in reqs)
    assert ca.get_timer() == pytest.approx(t0 + QUIET.probe_interval_s)
    t_end = t0 + QUIET.probe_interval_s
    ca.handle_timer(t_end)
    evs = [e for e in m.take_events(a) if isinstance(e, PeerSuspected)]
    assert evs == [PeerSuspected(target, 10, a)]
    lo = suspicion_timeout_s(QUIET.suspicion_mult, 5, QUIET.probe_interval_s)
    assert ca.suspicion_deadline(target) == pytest.approx(t_end + QUIET.suspicion_max_timeout_mult * lo)
    view = ca.member(target)
    assert view is not None and view.state == "suspect"


def test_indirect_probe_through_relay_counts_as_ack() -> None:
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    ca = m.cores[a]
    ca._probe_order, ca._probe_idx = [b], 0
    t0 = ca.get_timer()
    ca.handle_timer(t0)
    ca.messages_to_send()  # the direct ping is lost
    ca.handle_timer(t0 + QUIET.probe_timeout_s)
    m.dropped = set()
    for dest, data in ca.messages_to_send():
        m.queue.append((a, dest, data))
    m.pump(t0 + QUIET.probe_timeout_s + 0.01)
    ca.handle_timer(t0 + QUIET.probe_interval_s)
    assert not [e for e in m.take_events(a) if isinstance(e, PeerSuspected)]
    view = ca.member(b)
    assert view is not None and view.state == "alive" and view.rtt_ms is None  # indirect: no rtt


def test_suspicion_expires_into_death_exactly_and_confirmations_shorten_it() -> None:
    m = Mesh(6)
    m.introduce_all()
    a, b, c, d = m.names[:4]
    ca = m.cores[a]
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", b, 10, c]])), 5.0)
    assert m.take_events(a) == [PeerSuspected(b, 10, c)]
    lo = suspicion_timeout_s(QUIET.suspicion_mult, 6, QUIET.probe_interval_s)
    hi = QUIET.suspicion_max_timeout_mult * lo
    assert ca.suspicion_deadline(b) == pytest.approx(5.0 + hi)
    # the same suspecter again is not a confirmation
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", b, 10, c]])), 5.5)
    assert ca.suspicion_deadline(b) == pytest.approx(5.0 + hi)
    ca.receive(d, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", b, 10, d]])), 6.0)
    k = confirmations_needed(QUIET.indirect_checks, 6)
    want = 5.0 + remaining_suspicion_s(1, k, 0.0, lo, hi)
    assert ca.suspicion_deadline(b) == pytest.approx(want)
    assert m.take_events(a) == []
    ca.handle_timer(want - 1e-6)
    assert not [e for e in m.take_events(a) if isinstance(e, PeerDied)]
    ca.handle_timer(want)
    assert [e for e in m.take_events(a) if isinstance(e, PeerDied)] == [PeerDied(b, 10)]
    assert b not in ca.live_ids()


def test_claim_order_unknown_older_confirm_refute_transition() -> None:
    m = Mesh(4)
    m.introduce_all()
    a, b, c, d = m.names
    ca = m.cores[a]
    stranger = NodeIdentity.generate().node_id
    # unknown: ignored
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["dead", stranger, 99, c]])), 1.0)
    # older: incarnation below what we know
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", b, 9, c]])), 1.0)
    assert m.take_events(a) == [] and ca.member(b).state == "alive"  # type: ignore[union-attr]
    # refute: a claim about ourselves makes us re-sign with a higher incarnation
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", a, 10, c]])), 1.0)
    assert m.take_events(a) == [LocalRefuted(11)] and ca.incarnation == 11
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["dead", a, 30, c]])), 1.0)
    assert m.take_events(a) == [LocalRefuted(31)]
    # transition then dead
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", d, 10, c]])), 1.0)
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["dead", d, 10, c]])), 1.0)
    assert m.take_events(a) == [PeerSuspected(d, 10, c), PeerDied(d, 10)]
    # already dead: a suspect claim does not resurrect the suspicion
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", d, 10, c]])), 1.0)
    assert m.take_events(a) == []


def test_refutation_spreads_and_clears_suspicion() -> None:
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    m.cores[a].receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", b, 10, c]])), 1.0)
    assert m.take_events(a) == [PeerSuspected(b, 10, c)]
    m.cores[a].sync_with(b, 1.0)  # the suspicion rumour reaches b, which refutes and answers
    m.pump(1.1)
    assert LocalRefuted(11) in m.take_events(b)
    m.cores[b].sync_with(a, 1.2)
    m.pump(1.2)
    evs = m.take_events(a)
    assert SuspicionRefuted(b, 11) in evs
    assert m.cores[a].member(b).state == "alive"  # type: ignore[union-attr]


def test_dead_claims_from_anti_entropy_only_suspect() -> None:
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    m.cores[a].receive(c, encode_frame(Frame(MsgType.DELTA, claims=[["dead", b, 10, c]])), 1.0)
    assert m.take_events(a) == [PeerSuspected(b, 10, c)]


# ----- records: forged, stale, non-member, revival ---------------------------------------------
def test_forged_stale_and_foreign_records_are_rejected() -> None:
    m = Mesh(2)
    a, b = m.names
    ca, cb = m.cores[a], m.cores[b]
    good = cb.local_record.encoded
    forged = good.replace(b'"tiny"', b'"evil"')
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, forged)])), 0.0)
    [ev] = m.take_events(a)
    assert isinstance(ev, RecordRejected) and "signature" in ev.reason
    other = Mesh(1)  # a node of another mesh
    foreign = next(iter(other.cores.values())).local_record.encoded
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, foreign)])), 0.0)
    [ev] = m.take_events(a)
    assert isinstance(ev, RecordRejected) and "another mesh" in ev.reason
    # same mesh id but a certificate signed by someone else's key: not a member
    from transport.credentials import MeshCredentials, MemberCert, create_mesh
    outsider = NodeIdentity.generate()
    fake = create_mesh(outsider, "x", 1, 1, 1)
    fake_cert = MemberCert.issue(fake.admin, fake.genesis, outsider.public_key, 1)  # type: ignore[arg-type]
    from meshd.membership.records import LocalInfo, sign_record
    forged_creds = MeshCredentials(genesis=m.creds0.genesis, cert=fake_cert)
    blob = sign_record(outsider, forged_creds, LocalInfo(), 1)
    blob = blob.replace(fake.mesh_id.encode(), m.creds0.mesh_id.encode(), 1)
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, blob)])), 0.0)
    [ev] = m.take_events(a)
    assert isinstance(ev, RecordRejected) and "not a member" in ev.reason
    # oversize
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, b"{" * 20000)])), 0.0)
    [ev] = m.take_events(a)
    assert isinstance(ev, RecordRejected) and "oversize" in ev.reason
    # accepted, then stale after an update
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, good)])), 0.0)
    assert [type(e) for e in m.take_events(a)] == [PeerJoined]
    cb.update_local(1.0, models=(ModelInfo("other", "dense", "fp9", 128),))
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, cb.local_record.encoded)])), 1.0)
    [ev] = m.take_events(a)
    assert isinstance(ev, RecordUpdated) and ev.record.models[0].name == "other"
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, good)])), 2.0)
    assert m.take_events(a) == [] and ca.stats["stale"] == 1
    assert ca.member(b).record.version == 11  # type: ignore[union-attr]


def test_stale_gossip_never_revives_a_dead_node_but_its_new_incarnation_does() -> None:
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    ca = m.cores[a]
    old = m.cores[b].local_record.encoded
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["dead", b, 10, c]])), 1.0)
    assert m.take_events(a) == [PeerDied(b, 10)]
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, old)])), 2.0)
    assert m.take_events(a) == [] and ca.member(b).state == "dead"  # type: ignore[union-attr]
    reborn = m.make_core(m.ids[1], incarnation=500, seed=1, now=3.0)  # a restart: new incarnation
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, reborn.local_record.encoded)])), 3.0)
    evs = m.take_events(a)
    assert [type(e) for e in evs] == [PeerJoined] and ca.member(b).state == "alive"  # type: ignore[union-attr]


def test_own_record_echo_does_not_bump_but_an_old_life_does() -> None:
    m = Mesh(2)
    a, b = m.names
    ca = m.cores[a]
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, ca.local_record.encoded)])), 0.0)
    assert ca.incarnation == 10 and m.take_events(a) == []
    previous_life = m.make_core(m.ids[0], incarnation=40, seed=3)
    ca.receive(b, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, previous_life.local_record.encoded)])), 0.0)
    assert m.take_events(a) == [LocalRefuted(41)]


def test_leave_is_signed_immediate_and_tombstone_is_purged_after_ttl() -> None:
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    m.cores[b].leave(5.0)
    sent = m.cores[b].messages_to_send()
    assert sorted(d for d, _ in sent) == sorted([a, c])
    for d, data in sent:
        m.cores[d].receive(b, data, 5.0)
    assert m.take_events(a) == [PeerLeft(b, 11)] and m.take_events(c) == [PeerLeft(b, 11)]
    ca = m.cores[a]
    assert b not in ca.live_ids() and ca.member(b).state == "left"  # type: ignore[union-attr]
    # a forged "alive" claim cannot undo a signed leave; older records are stale
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, claims=[["suspect", b, 11, c]])), 6.0)
    assert m.take_events(a) == []
    ca.handle_timer(5.0 + QUIET.tombstone_ttl_s - 0.001)
    assert not [e for e in m.take_events(a) if isinstance(e, PeerPurged)]
    ca.handle_timer(5.0 + QUIET.tombstone_ttl_s)
    assert [e for e in m.take_events(a) if isinstance(e, PeerPurged)] == [PeerPurged(b)]
    assert ca.member(b) is None


# ----- bans ------------------------------------------------------------------------------------
def test_ban_removes_node_rejects_its_records_and_frames() -> None:
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    ca = m.cores[a]
    assert m.admin is not None
    rev1 = Revocations.sign(m.admin, m.creds0.mesh_id, 1, {b})
    not_admin = Revocations.sign(NodeIdentity.generate(), m.creds0.mesh_id, 5, {c})
    assert not ca.apply_revocations(not_admin, 1.0)
    [ev] = m.take_events(a)
    assert isinstance(ev, RecordRejected) and "admin" in ev.reason
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.REVOCATIONS, rev1)])), 1.0)
    assert m.take_events(a) == [NodeBanned(b, 1)]
    assert ca.member(b) is None and ca.is_banned(b) and b not in ca.live_ids()
    ca.receive(c, encode_frame(Frame(MsgType.GOSSIP, blobs=[(BlobKind.RECORD, m.cores[b].local_record.encoded)])), 2.0)
    [ev] = m.take_events(a)
    assert isinstance(ev, RecordRejected) and ev.reason == "node is banned"
    ping = encode_frame(Frame(MsgType.PING, {"seq": 1, "target": a}))
    ca.receive(b, ping, 2.0)
    assert ca.messages_to_send() == []  # frames from a banned node are ignored
    rev0 = Revocations.sign(m.admin, m.creds0.mesh_id, 0, set())
    assert not ca.apply_revocations(rev0, 3.0)  # older list: stale
    assert ca.is_banned(b)


# ----- anti-entropy ----------------------------------------------------------------------------
def test_digest_exchange_converges_without_rumours() -> None:
    m = Mesh(4)
    a, b, c, d = m.names
    # a knows c, b knows d; no rumours queued anywhere
    m.cores[a].add_records([m.cores[c].local_record.encoded, m.cores[b].local_record.encoded], 0.0)
    m.cores[b].add_records([m.cores[d].local_record.encoded, m.cores[a].local_record.encoded], 0.0)
    assert m.admin is not None
    m.cores[b].apply_revocations(Revocations.sign(m.admin, m.creds0.mesh_id, 3, set()), 0.0)
    for k in (a, b):
        m.cores[k]._rumours.clear()
        m.take_events(k)
    m.cores[a].sync_with(b, 1.0)
    m.pump(1.0)
    assert m.cores[a].digest_root() == m.cores[b].digest_root()
    assert {v.node_id for v in m.cores[a].members()} == {b, c, d}
    assert m.cores[a].revocations is not None and m.cores[a].revocations.version == 3
    # converged: a further round sends only the digest, answered by nothing
    m.cores[a].sync_with(b, 5.0)
    assert m.pump(5.0) == 1


def test_each_rumour_is_sent_exactly_retransmit_limit_times() -> None:
    m = Mesh(4)
    m.introduce_all()
    a, b, c, d = m.names
    ca = m.cores[a]
    ca.update_local(1.0, models=(ModelInfo("x", "moe", "fpx", 1),))
    limit = retransmit_limit(QUIET.retransmit_mult, ca.cluster_size())
    carried = 0
    for i in range(limit + 3):
        ca.sync_with(b, 2.0 + i)
        [(_, data)] = ca.messages_to_send()
        carried += sum(1 for k, blob in decode_frame(data).blobs if blob == ca.local_record.encoded)
    assert carried == limit


def test_banned_node_is_told_directly() -> None:
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    assert m.admin is not None
    m.cores[a].apply_revocations(Revocations.sign(m.admin, m.creds0.mesh_id, 1, {b}), 1.0)
    m.cores[a].messages_to_send()
    m.cores[a].tell_revocations(b)
    [(dest, data)] = m.cores[a].messages_to_send()
    m.cores[b].receive(a, data, 1.0)
    assert dest == b and m.take_events(b) == [NodeBanned(b, 1)] and m.cores[b].is_banned(b)


def test_a_late_probe_still_ends_in_suspicion_when_the_next_one_is_due() -> None:
    """Probes run on a fixed grid, but a probe that started late would end after the next grid tick: that
    tick must end it (failed) before starting the next, not overwrite it unanswered."""
    m = Mesh(3)
    m.introduce_all()
    a, b, c = m.names
    ca = m.cores[a]
    ca._probe_order, ca._probe_idx = [c, b], 0  # probe c (dead), then b
    ca.handle_timer(ca.get_timer() + 0.002)  # the loop woke 2 ms late: ping to c
    ca.messages_to_send()  # lost: c is dead
    ca.handle_timer(ca.get_timer())  # indirect probes, lost too
    ca.messages_to_send()
    ca.handle_timer(ca.get_timer())  # on time: the next probe is due, 2 ms before c's would end
    assert PeerSuspected(c, 10, a) in m.take_events(a)


def test_a_dead_member_is_suspected_at_its_first_probe_on_a_jittery_loop() -> None:
    m = Mesh(3, config=MembershipConfig.local())
    m.introduce_all()
    a, _, c = m.names
    ca = m.cores[a]
    rng = random.Random(1)
    now, probes_of_c = 0.0, 0
    while now < 30.0 and ca.member(c).state == "alive":  # type: ignore[union-attr]
        now = max(now, ca.get_timer()) + rng.uniform(0.0, 0.004)  # asyncio timers fire 0-4 ms late
        ca.handle_timer(now)
        ca.messages_to_send()  # nobody answers: only this node's probes matter here
        p = ca._probe
        if p is not None and p.target == c and p.sent_at == now:
            probes_of_c += 1
    assert ca.member(c).state == "suspect"  # type: ignore[union-attr]
    assert probes_of_c == 1, f"c was probed {probes_of_c} times before it was suspected"
