"""The membership service: drives the sans-I/O core inside the daemon.

It feeds the core with gossip frames (``StreamType.GOSSIP``, one stream per frame) and timer ticks,
sends what the core wants sent (dialling members at the addresses in their signed records), redeems
invite tokens (``transport.redeem``) or answers them (``transport.set_join_handler``), persists the ban
list, the invite ledger and remembered peers in the state dir, enforces bans through the transport's
admission hook, runs mDNS, and serves the control commands ``invite``, ``join``, ``ban`` and
``invite_revoke``.

Public API for other services (get the instance with ``membership_of(daemon)``)::

    set_local_models(models: list[ModelInfo]);  set_local_experts(experts: list[ExpertShard])
    set_load(in_flight: int)                    # republished at most every LOAD_REPUBLISH_S
    alive_peers() -> list[MemberView];  peers() -> list[MemberView];  record(node_id) -> NodeRecord | None
    on_change(callback(event))                  # every core event (PeerJoined, RecordUpdated, PeerDied ...)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from discovery.invite import (
    WRONG_MESH,
    InviteError,
    InviteLedger,
    InviteToken,
    JoinResponse,
    build_join_request,
    parse_join_request,
)
from discovery.mdns import MdnsDiscovery, interface_addresses
from meshd import __version__
from meshd.config import format_hostport, is_loopback
from meshd.control import ControlError
from meshd.errors import RuntimeFailure, UsageError
from meshd.membership.config import MembershipConfig
from meshd.membership.core import Membership, MemberView
from meshd.membership.events import Event, LocalRefuted, NodeBanned, PeerDied, PeerJoined, PeerLeft
from meshd.membership.records import (
    Capacity,
    ExpertShard,
    LocalInfo,
    ModelInfo,
    NodeRecord,
    RecordError,
    RecordVerifier,
    Revocations,
)
from meshd.state import write_atomic
from transport import PROTOCOL_VERSION
from transport.credentials import CredentialError, Genesis, MemberCert, MeshCredentials
from transport.errors import JoinRefused, TransportError
from transport.identity import is_node_id, node_id_from_public_key
from transport.limits import MAX_JOIN_MESSAGE_BYTES, MAX_JOIN_VIEW_RECORDS, MAX_REMEMBERED_PEERS
from transport.streams import StreamType

if TYPE_CHECKING:
    from meshd.config import DaemonConfig
    from meshd.daemon import Daemon
    from transport.quic import MeshTransport, Peer, Stream

log = structlog.get_logger(__name__)

PEERS_FILE = "peers.json"
BANS_FILE = "bans.json"
INVITES_FILE = "invites.json"
STRANGER_SYNC_S = 1.0  # how often connected-but-not-alive members are sent our digest
PEERS_SAVE_DELAY_S = 2.0  # remembered peers are written at most this often (joins come in bursts)
LOAD_REPUBLISH_S = 2.0  # in-flight counts change constantly; re-sign at most this often
SEND_QUEUE_FRAMES = 64  # frames waiting per destination while we dial it; older ones are dropped
SEND_TIMEOUT_S = 1.0  # one frame to a connected peer; a dead peer's frames are simply lost
DIAL_TIMEOUT_S = 2.0  # dialling a member from its record; failures are retried by SWIM itself
DIAL_RETRY_S = 1.0  # do not redial a member that just failed more often than this
JOIN_BACKOFF_MIN_S = 0.5  # issuer unreachable: retry after this, doubling ...
JOIN_BACKOFF_MAX_S = 30.0  # ... up to this (with jitter)
BAN_NOTICE_S = 0.3  # a banned node gets the ban list, then this long before we disconnect it
LEAVE_FLUSH_S = 0.5  # on SIGTERM, how long we wait for the "leaving" record to go out


class IssuerUnreachable(RuntimeFailure):
    """No address in the token answered (the join is retried, not refused)."""


def membership_of(daemon: Daemon) -> MembershipService | None:
    """The daemon's membership service, if it runs one."""
    for s in daemon.services:
        if isinstance(s, MembershipService):
            return s
    return None


