"""Invite token codec and the issuer's ledger: every refusal, with its reason."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from discovery import invite as inv
from discovery.invite import (
    UNKNOWN,
    InviteError,
    InviteLedger,
    InviteToken,
    build_join_request,
    parse_join_request,
)
from transport.credentials import create_mesh
from transport.identity import NodeIdentity

NOW = 1_800_000_000


def _setup(uses: int = 1, ttl: int = 3600):  # type: ignore[no-untyped-def]
    issuer = NodeIdentity.generate()
    creds = create_mesh(issuer, "home", NOW, 1, 1)
    assert creds.admin is not None
    tok = InviteToken.issue(creds.admin, issuer.public_key, ["10.0.0.1:9336", "127.0.0.1:9336"], ttl, uses,
                            NOW, os.urandom)
    ledger = InviteLedger()
    ledger.add(tok)
    return creds, issuer, tok, ledger


def test_token_roundtrip_and_shape() -> None:
    creds, issuer, tok, _ = _setup(uses=3)
    assert tok.text.startswith("meshd1") and len(tok.text) < 700
    back = InviteToken.decode("  " + tok.text + "\n")
    assert (back.mesh_id, back.issuer_id, back.addrs, back.uses, back.expires_at) == (
        creds.mesh_id, issuer.node_id, ("10.0.0.1:9336", "127.0.0.1:9336"), 3, NOW + 3600)
    assert back.secret == tok.secret and "secret" not in repr(back)


def test_redeem_counts_and_exhausts() -> None:
    creds, _, tok, ledger = _setup(uses=2)
    for _ in range(2):
        j = NodeIdentity.generate()
        ledger.redeem(parse_join_request(build_join_request(tok, j.public_key, 1)), j.public_key, creds.mesh_id, NOW)
    j = NodeIdentity.generate()
    with pytest.raises(InviteError, match="^invite token already used up$"):
        ledger.redeem(parse_join_request(build_join_request(tok, j.public_key, 1)), j.public_key, creds.mesh_id, NOW)
    # persisted state keeps the count (what the issuer fsyncs before issuing)
    again = InviteLedger.from_json(ledger.to_json())
    with pytest.raises(InviteError, match="used up"):
        again.redeem(parse_join_request(build_join_request(tok, j.public_key, 1)), j.public_key, creds.mesh_id, NOW)


def test_expired_is_refused_by_joiner_and_issuer() -> None:
    creds, _, tok, ledger = _setup(ttl=60)
    tok.check_usable(NOW + 59, None)
    with pytest.raises(InviteError, match="^invite token expired$"):
        tok.check_usable(NOW + 60, None)
    j = NodeIdentity.generate()
    with pytest.raises(InviteError, match="expired"):
        ledger.redeem(parse_join_request(build_join_request(tok, j.public_key, 1)), j.public_key, creds.mesh_id, NOW + 61)


def test_revoked_is_refused() -> None:
    creds, _, tok, ledger = _setup()
    assert ledger.revoke(tok.token_id)
    j = NodeIdentity.generate()
    with pytest.raises(InviteError, match="^invite token was revoked$"):
        ledger.redeem(parse_join_request(build_join_request(tok, j.public_key, 1)), j.public_key, creds.mesh_id, NOW)


def test_wrong_mesh_is_refused_by_joiner_and_issuer() -> None:
    creds, _, tok, ledger = _setup()
    with pytest.raises(InviteError, match="^invite token is for another mesh$"):
        tok.check_usable(NOW, "0" * 32)
    j = NodeIdentity.generate()
    with pytest.raises(InviteError, match="another mesh"):
        ledger.redeem(parse_join_request(build_join_request(tok, j.public_key, 1)), j.public_key, "f" * 32, NOW)


def test_proof_is_bound_to_the_joiners_key() -> None:
    creds, _, tok, ledger = _setup()
    j, thief = NodeIdentity.generate(), NodeIdentity.generate()
    req = parse_join_request(build_join_request(tok, j.public_key, 1))
    with pytest.raises(InviteError, match="proof"):
        ledger.redeem(req, thief.public_key, creds.mesh_id, NOW)
    with pytest.raises(InviteError, match="unknown"):
        InviteLedger().redeem(req, j.public_key, creds.mesh_id, NOW)


@pytest.mark.parametrize("pos", [8, 40, 120, 200, -5])
def test_tampered_tokens_are_refused(pos: int) -> None:
    _, _, tok, _ = _setup()
    text = tok.text
    i = pos % len(text)
    flipped = text[:i] + ("A" if text[i] != "A" else "B") + text[i + 1:]
    with pytest.raises(InviteError, match="tampered|not a meshd"):
        InviteToken.decode(flipped)


def test_edited_and_resigned_by_another_admin_is_a_different_mesh() -> None:
    creds, issuer, tok, _ = _setup()
    other = NodeIdentity.generate()
    forged = InviteToken.issue(other, issuer.public_key, list(tok.addrs), 10**6, 100, NOW, os.urandom)
    assert forged.mesh_id != creds.mesh_id
    with pytest.raises(InviteError, match="another mesh"):
        forged.check_usable(NOW, creds.mesh_id)


def test_not_a_token() -> None:
    for bad in ("", "hello", "meshd2abc", "meshd1", "meshd1!!!!", "meshd1" + "A" * 5000):
        with pytest.raises(InviteError):
            InviteToken.decode(bad)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_arbitrary_text_gives_token_or_invite_error(text: str) -> None:
    try:
        InviteToken.decode("meshd1" + text)
    except InviteError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_join_messages_give_invite_error(data: bytes) -> None:
    for parse in (parse_join_request, inv.JoinResponse.decode):
        try:
            parse(data)
        except InviteError:
            pass


def test_token_state_is_told_only_to_the_holder_of_its_secret() -> None:
    """Unknown, expired, revoked or used up: without the secret, every token looks the same."""
    creds, _, tok, ledger = _setup()
    j, thief = NodeIdentity.generate(), NodeIdentity.generate()
    stolen_id = parse_join_request(build_join_request(tok, j.public_key, 1))  # the thief sends it as its own
    states = {"unknown": InviteLedger(), "expired": ledger}
    revoked, used = _setup()[3], _setup()[3]
    for name, other in (("revoked", revoked), ("used", used)):
        states[name] = other
    reasons = set()
    for name, led in states.items():
        tid = tok.token_id if name in ("unknown", "expired") else next(iter(led.tokens))
        req = type(stolen_id)(tid, stolen_id.mesh_id, stolen_id.proof, stolen_id.proto)
        if name == "revoked":
            led.revoke(tid)
        if name == "used":
            led.tokens[tid]["used"] = led.tokens[tid]["uses"]
        now = NOW + (10**9 if name == "expired" else 0)
        with pytest.raises(InviteError) as err:
            led.redeem(req, thief.public_key, creds.mesh_id, now)
        reasons.add(str(err.value))
    assert reasons == {UNKNOWN}
    with pytest.raises(InviteError, match="expired"):  # the secret's holder is told the truth
        ledger.redeem(stolen_id, j.public_key, creds.mesh_id, NOW + 10**9)
