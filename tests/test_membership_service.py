"""The membership service's public API, in one process: two real daemons on loopback QUIC."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from meshd.config import DaemonConfig, HostPort
from meshd.daemon import Daemon
from meshd.errors import UsageError
from meshd.membership.events import Event, RecordUpdated
from meshd.membership.records import ExpertShard, ModelInfo
from meshd.membership.service import MembershipService, membership_of, parse_duration
from meshd.state import StateDir
from transport import PROTOCOL_MAX, PROTOCOL_MIN
from discovery.invite import InviteToken, build_join_request
from transport.credentials import create_mesh
from transport.errors import JoinRefused
from transport.identity import NodeIdentity


@pytest.mark.parametrize(("text", "want"), [("90", 90), ("90s", 90), ("30m", 1800), ("24h", 86400),
                                            ("7d", 604800), (" 2H ", 7200)])
def test_parse_duration(text: str, want: int) -> None:
    assert parse_duration(text) == want


@pytest.mark.parametrize("text", ["", "h", "-5m", "0", "1y", "ten"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(UsageError):
        parse_duration(text)


def _daemon(root: Path, name: str, token: str | None = None, found: bool = False) -> Daemon:
    cfg = DaemonConfig(role="serve", state_dir=root / name, listen=HostPort("127.0.0.1", 0),
                       api=HostPort("127.0.0.1", 0), mdns=False, join_token=token)
    state = StateDir(cfg.state_dir)
    state.ensure()
    identity, _ = state.load_or_create_identity()
    creds = None
    if found:
        creds = create_mesh(identity, "svc", int(time.time()), PROTOCOL_MIN, PROTOCOL_MAX)
        state.store_credentials(creds)
    return Daemon(cfg, state, identity, creds, services=[MembershipService(cfg)])


async def _until(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_models_experts_and_load_reach_other_nodes(tmp_path: Path) -> None:
    async def main() -> None:
        a = _daemon(tmp_path, "a", found=True)
        ta = asyncio.ensure_future(a.run())
        await _until(lambda: a.phase == "running")
        ma = membership_of(a)
        assert ma is not None
        token = (await ma._cmd_invite({"ttl_s": 60, "uses": 1}))["token"]
        # a joiner speaking a protocol outside the genesis range is refused with that reason
        stranger = NodeIdentity.generate()
        tok = InviteToken.decode((await ma._cmd_invite({"ttl_s": 60, "uses": 1}))["token"])
        with pytest.raises(JoinRefused, match="protocol version 99 is outside the mesh's range 1..1"):
            await ma._on_join(stranger.public_key, build_join_request(tok, stranger.public_key, 99))
        b = _daemon(tmp_path, "b", token=token)
        tb = asyncio.ensure_future(b.run())
        await _until(lambda: b.phase == "running")
        mb = membership_of(b)
        assert mb is not None
        await _until(lambda: [v.node_id for v in mb.alive_peers()] == [a.node_id])
        seen: list[Event] = []
        mb.on_change(seen.append)
        ma.set_local_models([ModelInfo("tiny", "moe", "fp-tiny", 4096)])
        ma.set_local_experts([ExpertShard("fp-tiny", (0, 3), (0, 7), 2)])
        ma.set_load(3)
        await _until(lambda: (r := mb.record(a.node_id)) is not None and r.capacity.in_flight == 3)
        rec = mb.record(a.node_id)
        assert rec is not None and rec.models[0].name == "tiny" and rec.experts[0].layers == (0, 3)
        assert any(isinstance(e, RecordUpdated) and e.node_id == a.node_id for e in seen)
        st = b.status()
        [peer] = st["peers"]
        assert set(peer) >= {"node_id", "addrs", "state", "rtt_ms", "models", "experts", "version", "last_seen_s"}
        assert peer["models"][0]["name"] == "tiny" and peer["state"] == "alive"
        b.request_stop("test")
        assert await tb == 0
        await _until(lambda: ma.peers()[0].state == "left")
        a.request_stop("test")
        assert await ta == 0

    asyncio.run(main())
