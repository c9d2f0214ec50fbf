"""The membership control commands: ``invite``, ``invite_revoke``, ``join`` and ``ban``.

A mixin of ``MembershipService`` (``meshd.membership.service``); split from it, code moved, not changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

import structlog

from discovery.invite import WRONG_MESH, InviteError, InviteToken, JoinResponse
from meshd.control import ControlError
from meshd.errors import RuntimeFailure, UsageError
from meshd.membership.records import Revocations
from meshd.state import write_atomic
from transport.identity import is_node_id

if TYPE_CHECKING:
    from discovery.invite import InviteLedger
    from discovery.mdns import MdnsDiscovery
    from meshd.daemon import Daemon
    from meshd.membership.core import Membership, MemberView
    from meshd.membership.records import LocalInfo
    from transport.credentials import MeshCredentials

log = structlog.get_logger("meshd.membership.service")

PEERS_FILE = "peers.json"
BANS_FILE = "bans.json"
INVITES_FILE = "invites.json"


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


class CommandsMixin:
    """The control-command half of ``MembershipService`` (it provides the attributes below)."""

    if TYPE_CHECKING:
        daemon: Daemon | None
        core: Membership | None
        _info: LocalInfo
        _ledger: InviteLedger
        _ledger_lock: asyncio.Lock
        _join_lock: asyncio.Lock
        _bg_join: asyncio.Task[None] | None
        _mdns: MdnsDiscovery | None

        def alive_peers(self) -> list[MemberView]: ...
        def _install(self, creds: MeshCredentials, view: JoinResponse | None) -> None: ...
        def _now(self) -> float: ...
        def _flush(self) -> None: ...
        def _spawn(self, coro: Any) -> None: ...
        async def _redeem(self, text: str, reread: bool = False, max_wait_s: float | None = None
                          ) -> tuple[MeshCredentials, JoinResponse]: ...

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


