"""A self-signed TLS certificate for QUIC, made in memory from the node key.

TLS here only encrypts; it authenticates nothing (the meshd handshake does that, bound to this
certificate's hash). The certificate is deterministic for a given key, so its hash is stable.
"""

from __future__ import annotations

import datetime
import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from transport.identity import NodeIdentity

_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(2120, 1, 1, tzinfo=datetime.timezone.utc)


def self_signed_certificate(identity: NodeIdentity) -> x509.Certificate:
    """An Ed25519 certificate for the node key, CN = node id, valid 2020..2120."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id)])
    serial = int.from_bytes(hashlib.sha256(b"meshd/tls-serial/v1" + identity.public_key).digest()[:16], "big")
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key().public_key())
        .serial_number(serial >> 1 or 1)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .sign(identity.private_key(), None)
    )


def certificate_der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)
