"""The membership service: drives the sans-I/O core inside the daemon.

It feeds the core with gossip frames (``StreamType.GOSSIP``, one stream per frame) and timer ticks,
sends what the core wants sent (dialling members at the addresses in their signed records), redeems
invite tokens (``transport.redeem``) or answers them (``transport.set_join_handler``), persists the ban
list, the invite ledger and remembered peers in the state dir, enforces bans through the transport's
admission hook, runs mDNS, and serves the control commands ``invite``, ``join``, ``ban`` and
``invite_revoke``. Joining lives in ``joining.py`` and the control commands in ``commands.py`` (mixins).

Public API for other services (get the instance with ``membership_of(daemon)``)::

    set_local_models(models: list[ModelInfo]);  set_local_experts(experts: list[ExpertShard])
    set_load(in_flight, queue, tok_s, slots)    # re-signed when it changed, rate limited (load.py)
    set_api("host:port");  set_local_field(key, json_value)   # e.g. pipeline "stages"
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

from discovery.invite import InviteError, InviteLedger, JoinResponse
from discovery.mdns import MdnsDiscovery, interface_addresses
from meshd import __version__
from meshd.config import format_hostport, is_loopback
from meshd.errors import RuntimeFailure
from meshd.membership.commands import BANS_FILE, INVITES_FILE, PEERS_FILE, CommandsMixin, parse_duration
from meshd.membership.config import MembershipConfig
from meshd.membership.core import Membership, MemberView
from meshd.membership.joining import IssuerUnreachable, JoinMixin, _parse_addr
from meshd.membership.events import Event, LocalRefuted, NodeBanned, PeerDied, PeerJoined, PeerLeft
from meshd.membership.load import TYPICAL_RECORD_BYTES, free_mb, load_changed, load_interval_s
from meshd.mesh.limits import LINK_MIN_IDLE_S
from meshd.mesh.links import Links
from meshd.mesh.view import HEARD_RECENTLY_S, MeshView
from meshd.membership.records import (
    KNOWN_KEYS,
    Capacity,
    ExpertShard,
    Load,
    LocalInfo,
    ModelInfo,
    NodeRecord,
    RecordError,
    RecordVerifier,
)
from meshd.state import write_atomic
from transport import PROTOCOL_VERSION
from transport.credentials import MemberCert, MeshCredentials
from transport.errors import TransportError
from transport.limits import MAX_REMEMBERED_PEERS
from transport.streams import StreamType

if TYPE_CHECKING:
    from meshd.config import DaemonConfig
    from meshd.daemon import Daemon
    from transport.quic import MeshTransport, Peer, Stream

log = structlog.get_logger(__name__)

__all__ = ["IssuerUnreachable", "MembershipService", "membership_of", "parse_duration"]

STRANGER_SYNC_S = 1.0  # how often connected-but-not-alive members are sent our digest
PEERS_SAVE_DELAY_S = 2.0  # remembered peers are written at most this often (joins come in bursts)
SEND_QUEUE_FRAMES = 64  # frames waiting per destination while we dial it; older ones are dropped
SEND_TIMEOUT_S = 1.0  # one frame to a connected peer; a dead peer's frames are simply lost
DIAL_TIMEOUT_S = 2.0  # dialling a member found by mDNS (members in records are dialled by ``Links``)
BAN_NOTICE_S = 0.3  # a banned node gets the ban list, then this long before we disconnect it
LEAVE_FLUSH_S = 0.5  # on SIGTERM, how long we wait for the "leaving" record to go out


def membership_of(daemon: Daemon) -> MembershipService | None:
    """The daemon's membership service, if it runs one."""
    for s in daemon.services:
        if isinstance(s, MembershipService):
            return s
    return None


