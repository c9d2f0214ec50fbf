"""``meshd doctor``: check what usually breaks a mesh and say how to fix it.

Each check gives ``ok``, ``warn`` or ``fail``, one line of what was found and, when not ok, one line of
what to do. Checks: state dir and key file permissions; the daemon is running; the UDP (QUIC) port is
reachable from peers (some peer connected to it); the TCP API port answers; mDNS; peers alive; clock skew
against peers (their API's HTTP ``Date``); protocol versions within the mesh's genesis range; why the last
join failed. Pure functions over what the CLI gathered (``gather``), so each check is tested from tables.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
import urllib.request
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

CLOCK_SKEW_WARN_S = 2.0  # invite tokens and certificates carry times; more skew than this is worth fixing
SKEW_PEERS = 8  # peers asked for their time
SKEW_TIMEOUT_S = 1.5  # one peer's HTTP answer
SECRET_FILES = ("identity.key", "admin.key")


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # ok | warn | fail
    detail: str
    fix: str = ""


def check_permissions(state_dir: Path, uid: int) -> list[Check]:
    if not state_dir.is_dir():
        return [Check("state dir", "fail", f"{state_dir} does not exist",
                      "start the node once (meshd serve) or pass the right --state-dir")]
    out = []
    st = state_dir.stat()
    if st.st_uid != uid:
        out.append(Check("state dir", "fail", f"{state_dir} is owned by uid {st.st_uid}, not {uid}",
                         f"chown -R {uid} {state_dir} (or run meshd as its owner)"))
    elif st.st_mode & 0o077:
        out.append(Check("state dir", "fail", f"{state_dir} is mode {stat.S_IMODE(st.st_mode):o}: others can read it",
                         f"chmod 700 {state_dir}"))
    else:
        out.append(Check("state dir", "ok", f"{state_dir} (mode 700, owned by you)"))
    for name in SECRET_FILES:
        p = state_dir / name
        if not p.exists():
            continue
        ps = p.stat()
        if ps.st_uid != uid:
            out.append(Check(name, "fail", f"{p} is owned by uid {ps.st_uid}", f"chown {uid} {p}"))
        elif ps.st_mode & 0o077:
            out.append(Check(name, "fail", f"{p} is mode {stat.S_IMODE(ps.st_mode):o}: others can read the key",
                             f"chmod 600 {p}"))
        else:
            out.append(Check(name, "ok", f"{p} (mode 600)"))
    return out


def check_daemon(status: dict[str, Any] | None, error: str | None) -> list[Check]:
    if status is None:
        why = error or "its control socket does not answer"
        return [Check("daemon", "fail", f"no running daemon: {why}",
                      "start it: meshd serve (or systemctl start meshd); its log says why it stopped")]
    return [Check("daemon", "ok", f"{status.get('state')}, {status.get('role')} node {status.get('node_id')}, "
                                  f"mesh {status.get('mesh_name')} ({status.get('mesh_id')})")]


def _membership(status: dict[str, Any]) -> dict[str, Any]:
    return (status.get("services") or {}).get("membership") or {}


def check_ports(status: dict[str, Any], api_ok: bool | None) -> list[Check]:
    out = []
    quic = str(status.get("quic") or "")
    port = quic.rpartition(":")[2]
    peers = status.get("peers") or []
    alive = [p for p in peers if p.get("state") == "alive"]
    links = _membership(status).get("links") or {}
    inbound = int(links.get("inbound", 0))
    host = quic.rpartition(":")[0].strip("[]")
    if host in ("127.0.0.1", "::1", "localhost"):
        out.append(Check("udp port", "warn", f"QUIC listens on {quic}: only this machine can reach it",
                         f"listen on all interfaces: meshd serve --listen 0.0.0.0:{port}"))
    elif inbound:
        out.append(Check("udp port", "ok", f"{inbound} peer connection(s) reached this node's UDP port {port}"))
    elif alive:
        out.append(Check("udp port", "warn", f"{len(alive)} peers alive but none has connected to UDP port {port}",
                         f"allow it through the firewall (e.g. ufw allow {port}/udp); behind NAT, forward it"))
    else:
        out.append(Check("udp port", "warn", f"no peer yet, so UDP port {port} is untested",
                         "add a node (meshd invite, then meshd serve --join TOKEN on it)"))
    api = status.get("api")
    if api is None:
        out.append(Check("tcp api port", "warn", "the API is not listening", "start with --api HOST:PORT"))
    elif api_ok is False:
        out.append(Check("tcp api port", "fail", f"nothing answers on {api}", "check the daemon's log for the API"))
    else:
        h = str(api).rpartition(":")[0].strip("[]")
        local = h in ("127.0.0.1", "::1", "localhost")
        out.append(Check("tcp api port", "ok", f"{api} answers" + (" (this machine only)" if local else ""),
                         "" if not local else ""))
    return out


def check_mdns(status: dict[str, Any]) -> list[Check]:
    m = _membership(status)
    if not m.get("mdns"):
        return [Check("mdns", "warn", "mDNS discovery is off (--no-mdns): nodes on this LAN do not find each other",
                      "join with an invite token instead, or drop --no-mdns")]
    if not status.get("peers"):
        return [Check("mdns", "warn", "mDNS is on but no peer was found",
                      "allow multicast UDP 5353 on this network (some Wi-Fi isolates clients), or join with a token")]
    return [Check("mdns", "ok", "mDNS discovery is on")]


def check_peers(status: dict[str, Any]) -> list[Check]:
    peers = status.get("peers") or []
    by: dict[str, int] = {}
    for p in peers:
        by[p.get("state", "?")] = by.get(p.get("state", "?"), 0) + 1
    if not peers:
        return [Check("peers", "warn", "this node knows no peer", "meshd invite on a member, meshd join TOKEN here")]
    dead = [p["node_id"][:12] for p in peers if p.get("state") == "dead"]
    level = "ok" if by.get("alive") else "fail"
    detail = ", ".join(f"{n} {s}" for s, n in sorted(by.items()))
    fix = f"dead: {', '.join(dead)}: restart them or meshd ban the ones gone for good" if dead else ""
    return [Check("peers", level if not dead else "warn", detail, fix)]


def check_versions(status: dict[str, Any], proto_range: tuple[int, int] | None) -> list[Check]:
    out = []
    mine = status.get("version")
    peers = [p for p in status.get("peers") or [] if p.get("state") in ("alive", "suspect")]
    if proto_range is not None:
        lo, hi = proto_range
        bad = [f"{p['node_id'][:12]} ({p.get('protocol')})" for p in peers
               if isinstance(p.get("protocol"), int) and not lo <= p["protocol"] <= hi]
        own = status.get("protocol")
        if isinstance(own, int) and not lo <= own <= hi:
            bad.insert(0, f"this node ({own})")
        if bad:
            out.append(Check("versions", "fail", f"protocol outside the mesh's range {lo}..{hi}: {', '.join(bad)}",
                             "upgrade (or downgrade) meshd on those nodes"))
        else:
            out.append(Check("versions", "ok", f"every node speaks a protocol within {lo}..{hi}"))
    other = sorted({str(p.get("version")) for p in peers if p.get("version") != mine})
    if other:
        out.append(Check("software", "warn", f"this node runs {mine}, peers run {', '.join(other)}",
                         "run the same meshd version everywhere when you can"))
    return out


def check_clock(skews: dict[str, float]) -> list[Check]:
    if not skews:
        return [Check("clock", "warn", "no peer's API answered, clock skew unknown",
                      "make sure every node runs NTP (timedatectl set-ntp true)")]
    worst_id, worst = max(skews.items(), key=lambda kv: abs(kv[1]))
    if abs(worst) > CLOCK_SKEW_WARN_S:
        return [Check("clock", "warn", f"clock differs from {worst_id[:12]} by {worst:+.1f} s "
                                       f"(invite tokens and certificates carry times)",
                      "turn on NTP on every node (timedatectl set-ntp true)")]
    return [Check("clock", "ok", f"within {abs(worst):.1f} s of {len(skews)} peer(s)")]


def check_last_join(state_dir: Path) -> list[Check]:
    try:
        info = json.loads((state_dir / "last-join.json").read_text())
    except (OSError, ValueError):
        return []
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(info.get("time", 0))))
    reason = str(info.get("reason"))
    fix = ("ask a member for a new token (meshd invite) and run meshd join TOKEN" if "refused" in reason
           else "check that the issuer runs and its UDP port is reachable from here, then retry")
    return [Check("last join", "fail", f"{when}: {reason}", fix)]


def peer_skew(api: str, timeout_s: float = SKEW_TIMEOUT_S) -> float | None:
    """Seconds the peer's clock is ahead of ours (its API's ``Date`` header, 1 s resolution), or None."""
    t0 = time.time()
    try:
        with urllib.request.urlopen(f"http://{api}/health", timeout=timeout_s) as r:
            date = r.headers.get("Date")
    except OSError:
        return None
    t1 = time.time()
    if not date:
        return None
    try:
        theirs = parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return None
    return theirs + 0.5 - (t0 + t1) / 2  # the Date header is truncated to the second


def api_answers(api: str | None) -> bool | None:
    if not api:
        return None
    host, _, port = str(api).rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def run_checks(state_dir: Path, status: dict[str, Any] | None, error: str | None,
               proto_range: tuple[int, int] | None) -> list[Check]:
    """Everything ``meshd doctor`` checks, in order."""
    out = check_permissions(state_dir, os.geteuid())
    out += check_daemon(status, error)
    if status is not None:
        out += check_ports(status, api_answers(status.get("api")))
        out += check_mdns(status)
        out += check_peers(status)
        out += check_versions(status, proto_range)
        skews: dict[str, float] = {}
        for p in [p for p in status.get("peers") or [] if p.get("state") == "alive" and p.get("api")][:SKEW_PEERS]:
            s = peer_skew(p["api"])
            if s is not None:
                skews[p["node_id"]] = s
        out += check_clock(skews)
    out += check_last_join(state_dir)
    return out
