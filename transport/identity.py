"""Node identity: an Ed25519 key pair and the node id derived from its public key.

Pure: no file or socket I/O here (``meshd.state`` loads and stores keys). Randomness comes from the
``cryptography`` key generator only when ``NodeIdentity.generate()`` is called.

Node id: the first 16 bytes of ``SHA-256(b"meshd/node-id/v1" || raw_public_key)`` as 32 lowercase hex
characters. Signatures are always domain-separated: ``sign(domain, data)`` signs
``b"meshd/" + domain + b"\\x00" + data`` so a signature made for one purpose is never valid for another.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
PRIVATE_KEY_BYTES = 32
SIGNATURE_BYTES = 64
NODE_ID_HEX_CHARS = 32


class IdentityError(Exception):
    """A key or id could not be parsed or does not match."""


def node_id_from_public_key(public_key: bytes) -> str:
    """Return the node id (32 hex chars) for a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise IdentityError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(b"meshd/node-id/v1" + public_key).hexdigest()[:NODE_ID_HEX_CHARS]


def is_node_id(text: str) -> bool:
    """True if ``text`` has the shape of a node id (32 lowercase hex characters)."""
    return len(text) == NODE_ID_HEX_CHARS and all(c in "0123456789abcdef" for c in text)


def _tagged(domain: bytes, data: bytes) -> bytes:
    if b"\x00" in domain:
        raise ValueError("signature domain must not contain NUL")
    return b"meshd/" + domain + b"\x00" + data


def verify_signature(public_key: bytes, domain: bytes, data: bytes, signature: bytes) -> bool:
    """True if ``signature`` is ``public_key``'s signature of ``data`` under ``domain``; never raises."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, _tagged(domain, data))
    except (InvalidSignature, ValueError):
        return False
    return True


class NodeIdentity:
    """An Ed25519 private key with its public key and node id."""

    __slots__ = ("_key", "public_key", "node_id")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key: bytes = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.node_id: str = node_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> NodeIdentity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> NodeIdentity:
        """Build from the raw 32-byte private key; raises ``IdentityError`` if malformed."""
        if len(raw) != PRIVATE_KEY_BYTES:
            raise IdentityError(f"private key must be {PRIVATE_KEY_BYTES} bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def private_key(self) -> Ed25519PrivateKey:
        """The ``cryptography`` key object (e.g. to build a TLS certificate)."""
        return self._key

    def sign(self, domain: bytes, data: bytes) -> bytes:
        return self._key.sign(_tagged(domain, data))

    def same_key(self, other: NodeIdentity) -> bool:
        return hmac.compare_digest(self.public_key, other.public_key)

    def __repr__(self) -> str:  # never show key material
        return f"NodeIdentity(node_id={self.node_id})"
