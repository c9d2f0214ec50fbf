"""Mesh credentials: the genesis record and member certificates. Pure (no I/O).

Wire/storage format, version 1 (APPEND ONLY: new fields may be added, none removed or re-meant):
every signed object is a JSON document ``{"body": {...}, "sig": "<base64 Ed25519 signature>"}``. The
signature covers ``canonical_json(body)`` (UTF-8, keys sorted, no whitespace) under a domain tag
(see ``transport.identity``). Binary fields are unpadded standard base64.

Genesis body (signed by the admin key itself, domain ``genesis``)::

    {"v": 1, "mesh_id": hex32, "name": str, "created_at": int unix seconds,
     "admin_pub": b64 32 bytes, "proto_min": int, "proto_max": int}

``mesh_id`` is ``SHA-256(b"meshd/mesh-id/v1" || admin_pub)[:16]`` in hex, so it cannot be forged for
another admin key.

Member certificate body (signed by the admin key, domain ``member-cert``)::

    {"v": 1, "mesh_id": hex32, "node_pub": b64 32 bytes, "node_id": hex32, "issued_at": int unix seconds}

A certificate binds one node key to one mesh. Whether the node is still welcome (bans) is decided by the
membership layer, not here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from transport.identity import (
    PUBLIC_KEY_BYTES,
    NodeIdentity,
    node_id_from_public_key,
    verify_signature,
)

CREDENTIALS_FORMAT_VERSION = 1
MAX_CREDENTIAL_BYTES = 4096
"""Largest encoded genesis or certificate accepted (both are ~400 bytes)."""
MAX_MESH_NAME_CHARS = 64


class CredentialError(Exception):
    """A credential is malformed, forged, or belongs to another mesh. ``str(e)`` is the reason."""


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode().rstrip("=")


def b64d(text: str) -> bytes:
    """Decode unpadded base64; raises ``CredentialError`` on anything else."""
    if not isinstance(text, str):
        raise CredentialError("expected a base64 string")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise CredentialError("bad base64") from e


def mesh_id_for(admin_pub: bytes) -> str:
    return hashlib.sha256(b"meshd/mesh-id/v1" + admin_pub).hexdigest()[:32]


def sign_document(identity: NodeIdentity, domain: bytes, body: dict[str, Any]) -> bytes:
    """Encode ``body`` as a signed document (see module docstring)."""
    sig = identity.sign(domain, canonical_json(body))
    return canonical_json({"body": body, "sig": b64e(sig)})


def open_document(data: bytes, domain: bytes, signer_pub: bytes | None = None) -> tuple[dict[str, Any], bytes]:
    """Parse a signed document. Returns ``(body, signature)``; verifies it when ``signer_pub`` is given.

    Raises ``CredentialError`` for anything malformed, oversize or wrongly signed.
    """
    if len(data) > MAX_CREDENTIAL_BYTES:
        raise CredentialError("document too large")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CredentialError("not a JSON document") from e
    if not isinstance(doc, dict) or set(doc) != {"body", "sig"} or not isinstance(doc["body"], dict):
        raise CredentialError("not a signed document")
    sig = b64d(doc["sig"])
    body = doc["body"]
    if signer_pub is not None and not verify_signature(signer_pub, domain, canonical_json(body), sig):
        raise CredentialError("bad signature")
    return body, sig


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CredentialError(f"field {name!r} missing or not {kind.__name__}")
    return value


@dataclass(frozen=True, slots=True)
class Genesis:
    """The record that founds a mesh. Immutable for the mesh's lifetime."""

    mesh_id: str
    name: str
    created_at: int
    admin_pub: bytes
    proto_min: int
    proto_max: int
    encoded: bytes

    @classmethod
    def create(
        cls, admin: NodeIdentity, name: str, created_at: int, proto_min: int, proto_max: int
    ) -> Genesis:
        if not name or len(name) > MAX_MESH_NAME_CHARS:
            raise CredentialError(f"mesh name must be 1..{MAX_MESH_NAME_CHARS} characters")
        body = {
            "v": CREDENTIALS_FORMAT_VERSION,
            "mesh_id": mesh_id_for(admin.public_key),
            "name": name,
            "created_at": int(created_at),
            "admin_pub": b64e(admin.public_key),
            "proto_min": proto_min,
            "proto_max": proto_max,
        }
        return cls.decode(sign_document(admin, b"genesis", body))

    @classmethod
    def decode(cls, data: bytes) -> Genesis:
        """Parse and verify (self-signed by its admin key). Raises ``CredentialError``."""
        body, _ = open_document(data, b"genesis")
        if _field(body, "v", int) != CREDENTIALS_FORMAT_VERSION:
            raise CredentialError(f"unsupported genesis version {body.get('v')!r}")
        admin_pub = b64d(_field(body, "admin_pub", str))
        if len(admin_pub) != PUBLIC_KEY_BYTES:
            raise CredentialError("admin key has the wrong length")
        open_document(data, b"genesis", admin_pub)
        mesh_id = _field(body, "mesh_id", str)
        if mesh_id != mesh_id_for(admin_pub):
            raise CredentialError("mesh id does not match the admin key")
        proto_min, proto_max = _field(body, "proto_min", int), _field(body, "proto_max", int)
        if not 0 < proto_min <= proto_max:
            raise CredentialError("bad protocol version range")
        return cls(
            mesh_id=mesh_id,
            name=_field(body, "name", str),
            created_at=_field(body, "created_at", int),
            admin_pub=admin_pub,
            proto_min=proto_min,
            proto_max=proto_max,
            encoded=data,
        )

    def accepts_protocol(self, version: int) -> bool:
        return self.proto_min <= version <= self.proto_max


