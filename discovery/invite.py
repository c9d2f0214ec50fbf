"""Invite tokens and the join exchange. Pure: time comes in as ``now`` (unix seconds), randomness as a
``token_bytes`` callable, persistence is the caller's (see ``InviteLedger``).

Token, version 1 (APPEND ONLY): ``"meshd1" + base64url(signed document)`` without padding. The document
is signed by the mesh admin key under domain ``invite``::

    {"v": 1, "mesh_id": hex32, "admin_pub": b64, "issuer_pub": b64, "addrs": ["host:port", ...],
     "exp": unix seconds, "uses": int, "tid": hex16, "secret": b64 16 bytes}

The admin signature plus ``mesh_id == H(admin_pub)`` makes any edit detectable by the joiner before it
contacts anyone. The joiner pins ``issuer_pub`` for the connection and proves it holds the secret, bound
to its own key: ``proof = HMAC-SHA256(secret, "meshd/join/v1" || mesh_id || joiner_pub)``; the secret
itself never travels again. The issuer keeps every token it issued in an ``InviteLedger`` and counts a
use *before* it issues a certificate (the caller persists the ledger with fsync in between).

Join request (joiner -> issuer, JSON): ``{"v": 1, "tid", "mesh_id", "proof": b64, "proto": int}``.
Join response (JSON): ``{"v": 1, "genesis": str, "cert": str, "records": [str], "revocations": str|null}``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transport.credentials import CredentialError, b64d, b64e, canonical_json, mesh_id_for
from transport.identity import PUBLIC_KEY_BYTES, NodeIdentity, node_id_from_public_key, verify_signature
from transport.limits import MAX_INVITE_TOKEN_CHARS, MAX_JOIN_MESSAGE_BYTES, MAX_JOIN_VIEW_RECORDS

TOKEN_PREFIX = "meshd1"
TOKEN_VERSION = 1
INVITE_DOMAIN = b"invite"
SECRET_BYTES = 16
TOKEN_ID_BYTES = 8
MAX_TOKEN_USES = 10_000
MAX_TOKEN_ADDRS = 16

# Refusal reasons (stable text: users and tests read them).
EXPIRED = "invite token expired"
EXHAUSTED = "invite token already used up"
REVOKED = "invite token was revoked"
WRONG_MESH = "invite token is for another mesh"
TAMPERED = "invite token is corrupt or was tampered with"
UNKNOWN = "invite token unknown to its issuer, or its secret proof does not match"  # one reason for both: a
BAD_PROOF = UNKNOWN  # token id alone must not tell whether the issuer knows it (only the secret's holder may)


class InviteError(Exception):
    """A token or join message is refused. ``str(e)`` is the one-line reason."""


@dataclass(frozen=True, slots=True)
class InviteToken:
    mesh_id: str
    admin_pub: bytes
    issuer_pub: bytes
    addrs: tuple[str, ...]
    expires_at: int
    uses: int
    token_id: str
    secret: bytes
    text: str

    @property
    def issuer_id(self) -> str:
        return node_id_from_public_key(self.issuer_pub)

    def __repr__(self) -> str:  # never show the secret
        return f"InviteToken(tid={self.token_id}, mesh={self.mesh_id}, issuer={self.issuer_id})"

    @classmethod
    def issue(cls, admin: NodeIdentity, issuer_pub: bytes, addrs: list[str], ttl_s: int, uses: int,
              now: int, token_bytes: Callable[[int], bytes]) -> InviteToken:
        if not 1 <= uses <= MAX_TOKEN_USES:
            raise InviteError(f"uses must be 1..{MAX_TOKEN_USES}")
        if ttl_s <= 0:
            raise InviteError("ttl must be positive")
        body = {
            "v": TOKEN_VERSION, "mesh_id": mesh_id_for(admin.public_key), "admin_pub": b64e(admin.public_key),
            "issuer_pub": b64e(issuer_pub), "addrs": list(addrs[:MAX_TOKEN_ADDRS]), "exp": int(now + ttl_s),
            "uses": int(uses), "tid": token_bytes(TOKEN_ID_BYTES).hex(), "secret": b64e(token_bytes(SECRET_BYTES)),
        }
        sig = admin.sign(INVITE_DOMAIN, canonical_json(body))
        doc = canonical_json({"body": body, "sig": b64e(sig)})
        return cls.decode(TOKEN_PREFIX + base64.urlsafe_b64encode(doc).decode().rstrip("="))

    @classmethod
    def decode(cls, text: str) -> InviteToken:
        """Parse and verify a token's signature. Raises ``InviteError`` (not a token / tampered)."""
        text = text.strip()
        if len(text) > MAX_INVITE_TOKEN_CHARS:
            raise InviteError("invite token is too long")
        if not text.startswith(TOKEN_PREFIX):
            raise InviteError("not a meshd invite token (it must start with 'meshd1')")
        raw = text[len(TOKEN_PREFIX):]
        try:
            doc = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
            body, sig = doc["body"], b64d(doc["sig"])
            if not isinstance(body, dict) or set(doc) != {"body", "sig"}:
                raise InviteError(TAMPERED)
            if body.get("v") != TOKEN_VERSION:
                raise InviteError(f"unsupported invite token version {body.get('v')!r}")
            admin_pub, issuer_pub = b64d(body["admin_pub"]), b64d(body["issuer_pub"])
            secret = b64d(body["secret"])
            addrs, exp, uses, tid = body["addrs"], body["exp"], body["uses"], body["tid"]
        except InviteError:
            raise
        except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError, CredentialError):
            raise InviteError(TAMPERED) from None
        ok_types = (
            len(admin_pub) == PUBLIC_KEY_BYTES and len(issuer_pub) == PUBLIC_KEY_BYTES
            and len(secret) == SECRET_BYTES and isinstance(addrs, list) and len(addrs) <= MAX_TOKEN_ADDRS
            and all(isinstance(a, str) and len(a) < 256 for a in addrs)
            and isinstance(exp, int) and isinstance(uses, int) and isinstance(tid, str) and len(tid) == 16
        )
        if not ok_types or body.get("mesh_id") != mesh_id_for(admin_pub):
            raise InviteError(TAMPERED)
        if not verify_signature(admin_pub, INVITE_DOMAIN, canonical_json(body), sig):
            raise InviteError(TAMPERED)
        return cls(mesh_id=body["mesh_id"], admin_pub=admin_pub, issuer_pub=issuer_pub, addrs=tuple(addrs),
                   expires_at=exp, uses=uses, token_id=tid, secret=secret, text=text)

    def check_usable(self, now: float, my_mesh_id: str | None) -> None:
        """Joiner-side checks before contacting the issuer. Raises ``InviteError``."""
        if my_mesh_id is not None and my_mesh_id != self.mesh_id:
            raise InviteError(WRONG_MESH)
        if now >= self.expires_at:
            raise InviteError(EXPIRED)