def _parse_addr(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def parse_duration(text: str) -> int:
    """'90s', '30m', '24h', '7d' or plain seconds -> seconds. Raises ``UsageError``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise UsageError(f"bad duration {text!r} (use e.g. 30m, 24h, 7d)") from None
    if value <= 0:
        raise UsageError("duration must be positive")
    return value


class MembershipService:
    name = "membership"

    def __init__(self, config: DaemonConfig, preset: MembershipConfig | None = None) -> None:
        self.config = config
        self.preset = preset
        self.core: Membership | None = None
        self.daemon: Daemon | None = None
        self._info = LocalInfo(role="serve" if config.role == "serve" else "client", proto=PROTOCOL_VERSION,
                               software=__version__)
        self._callbacks: list[Callable[[Event], None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._queues: dict[str, deque[bytes]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._dial_failed: dict[str, float] = {}
        self._ledger = InviteLedger()
        self._ledger_lock = asyncio.Lock()
        self._mdns: MdnsDiscovery | None = None
        self._load_pending: int | None = None
        self._load_handle: asyncio.TimerHandle | None = None
        self._last_load_publish = -1e18
        self._join_lock = asyncio.Lock()
        self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._bg_join: asyncio.Task[None] | None = None
        self._save_handle: asyncio.TimerHandle | None = None
        self._mdns_addrs: dict[str, list[tuple[str, int]]] = {}

    # ----- public API for other services -------------------------------------------------------
    def set_local_models(self, models: list[ModelInfo]) -> None:
        self._update(models=tuple(models))

    def set_local_experts(self, experts: list[ExpertShard]) -> None:
        self._update(experts=tuple(experts))

    def set_local_stages(self, stages: list[Any]) -> None:
        """Advertise this node's pipeline stage offers (``records.StageOffer``)."""
        self._update(stages=tuple(stages))

    def set_load(self, in_flight: int) -> None:
        """Advertise requests in flight; re-signed at most every ``LOAD_REPUBLISH_S`` seconds."""
        self._load_pending = max(0, int(in_flight))
        if self._load_handle is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last_load_publish + LOAD_REPUBLISH_S - loop.time())
        self._load_handle = loop.call_later(delay, self._publish_load)

    def _publish_load(self) -> None:
        self._load_handle = None
        if self._load_pending is None or self._load_pending == self._info.capacity.in_flight:
            return
        self._last_load_publish = asyncio.get_running_loop().time()
        cap = self._info.capacity
        self._update(capacity=Capacity(cap.cpus, cap.ram_mb, self._load_pending))

    def alive_peers(self) -> list[MemberView]:
        return [v for v in self.peers() if v.state == "alive"]

    def peers(self) -> list[MemberView]:
        return self.core.members() if self.core is not None else []

    def record(self, node_id: str) -> NodeRecord | None:
        v = self.core.member(node_id) if self.core is not None else None
        return v.record if v is not None else None

    def on_change(self, callback: Callable[[Event], None]) -> None:
        self._callbacks.append(callback)

    def _update(self, **changes: Any) -> None:
        from dataclasses import replace

        self._info = replace(self._info, **changes)
        if self.core is not None:
            self.core.update_local(self._now(), **changes)
            self._flush()

    # ----- lifecycle ---------------------------------------------------------------------------
    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def transport(self) -> MeshTransport:
        assert self.daemon is not None and self.daemon.transport is not None  # noqa: S101 - started
        return self.daemon.transport

    async def start(self, daemon: Daemon) -> None:
        self.daemon = daemon
        t = self.transport
        self._info = _replace_info(self._info, addrs=tuple(self._advertised_addrs()),
                                   cpus=os.cpu_count() or 0, ram_mb=_ram_mb())
        try:
            self._ledger = InviteLedger.from_json((daemon.state.path / INVITES_FILE).read_bytes())
        except FileNotFoundError:
            pass
        except (InviteError, ValueError, OSError) as e:
            raise RuntimeFailure(f"cannot read {INVITES_FILE}: {e}") from e
        daemon.admission_checks.append(self._admit)
        t.on_stream(StreamType.GOSSIP, self._on_gossip_stream)
        t.set_join_handler(self._on_join)
        t.on_peer_up.append(self._on_peer_up)
        daemon.control.register("invite", self._cmd_invite)
        daemon.control.register("invite_revoke", self._cmd_invite_revoke)
        daemon.control.register("join", self._cmd_join)
        daemon.control.register("ban", self._cmd_ban)
        if daemon.credentials is None:
            await self._join_from_config()
        else:
            self._install(daemon.credentials, view=None)
            switch = self._solo_switch_token(daemon.credentials)
            if switch is not None:
                self._spawn(self._switch_from_solo(switch))
        self._task = asyncio.ensure_future(self._run())

    def _solo_switch_token(self, creds: MeshCredentials) -> str | None:
        """A configured join token to act on although this node has credentials: only when the token is
        for another mesh and this node is alone in a mesh it founded itself (it holds that mesh's admin
        key and has never remembered a peer), e.g. `meshd serve` once on its own, then `--join`. Any
        other node keeps its mesh and logs why the token is ignored."""
        if not self.config.has_join:
            return None
        try:
            text = self.config.read_join_token()
            tok = InviteToken.decode(text) if text else None
        except (InviteError, UsageError, OSError):
            tok, text = None, None
        if tok is None or text is None:
            log.warning("join_ignored", reason="this node already has mesh credentials and the configured "
                        "token cannot be read", mesh_id=creds.mesh_id)
            return None
        if tok.mesh_id == creds.mesh_id:
            return None  # already a member of the token's mesh: nothing to do
        if creds.admin is None or self._remembered_texts():
            log.warning("join_ignored", reason="this node is a member of another mesh with peers; it keeps "
                        "that mesh", mesh_id=creds.mesh_id)
            return None
        return text

    async def _switch_from_solo(self, text: str) -> None:
        """Join the token's mesh from a solo mesh, as `meshd join` does; a refusal stops the node (exit 1)
        with the reason, and its solo mesh is left as it was."""
        try:
            result = await self._cmd_join({"token": text})
        except ControlError as e:
            if self.daemon is not None:
                self.daemon.fail(f"join refused: {e}" if "refused" not in str(e) else str(e))
            return
        log.info("joined_from_solo_mesh", mesh_id=result.get("mesh_id"))

    async def _join_from_config(self) -> None:
        """First attempt inline (a refusal aborts start with its reason); if the issuer is unreachable,
        keep retrying in the background while the daemon runs in state ``joining``."""
        assert self.daemon is not None  # noqa: S101
        text = self.config.read_join_token()
        if text is None:
            raise UsageError("no join token configured")
        reread = self.config.join_file is not None
        try:
            creds, view = await self._redeem(text, reread=reread, max_wait_s=0.0)
        except IssuerUnreachable:
            self._bg_join = asyncio.ensure_future(self._join_in_background(text, reread))
            return
        self.daemon.set_credentials(creds)
        self._install(creds, view)

    async def _join_in_background(self, text: str, reread: bool) -> None:
        assert self.daemon is not None  # noqa: S101
        try:
            creds, view = await self._redeem(text, reread=reread)
            self.daemon.set_credentials(creds)
            self._install(creds, view)
        except (UsageError, RuntimeFailure) as e:
            if not self._stop_requested():
                self.daemon.fail(str(e))

    async def stop(self) -> None:
        self._stopping = True
        if self._load_handle is not None:
            self._load_handle.cancel()
        if self._save_handle is not None:
            self._save_handle.cancel()
        core = self.core
        if core is not None and self.daemon is not None and self.daemon.transport is not None:
            core.leave(self._now())
            self._flush()
            pending = list(self._senders.values())
            if pending:
                await asyncio.wait(pending, timeout=LEAVE_FLUSH_S)
            log.info("membership_left", incarnation=core.incarnation)
        if self._task is not None:
            self._task.cancel()
        for task in [*self._senders.values(), *self._tasks, *([self._bg_join] if self._bg_join else [])]:
            task.cancel()
        if self._mdns is not None:
            await self._mdns.close()
            self._mdns = None
        self._save_peers()

    def status(self) -> dict[str, Any]:
        core = self.core
        if core is None:
            return {"state": "joining", "peers": []}
        now = self._now()
        peers = []
        for v in sorted(core.members(), key=lambda v: v.node_id):
            tpeer = self.daemon.transport.peer(v.node_id) if self.daemon and self.daemon.transport else None
            rtt = v.rtt_ms if v.rtt_ms is not None else (tpeer.rtt_ms if tpeer is not None else None)
            peers.append({
                "node_id": v.node_id, "addrs": list(v.record.addrs), "state": v.state,
                "rtt_ms": None if rtt is None else round(rtt, 2),
                "models": [m.to_json() for m in v.record.models],
                "experts": [e.to_json() for e in v.record.experts], "version": v.record.software,
                "last_seen_s": None if v.last_seen is None else round(now - v.last_seen, 2),
                "role": v.record.role, "api": v.record.api, "incarnation": v.incarnation,
            })
        rev = core.revocations
        return {
            "peers": peers, "incarnation": core.incarnation, "alive": len(core.live_ids()),
            "banned": sorted(rev.banned) if rev else [], "stats": dict(core.stats),
            "mdns": self._mdns is not None,
        }

    # ----- core installation -------------------------------------------------------------------
    def _preset(self) -> MembershipConfig:
        if self.preset is not None:
            return self.preset
        return MembershipConfig.local() if is_loopback(self.config.listen.host) else MembershipConfig.lan()

    def _install(self, creds: MeshCredentials, view: JoinResponse | None) -> None:
        """Create the core for ``creds`` with persisted bans and remembered peers (or a join's view)."""
        assert self.daemon is not None  # noqa: S101
        state = self.daemon.state.path
        self._info = _replace_info(self._info, admin=creds.is_admin)
        verifier = RecordVerifier(creds.genesis)
        core = Membership(identity=self.daemon.identity, credentials=creds, info=self._info,
                          config=self._preset(), rng=random.Random(), now=self._now(),
                          incarnation=int(time.time() * 1000), verifier=verifier)
        bans = view.revocations if view is not None else _read(state / BANS_FILE)
        if bans is not None:
            core.apply_revocations(bans, self._now())
        if core.is_banned(core.node_id):
            raise RuntimeFailure(f"this node was banned from mesh {creds.mesh_id}")
        records = list(view.records) if view is not None else self._remembered_records(verifier)
        core.add_records(records, self._now())
        self.core = core
        self._flush()
        for v in core.members():
            if v.state == "alive":
                core.sync_with(v.node_id, self._now())
        self._flush()
        if self.config.mdns and self._mdns is None:
            self._start_mdns(creds)
        log.info("membership_started", mesh_id=creds.mesh_id, known_peers=len(core.members()),
                 banned=len(core.revocations.banned) if core.revocations else 0)

    def _remembered_texts(self) -> list[Any]:
        """The encoded records in the remembered-peers file (unverified); [] if there is none."""
        assert self.daemon is not None  # noqa: S101
        raw = _read(self.daemon.state.path / PEERS_FILE)
        if raw is None:
            return []
        try:
            items = json.loads(raw)["records"]
        except (ValueError, KeyError, TypeError):
            log.warning("remembered_peers_unreadable", file=PEERS_FILE)
            return []
        return list(items) if isinstance(items, list) else []

    def _remembered_records(self, verifier: RecordVerifier) -> list[bytes]:
        out = []
        for text in self._remembered_texts()[:MAX_REMEMBERED_PEERS]:
            try:
                verifier.decode_record(text.encode())
                out.append(text.encode())
            except (RecordError, AttributeError):
                continue
        return out

    def _schedule_save(self) -> None:
        if self._save_handle is None and not self._stopping:
            self._save_handle = asyncio.get_running_loop().call_later(PEERS_SAVE_DELAY_S, self._save_now)

    def _save_now(self) -> None:
        self._save_handle = None
        self._save_peers()

    def _save_peers(self) -> None:
        core, daemon = self.core, self.daemon
        if core is None or daemon is None:
            return
        alive = [v for v in core.members() if v.state in ("alive", "suspect")]
        alive.sort(key=lambda v: v.last_seen or 0.0, reverse=True)
        data = json.dumps({"records": [v.record.encoded.decode() for v in alive[:MAX_REMEMBERED_PEERS]]})
        if alive or not (daemon.state.path / PEERS_FILE).exists():
            with contextlib.suppress(OSError):
                write_atomic(daemon.state.path / PEERS_FILE, data.encode())

    def _advertised_addrs(self) -> list[str]:
        assert self.daemon is not None and self.daemon.quic_address is not None  # noqa: S101
        host, port = self.daemon.quic_address
        if host in ("0.0.0.0", "::", ""):
            hosts = [h for h in interface_addresses() if not h.startswith("127.")] or ["127.0.0.1"]
        else:
            hosts = [host]
        return [format_hostport(h, port) for h in hosts]

    def _start_mdns(self, creds: MeshCredentials) -> None:
        assert self.daemon is not None and self.daemon.quic_address is not None  # noqa: S101
        addrs = [a.rpartition(":")[0].strip("[]") for a in self._info.addrs]
        self._mdns = MdnsDiscovery(self.daemon.node_id, creds.mesh_id, PROTOCOL_VERSION,
                                   self.daemon.quic_address.port, addrs, self._on_mdns_found)
        self._spawn(self._mdns.start())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- the loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        next_check = 0.0
        while True:
            core = self.core
            if core is None:
                await asyncio.sleep(0.1)
                continue
            now = self._now()
            if now >= next_check:
                next_check = now + STRANGER_SYNC_S
                self._sync_strangers(core, now)
            due = min(core.get_timer(), next_check)
            if due <= now:
                core.handle_timer(now)
                self._flush()
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), due - now)

    def _sync_strangers(self, core: Membership, now: float) -> None:
        """Connected members we do not see as alive (a restarted node that knows nobody, a first sync
        lost to a duplicate-connection close) get our digest, so the exchange that follows fixes it."""
        if self.daemon is None or self.daemon.transport is None:
            return
        for peer in self.daemon.transport.peers():
            view = core.member(peer.node_id)
            if (view is None or view.state != "alive") and not core.is_banned(peer.node_id):
                core.sync_with(peer.node_id, now)
        self._flush()

    def _flush(self) -> None:
        core = self.core
        if core is None:
            return
        for dest, data in core.messages_to_send():
            self._send(dest, data)
        while (ev := core.next_event()) is not None:
            self._on_event(ev)
        self._wake.set()

    def _send(self, dest: str, data: bytes) -> None:
        q = self._queues.setdefault(dest, deque())
        if len(q) >= SEND_QUEUE_FRAMES:
            q.popleft()
        q.append(data)
        if dest not in self._senders:
            self._senders[dest] = asyncio.ensure_future(self._sender(dest))

    async def _sender(self, dest: str) -> None:
        q = self._queues[dest]
        try:
            while q:
                peer = await self._peer_for(dest)
                if peer is None:
                    q.clear()
                    return
                data = q.popleft()
                try:
                    async with asyncio.timeout(SEND_TIMEOUT_S):
                        stream = await peer.open_stream(StreamType.GOSSIP)
                        await stream.send(data, end=True)
                except (TransportError, TimeoutError, OSError) as e:
                    log.debug("gossip_send_failed", peer=dest, error=str(e))
        finally:
            self._senders.pop(dest, None)
            if not q:
                self._queues.pop(dest, None)

    async def _peer_for(self, dest: str) -> Peer | None:
        t = self.transport
        peer = t.peer(dest)
        if peer is not None:
            return peer
        now = self._now()
        if now - self._dial_failed.get(dest, -1e18) < DIAL_RETRY_S or self.core is None:
            return None
        view = self.core.member(dest)
        addrs = [a for a in (_parse_addr(x) for x in (view.record.addrs if view else ())) if a]
        addrs += [a for a in self._mdns_addrs.get(dest, []) if a not in addrs]
        for addr in addrs:
            try:
                async with asyncio.timeout(DIAL_TIMEOUT_S):
                    return await t.connect(addr, expected_node_id=dest)
            except (TransportError, TimeoutError, OSError) as e:
                log.debug("gossip_dial_failed", peer=dest, addr=format_hostport(*addr), error=str(e))
        self._dial_failed[dest] = self._now()
        return None

    async def _on_gossip_stream(self, peer: Peer, stream: Stream) -> None:
        try:
            while (data := await stream.recv()) is not None:
                if self.core is not None and not self._stopping:
                    self.core.receive(peer.node_id, data, self._now())
                    self._flush()
        except TransportError as e:  # the sender went away mid-frame: gossip is lossy by design
            log.debug("gossip_stream_failed", peer=peer.node_id, error=str(e))

    def _on_peer_up(self, peer: Peer) -> None:
        core = self.core
        if core is None or self._stopping:
            return
        self._dial_failed.pop(peer.node_id, None)
        view = core.member(peer.node_id)
        if view is None or view.state != "alive":
            core.sync_with(peer.node_id, self._now())
            self._flush()

    def _on_mdns_found(self, node_id: str, addrs: list[tuple[str, int]]) -> None:
        core = self.core
        if core is None or core.is_banned(node_id) or node_id == core.node_id:
            return
        self._spawn(self._connect_found(node_id, addrs))

    async def _connect_found(self, node_id: str, addrs: list[tuple[str, int]]) -> None:
        t = self.transport
        self._mdns_addrs[node_id] = addrs
        existing = t.peer(node_id)
        view = self.core.member(node_id) if self.core is not None else None
        if existing is not None and view is not None and view.state == "alive":
            return  # connected and healthy (an inbound connection's address is the peer's dial port)
        if existing is not None:  # it restarted, maybe on a new port: drop the stale connection
            await t.disconnect(node_id, "rediscovered on the LAN")
        for addr in addrs:
            try:
                async with asyncio.timeout(DIAL_TIMEOUT_S):
                    await t.connect(addr, expected_node_id=node_id)
                log.info("mdns_peer_connected", peer=node_id, addr=format_hostport(*addr))
                return
            except (TransportError, TimeoutError, OSError) as e:
                log.debug("mdns_connect_failed", peer=node_id, error=str(e))

    def _on_event(self, ev: Event) -> None:
        t = self.daemon.transport if self.daemon is not None else None
        if isinstance(ev, PeerJoined):
            log.info("peer_joined", peer=ev.node_id, incarnation=ev.record.version, role=ev.record.role)
            self._dial_failed.pop(ev.node_id, None)
            self._schedule_save()
        elif isinstance(ev, PeerDied):
            log.info("peer_died", peer=ev.node_id, incarnation=ev.incarnation)
            if t is not None:
                self._spawn(t.disconnect(ev.node_id, "declared dead by membership"))
        elif isinstance(ev, PeerLeft):
            log.info("peer_left", peer=ev.node_id)
        elif isinstance(ev, NodeBanned):
            log.info("node_banned", peer=ev.node_id, revocations_version=ev.revocations_version)
            self._save_bans()
            if self.core is not None and ev.node_id == self.core.node_id:
                if self.daemon is not None:
                    self.daemon.fail("this node was banned from the mesh")
            elif t is not None and self.core is not None:
                t.forget(ev.node_id)
                self.core.tell_revocations(ev.node_id)  # so it knows, stops, and stays out after a restart
                self._spawn(self._cut_off(ev.node_id))
        elif isinstance(ev, LocalRefuted):
            log.info("membership_refuted", incarnation=ev.incarnation)
        else:
            log.debug("membership_event", kind=type(ev).__name__, **{
                k: getattr(ev, k) for k in ("node_id", "reason", "incarnation") if hasattr(ev, k)})
        for cb in list(self._callbacks):
            try:
                cb(ev)
            except Exception:  # noqa: BLE001 - another service's bug must not stop gossip
                log.exception("membership_callback_failed")

    async def _cut_off(self, node_id: str) -> None:
        await asyncio.sleep(BAN_NOTICE_S)
        if self.daemon is not None and self.daemon.transport is not None:
            await self.daemon.transport.disconnect(node_id, "banned from the mesh")

    def _save_bans(self) -> None:
        core, daemon = self.core, self.daemon
        if core is None or daemon is None or core.revocations is None:
            return
        write_atomic(daemon.state.path / BANS_FILE, core.revocations.encoded)

    def _admit(self, node_id: str, cert: MemberCert) -> str | None:
        if self.core is not None and self.core.is_banned(node_id):
            return "node is banned from this mesh"
        return None

    # ----- joining -----------------------------------------------------------------------------

    async def _redeem(self, text: str, reread: bool = False, max_wait_s: float | None = None
                      ) -> tuple[MeshCredentials, JoinResponse]:
        """Redeem a token at its issuer, retrying with backoff while the issuer is unreachable.

        Raises ``UsageError`` (not a token) or ``RuntimeFailure`` (refused, with the reason).
        """
        assert self.daemon is not None  # noqa: S101
        delay = JOIN_BACKOFF_MIN_S
        deadline = None if max_wait_s is None else self._now() + max_wait_s
        while True:
            try:
                tok = InviteToken.decode(text)
            except InviteError as e:
                raise UsageError(str(e)) from None
            mine = self.daemon.credentials.mesh_id if self.daemon.credentials else None
            try:
                tok.check_usable(time.time(), mine)
            except InviteError as e:
                raise RuntimeFailure(f"join refused: {e}") from None
            request = build_join_request(tok, self.daemon.identity.public_key, PROTOCOL_VERSION)
            last = "no address in the token"
            for addr in [a for a in (_parse_addr(x) for x in tok.addrs) if a]:
                try:
                    reply = await self.transport.redeem(addr, tok.issuer_id, request)
                except JoinRefused as e:
                    log.warning("join_refused", issuer=tok.issuer_id, reason=e.reason)
                    raise RuntimeFailure(f"join refused: {e.reason}") from None
                except (TransportError, OSError) as e:
                    last = str(e)
                    continue
                return self._accept_join(tok, reply), JoinResponse.decode(reply)
            if self._stop_requested() or (deadline is not None and self._now() >= deadline):
                raise IssuerUnreachable(f"issuer of the invite token unreachable: {last}")
            wait = delay * (0.5 + 0.5 * random.random())
            log.info("join_retry", issuer=tok.issuer_id, retry_in_s=round(wait, 2), error=last)
            until = self._now() + wait
            while self._now() < until and not self._stop_requested():
                await asyncio.sleep(min(0.2, until - self._now()))
            if self._stop_requested():
                raise RuntimeFailure("stopped while joining")
            delay = min(delay * 2, JOIN_BACKOFF_MAX_S)
            if reread:
                text = self.config.read_join_token() or text

    def _stop_requested(self) -> bool:
        check = getattr(self.daemon, "_stop_requested", None)
        return self._stopping or (callable(check) and bool(check()))

    def _accept_join(self, tok: InviteToken, reply: bytes) -> MeshCredentials:
        assert self.daemon is not None  # noqa: S101
        try:
            resp = JoinResponse.decode(reply)
            genesis = Genesis.decode(resp.genesis)
            cert = MemberCert.decode(resp.cert, genesis)
        except (InviteError, CredentialError) as e:
            raise RuntimeFailure(f"join failed: the issuer sent a bad answer ({e})") from None
        if genesis.mesh_id != tok.mesh_id or genesis.admin_pub != tok.admin_pub:
            raise RuntimeFailure(f"join failed: {WRONG_MESH}")
        if cert.node_pub != self.daemon.identity.public_key:
            raise RuntimeFailure("join failed: the certificate is for another key")
        log.info("mesh_joined", mesh_id=genesis.mesh_id, issuer=tok.issuer_id)
        return MeshCredentials(genesis=genesis, cert=cert)

    async def _on_join(self, joiner_pub: bytes, request: bytes) -> bytes:
        """Issuer side of a join: checks, counts the use durably, then issues the certificate."""
        daemon, core = self.daemon, self.core
        creds = daemon.credentials if daemon is not None else None
        if daemon is None or core is None or creds is None or creds.admin is None:
            raise JoinRefused("this node cannot issue invites (it does not hold the mesh admin key)")
        joiner_id = node_id_from_public_key(joiner_pub)
        try:
            req = parse_join_request(request)
            self._ledger.check_proof(req, joiner_pub, creds.mesh_id)  # first: tell a stranger nothing
        except InviteError as e:
            raise JoinRefused(str(e)) from None
        if core.is_banned(joiner_id):
            raise JoinRefused("node is banned from this mesh")
        g = creds.genesis
        if not g.accepts_protocol(req.proto):
            raise JoinRefused(f"protocol version {req.proto} is outside the mesh's range {g.proto_min}..{g.proto_max}")
        async with self._ledger_lock:
            try:
                self._ledger.redeem(req, joiner_pub, creds.mesh_id, time.time())
            except InviteError as e:
                log.info("join_refused", joiner=joiner_id, reason=str(e))
                raise JoinRefused(str(e)) from None
            try:  # durable BEFORE the certificate exists: a crash never lets a use count twice
                write_atomic(daemon.state.path / INVITES_FILE, self._ledger.to_json())
            except OSError as e:
                raise JoinRefused("the issuer could not record the use of the token") from e
        cert = MemberCert.issue(creds.admin, g, joiner_pub, int(time.time()))
        records = [core.local_record.encoded]
        size = len(g.encoded) + len(cert.encoded) + len(records[0]) + 1024
        for v in core.members():
            if v.state == "alive" and len(records) < MAX_JOIN_VIEW_RECORDS:
                if size + len(v.record.encoded) > MAX_JOIN_MESSAGE_BYTES - 8192:
                    break
                size += len(v.record.encoded)
                records.append(v.record.encoded)
        rev = core.revocations.encoded if core.revocations else None
        log.info("join_accepted", joiner=joiner_id, view=len(records))
        return JoinResponse(g.encoded, cert.encoded, tuple(records), rev).encode()

    # ----- control commands --------------------------------------------------------------------
    def _admin_hint(self) -> str:
        holders = [v for v in self.alive_peers() if v.record.admin]
        if holders:
            h = holders[0]
            return f"node {h.node_id} ({', '.join(h.record.addrs)}) holds it"
        return "the node that created the mesh holds it"

    async def _cmd_invite(self, params: dict[str, Any]) -> dict[str, Any]:
        daemon, core = self.daemon, self.core
        creds = daemon.credentials if daemon is not None else None
        if daemon is None or core is None or creds is None:
            raise ControlError("this node has not joined a mesh yet")
        if creds.admin is None:
            raise ControlError(f"this node cannot issue invites: it does not hold the mesh admin key; "
                               f"{self._admin_hint()}")
        ttl, uses = params.get("ttl_s", 86400), params.get("uses", 1)
        if not isinstance(ttl, int) or not isinstance(uses, int) or ttl <= 0 or uses <= 0:
            raise ControlError("ttl_s and uses must be positive integers")
        try:
            tok = InviteToken.issue(creds.admin, daemon.identity.public_key, list(self._info.addrs), ttl, uses,
                                    int(time.time()), os.urandom)
        except InviteError as e:
            raise ControlError(str(e)) from None
        async with self._ledger_lock:
            self._ledger.purge_expired(time.time())
            self._ledger.add(tok)
            write_atomic(daemon.state.path / INVITES_FILE, self._ledger.to_json())
        log.info("invite_issued", token_id=tok.token_id, uses=uses, ttl_s=ttl)
        return {"token": tok.text, "token_id": tok.token_id, "expires_at": tok.expires_at, "uses": uses}

    async def _cmd_invite_revoke(self, params: dict[str, Any]) -> dict[str, Any]:
        tid = params.get("token_id")
        async with self._ledger_lock:
            if not isinstance(tid, str) or not self._ledger.revoke(tid):
                raise ControlError("no such invite token issued by this node")
            assert self.daemon is not None  # noqa: S101
            write_atomic(self.daemon.state.path / INVITES_FILE, self._ledger.to_json())
        return {"revoked": tid}

    async def _cmd_join(self, params: dict[str, Any]) -> dict[str, Any]:
        daemon = self.daemon
        text = params.get("token")
        if daemon is None or not isinstance(text, str):
            raise ControlError("missing token")
        async with self._join_lock:
            try:
                tok = InviteToken.decode(text)
            except InviteError as e:
                raise ControlError(str(e)) from None
            creds = daemon.credentials
            if creds is not None and creds.mesh_id == tok.mesh_id:
                raise ControlError(f"already a member of mesh {creds.mesh_id}")
            if creds is not None and self.core is not None and self.core.live_ids():
                raise ControlError(f"{WRONG_MESH} (this node is a member of mesh {creds.mesh_id} "
                                   f"with {len(self.core.live_ids())} live peers)")
            if self._bg_join is not None:  # a configured token still retrying: this one wins
                self._bg_join.cancel()
                self._bg_join = None
            self._stop_core_for_switch()
            try:
                new, view = await self._redeem_any_mesh(text)
            except (RuntimeFailure, UsageError) as e:
                if creds is not None and self.core is None:
                    self._install(creds, None)
                raise ControlError(str(e)) from None
            admin_key = daemon.state.path / "admin.key"
            if creds is not None and creds.admin is not None and admin_key.exists():
                # the solo mesh we leave keeps its key aside; the new mesh's genesis must not meet it
                admin_key.rename(daemon.state.path / f"admin-{creds.mesh_id}.key.old")
            daemon.set_credentials(new)
            for name in (PEERS_FILE, BANS_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (daemon.state.path / name).unlink()
            self._install(new, view)
            return {"mesh_id": new.mesh_id, "mesh_name": new.genesis.name}

    async def _redeem_any_mesh(self, text: str) -> tuple[MeshCredentials, JoinResponse]:
        """Redeem for a node that may already hold (solo) credentials of another mesh."""
        assert self.daemon is not None  # noqa: S101
        saved = self.daemon.credentials
        try:
            self.daemon.credentials = None  # the token's mesh check must not compare with our solo mesh
            return await self._redeem(text, max_wait_s=20.0)
        finally:
            self.daemon.credentials = saved

    def _stop_core_for_switch(self) -> None:
        self.core = None
        if self._mdns is not None:
            self._spawn(self._mdns.close())
            self._mdns = None

    async def _cmd_ban(self, params: dict[str, Any]) -> dict[str, Any]:
        daemon, core = self.daemon, self.core
        node_id = params.get("node_id")
        if not isinstance(node_id, str) or not is_node_id(node_id):
            raise ControlError("NODE_ID must be 32 lowercase hex characters (see `meshd status`)")
        creds = daemon.credentials if daemon is not None else None
        if daemon is None or core is None or creds is None:
            raise ControlError("this node has not joined a mesh yet")
        if creds.admin is None:
            raise ControlError(f"only the mesh admin key can ban; {self._admin_hint()}")
        if node_id == daemon.node_id:
            raise ControlError("refusing to ban this node itself")
        old = core.revocations
        banned = set(old.banned) if old else set()
        if node_id in banned:
            return {"banned": node_id, "version": old.version if old else 0, "already": True}
        blob = Revocations.sign(creds.admin, creds.mesh_id, (old.version if old else 0) + 1, banned | {node_id})
        core.apply_revocations(blob, self._now())
        self._flush()
        for peer_id in core.live_ids():  # tell everyone now, not only through the next rounds
            core.sync_with(peer_id, self._now())
        self._flush()
        rev = core.revocations
        return {"banned": node_id, "version": rev.version if rev else 0}


def _replace_info(info: LocalInfo, cpus: int | None = None, ram_mb: int | None = None, **changes: Any
                  ) -> LocalInfo:
    from dataclasses import replace

    if cpus is not None or ram_mb is not None:
        cap = info.capacity
        changes["capacity"] = Capacity(cpus if cpus is not None else cap.cpus,
                                       ram_mb if ram_mb is not None else cap.ram_mb, cap.in_flight)
    return replace(info, **changes)


def _ram_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))
    except (ValueError, OSError):
        return 0


def _read(path: Any) -> bytes | None:
    try:
        data: bytes = path.read_bytes()
        return data
    except FileNotFoundError:
        return None