@dataclass(frozen=True, slots=True)
class MemberCert:
    """An admin-signed statement that ``node_pub`` is a member of ``mesh_id``."""

    mesh_id: str
    node_pub: bytes
    node_id: str
    issued_at: int
    encoded: bytes

    @classmethod
    def issue(cls, admin: NodeIdentity, genesis: Genesis, node_pub: bytes, issued_at: int) -> MemberCert:
        if not admin.public_key == genesis.admin_pub:
            raise CredentialError("only the mesh admin key can issue member certificates")
        body = {
            "v": CREDENTIALS_FORMAT_VERSION,
            "mesh_id": genesis.mesh_id,
            "node_pub": b64e(node_pub),
            "node_id": node_id_from_public_key(node_pub),
            "issued_at": int(issued_at),
        }
        return cls.decode(sign_document(admin, b"member-cert", body), genesis)

    @classmethod
    def decode(cls, data: bytes, genesis: Genesis) -> MemberCert:
        """Parse and verify against ``genesis``. Raises ``CredentialError`` with the reason."""
        body, _ = open_document(data, b"member-cert")
        if _field(body, "v", int) != CREDENTIALS_FORMAT_VERSION:
            raise CredentialError(f"unsupported certificate version {body.get('v')!r}")
        if _field(body, "mesh_id", str) != genesis.mesh_id:
            raise CredentialError("certificate is for another mesh")
        open_document(data, b"member-cert", genesis.admin_pub)
        node_pub = b64d(_field(body, "node_pub", str))
        if len(node_pub) != PUBLIC_KEY_BYTES:
            raise CredentialError("node key has the wrong length")
        node_id = _field(body, "node_id", str)
        if node_id != node_id_from_public_key(node_pub):
            raise CredentialError("node id does not match the node key")
        return cls(
            mesh_id=genesis.mesh_id,
            node_pub=node_pub,
            node_id=node_id,
            issued_at=_field(body, "issued_at", int),
            encoded=data,
        )


@dataclass(frozen=True, slots=True)
class MeshCredentials:
    """What a member holds: the mesh's genesis, its own certificate, and the admin key if it has it."""

    genesis: Genesis
    cert: MemberCert
    admin: NodeIdentity | None = None

    @property
    def mesh_id(self) -> str:
        return self.genesis.mesh_id

    @property
    def is_admin(self) -> bool:
        return self.admin is not None


def create_mesh(node: NodeIdentity, name: str, now: int, proto_min: int, proto_max: int) -> MeshCredentials:
    """Found a new mesh: a fresh admin key, its genesis, and a member certificate for ``node``."""
    admin = NodeIdentity.generate()
    genesis = Genesis.create(admin, name, now, proto_min, proto_max)
    cert = MemberCert.issue(admin, genesis, node.public_key, now)
    return MeshCredentials(genesis=genesis, cert=cert, admin=admin)
