"""Joining a mesh, both sides: redeeming an invite token at its issuer (with backoff while it is
unreachable), switching from a solo mesh, and the issuer's answer to a join request.

A mixin of ``MembershipService`` (``meshd.membership.service``); split from it, code moved, not changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from typing import TYPE_CHECKING, Any

import structlog

from discovery.invite import WRONG_MESH, InviteError, InviteToken, JoinResponse, build_join_request, parse_join_request
from meshd.control import ControlError
from meshd.errors import RuntimeFailure, UsageError
from meshd.state import write_atomic
from transport import PROTOCOL_VERSION
from transport.credentials import CredentialError, Genesis, MemberCert, MeshCredentials
from transport.errors import JoinRefused, TransportError
from transport.identity import node_id_from_public_key
from transport.limits import MAX_JOIN_MESSAGE_BYTES, MAX_JOIN_VIEW_RECORDS

if TYPE_CHECKING:
    from discovery.invite import InviteLedger
    from meshd.config import DaemonConfig
    from meshd.daemon import Daemon
    from meshd.membership.core import Membership
    from transport.quic import MeshTransport

log = structlog.get_logger("meshd.membership.service")

JOIN_BACKOFF_MIN_S = 0.5  # issuer unreachable: retry after this, doubling ...
JOIN_BACKOFF_MAX_S = 30.0  # ... up to this (with jitter)
INVITES_FILE = "invites.json"
LAST_JOIN_FILE = "last-join.json"  # why the last join attempt failed (removed once a join succeeds)


class IssuerUnreachable(RuntimeFailure):
    """No address in the token answered (the join is retried, not refused)."""



def _parse_addr(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class JoinMixin:
    """The joining half of ``MembershipService`` (it provides the attributes below)."""

    if TYPE_CHECKING:
        config: DaemonConfig
        daemon: Daemon | None
        core: Membership | None
        transport: MeshTransport
        _ledger: InviteLedger
        _ledger_lock: asyncio.Lock
        _stopping: bool
        _bg_join: asyncio.Task[None] | None

        def _install(self, creds: MeshCredentials, view: JoinResponse | None) -> None: ...
        def _remembered_texts(self) -> list[Any]: ...
        def _now(self) -> float: ...
        async def _cmd_join(self, params: dict[str, Any]) -> dict[str, Any]: ...

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
                self._note_join(f"join refused: {e}")
                raise RuntimeFailure(f"join refused: {e}") from None
            request = build_join_request(tok, self.daemon.identity.public_key, PROTOCOL_VERSION)
            last = "no address in the token"
            for addr in [a for a in (_parse_addr(x) for x in tok.addrs) if a]:
                try:
                    reply = await self.transport.redeem(addr, tok.issuer_id, request)
                except JoinRefused as e:
                    log.warning("join_refused", issuer=tok.issuer_id, reason=e.reason)
                    self._note_join(f"join refused: {e.reason}")
                    raise RuntimeFailure(f"join refused: {e.reason}") from None
                except (TransportError, OSError) as e:
                    last = str(e)
                    continue
                return self._accept_join(tok, reply), JoinResponse.decode(reply)
            self._note_join(f"issuer of the invite token unreachable: {last}")
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

    def _note_join(self, reason: str | None) -> None:
        """Remember why the last join attempt failed (``meshd doctor`` shows it); None: it succeeded."""
        if self.daemon is None:
            return
        path = self.daemon.state.path / LAST_JOIN_FILE
        with contextlib.suppress(OSError):
            if reason is None:
                path.unlink(missing_ok=True)
            else:
                write_atomic(path, json.dumps({"time": int(time.time()), "reason": reason}).encode())

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
        self._note_join(None)
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

