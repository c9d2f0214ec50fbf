"""Signed node records and the admin-signed ban list. Pure (no I/O, no clock).

Node record, format version 1 (APPEND ONLY: fields may be added, none removed or re-meant). A signed
document (``transport.credentials``) under domain ``node-record``, signed by the node it describes::

    {"v": 1, "mesh_id": hex32, "node_id": hex32, "cert": "<the node's member certificate document>",
     "ver": int incarnation (grows with every change), "leaving": bool,
     "addrs": ["host:port", ...], "role": "serve"|"client"|"worker", "proto": int, "sw": str,
     "models": [{"name", "kind", "fingerprint", "ctx"}],
     "experts": [{"model_fp", "layers": [first, last], "experts": [first, last], "capacity"}],
     "stages": [{"model_fp", "free_kb", "pin": [first, last] | null}]  (optional, default []),
     "cap": {"cpus": int, "ram_mb": int, "in_flight": int}, "api": "host:port" | null,
     "admin": bool (holds the mesh admin key; optional, default false)}

The embedded member certificate makes a record verifiable by any member, including ones that never
connected to the node: a record is accepted only if the certificate was issued by this mesh's admin key,
names the node id, and its key signed the record.

Ban list, version 1: signed document under domain ``revocations`` by the mesh admin key::

    {"v": 1, "mesh_id": hex32, "ver": int, "banned": [node_id, ...]}   # sorted, unique
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from transport.credentials import (
    CredentialError,
    Genesis,
    MemberCert,
    MeshCredentials,
    b64d,
    b64e,
    canonical_json,
)
from transport.identity import NodeIdentity, is_node_id, verify_signature
from transport.limits import (
    MAX_BANNED_NODES,
    MAX_RECORD_ADDRS,
    MAX_RECORD_BYTES,
    MAX_RECORD_EXPERTS,
    MAX_RECORD_MODELS,
    MAX_RECORD_STRING_CHARS,
    MAX_REVOCATION_BYTES,
    MAX_VERIFY_CACHE,
)

RECORD_FORMAT_VERSION = 1
RECORD_DOMAIN = b"node-record"
REVOCATION_DOMAIN = b"revocations"
ROLES = ("serve", "client", "worker")


class RecordError(Exception):
    """A record or ban list is malformed, forged, oversize, of another mesh, or of a non-member."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    kind: str
    fingerprint: str
    context_length: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "fingerprint": self.fingerprint,
                "ctx": self.context_length}


@dataclass(frozen=True, slots=True)
class ExpertShard:
    model_fingerprint: str
    layers: tuple[int, int]
    experts: tuple[int, int]
    capacity: int

    def to_json(self) -> dict[str, Any]:
        return {"model_fp": self.model_fingerprint, "layers": list(self.layers),
                "experts": list(self.experts), "capacity": self.capacity}


@dataclass(frozen=True, slots=True)
class StageOffer:
    """``--stage``: this node offers to hold layers of a checkpoint (any range, or exactly ``pin``)."""

    model_fingerprint: str
    free_kb: int
    pin: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"model_fp": self.model_fingerprint, "free_kb": self.free_kb,
                "pin": list(self.pin) if self.pin is not None else None}


MAX_RECORD_STAGES = 16  # stage offers in one record: one per --stage checkpoint


@dataclass(frozen=True, slots=True)
class Capacity:
    cpus: int = 0
    ram_mb: int = 0
    in_flight: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "ram_mb": self.ram_mb, "in_flight": self.in_flight}


