"""LAN discovery over mDNS/DNS-SD (zeroconf): announce and browse ``_meshd._udp.local.``.

TXT record (version 1): ``v`` (protocol version), ``id`` (node id) and ``mf``, a mesh fingerprint
``SHA-256("meshd/mdns/v1" || mesh_id)[:8]`` in hex. None of it helps a stranger join: joining needs a
signed token and its secret, and every connection is still authenticated as a member. Nodes of other
meshes are ignored by fingerprint before any connection is tried.

The pure helpers (``mesh_fingerprint``, ``txt_for``, ``parse_txt``) are tested without sockets;
``MdnsDiscovery`` is the thin asyncio wrapper around python-zeroconf.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import structlog

from transport.identity import is_node_id

log = structlog.get_logger(__name__)

SERVICE_TYPE = "_meshd._udp.local."
TXT_VERSION = "1"
RESOLVE_TIMEOUT_MS = 3000

FoundCallback = Callable[[str, list[tuple[str, int]]], None]


def mesh_fingerprint(mesh_id: str) -> str:
    return hashlib.sha256(b"meshd/mdns/v1" + mesh_id.encode()).hexdigest()[:16]


def txt_for(node_id: str, mesh_id: str, proto: int) -> dict[str, str]:
    return {"v": TXT_VERSION, "p": str(proto), "id": node_id, "mf": mesh_fingerprint(mesh_id)}


def parse_txt(props: dict[Any, Any]) -> tuple[str, str] | None:
    """``(node_id, mesh_fingerprint)`` from a TXT record, or None if it is not a v1 meshd record."""
    def get(key: str) -> str | None:
        v = props.get(key.encode(), props.get(key))
        if isinstance(v, bytes):
            try:
                return v.decode()
            except UnicodeDecodeError:
                return None
        return v if isinstance(v, str) else None

    node_id, mf = get("id"), get("mf")
    if get("v") != TXT_VERSION or node_id is None or mf is None or not is_node_id(node_id) or len(mf) != 16:
        return None
    return node_id, mf


class MdnsDiscovery:
    """Announce this node and report same-mesh nodes found on the LAN (``on_found(node_id, addrs)``)."""

    def __init__(self, node_id: str, mesh_id: str, proto: int, port: int, addrs: list[str],
                 on_found: FoundCallback) -> None:
        self.node_id = node_id
        self.mesh_fp = mesh_fingerprint(mesh_id)
        self._txt = txt_for(node_id, mesh_id, proto)
        self._port = port
        self._addrs = [a for a in addrs if _is_ip(a)]
        self._on_found = on_found
        self._azc: Any = None
        self._browser: Any = None
        self._info: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        from zeroconf import IPVersion, ServiceStateChange
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        self._azc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        name = f"meshd-{self.node_id[:16]}.{SERVICE_TYPE}"
        self._info = AsyncServiceInfo(
            SERVICE_TYPE, name, port=self._port, properties=self._txt,
            addresses=[socket.inet_aton(a) for a in self._addrs if ":" not in a],
            server=f"meshd-{self.node_id[:16]}.local.",
        )
        await self._azc.async_register_service(self._info, allow_name_change=True)

        def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
            if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
                task = asyncio.ensure_future(self._resolve(service_type, name))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        self._browser = AsyncServiceBrowser(self._azc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
        log.info("mdns_started", service=SERVICE_TYPE, port=self._port)

    async def _resolve(self, service_type: str, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        try:
            info = AsyncServiceInfo(service_type, name)
            if not await info.async_request(self._azc.zeroconf, RESOLVE_TIMEOUT_MS):
                return
            parsed = parse_txt(info.properties or {})
            if parsed is None or parsed[0] == self.node_id:
                return
            if parsed[1] != self.mesh_fp:
                log.debug("mdns_other_mesh_ignored", peer=parsed[0])
                return
            addrs = [(a, int(info.port)) for a in info.parsed_addresses() if info.port]
            if addrs:
                self._on_found(parsed[0], addrs)
        except Exception as e:  # noqa: BLE001 - a bad announcement must not break discovery
            log.debug("mdns_resolve_failed", error=repr(e))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        try:
            if self._browser is not None:
                await self._browser.async_cancel()
            if self._azc is not None:
                if self._info is not None:
                    await self._azc.async_unregister_service(self._info)
                await self._azc.async_close()
        except Exception as e:  # noqa: BLE001
            log.debug("mdns_close_failed", error=repr(e))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def interface_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces that are up (Linux ioctl; empty elsewhere), loopback last."""
    import fcntl
    import struct

    found: list[str] = []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            found.append(socket.inet_ntoa(packed[20:24]))
    except OSError:
        return []
    finally:
        s.close()
    return sorted(set(found), key=lambda a: (ipaddress.ip_address(a).is_loopback, a))