def join_proof(secret: bytes, mesh_id: str, node_pub: bytes) -> bytes:
    return hmac.new(secret, b"meshd/join/v1" + mesh_id.encode() + node_pub, hashlib.sha256).digest()


def build_join_request(token: InviteToken, node_pub: bytes, proto: int) -> bytes:
    return canonical_json({"v": TOKEN_VERSION, "tid": token.token_id, "mesh_id": token.mesh_id,
                           "proof": b64e(join_proof(token.secret, token.mesh_id, node_pub)), "proto": proto})


@dataclass(frozen=True, slots=True)
class JoinRequest:
    token_id: str
    mesh_id: str
    proof: bytes
    proto: int


def parse_join_request(data: bytes) -> JoinRequest:
    if len(data) > 4096:
        raise InviteError("join request too large")
    try:
        obj = json.loads(data)
        req = JoinRequest(str(obj["tid"]), str(obj["mesh_id"]), b64d(obj["proof"]), int(obj["proto"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, CredentialError):
        raise InviteError("malformed join request") from None
    return req


@dataclass(frozen=True, slots=True)
class JoinResponse:
    genesis: bytes
    cert: bytes
    records: tuple[bytes, ...]
    revocations: bytes | None

    def encode(self) -> bytes:
        return canonical_json({"v": TOKEN_VERSION, "genesis": self.genesis.decode(), "cert": self.cert.decode(),
                               "records": [r.decode() for r in self.records[:MAX_JOIN_VIEW_RECORDS]],
                               "revocations": self.revocations.decode() if self.revocations else None})

    @classmethod
    def decode(cls, data: bytes) -> JoinResponse:
        if len(data) > MAX_JOIN_MESSAGE_BYTES:
            raise InviteError("join response too large")
        try:
            obj = json.loads(data)
            recs = obj["records"]
            if not isinstance(recs, list) or len(recs) > MAX_JOIN_VIEW_RECORDS:
                raise InviteError("malformed join response")
            rev = obj.get("revocations")
            return cls(obj["genesis"].encode(), obj["cert"].encode(), tuple(r.encode() for r in recs),
                       rev.encode() if isinstance(rev, str) else None)
        except InviteError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise InviteError("malformed join response") from None


class InviteLedger:
    """The issuer's record of tokens it issued: expiry, uses allowed, uses counted, revoked.

    ``redeem`` checks in order (unknown or wrong proof, one reason for both -> wrong mesh -> revoked ->
    expired -> exhausted) and counts the use; the caller must persist ``to_json()`` durably *before*
    issuing the certificate. So a token's state is told only to whoever holds its secret.
    """

    def __init__(self, tokens: dict[str, dict[str, Any]] | None = None) -> None:
        self.tokens: dict[str, dict[str, Any]] = tokens or {}

    def add(self, token: InviteToken) -> None:
        self.tokens[token.token_id] = {"mesh_id": token.mesh_id, "exp": token.expires_at, "uses": token.uses,
                                       "used": 0, "revoked": False, "secret": b64e(token.secret)}

    def revoke(self, token_id: str) -> bool:
        t = self.tokens.get(token_id)
        if t is None:
            return False
        t["revoked"] = True
        return True

    def check_proof(self, req: JoinRequest, joiner_pub: bytes, mesh_id: str) -> None:
        """Raise ``InviteError(UNKNOWN)`` unless ``req`` proves the secret of a token we issued (for the
        mesh it was issued for; ``mesh_id`` is checked later). Nothing else about the token is looked at
        (nor told) before this passed."""
        t = self.tokens.get(req.token_id)
        expected = join_proof(b64d(t["secret"]), t["mesh_id"], joiner_pub) if t is not None else b"\0" * 32
        if not hmac.compare_digest(req.proof, expected) or t is None:
            raise InviteError(UNKNOWN)

    def redeem(self, req: JoinRequest, joiner_pub: bytes, mesh_id: str, now: float) -> None:
        """Count one use of ``req``'s token or raise ``InviteError`` with the refusal reason."""
        self.check_proof(req, joiner_pub, mesh_id)
        t = self.tokens[req.token_id]
        if req.mesh_id != t["mesh_id"] or t["mesh_id"] != mesh_id:
            raise InviteError(WRONG_MESH)
        if t["revoked"]:
            raise InviteError(REVOKED)
        if now >= t["exp"]:
            raise InviteError(EXPIRED)
        if t["used"] >= t["uses"]:
            raise InviteError(EXHAUSTED)
        t["used"] += 1

    def purge_expired(self, now: float, keep_s: float = 7 * 86400) -> None:
        for tid in [k for k, t in self.tokens.items() if t["exp"] + keep_s < now]:
            del self.tokens[tid]

    def to_json(self) -> bytes:
        return canonical_json({"v": 1, "tokens": self.tokens})

    @classmethod
    def from_json(cls, data: bytes) -> InviteLedger:
        obj = json.loads(data)
        if not isinstance(obj, dict) or obj.get("v") != 1 or not isinstance(obj.get("tokens"), dict):
            raise InviteError("invite ledger is corrupt")
        return cls(obj["tokens"])
