"""Admission of new QUIC connections on a listening node (sans-I/O: bytes, addresses and ``now`` in).

What a stranger may cost us before it proved anything:

- ``initial_decrypts``: a first datagram creates a connection only if its Initial packet decrypts (the
  Initial keys derive from the client's connection id, so this is cheap and needs no state). Junk leaves
  nothing behind.
- ``RetryTokens``: QUIC address validation (RFC 9000 8.1.2). When many handshakes are in progress, a
  new client must first echo a token bound to its address; a spoofed source cannot, so it creates
  nothing. Tokens are an HMAC (no state), valid for ``lifetime_s``.
- ``make_hint``/``InitialHints``: a member's first Initial carries a token that shows, blinded (an HMAC
  under a key derived from the mesh's genesis), that it holds the genesis. It reveals nothing to anyone
  else; a hinted handshake skips the Retry and evicts strangers' handshakes instead of waiting for room,
  and is evicted last. Each hint counts once (its nonce is remembered for its validity window), so an
  observer who replays one gains at most that one priority. A member whose clock is off by more than the
  window is simply not hinted.
- ``choose_eviction``: when the handshakes from one source address or from everybody reach their cap,
  the least promising unproven one is closed to make room (silent ones first: TLS done, nothing said;
  then those still in TLS; then those mid-handshake; oldest first in each), unless even that one is
  younger than ``min_age_s``: then the new one is refused, which bounds the handshakes (and the TLS
  work) one source can make us do per second. A member's handshake says its first frame together with
  finishing TLS, so strangers holding slots open without speaking are evicted before it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.crypto import CryptoError, CryptoPair  # type: ignore[attr-defined]
from aioquic.quic.packet import QuicPacketType, pull_quic_header


def initial_decrypts(data: bytes, host_cid_length: int) -> bool:
    """Whether ``data`` starts with a client Initial packet that decrypts (any QUIC version we can key)."""
    buf = Buffer(data=data)
    try:
        header = pull_quic_header(buf, host_cid_length=host_cid_length)
    except ValueError:
        return False
    if header.packet_type != QuicPacketType.INITIAL or header.version is None:
        return False
    crypto = CryptoPair()
    try:
        crypto.setup_initial(cid=header.destination_cid, is_client=False, version=header.version)
        crypto.decrypt_packet(data[: header.packet_length], buf.tell(), 0)
    except (CryptoError, ValueError):
        return False
    return True


_TOKEN_VERSION = 1  # first byte of a Retry token
HINT_KIND = 2  # first byte of a member hint
_TOKEN_MAC_BYTES = 16
_HINT_BYTES = 1 + 4 + 8 + _TOKEN_MAC_BYTES


def hint_key(mesh_key: bytes) -> bytes:
    """The key of member hints, from ``handshake.mesh_key(genesis)`` (a key of its own for this use)."""
    return hmac.new(mesh_key, b"meshd-initial-hint-v1", hashlib.sha256).digest()


def make_hint(key: bytes, now_wall: float, nonce: bytes) -> bytes:
    """A member's Initial token: ``kind u8 | unix seconds u32 | nonce[8] | mac[16]`` (``nonce`` fresh random)."""
    if len(nonce) != 8:
        raise ValueError("the nonce must be 8 bytes")
    body = struct.pack(">BI", HINT_KIND, int(now_wall) & 0xFFFFFFFF) + nonce
    return body + hmac.new(key, body, hashlib.sha256).digest()[:_TOKEN_MAC_BYTES]


class InitialHints:
    """Checks member hints: MAC, age within ``window_s`` either way (wall clocks differ a little), and
    each nonce once. Remembers at most ``max_seen`` nonces; when full, hints are refused until some expire."""

    def __init__(self, window_s: float, max_seen: int) -> None:
        self._window_s = window_s
        self._max_seen = max_seen
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten (wall seconds)

    def check(self, key: bytes, token: bytes, now_wall: float) -> bool:
        if len(token) != _HINT_BYTES or token[0] != HINT_KIND:
            return False
        body, mac = token[:-_TOKEN_MAC_BYTES], token[-_TOKEN_MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()[:_TOKEN_MAC_BYTES]):
            return False
        (t,) = struct.unpack_from(">I", body, 1)
        if abs(now_wall - t) > self._window_s:
            return False
        if len(self._seen) >= self._max_seen:
            self._seen = {n: until for n, until in self._seen.items() if until > now_wall}
        nonce = body[5:]
        if nonce in self._seen or len(self._seen) >= self._max_seen:
            return False
        self._seen[nonce] = now_wall + 2 * self._window_s
        return True