class MembershipService(JoinMixin, CommandsMixin):
    name = "membership"

    def __init__(self, config: DaemonConfig, preset: MembershipConfig | None = None,
                 max_links: int | None = None, link_idle_s: float = LINK_MIN_IDLE_S) -> None:
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
        self.max_links = max_links
        self.link_idle_s = link_idle_s
        self.links: Links | None = None
        self.view = MeshView(self)
        self._ledger = InviteLedger()
        self._ledger_lock = asyncio.Lock()
        self._mdns: MdnsDiscovery | None = None
        self._load_pending: tuple[int, Load] | None = None
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

    def set_load(self, in_flight: int, queue: int = 0, tok_s: float = 0.0, slots: int | None = None) -> None:
        """Advertise load: requests in flight and waiting, recent tokens/s, request slots. Re-signed only
        when it changed materially, at most every ``load_interval_s(N)`` (``meshd.membership.load``)."""
        old = self._info.load
        self._load_pending = (max(0, int(in_flight)),
                              Load(max(0, int(queue)), round(max(0.0, float(tok_s)), 1),
                                   max(1, int(slots)) if slots is not None else old.slots))
        if self._load_handle is not None:
            return
        loop = asyncio.get_running_loop()
        core = self.core
        n = len(core.live_ids()) + 1 if core is not None else 1
        size = len(core.local_record.encoded) if core is not None else TYPICAL_RECORD_BYTES
        interval = load_interval_s(n, size, core.config.retransmit_mult if core is not None else 4)
        delay = max(0.0, self._last_load_publish + interval - loop.time())
        self._load_handle = loop.call_later(delay, self._publish_load)

    def _publish_load(self) -> None:
        self._load_handle = None
        if self._load_pending is None:
            return
        in_flight, load = self._load_pending
        cap = self._info.capacity
        new_cap = Capacity(cap.cpus, cap.ram_mb, in_flight, free_mb())
        if not load_changed(cap, self._info.load, new_cap, load):
            return
        self._last_load_publish = asyncio.get_running_loop().time()
        self._update(capacity=new_cap, load=load)

    def set_api(self, address: str | None) -> None:
        """Advertise this node's API address (``host:port``) in its record."""
        if address != self._info.api:
            self._update(api=address)

    def set_local_field(self, key: str, value: Any) -> None:
        """Advertise another record field (e.g. pipeline ``stages``): any JSON value, carried as is by
        every member (``NodeRecord.extra``) and shown by status and the console. None removes it."""
        if key in KNOWN_KEYS:
            raise ValueError(f"record field {key!r} has its own setter")
        extra = dict(self._info.extra)
        if value is None:
            extra.pop(key, None)
        else:
            extra[key] = value
        if tuple(sorted(extra.items())) != self._info.extra:
            self._update(extra=tuple(sorted(extra.items())))

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
        self.links = Links(t, self._addrs_of, cap=self.max_links, min_idle_s=self.link_idle_s)
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
        rev = core.revocations
        return {
            "peers": self.view.peers_json(), "incarnation": core.incarnation, "alive": len(core.live_ids()),
            "banned": sorted(rev.banned) if rev else [], "stats": dict(core.stats),
            "mdns": self._mdns is not None, "links": self.links.status() if self.links is not None else None,
            "numerics": dict(self._info.extra).get("numerics"),  # this node's tag as gossiped (None: no model)
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
                if self.links is not None:
                    self.links.make_room()
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
        if self.core is None or self.links is None:
            return None
        return await self.links.get(dest, retry=False)

    def _addrs_of(self, node_id: str) -> list[tuple[str, int]]:
        """Where to dial a member: the addresses in its signed record, then those mDNS saw."""
        view = self.core.member(node_id) if self.core is not None else None
        addrs = [a for a in (_parse_addr(x) for x in (view.record.addrs if view else ())) if a]
        return addrs + [a for a in self._mdns_addrs.get(node_id, []) if a not in addrs]

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
        if self.links is not None:
            self.links.forget_failure(peer.node_id)
            self.links.note_up(peer.node_id)
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
            if self.links is not None:
                self.links.forget_failure(ev.node_id)
            self._schedule_save()
        elif isinstance(ev, PeerDied):
            log.info("peer_died", peer=ev.node_id, incarnation=ev.incarnation)
            v = self.core.member(ev.node_id) if self.core is not None else None
            heard = v is not None and v.last_seen is not None and self._now() - v.last_seen < HEARD_RECENTLY_S
            if t is not None and not heard:  # still talking to us: keep the link, it will refute
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

def _replace_info(info: LocalInfo, cpus: int | None = None, ram_mb: int | None = None, **changes: Any
                  ) -> LocalInfo:
    from dataclasses import replace

    if cpus is not None or ram_mb is not None:
        cap = info.capacity
        changes["capacity"] = Capacity(cpus if cpus is not None else cap.cpus,
                                       ram_mb if ram_mb is not None else cap.ram_mb, cap.in_flight, free_mb())
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
