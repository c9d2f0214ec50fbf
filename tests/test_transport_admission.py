"""The sans-I/O admission core (transport/admission.py): Initial checks, Retry tokens, eviction order."""

from __future__ import annotations

import random

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from hostile_tools import junk_initial
from hypothesis import given
from hypothesis import strategies as st

from transport import ALPN
from transport.admission import (
    InitialHints,
    Pending,
    RetryTokens,
    Stage,
    choose_eviction,
    hint_key,
    initial_decrypts,
    make_hint,
)


def client_initial() -> bytes:
    client = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN]))
    client.connect(("127.0.0.1", 1), now=0.0)
    datagrams = client.datagrams_to_send(now=0.0)
    return datagrams[0][0]


def test_a_real_initial_decrypts_and_junk_does_not() -> None:
    assert initial_decrypts(client_initial(), 8)
    rng = random.Random(1)
    assert not any(initial_decrypts(junk_initial(rng), 8) for _ in range(50))
    real = bytearray(client_initial())
    real[200] ^= 1  # one flipped bit of ciphertext
    assert not initial_decrypts(bytes(real), 8)
    assert not initial_decrypts(b"", 8) and not initial_decrypts(b"\xc3" * 1200, 8)


@given(st.binary(max_size=1500))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    assert initial_decrypts(data, 8) in (True, False)


def test_retry_tokens() -> None:
    tokens = RetryTokens(b"k" * 32, lifetime_s=10.0)
    addr = ("127.0.0.1", 4000)
    odcid, scid = b"\x01" * 8, b"\x02" * 8
    token = tokens.issue(addr, odcid, scid, now=100.0)
    assert tokens.check(addr, token, scid, now=105.0) == odcid
    assert tokens.check(addr, token, scid, now=110.5) is None  # expired
    assert tokens.check(("127.0.0.1", 4001), token, scid, now=101.0) is None  # another address
    assert tokens.check(("127.0.0.2", 4000), token, scid, now=101.0) is None
    assert tokens.check(addr, token, b"\x03" * 8, now=101.0) is None  # not sent to the Retry's cid
    assert RetryTokens(b"x" * 32, 10.0).check(addr, token, scid, now=101.0) is None  # another node's secret
    for i in range(len(token)):
        bad = bytearray(token)
        bad[i] ^= 0x40
        assert tokens.check(addr, bytes(bad), scid, now=101.0) is None
    assert tokens.check(addr, b"", scid, now=101.0) is None
    assert tokens.check(addr, token[:-1], scid, now=101.0) is None
    with pytest.raises(ValueError):
        RetryTokens(b"short", 10.0)


@given(st.binary(max_size=200))
def test_retry_token_check_never_raises(token: bytes) -> None:
    assert RetryTokens(b"k" * 32, 10.0).check(("::1", 1), token, b"\x00" * 8, 0.0) is None


def P(key: str, source: str, at: float, stage: Stage) -> Pending:  # noqa: N802 - a table helper
    return Pending(key, source, at, stage)


@pytest.mark.parametrize(
    ("pending", "source", "verdict"),
    [
        ([], "a", (True, None)),
        ([P("1", "a", 1, Stage.SILENT)], "a", (True, None)),  # room left under both caps
        # per-source cap (2) reached: the lowest stage from that source, oldest first
        ([P("1", "a", 1, Stage.TALKING), P("2", "a", 2, Stage.SILENT)], "a", (True, "2")),
        ([P("1", "a", 1, Stage.TLS), P("2", "a", 2, Stage.TLS)], "a", (True, "1")),
        ([P("1", "a", 1, Stage.TALKING), P("2", "a", 2, Stage.TLS), P("3", "b", 0, Stage.SILENT)], "a", (True, "2")),
        # the victim would be younger than min_age (1 s at now = 10): the new one is refused
        ([P("1", "a", 9.5, Stage.SILENT), P("2", "a", 2, Stage.TALKING)], "a", (False, None)),
        # another source is not over its own cap; the total (4) is not reached
        ([P("1", "a", 1, Stage.SILENT), P("2", "a", 2, Stage.SILENT), P("3", "b", 3, Stage.TLS)], "b", (True, None)),
        # the total cap reached: anybody's, lowest stage then oldest
        (
            [P("1", "a", 1, Stage.TALKING), P("2", "b", 2, Stage.TLS), P("3", "c", 3, Stage.SILENT),
             P("4", "d", 0, Stage.SILENT)],
            "e",
            (True, "4"),
        ),
    ],
)
def test_eviction_order(pending: list[Pending], source: str, verdict: tuple[bool, str | None]) -> None:
    assert choose_eviction(pending, source, 10.0, max_total=4, max_per_source=2, min_age_s=1.0) == verdict


def test_hinted_newcomers_take_a_strangers_slot_and_are_evicted_last() -> None:
    young_stranger = [P("s", "a", 9.9, Stage.SILENT), P("t", "a", 9.8, Stage.TLS)]
    assert choose_eviction(young_stranger, "a", 10.0, 4, 2, 1.0) == (False, None)
    assert choose_eviction(young_stranger, "a", 10.0, 4, 2, 1.0, hinted=True) == (True, "s")
    member = [Pending("m", "a", 1.0, Stage.TLS, hinted=True), P("s", "a", 9.9, Stage.TALKING)]
    assert choose_eviction(member, "a", 10.0, 4, 2, 1.0, hinted=True) == (True, "s")  # the stranger goes
    old_member_only = [Pending("m", "a", 1.0, Stage.TLS, hinted=True), Pending("n", "a", 2.0, Stage.TLS, hinted=True)]
    assert choose_eviction(old_member_only, "a", 10.0, 4, 2, 1.0) == (False, None)  # strangers never evict them
    assert choose_eviction(old_member_only, "a", 10.0, 4, 2, 1.0, hinted=True) == (True, "m")


def test_member_hints() -> None:
    key, other = hint_key(b"k" * 32), hint_key(b"j" * 32)
    hints = InitialHints(window_s=60.0, max_seen=3)
    assert hints.check(key, make_hint(key, 1000.0, b"\x01" * 8), 1030.0)
    assert not hints.check(key, make_hint(key, 1000.0, b"\x01" * 8), 1030.0)  # each nonce once
    assert not hints.check(key, make_hint(other, 1000.0, b"\x02" * 8), 1000.0)  # another mesh
    assert not hints.check(key, make_hint(key, 1000.0, b"\x03" * 8), 1061.0)  # too old
    assert not hints.check(key, make_hint(key, 1000.0, b"\x04" * 8), 939.0)  # from the future
    tampered = bytearray(make_hint(key, 1000.0, b"\x05" * 8))
    tampered[3] ^= 1
    assert not hints.check(key, bytes(tampered), 1000.0)
    assert hints.check(key, make_hint(key, 1000.0, b"\x06" * 8), 1000.0)
    assert hints.check(key, make_hint(key, 1000.0, b"\x07" * 8), 1000.0)
    assert not hints.check(key, make_hint(key, 1000.0, b"\x08" * 8), 1000.0)  # memory full: refused
    assert hints.check(key, make_hint(key, 1200.0, b"\x09" * 8), 1200.0)  # the old ones expired
    assert not hints.check(key, b"\x02", 0.0) and not hints.check(key, b"", 0.0)


@given(st.binary(max_size=100))
def test_hint_check_never_raises(token: bytes) -> None:
    assert InitialHints(60.0, 10).check(hint_key(b"k" * 32), token, 0.0) is False