class RetryTokens:
    """Stateless address-validation tokens: ``issue`` for a Retry, ``check`` on the client's next Initial.

    Token: ``version u8 | issued_at_ms u64 | len u8 | original dcid | len u8 | retry scid | mac[16]``,
    the MAC (HMAC-SHA256 under ``secret``) covering the client's address too. ``now`` is any monotonic
    clock in seconds, the same for both calls.
    """

    def __init__(self, secret: bytes, lifetime_s: float) -> None:
        if len(secret) < 16:
            raise ValueError("the token secret must be at least 16 bytes")
        self._secret = secret
        self._lifetime_s = lifetime_s

    def _mac(self, addr: tuple[str, int], body: bytes) -> bytes:
        who = f"{addr[0]}|{addr[1]}".encode()
        return hmac.new(self._secret, struct.pack(">H", len(who)) + who + body, hashlib.sha256).digest()[
            :_TOKEN_MAC_BYTES
        ]

    def issue(self, addr: tuple[str, int], original_dcid: bytes, retry_scid: bytes, now: float) -> bytes:
        body = struct.pack(">BQ", _TOKEN_VERSION, int(now * 1000))
        body += bytes([len(original_dcid)]) + original_dcid + bytes([len(retry_scid)]) + retry_scid
        return body + self._mac(addr, body)

    def check(self, addr: tuple[str, int], token: bytes, dcid: bytes, now: float) -> bytes | None:
        """The original destination connection id if ``token`` is ours, fresh, for ``addr`` and for a
        client now sending to ``dcid`` (the Retry's source id); None otherwise."""
        if len(token) < 11 + _TOKEN_MAC_BYTES:
            return None
        body, mac = token[:-_TOKEN_MAC_BYTES], token[-_TOKEN_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(addr, body)):
            return None
        version, issued_ms = struct.unpack_from(">BQ", body)
        n = body[9]
        odcid = body[10 : 10 + n]
        rest = body[10 + n :]
        if version != _TOKEN_VERSION or len(odcid) != n or not rest or rest[1:] != dcid or rest[0] != len(dcid):
            return None
        age_s = now - issued_ms / 1000.0
        if not -1.0 <= age_s <= self._lifetime_s:
            return None
        return odcid


class Stage(IntEnum):
    """How far an unproven handshake got; lower values are evicted first."""

    SILENT = 0  # TLS finished, not a byte of the meshd handshake yet
    TLS = 1  # still in the TLS handshake
    TALKING = 2  # the meshd handshake started, membership not proven yet


@dataclass(frozen=True, slots=True)
class Pending:
    """One unproven handshake, as ``choose_eviction`` sees it."""

    key: Hashable
    source: str
    started_at: float
    stage: Stage
    hinted: bool = False


def choose_eviction(
    pending: Sequence[Pending],
    source: str,
    now: float,
    max_total: int,
    max_per_source: int,
    min_age_s: float,
    hinted: bool = False,
) -> tuple[bool, Hashable | None]:
    """Whether a new handshake from ``source`` may start, and which one to close first to make room.

    Under both caps: ``(True, None)``. Over the per-source cap the victim comes from ``source``; else,
    over the total cap, from anybody: unhinted before hinted, then the lowest ``Stage``, oldest first.
    For an unhinted newcomer, a hinted victim or one younger than ``min_age_s`` is spared and the new
    handshake refused instead ``(False, None)``, so that reopening connections as fast as they are
    evicted buys a source at most ``max_per_source / min_age_s`` handshakes a second, and a handshake
    once started has ``min_age_s`` to show progress. A hinted newcomer always gets the slot.
    """
    same = [p for p in pending if p.source == source]
    if len(same) >= max_per_source:
        pool = same
    elif len(pending) >= max_total:
        pool = list(pending)
    else:
        return True, None
    if not pool:
        return True, None
    victim = min(pool, key=lambda p: (p.hinted, p.stage, p.started_at))
    if not hinted and (victim.hinted or now - victim.started_at < min_age_s):
        return False, None
    return True, victim.key
