from __future__ import annotations

import pytest

from transport.credentials import CredentialError, Genesis, MemberCert, create_mesh
from transport.identity import NodeIdentity, verify_signature


def test_mesh_genesis_and_member_cert_roundtrip() -> None:
    node = NodeIdentity.generate()
    creds = create_mesh(node, "home", 1_700_000_000, 1, 1)
    g = Genesis.decode(creds.genesis.encoded)
    assert g.mesh_id == creds.mesh_id and g.name == "home"
    cert = MemberCert.decode(creds.cert.encoded, g)
    assert cert.node_id == node.node_id


def test_cert_from_another_mesh_is_refused() -> None:
    node = NodeIdentity.generate()
    a = create_mesh(node, "a", 1, 1, 1)
    b = create_mesh(node, "b", 1, 1, 1)
    with pytest.raises(CredentialError, match="another mesh"):
        MemberCert.decode(b.cert.encoded, a.genesis)


def test_tampered_cert_is_refused() -> None:
    node = NodeIdentity.generate()
    creds = create_mesh(node, "a", 1, 1, 1)
    forged = creds.cert.encoded.replace(b'"issued_at":1', b'"issued_at":2')
    assert forged != creds.cert.encoded
    with pytest.raises(CredentialError, match="bad signature"):
        MemberCert.decode(forged, creds.genesis)


def test_signatures_are_domain_separated() -> None:
    node = NodeIdentity.generate()
    sig = node.sign(b"gossip", b"data")
    assert verify_signature(node.public_key, b"gossip", b"data", sig)
    assert not verify_signature(node.public_key, b"member-cert", b"data", sig)