@dataclass(frozen=True, slots=True)
class LocalInfo:
    """What this node advertises about itself (the unsigned content of its record)."""

    addrs: tuple[str, ...] = ()
    role: str = "serve"
    proto: int = 1
    software: str = ""
    models: tuple[ModelInfo, ...] = ()
    experts: tuple[ExpertShard, ...] = ()
    capacity: Capacity = field(default_factory=Capacity)
    api: str | None = None
    admin: bool = False  # holds the mesh admin key (can issue invites and bans)
    stages: tuple[StageOffer, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A verified node record (what other services read about a peer)."""

    node_id: str
    public_key: bytes
    version: int
    leaving: bool
    addrs: tuple[str, ...]
    role: str
    proto: int
    software: str
    models: tuple[ModelInfo, ...]
    experts: tuple[ExpertShard, ...]
    capacity: Capacity
    api: str | None
    admin: bool
    encoded: bytes
    stages: tuple[StageOffer, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """JSON view for status and other services (no certificate, no signature)."""
        return {"node_id": self.node_id, "version": self.version, "leaving": self.leaving,
                "addrs": list(self.addrs), "role": self.role, "proto": self.proto, "sw": self.software,
                "models": [m.to_json() for m in self.models],
                "experts": [e.to_json() for e in self.experts], "cap": self.capacity.to_json(),
                "api": self.api, "admin": self.admin, "stages": [s.to_json() for s in self.stages]}


def sign_record(identity: NodeIdentity, creds: MeshCredentials, info: LocalInfo, version: int,
                leaving: bool = False) -> bytes:
    """Encode and sign this node's record. Raises ``RecordError`` if it would exceed the limits."""
    body = {
        "v": RECORD_FORMAT_VERSION, "mesh_id": creds.mesh_id, "node_id": identity.node_id,
        "cert": creds.cert.encoded.decode(), "ver": int(version), "leaving": bool(leaving),
        "addrs": list(info.addrs), "role": info.role, "proto": info.proto, "sw": info.software,
        "models": [m.to_json() for m in info.models], "experts": [e.to_json() for e in info.experts],
        "cap": info.capacity.to_json(), "api": info.api, "admin": info.admin,
    }
    if info.stages:  # optional: a record without stages stays as older nodes wrote it
        body["stages"] = [s.to_json() for s in info.stages]
    _check_body(body)
    sig = identity.sign(RECORD_DOMAIN, canonical_json(body))
    data = canonical_json({"body": body, "sig": b64e(sig)})
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record is {len(data)} bytes, limit {MAX_RECORD_BYTES}")
    return data


def _str(v: Any, name: str, allow_none: bool = False) -> Any:
    if v is None and allow_none:
        return None
    if not isinstance(v, str) or len(v) > MAX_RECORD_STRING_CHARS:
        raise RecordError(f"field {name!r} must be a string of at most {MAX_RECORD_STRING_CHARS} chars")
    return v


def _int(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 2**63:
        raise RecordError(f"field {name!r} must be a non-negative integer")
    return v


def _range(v: Any, name: str) -> tuple[int, int]:
    if not isinstance(v, list) or len(v) != 2:
        raise RecordError(f"field {name!r} must be [first, last]")
    a, b = _int(v[0], name), _int(v[1], name)
    if a > b:
        raise RecordError(f"field {name!r} has first > last")
    return a, b


def _obj(v: Any, name: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(v, dict) or not keys <= set(v):
        raise RecordError(f"field {name!r} must be an object with {sorted(keys)}")
    return v


def _check_body(body: dict[str, Any]) -> tuple[Any, ...]:
    """Validate every field's type and bound; returns the parsed content."""
    if body.get("v") != RECORD_FORMAT_VERSION:
        raise RecordError(f"unsupported record version {body.get('v')!r}")
    addrs = body.get("addrs")
    if not isinstance(addrs, list) or len(addrs) > MAX_RECORD_ADDRS:
        raise RecordError(f"'addrs' must be a list of at most {MAX_RECORD_ADDRS}")
    role = body.get("role")
    if role not in ROLES:
        raise RecordError(f"unknown role {role!r}")
    models_raw, experts_raw = body.get("models"), body.get("experts")
    if not isinstance(models_raw, list) or len(models_raw) > MAX_RECORD_MODELS:
        raise RecordError(f"'models' must be a list of at most {MAX_RECORD_MODELS}")
    if not isinstance(experts_raw, list) or len(experts_raw) > MAX_RECORD_EXPERTS:
        raise RecordError(f"'experts' must be a list of at most {MAX_RECORD_EXPERTS}")
    models = tuple(
        ModelInfo(_str(m["name"], "name"), _str(m["kind"], "kind"), _str(m["fingerprint"], "fingerprint"),
                  _int(m["ctx"], "ctx"))
        for m in (_obj(x, "models[]", {"name", "kind", "fingerprint", "ctx"}) for x in models_raw)
    )
    experts = tuple(
        ExpertShard(_str(e["model_fp"], "model_fp"), _range(e["layers"], "layers"),
                    _range(e["experts"], "experts"), _int(e["capacity"], "capacity"))
        for e in (_obj(x, "experts[]", {"model_fp", "layers", "experts", "capacity"}) for x in experts_raw)
    )
    cap = _obj(body.get("cap"), "cap", {"cpus", "ram_mb", "in_flight"})
    capacity = Capacity(_int(cap["cpus"], "cpus"), _int(cap["ram_mb"], "ram_mb"),
                        _int(cap["in_flight"], "in_flight"))
    _stages(body)
    if not isinstance(body.get("admin", False), bool):
        raise RecordError("field 'admin' must be a boolean")
    if not isinstance(body.get("leaving"), bool):
        raise RecordError("field 'leaving' must be a boolean")
    return (
        tuple(_str(a, "addrs[]") for a in addrs), role, _int(body.get("proto"), "proto"),
        _str(body.get("sw"), "sw"), models, experts, capacity, _str(body.get("api"), "api", True),
        _int(body.get("ver"), "ver"),
    )


def _stages(body: dict[str, Any]) -> tuple[StageOffer, ...]:
    raw = body.get("stages", [])
    if not isinstance(raw, list) or len(raw) > MAX_RECORD_STAGES:
        raise RecordError(f"'stages' must be a list of at most {MAX_RECORD_STAGES}")
    out = []
    for x in raw:
        e = _obj(x, "stages[]", {"model_fp", "free_kb", "pin"})
        pin = None if e["pin"] is None else _range(e["pin"], "pin")
        out.append(StageOffer(_str(e["model_fp"], "model_fp"), _int(e["free_kb"], "free_kb"), pin))
    return tuple(out)


def _open(data: bytes, limit: int) -> tuple[dict[str, Any], bytes]:
    if len(data) > limit:
        raise RecordError(f"oversize ({len(data)} bytes, limit {limit})")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError("not JSON") from e
    if not isinstance(doc, dict) or set(doc) != {"body", "sig"} or not isinstance(doc["body"], dict):
        raise RecordError("not a signed document")
    try:
        sig = b64d(doc["sig"])
    except CredentialError as e:
        raise RecordError(str(e)) from e
    return doc["body"], sig


class RecordVerifier:
    """Verifies records and ban lists for one mesh, remembering verified bytes (bounded LRU).

    ``decode_record`` / ``decode_revocations`` raise ``RecordError`` with the reason.
    """

    def __init__(self, genesis: Genesis, cache_size: int = MAX_VERIFY_CACHE) -> None:
        self.genesis = genesis
        self._cache: OrderedDict[bytes, NodeRecord] = OrderedDict()
        self._certs: dict[bytes, MemberCert] = {}
        self._cache_size = cache_size

    def decode_record(self, data: bytes) -> NodeRecord:
        key = hashlib.blake2b(data, digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        body, sig = _open(data, MAX_RECORD_BYTES)
        if body.get("mesh_id") != self.genesis.mesh_id:
            raise RecordError("record of another mesh")
        cert_text = body.get("cert")
        if not isinstance(cert_text, str):
            raise RecordError("record carries no member certificate")
        cert = self._cert(cert_text.encode())
        node_id = body.get("node_id")
        if node_id != cert.node_id:
            raise RecordError("record's node id does not match its certificate")
        parsed = _check_body(body)
        if not verify_signature(cert.node_pub, RECORD_DOMAIN, canonical_json(body), sig):
            raise RecordError("bad record signature")
        addrs, role, proto, sw, models, experts, capacity, api, ver = parsed
        rec = NodeRecord(node_id=cert.node_id, public_key=cert.node_pub, version=ver,
                         leaving=body["leaving"], addrs=addrs, role=role, proto=proto, software=sw,
                         models=models, experts=experts, capacity=capacity, api=api,
                         admin=body.get("admin", False), encoded=data, stages=_stages(body))
        self._cache[key] = rec
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return rec

    def _cert(self, data: bytes) -> MemberCert:
        cert = self._certs.get(data)
        if cert is None:
            try:
                cert = MemberCert.decode(data, self.genesis)
            except CredentialError as e:
                raise RecordError(f"not a member: {e}") from e
            if len(self._certs) >= self._cache_size:
                self._certs.clear()
            self._certs[data] = cert
        return cert

    def decode_revocations(self, data: bytes) -> Revocations:
        body, sig = _open(data, MAX_REVOCATION_BYTES)
        if body.get("v") != RECORD_FORMAT_VERSION:
            raise RecordError(f"unsupported ban list version {body.get('v')!r}")
        if body.get("mesh_id") != self.genesis.mesh_id:
            raise RecordError("ban list of another mesh")
        if not verify_signature(self.genesis.admin_pub, REVOCATION_DOMAIN, canonical_json(body), sig):
            raise RecordError("ban list not signed by the mesh admin key")
        banned = body.get("banned")
        if not isinstance(banned, list) or len(banned) > MAX_BANNED_NODES:
            raise RecordError(f"'banned' must be a list of at most {MAX_BANNED_NODES}")
        if not all(isinstance(b, str) and is_node_id(b) for b in banned):
            raise RecordError("'banned' holds something that is not a node id")
        return Revocations(version=_int(body.get("ver"), "ver"), banned=frozenset(banned), encoded=data)


@dataclass(frozen=True, slots=True)
class Revocations:
    """The mesh's ban list (verified)."""

    version: int
    banned: frozenset[str]
    encoded: bytes

    @classmethod
    def sign(cls, admin: NodeIdentity, mesh_id: str, version: int, banned: set[str] | frozenset[str]
             ) -> bytes:
        if len(banned) > MAX_BANNED_NODES:
            raise RecordError(f"a ban list holds at most {MAX_BANNED_NODES} nodes")
        body = {"v": RECORD_FORMAT_VERSION, "mesh_id": mesh_id, "ver": int(version),
                "banned": sorted(banned)}
        sig = admin.sign(REVOCATION_DOMAIN, canonical_json(body))
        return canonical_json({"body": body, "sig": b64e(sig)})
