"""Direct channels: a blocking TLS socket per peer pair and service, driven by the thread that computes.

A lane (``transport.lane_conn``) runs on the event loop: every message crosses asyncio's TLS layer
(``sslproto``, a MemoryBIO), the lane's record multiplexer, the stream framing and a loop wake-up on each
side. For a request/reply exchanged once per decode layer that Python costs more than the wire (session 5:
the lane's echo in decode 0.29-0.55 ms against a plain TCP echo's 0.04-0.1 ms). A direct channel is one
more TLS 1.3 connection to the same lane port, kept out of asyncio: an ``ssl.SSLSocket`` on a blocking TCP
socket (``TCP_NODELAY``), read and written by the thread that needs the answer (the coordinator's engine
thread; the worker's serving thread), with no event-loop hop on either side. Messages are
``length u32 | payload``; what they mean is the service's business (expert RPC, ``engine.experts.direct``;
a pipeline stage's decode hop, ``engine.pipeline.direct``).

How one comes up (the client is the node that wants to make calls)::

    C -> S  TCP, then in clear: b"MDIRECT" | service u8
    TLS 1.3 (the server's certificate is its node key's, as on a lane; the client presents none)
    the lane's proof of identity (``transport.lane_wire``: HELLO, AUTH, AUTH, READY) with the transcript
    tag b"meshd-direct-v1" | service: fresh nonces from both sides, the server certificate's hash, both keys

So a direct channel is authenticated exactly as strongly as a lane (a TLS-terminating machine in the
middle fails for the same reasons: ``lane_wire``'s docstring), and its proofs can stand neither for a lane
nor for another service's channel (the tag is signed, and the service byte sent in clear is in it). The
server (``LaneManager``) tells a direct channel from a lane by peeking at the first bytes (a lane starts
with a TLS record), counts it among its pending connections until the proof is done (``LANE_DIRECT_*`` in
``transport.limits``; a stranger is dropped after ``LANE_AUTH_TIMEOUT_S``), refuses a key that is not a
member connected over QUIC right now, and then hands the channel, in its own thread, to the handler the
service registered (``LaneManager.direct_handlers``). A member that disconnects has its channels closed.

Failure: any error (socket closed or reset, a timeout, a malformed record) raises ``TransportError`` and
closes the channel; the caller falls back to its stream over the lane or QUIC.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from transport import lane_wire, limits
from transport.errors import TransportError
from transport.framing import RemoteProtocolError
from transport.identity import NodeIdentity, node_id_from_public_key

DIRECT_MAGIC = b"MDIRECT"
assert len(DIRECT_MAGIC) + 1 == limits.LANE_DIRECT_MAGIC_BYTES  # noqa: S101 - module constants
SERVICE_EXPERTS = 1  # expert RPC (engine.experts.direct)
SERVICE_PIPELINE = 2  # a pipeline stage's decode hop (engine.pipeline.direct)
_RECORD = struct.Struct(">I")
_ONE_RECORD_BYTES = 16 * 1024  # TLS's largest record (plaintext): a message up to this, header included, is
#   written as one record (joined once); a longer one is written corked (``send_parts``)
_SMALL_FIRST_BYTES = 256  # a longer message's first part up to this (a frame header) is joined with the record
#   header; the rest is written from where it lies, not copied into one buffer first
_CORK = getattr(socket, "TCP_CORK", None)  # Linux: hold the records of one message until the whole is written
_RECV_BYTES = 256 * 1024  # one read's room: a per-channel buffer read into, not a new object per read (below)


def transcript_tag(service: int) -> bytes:
    return b"meshd-direct-v1" + bytes([service])


def magic(service: int) -> bytes:
    return DIRECT_MAGIC + bytes([service])


class DirectChannel:
    """One authenticated direct channel: whole messages each way over a blocking TLS socket.

    Not for concurrent use: one thread at a time sends and receives (``lock`` is there for callers that
    must make sure; ``close`` may come from any thread and wakes a blocked ``recv``)."""

    def __init__(self, tls: ssl.SSLSocket, peer_id: str, service: int, is_client: bool) -> None:
        self._sock = tls
        # the TLS object under ``tls``: its ``read``/``write`` called straight, not through ``ssl.SSLSocket``'s
        # Python wrappers (``recv_into`` -> ``read`` -> ``_checkClosed`` twice; ``sendall`` -> ``send``): a hop makes
        # 8-9 such calls, with cold caches, where each Python frame is a handful of misses (the socket's timeout,
        # the TLS state and the errors raised are the same; a peer gone without a TLS close reads as an end, as
        # the wrappers' ``suppress_ragged_eofs`` has it)
        self._tls = getattr(tls, "_sslobj", None) or _Wrapped(tls)
        self.peer_id = peer_id
        self.service = service
        self.is_client = is_client
        self.lock = threading.Lock()
        self.closed = False
        self.close_reason = ""
        self._buf = bytearray()
        # reads go into this buffer: ``recv(n)`` makes a new n-byte object per read, and at 256 KiB that is
        # above malloc's mmap threshold: an mmap, page faults, an mremap and a munmap on every read (measured
        # ~65 us per read against recv_into's, on a socket pair here; a 32 KiB reply takes 2-3 reads of TLS)
        self._scratch = bytearray(_RECV_BYTES)
        self._scratch_view = memoryview(self._scratch)
        self._head = memoryview(bytearray(_RECORD.size))  # ``recv_owned`` reads a record header here
        self._timeout: float | None = -1.0
        self.max_record_bytes = limits.LANE_DIRECT_MAX_RECORD_BYTES
        self.on_close: list[Callable[[DirectChannel], None]] = []
        self.messages_out = 0
        self.messages_in = 0
        peer = tls.getpeername()
        self.remote_address = (str(peer[0]), int(peer[1]))
        self.on_loopback = False
        with contextlib.suppress(ValueError):
            self.on_loopback = ipaddress.ip_address(self.remote_address[0]).is_loopback

    def _settimeout(self, timeout: float | None) -> None:
        if timeout != self._timeout:
            self._sock.settimeout(timeout)
            self._timeout = timeout

    def send(self, payload: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Send one message (blocks until the kernel took it). Raises ``TransportError`` and closes on
        failure."""
        self.send_parts((payload,), len(payload), timeout)

    def send_parts(self, parts: tuple[Any, ...], n: int, timeout: float | None = None) -> None:
        """Send one message made of ``parts`` (objects with the buffer protocol, C-contiguous, ``n`` bytes in
        all), as ``send`` does. Up to one TLS record, joined with the record header in one copy (one record, one
        segment). Longer: the record header (with the first part when it is small, a frame header) and then each
        part from where it lies, the socket corked meanwhile (``TCP_CORK``), so the message leaves as one
        segment on loopback and its reader wakes once for it, not once per 16 KiB record: a 32 KiB logits row
        is neither copied into a joined buffer nor sent as three segments (measured: docs/pipeline.md, session
        10). Raises ``TransportError`` and closes on failure (``BufferError`` for a part that cannot be read as
        bytes, ``ValueError`` for parts that are not ``n`` bytes, before anything is sent)."""
        if self.closed:
            raise TransportError(f"direct channel closed: {self.close_reason}")
        if n > self.max_record_bytes:
            raise TransportError(f"direct message of {n} bytes")
        head = _RECORD.pack(n)
        whole = n + _RECORD.size <= _ONE_RECORD_BYTES
        if whole:
            data = b"".join((head, *parts))
            if len(data) != _RECORD.size + n:
                raise ValueError(f"message parts of {len(data) - _RECORD.size} bytes, said {n}")
        else:
            views, total = [], 0  # (a loop, not comprehensions: each is one more frame, on the hop with cold caches)
            for part in parts:
                v = memoryview(part).cast("B")
                views.append(v)
                total += v.nbytes
            if total != n:
                raise ValueError(f"message parts of {total} bytes, said {n}")
            if views and views[0].nbytes <= _SMALL_FIRST_BYTES:
                head += views.pop(0)
        sock = self._sock
        try:
            if timeout != self._timeout:
                self._settimeout(timeout)
            if whole:
                self._write(data)
            else:
                if _CORK is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, _CORK, 1)
                self._write(head)
                for v in views:
                    if v.nbytes:
                        self._write(v)
                if _CORK is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, _CORK, 0)  # out now, as one segment where it fits
        except (OSError, ValueError) as e:
            self.close(f"send failed: {e!r}")
            raise TransportError(f"direct channel: send failed: {e!r}") from None
        self.messages_out += 1

    def recv(self, timeout: float | None = None) -> bytes | None:
        """The next whole message, or None when the peer closed the channel cleanly between messages.
        Raises ``TransportError`` (and closes) on a timeout, a broken socket or a malformed record."""
        out = self._recv(timeout, False)
        return out if out is None or type(out) is bytes else bytes(out)

    def recv_owned(self, timeout: float | None = None, lead: int = 0) -> bytearray | None:
        """``recv``, but the message is a ``bytearray`` the caller owns (nothing else refers to it), read straight
        into it from TLS (its record header first, then its bytes: copied once on their way, not into this
        channel's buffer and out again), after ``lead`` zero bytes: the message starts at ``out[lead]``, so a
        caller can put a field it will view in place at the alignment it needs (a ``bytearray``'s bytes are
        16-byte aligned)."""
        if self._buf:  # bytes read ahead by ``recv`` (not on a request/reply channel): the buffered way
            out = self._recv(timeout, True)
            return out if out is None or not lead else bytearray(lead) + out
        if self.closed:
            raise TransportError(f"direct channel closed: {self.close_reason}")
        head, read = self._head, self._tls.read  # (a ``close`` from another thread meanwhile: the read fails or
        got = 0  # ends, as it does through ``_read_into``)
        try:
            if timeout != self._timeout:
                self._settimeout(timeout)
            got = read(_RECORD.size, head)
            if not got:
                self.close("peer closed")
                return None
            while got < _RECORD.size:
                k = read(_RECORD.size - got, head[got:])
                if not k:
                    raise TransportError("direct channel ended inside a message")
                got += k
            (n,) = _RECORD.unpack_from(head)
            if n > self.max_record_bytes:
                raise TransportError(f"direct message of {n} bytes")
            out = bytearray(lead + n)
            end = lead + n
            with memoryview(out) as view:
                while lead < end:
                    k = read(end - lead, view[lead:])
                    if not k:
                        raise TransportError("direct channel ended inside a message")
                    lead += k
        except ssl.SSLEOFError:  # the peer went without a TLS close (ours does too): an end, as in ``_read_into``
            self.close("peer closed")
            if got:
                raise TransportError("direct channel ended inside a message") from None
            return None
        except TransportError as e:
            self.close(str(e))
            raise
        except (OSError, ValueError) as e:  # TimeoutError is an OSError
            self.close(f"recv failed: {e!r}")
            raise TransportError(f"direct channel: recv failed: {e!r}") from None
        self.messages_in += 1
        return out

    def _recv(self, timeout: float | None, owned: bool) -> bytes | bytearray | None:
        buf = self._buf
        try:
            self._settimeout(timeout)
            if not buf:  # nothing left over (the usual case): the first read is taken from the scratch buffer
                got = self._read_into(self._scratch_view)
                if not got:
                    self.close("peer closed")
                    return None
                if got >= _RECORD.size:
                    out, used = self._take(self._scratch_view, got, owned)
                    if used < got:
                        buf += self._scratch_view[used:got]
                    self.messages_in += 1
                    return out
                buf += self._scratch_view[:got]
            while len(buf) < _RECORD.size:
                if not self._fill():
                    raise TransportError("direct channel ended inside a message")
            with memoryview(buf) as view:
                out, used = self._take(view, len(buf), owned)
            del buf[:used]
        except TransportError as e:
            self.close(str(e))
            raise
        except (OSError, ValueError) as e:  # TimeoutError is an OSError
            self.close(f"recv failed: {e!r}")
            raise TransportError(f"direct channel: recv failed: {e!r}") from None
        self.messages_in += 1
        return out

    def _take(self, src: memoryview, have: int, owned: bool) -> tuple[bytes | bytearray, int]:
        """The message whose record starts at ``src[0]`` (``have`` bytes of ``src`` read, its header among them)
        -> (the message, bytes of ``src`` it used): a ``bytearray`` when ``owned`` or when it is longer than
        ``src`` holds (then read straight into it: its bytes are copied once on their way from TLS)."""
        (n,) = _RECORD.unpack_from(src)
        if n > self.max_record_bytes:
            raise TransportError(f"direct message of {n} bytes")
        end = _RECORD.size + n
        if have >= end:
            return (bytearray if owned else bytes)(src[_RECORD.size:end]), end
        out = bytearray(n)
        got = have - _RECORD.size
        out[:got] = src[_RECORD.size:have]
        with memoryview(out) as view:
            while got < n:
                k = self._read_into(view[got:], n - got)
                if not k:
                    raise TransportError("direct channel ended inside a message")
                got += k
        return out, have

    def _read_into(self, view: memoryview, nbytes: int = 0) -> int:
        """Up to ``nbytes`` (0: ``len(view)``) plaintext bytes into ``view`` -> how many (0: the peer ended)."""
        if self.closed:
            raise TransportError(f"direct channel closed: {self.close_reason}")
        try:
            return int(self._tls.read(nbytes or len(view), view))
        except ssl.SSLEOFError:  # the peer went without a TLS close (ours does too: ``close``): an end
            return 0

    def _write(self, data: bytes | memoryview) -> None:
        """All of ``data`` (``bytes``, or a memoryview of format "B") through TLS, blocking up to the channel's
        timeout."""
        tls_write = self._tls.write
        done = tls_write(data)
        if done < len(data):  # (not with the modes ``ssl`` sets: a write is whole or raises)
            with memoryview(data) as rest:
                while done < len(data):
                    done += tls_write(rest[done:])

    def _fill(self) -> bool:
        n = self._read_into(self._scratch_view)
        if not n:
            return False
        self._buf += self._scratch_view[:n]
        return True

    def close(self, reason: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        with contextlib.suppress(OSError):
            self._sock.close()
        for cb in list(self.on_close):
            with contextlib.suppress(Exception):
                cb(self)


class _Wrapped:
    """``read``/``write`` of an ``ssl.SSLSocket`` through its public methods (an ``ssl`` without ``_sslobj``)."""

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self._tls = tls

    def read(self, n: int, buffer: Any) -> int:
        return self._tls.recv_into(buffer, n)

    def write(self, data: Any) -> int:
        self._tls.sendall(data)
        return memoryview(data).nbytes


def _read_exact(tls: ssl.SSLSocket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("direct channel proof not done in time")
        tls.settimeout(left)
        chunk = tls.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed during the proof")
        out += chunk
    return bytes(out)


def _send(tls: ssl.SSLSocket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("direct channel proof not done in time")
    tls.settimeout(left)
    tls.sendall(data)


def dial(identity: NodeIdentity, peer_public_key: bytes, address: tuple[str, int], service: int,
         context: ssl.SSLContext, timeout_s: float) -> DirectChannel:
    """Client, blocking (run it in a thread): TCP, TLS and the proof to the member whose node key is
    ``peer_public_key``, listening for lanes at ``address``. Raises ``TransportError``."""
    deadline = time.monotonic() + timeout_s
    tag = transcript_tag(service)
    raw: socket.socket | None = None
    tls: ssl.SSLSocket | None = None
    try:
        raw = socket.create_connection(address, timeout=timeout_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.sendall(magic(service))
        tls = context.wrap_socket(raw, server_side=False)
        der = tls.getpeercert(binary_form=True)
        from transport.lane_conn import _cert_public_key

        if not der or _cert_public_key(der) != peer_public_key:
            raise TransportError("direct channel certificate is not the peer's node key")
        chash = lane_wire.cert_hash(der)
        pub_c, nonce_c = identity.public_key, os.urandom(lane_wire.NONCE_BYTES)
        _send(tls, lane_wire.encode_hello(pub_c, nonce_c), deadline)
        auth = _read_exact(tls, lane_wire.SERVER_AUTH_BYTES, deadline)
        nonce_s, sig_s = auth[: lane_wire.NONCE_BYTES], auth[lane_wire.NONCE_BYTES:]
        lane_wire.verify(peer_public_key, sig_s, False, pub_c, peer_public_key, nonce_c, nonce_s, chash, tag)
        sig_c = lane_wire.sign(identity, True, pub_c, peer_public_key, nonce_c, nonce_s, chash, tag)
        _send(tls, sig_c, deadline)
        head = _read_exact(tls, 2, deadline)
        reason = _read_exact(tls, head[1], deadline).decode("utf-8", "replace") if head[1] else ""
        if head[0] != 0:
            raise TransportError(f"direct channel refused: {reason}")
        return DirectChannel(tls, node_id_from_public_key(peer_public_key), service, True)
    except BaseException as e:
        _failed(e, tls, raw)
        raise


def _failed(e: BaseException, *socks: socket.socket | None) -> None:
    """A dial or accept failed with ``e``: close its sockets, and raise it as a ``TransportError`` where it is a
    protocol, socket or value error (the caller re-raises anything else)."""
    for s in socks:
        if s is not None:
            with contextlib.suppress(OSError):
                s.close()
    if isinstance(e, RemoteProtocolError):
        raise TransportError(f"direct channel failed: {e.reason}") from None
    if isinstance(e, OSError | ValueError):
        raise TransportError(f"direct channel failed: {e!r}") from None


def accept(sock: socket.socket, service: int, identity: NodeIdentity, cert_hash: bytes,
           context: ssl.SSLContext, member: Callable[[bytes], Any], deadline: float,
           may_open: Callable[[], str | None]) -> tuple[Any, DirectChannel]:
    """Server, blocking (its own thread): TLS and the proof on ``sock`` (its magic already read), until
    ``deadline`` (``time.monotonic()``). ``member(public_key)``: the peer connected over QUIC with that key,
    or None (refused); ``may_open()``: a reason to refuse after the proof (a cap), or None.
    -> (peer, channel). Raises ``TransportError``; ``sock`` is closed on failure."""
    tag = transcript_tag(service)
    tls: ssl.SSLSocket | None = None
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = context.wrap_socket(sock, server_side=True)
        pub_c, nonce_c = lane_wire.decode_hello(_read_exact(tls, lane_wire.HELLO_BYTES, deadline))
        peer = member(pub_c)
        if peer is None:
            _send(tls, lane_wire.encode_ready(False, "not a connected member"), deadline)
            raise TransportError("direct channel refused: not a connected member")
        pub_s, nonce_s = identity.public_key, os.urandom(lane_wire.NONCE_BYTES)
        sig = lane_wire.sign(identity, False, pub_c, pub_s, nonce_c, nonce_s, cert_hash, tag)
        _send(tls, nonce_s + sig, deadline)
        sig_c = _read_exact(tls, lane_wire.CLIENT_AUTH_BYTES, deadline)
        lane_wire.verify(pub_c, sig_c, True, pub_c, pub_s, nonce_c, nonce_s, cert_hash, tag)
        refusal = may_open()
        if refusal is not None:
            _send(tls, lane_wire.encode_ready(False, refusal), deadline)
            raise TransportError(f"direct channel refused: {refusal}")
        _send(tls, lane_wire.encode_ready(True), deadline)
        return peer, DirectChannel(tls, node_id_from_public_key(pub_c), service, False)
    except BaseException as e:
        _failed(e, tls, sock)
        raise
