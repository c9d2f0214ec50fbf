"""Expert RPC wire format: versioned, self-delimiting, checksummed messages (sans-I/O).

Every message is ``header | payload | crc32`` (all integers little-endian):

``header`` (16 bytes): magic ``b"MX"``, ``version`` u8, ``type`` u8 (:class:`MsgType`), ``flags`` u16 (0,
or ``FLAG_POLL`` on a request, below), ``reserved`` u16 (must be 0), ``request_id`` u32, ``payload_len`` u32.
``version`` is the protocol version that introduced the message type (1 for HELLO .. ECHO_REPLY, 2 for the COMBINE pair), so a peer
of any version can read the hello, and a message of a type its version lacks is refused by its header.

Versions: the HELLO offers ``[min_version, max_version]``; the worker acks the highest version both speak
and the coordinator sends only that version's message types (v2: EXPERT_REQUEST_COMBINE) afterwards; a
worker refuses a message type above the version it acked.
``FLAG_POLL`` (bit 0, v3; on EXPERT_REQUEST, EXPERT_REQUEST_COMBINE and ECHO only): the coordinator will
send its next request shortly and a core is free for the worker to poll for it, instead of sleeping, once
it has replied (``transport.poll``). It changes no result; a worker that acked v1 or v2 refuses it. The
flag is the only v3 change: a flagged request's header still carries its type's version (1, or 2 for the
combine request).
``crc32`` (4 bytes): ``zlib.crc32`` of header and payload, so any corrupted or tampered byte is detected.

Payloads (``x`` and ``out`` are fp32 little-endian, row-major):

- HELLO (coordinator -> worker): ``min_version`` u8, ``max_version`` u8, ``fingerprint`` 32 B,
  ``max_message_bytes`` u32, ``max_rows`` u32.
- HELLO_ACK (worker -> coordinator): ``version`` u8, ``fingerprint`` 32 B, ``max_message_bytes`` u32,
  ``max_rows`` u32, ``capacity`` f64, ``n_ranges`` u32, then per range ``layer_first``, ``layer_last``,
  ``expert_first``, ``expert_last`` u32 (inclusive rectangles of the (layer, expert)s it holds); from v4
  (the acked ``version``) then ``numerics_len`` u8 and the worker's numerics tag (engine/numerics.py, printable
  ASCII, at most ``NUMERICS_MAX_CHARS``).
- EXPERT_REQUEST (c -> w): ``layer`` u32, ``dtype`` u8 (1 = fp32), ``n_rows`` u32, ``dim`` u32, ``n_pairs``
  u32, ``x`` [n_rows, dim], ``pairs`` [n_pairs, 2] u32 as (row into x, expert). Pairs are strictly
  ascending by (expert, row) and every row of x is used, so each expert's rows are exactly the rows the
  local path would give it, and every hidden row is sent once.
- EXPERT_REPLY (w -> c): ``layer`` u32, ``n_pairs`` u32, ``dim`` u32, ``compute_us`` u32, ``out``
  [n_pairs, dim]: ``expert_ffn`` output for each request pair, in request order.
- EXPERT_REQUEST_COMBINE (c -> w, v2): ``layer`` u32, ``dtype`` u8 (1 = fp32), ``n_rows`` u32, ``dim`` u32,
  ``n_pairs`` u32, ``top_k`` u32, ``n_combined`` u32, ``x`` [n_rows, dim], ``pairs`` [n_pairs, 2] u32 (the
  EXPERT_REQUEST rules), ``rows`` [n_combined] u32 (rows into x to combine, strictly ascending),
  ``slot_experts`` [n_combined, top_k] u32 and ``slot_weights`` [n_combined, top_k] fp32 (each combined
  row's experts and weights in slot order). A combined row's pairs are exactly its ``top_k`` distinct slot
  experts; every weight is finite; ``n_combined`` >= 1.
- EXPERT_REPLY_COMBINED (w -> c, v2): ``layer`` u32, ``n_combined`` u32, ``n_pairs`` u32, ``dim`` u32,
  ``compute_us`` u32, ``combined`` [n_combined, dim]: each combined row's ``weighted_sum`` (engine.moe) of
  its slot outputs, in ``rows`` order; ``out`` [n_pairs, dim]: ``expert_ffn`` output for each request pair
  whose row is not combined, in request order (``n_pairs`` may be 0).
- ERROR (either way): ``code`` u16 (:class:`ErrorCode`), ``layer`` u32, ``expert`` u32 (``NONE`` if not
  applicable), ``text_len`` u16, ``text`` UTF-8.
- ECHO / ECHO_REPLY: raw bytes (round-trip measurement).

Parsing is strict: anything malformed raises :class:`ExpertProtocolError` and nothing else.
"""

from __future__ import annotations

import collections
import math
import struct
import zlib

import numpy as np

from engine.experts.messages import (  # the message types are part of this module's API
    _F32,
    _HEADER,
    _POLL_TYPES,
    _U32,
    CRC_BYTES,
    DTYPE_F32,
    FINGERPRINT_BYTES,
    FLAG_POLL,
    HEADER_BYTES,
    LOADING_VERSION,
    MAGIC,
    MSG_VERSION,
    NONE,
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    SMALL_PAIRS,
    Echo,
    EchoReply,
    Envelope,
    ErrorCode,
    ErrorMsg,
    ExpertCombinedReply,
    ExpertCombineRequest,
    ExpertProtocolError,
    ExpertReply,
    ExpertRequest,
    Hello,
    HelloAck,
    Message,
    MsgType,
    ShardRange,
    _bad,
    _groups,
    _raw_mask,
    _slot_pairs,
)
from engine import limits, numerics

__all__ = [
    "CRC_BYTES",
    "decode",
    "DTYPE_F32",
    "Echo",
    "EchoReply",
    "encode",
    "encode_row_request",
    "Envelope",
    "ErrorCode",
    "ErrorMsg",
    "ExpertCombinedReply",
    "ExpertCombineRequest",
    "ExpertProtocolError",
    "ExpertReply",
    "ExpertRequest",
    "FINGERPRINT_BYTES",
    "FLAG_POLL",
    "HEADER_BYTES",
    "Hello",
    "HelloAck",
    "LOADING_VERSION",
    "MAGIC",
    "Message",
    "MessageDecoder",
    "MSG_VERSION",
    "MsgType",
    "NONE",
    "PROTOCOL_MAX",
    "PROTOCOL_MIN",
    "ReplyBuffer",
    "ShardRange",
    "SMALL_PAIRS",
]


# --- encoding ---------------------------------------------------------------------------------------

_HELLO = struct.Struct("<BB32sII")
_HELLO_ACK = struct.Struct("<B32sIIdI")
_RANGE = struct.Struct("<IIII")
_REQ = struct.Struct("<IBIII")
_REPLY = struct.Struct("<IIII")
_CREQ = struct.Struct("<IBIIIII")
_CREPLY = struct.Struct("<IIIII")
_ERR = struct.Struct("<HIIH")


def _check_u32(name: str, v: int) -> None:
    if not 0 <= v <= 0xFFFFFFFF:
        raise ValueError(f"{name} {v} does not fit u32")


def _raw(a: np.ndarray) -> bytes | memoryview:
    """A contiguous array's bytes without a copy (memoryview cannot cast an empty array)."""
    return memoryview(a).cast("B") if a.size else b""


def _payload(msg: Message) -> tuple[MsgType, list[bytes | memoryview]]:
    if isinstance(msg, Hello):
        if len(msg.fingerprint) != FINGERPRINT_BYTES:
            raise ValueError("fingerprint must be 32 bytes")
        return MsgType.HELLO, [_HELLO.pack(msg.min_version, msg.max_version, msg.fingerprint,
                                           msg.max_message_bytes, msg.max_rows)]
    if isinstance(msg, HelloAck):
        if len(msg.fingerprint) != FINGERPRINT_BYTES:
            raise ValueError("fingerprint must be 32 bytes")
        parts: list[bytes | memoryview] = [_HELLO_ACK.pack(msg.version, msg.fingerprint, msg.max_message_bytes,
                                                           msg.max_rows, msg.capacity, len(msg.ranges))]
        parts += [_RANGE.pack(r.layer_first, r.layer_last, r.expert_first, r.expert_last) for r in msg.ranges]
        if msg.version >= 4:
            tag = msg.numerics.encode("ascii")
            if len(tag) > limits.NUMERICS_MAX_CHARS:
                raise ValueError("numerics tag too long")
            parts.append(bytes([len(tag)]) + tag)
        return MsgType.HELLO_ACK, parts
    if isinstance(msg, ExpertRequest):
        x = np.ascontiguousarray(msg.x, dtype=_F32)
        pairs = np.ascontiguousarray(msg.pairs, dtype=_U32)
        if x.ndim != 2 or pairs.ndim != 2 or pairs.shape[1] != 2:
            raise ValueError("x must be [n, D] and pairs [m, 2]")
        _check_u32("layer", msg.layer)
        head = _REQ.pack(msg.layer, DTYPE_F32, x.shape[0], x.shape[1], pairs.shape[0])
        return MsgType.EXPERT_REQUEST, [head, memoryview(x).cast("B"), memoryview(pairs).cast("B")]
    if isinstance(msg, ExpertReply):
        out = np.ascontiguousarray(msg.out, dtype=_F32)
        if out.ndim != 2:
            raise ValueError("out must be [m, D]")
        head = _REPLY.pack(msg.layer, out.shape[0], out.shape[1], min(msg.compute_us, 0xFFFFFFFF))
        return MsgType.EXPERT_REPLY, [head, memoryview(out).cast("B")]
    if isinstance(msg, ExpertCombineRequest):
        x = np.ascontiguousarray(msg.x, dtype=_F32)
        pairs = np.ascontiguousarray(msg.pairs, dtype=_U32)
        rows = np.ascontiguousarray(msg.rows, dtype=_U32)
        experts = np.ascontiguousarray(msg.experts, dtype=_U32)
        weights = np.ascontiguousarray(msg.weights, dtype=_F32)
        if (x.ndim != 2 or pairs.ndim != 2 or pairs.shape[1] != 2 or rows.ndim != 1 or experts.ndim != 2
                or experts.shape != weights.shape or experts.shape[0] != rows.shape[0]):
            raise ValueError("x must be [n, D], pairs [m, 2], rows [c], experts and weights [c, k]")
        _check_u32("layer", msg.layer)
        head = _CREQ.pack(msg.layer, DTYPE_F32, x.shape[0], x.shape[1], pairs.shape[0], experts.shape[1],
                          rows.shape[0])
        return MsgType.EXPERT_REQUEST_COMBINE, [head, *(_raw(a) for a in (x, pairs, rows, experts, weights))]
    if isinstance(msg, ExpertCombinedReply):
        combined = np.ascontiguousarray(msg.combined, dtype=_F32)
        out = np.ascontiguousarray(msg.out, dtype=_F32)
        if combined.ndim != 2 or out.ndim != 2 or out.shape[1] != combined.shape[1]:
            raise ValueError("combined must be [c, D] and out [m, D]")
        head = _CREPLY.pack(msg.layer, combined.shape[0], out.shape[0], combined.shape[1],
                            min(msg.compute_us, 0xFFFFFFFF))
        return MsgType.EXPERT_REPLY_COMBINED, [head, _raw(combined), _raw(out)]
    if isinstance(msg, ErrorMsg):
        text = msg.text.encode("utf-8")[: limits.EXPERT_MAX_ERROR_TEXT_BYTES]
        text = text.decode("utf-8", "ignore").encode("utf-8")  # never cut a character in half
        return MsgType.ERROR, [_ERR.pack(int(msg.code), msg.layer, msg.expert, len(text)), text]
    if isinstance(msg, Echo | EchoReply):
        if len(msg.payload) > limits.EXPERT_MAX_ECHO_BYTES:
            raise ValueError("echo payload too large")
        return (MsgType.ECHO if isinstance(msg, Echo) else MsgType.ECHO_REPLY), [msg.payload]
    raise TypeError(f"not a message: {type(msg).__name__}")


def _header(mtype: MsgType, request_id: int, length: int, flags: int = 0) -> bytes:
    """The header of a message of ``length`` payload bytes; ``ValueError`` if it must never be sent."""
    _check_u32("request_id", request_id)
    if length > limits.EXPERT_MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {length} bytes exceeds {limits.EXPERT_MAX_MESSAGE_BYTES}")
    if flags and (flags != FLAG_POLL or mtype not in _POLL_TYPES):
        raise ValueError(f"flags {flags:#x} on {mtype.name}")
    return _HEADER.pack(MAGIC, MSG_VERSION[mtype], int(mtype), flags, 0, request_id, length)


def encode(msg: Message, request_id: int, flags: int = 0) -> bytes:
    """Serialize one message (its header carries its type's ``MSG_VERSION`` and ``flags``). Raises
    ``ValueError`` for a message we must never send."""
    mtype, parts = _payload(msg)
    header = _header(mtype, request_id, sum(len(p) for p in parts), flags)
    crc = zlib.crc32(header)
    for p in parts:
        crc = zlib.crc32(p, crc)
    return b"".join([header, *parts, crc.to_bytes(4, "little")])


def encode_row_request(layer: int, x: np.ndarray, experts: list[int], request_id: int, flags: int = 0) -> bytes:
    """``encode(ExpertRequest(layer, x, [(0, e) for e in experts]), request_id, flags)`` for one token's row ``x``
    [1, D] fp32 (a decode step's request, built without the message object and the generic checks): the
    same bytes. Raises ``ValueError`` for a layer, request id or expert that does not fit u32."""
    _check_u32("layer", layer)
    if x.ndim != 2 or x.shape[0] != 1 or x.dtype != _F32 or not x.flags.c_contiguous:
        raise ValueError("x must be one contiguous fp32 row [1, D]")
    n = len(experts)
    try:
        pairs = struct.pack(f"<{2 * n}I", *[v for e in experts for v in (0, e)])
    except struct.error:
        raise ValueError("an expert does not fit u32") from None
    head = _REQ.pack(layer, DTYPE_F32, 1, x.shape[1], n)
    row = memoryview(x).cast("B")
    header = _header(MsgType.EXPERT_REQUEST, request_id, len(head) + len(row) + len(pairs), flags)
    crc = zlib.crc32(pairs, zlib.crc32(row, zlib.crc32(head, zlib.crc32(header))))
    return b"".join((header, head, row, pairs, crc.to_bytes(4, "little")))


class ReplyBuffer:
    """An EXPERT_REPLY built where its outputs are computed: the worker writes the [pairs, D] outputs into
    ``out`` (a view of the message), then :meth:`finish` adds the compute time and the checksum. The
    message is byte for byte ``encode(ExpertReply(layer, out, compute_us), request_id)``, without the copy
    and the message object after the compute."""

    __slots__ = ("_buf", "_head", "out")

    def __init__(self, layer: int, pairs: int, dim: int, request_id: int) -> None:
        _check_u32("layer", layer)
        if pairs < 1 or dim < 1:
            raise ValueError("out must be [m, D]")
        length = _REPLY.size + 4 * pairs * dim
        header = _header(MsgType.EXPERT_REPLY, request_id, length)
        self._buf = bytearray(HEADER_BYTES + length + CRC_BYTES)
        self._buf[:HEADER_BYTES] = header
        self._head = (layer, pairs, dim)
        self.out = np.frombuffer(self._buf, dtype=_F32, count=pairs * dim, offset=HEADER_BYTES + _REPLY.size)
        self.out = self.out.reshape(pairs, dim)

    def finish(self, compute_us: int) -> bytearray:
        """The whole message, once ``out`` holds the outputs."""
        buf = self._buf
        _REPLY.pack_into(buf, HEADER_BYTES, *self._head, min(compute_us, 0xFFFFFFFF))
        crc = zlib.crc32(memoryview(buf)[:-CRC_BYTES])
        buf[-CRC_BYTES:] = crc.to_bytes(CRC_BYTES, "little")
        return buf


# --- decoding ---------------------------------------------------------------------------------------


def _parse_header(header: bytes | memoryview, max_message_bytes: int) -> tuple[int, MsgType, int, int]:
    """``(flags, type, request_id, payload_len)`` of a header; ``ExpertProtocolError`` if it is malformed."""
    magic, version, mtype, flags, reserved, request_id, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise _bad("bad magic")
    if not PROTOCOL_MIN <= version <= PROTOCOL_MAX:
        raise ExpertProtocolError(ErrorCode.VERSION_UNSUPPORTED, f"message version {version}")
    if reserved or flags & ~FLAG_POLL:
        raise _bad("reserved bits set")
    try:
        kind = MsgType(mtype)
    except ValueError:
        raise _bad(f"unknown message type {mtype}") from None
    if flags and kind not in _POLL_TYPES:
        raise _bad(f"flags {flags:#x} on {kind.name}")
    if version != MSG_VERSION[kind]:
        raise ExpertProtocolError(ErrorCode.VERSION_UNSUPPORTED, f"message version {version} for {kind.name}")
    if length > max_message_bytes:
        raise ExpertProtocolError(ErrorCode.TOO_LARGE, f"message of {length} bytes exceeds {max_message_bytes}")
    return flags, kind, request_id, length


def _parse_payload(kind: MsgType, p: memoryview) -> Message:
    n = len(p)
    if kind is MsgType.HELLO:
        if n != _HELLO.size:
            raise _bad("hello has the wrong length")
        lo, hi, fp, mmb, mr = _HELLO.unpack(p)
        if lo > hi or lo == 0:
            raise _bad("hello version range is empty")
        return Hello(fingerprint=bytes(fp), min_version=lo, max_version=hi, max_message_bytes=mmb, max_rows=mr)
    if kind is MsgType.HELLO_ACK:
        if n < _HELLO_ACK.size:
            raise _bad("hello_ack is truncated")
        ver, fp, mmb, mr, cap, count = _HELLO_ACK.unpack_from(p)
        if count > limits.EXPERT_MAX_SHARD_RANGES:
            raise _bad(f"hello_ack has {count} ranges")
        end = _HELLO_ACK.size + count * _RANGE.size
        tag = ""
        if ver >= 4:
            if n <= end or n != end + 1 + p[end]:
                raise _bad("hello_ack has the wrong length")
            raw = bytes(p[end + 1:])
            if len(raw) > limits.NUMERICS_MAX_CHARS or (raw and numerics.parse(raw.decode("latin-1")) is None):
                raise _bad("hello_ack numerics tag is not printable ASCII of at most "
                           f"{limits.NUMERICS_MAX_CHARS} characters")
            tag = raw.decode("ascii")
        elif n != end:
            raise _bad("hello_ack has the wrong length")
        if not (cap > 0.0 and cap < float("inf")):
            raise _bad("hello_ack capacity must be positive and finite")
        ranges = []
        for i in range(count):
            lf, ll, ef, el = _RANGE.unpack_from(p, _HELLO_ACK.size + i * _RANGE.size)
            if lf > ll or ef > el:
                raise _bad("hello_ack range is empty")
            ranges.append(ShardRange(lf, ll, ef, el))
        return HelloAck(version=ver, fingerprint=bytes(fp), capacity=cap, ranges=tuple(ranges),
                        max_message_bytes=mmb, max_rows=mr, numerics=tag)
    if kind is MsgType.EXPERT_REQUEST:
        if n < _REQ.size:
            raise _bad("expert_request is truncated")
        layer, dtype, rows, dim, npairs = _REQ.unpack_from(p)
        if dtype != DTYPE_F32:
            raise _bad(f"unknown dtype {dtype}")
        if not (1 <= rows <= limits.EXPERT_MAX_ROWS and 1 <= dim <= limits.EXPERT_MAX_DIM
                and 1 <= npairs <= limits.EXPERT_MAX_PAIRS):
            raise ExpertProtocolError(ErrorCode.TOO_LARGE, "expert_request sizes out of range")
        if n != _REQ.size + 4 * rows * dim + 8 * npairs:
            raise _bad("expert_request has the wrong length")
        x, pairs, work = _rows_and_pairs(p, _REQ.size, rows, dim, npairs)
        return ExpertRequest(layer=layer, x=x, pairs=pairs, work=work)
    if kind is MsgType.EXPERT_REQUEST_COMBINE:
        return _parse_combine_request(p)
    if kind is MsgType.EXPERT_REPLY:
        if n < _REPLY.size:
            raise _bad("expert_reply is truncated")
        layer, npairs, dim, us = _REPLY.unpack_from(p)
        if not (1 <= npairs <= limits.EXPERT_MAX_PAIRS and 1 <= dim <= limits.EXPERT_MAX_DIM):
            raise ExpertProtocolError(ErrorCode.TOO_LARGE, "expert_reply sizes out of range")
        if n != _REPLY.size + 4 * npairs * dim:
            raise _bad("expert_reply has the wrong length")
        out = np.frombuffer(p, dtype=_F32, count=npairs * dim, offset=_REPLY.size).reshape(npairs, dim)
        return ExpertReply(layer=layer, out=out, compute_us=us)
    if kind is MsgType.EXPERT_REPLY_COMBINED:
        if n < _CREPLY.size:
            raise _bad("expert_reply_combined is truncated")
        layer, ncomb, npairs, dim, us = _CREPLY.unpack_from(p)
        if not (1 <= ncomb <= limits.EXPERT_MAX_ROWS and 0 <= npairs <= limits.EXPERT_MAX_PAIRS
                and 1 <= dim <= limits.EXPERT_MAX_DIM):
            raise ExpertProtocolError(ErrorCode.TOO_LARGE, "expert_reply_combined sizes out of range")
        if n != _CREPLY.size + 4 * (ncomb + npairs) * dim:
            raise _bad("expert_reply_combined has the wrong length")
        combined = np.frombuffer(p, dtype=_F32, count=ncomb * dim, offset=_CREPLY.size).reshape(ncomb, dim)
        out = np.frombuffer(p, dtype=_F32, count=npairs * dim, offset=_CREPLY.size + 4 * ncomb * dim)
        out = out.reshape(npairs, dim)
        return ExpertCombinedReply(layer=layer, combined=combined, out=out, compute_us=us)
    if kind is MsgType.ERROR:
        if n < _ERR.size:
            raise _bad("error is truncated")
        code, layer, expert, tlen = _ERR.unpack_from(p)
        if tlen > limits.EXPERT_MAX_ERROR_TEXT_BYTES or n != _ERR.size + tlen:
            raise _bad("error has the wrong length")
        try:
            ecode = ErrorCode(code)
            text = bytes(p[_ERR.size:]).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            raise _bad("error has an unknown code or bad text") from None
        return ErrorMsg(code=ecode, text=text, layer=layer, expert=expert)
    if kind in (MsgType.ECHO, MsgType.ECHO_REPLY):
        if n > limits.EXPERT_MAX_ECHO_BYTES:
            raise ExpertProtocolError(ErrorCode.TOO_LARGE, "echo too large")
        return Echo(bytes(p)) if kind is MsgType.ECHO else EchoReply(bytes(p))
    raise _bad(f"unhandled type {kind}")  # unreachable: MsgType() already checked


def _rows_and_pairs(p: memoryview, offset: int, rows: int, dim: int,
                    npairs: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, np.ndarray]]]:
    """x [rows, dim], pairs [npairs, 2] at ``offset``, pairs checked by the EXPERT_REQUEST rules, and their
    groups (``ExpertRequest.groups``)."""
    x = np.frombuffer(p, dtype=_F32, count=rows * dim, offset=offset).reshape(rows, dim)
    pairs = np.frombuffer(p, dtype=_U32, count=2 * npairs, offset=offset + 4 * rows * dim).reshape(npairs, 2)
    if npairs <= SMALL_PAIRS:
        return x, pairs, _small_pairs(pairs.tolist(), rows)
    return x, pairs, _large_pairs(pairs, rows)


def _large_pairs(pairs: np.ndarray, rows: int) -> list[tuple[int, np.ndarray]]:
    """The EXPERT_REQUEST checks of ``pairs`` [n, 2] against ``rows`` rows of x, and their groups."""
    r, e = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
    if int(r.max()) >= rows:
        raise _bad("expert_request pair names a row outside x")
    key = e * (rows + 1) + r
    if len(pairs) > 1 and not bool(np.all(np.diff(key) > 0)):
        raise _bad("expert_request pairs are not strictly ascending by (expert, row)")
    if len(np.unique(r)) != rows:
        raise _bad("expert_request sends a row no pair uses")
    return _groups(pairs)


_ROW0 = np.zeros(1, dtype=np.int64)  # the rows of every group of a one-row request (shared, read-only)
_ROW0.flags.writeable = False


def _small_pairs(pairs: list[list[int]], rows: int) -> list[tuple[int, np.ndarray]]:
    """``_large_pairs`` in Python, for a few pairs (``pairs.tolist()``): the same checks in the same order,
    the same verdicts and groups."""
    if rows == 1:  # one token (a decode step): every pair is (0, expert), one group each
        if any(r for r, _ in pairs):
            raise _bad("expert_request pair names a row outside x")
        experts = [e for _, e in pairs]
        if any(a >= b for a, b in zip(experts, experts[1:])):
            raise _bad("expert_request pairs are not strictly ascending by (expert, row)")
        return [(e, _ROW0) for e in experts]
    if max(r for r, _ in pairs) >= rows:
        raise _bad("expert_request pair names a row outside x")
    prev = -1
    for r, e in pairs:
        key = e * (rows + 1) + r
        if key <= prev:
            raise _bad("expert_request pairs are not strictly ascending by (expert, row)")
        prev = key
    if len({r for r, _ in pairs}) != rows:
        raise _bad("expert_request sends a row no pair uses")
    groups: list[tuple[int, list[int]]] = []
    for r, e in pairs:
        if groups and groups[-1][0] == e:
            groups[-1][1].append(r)
        else:
            groups.append((e, [r]))
    return [(e, np.array(rs, dtype=np.int64)) for e, rs in groups]


def _parse_combine_request(p: memoryview) -> ExpertCombineRequest:
    n = len(p)
    if n < _CREQ.size:
        raise _bad("expert_request_combine is truncated")
    layer, dtype, rows, dim, npairs, k, ncomb = _CREQ.unpack_from(p)
    if dtype != DTYPE_F32:
        raise _bad(f"unknown dtype {dtype}")
    if not (1 <= rows <= limits.EXPERT_MAX_ROWS and 1 <= dim <= limits.EXPERT_MAX_DIM
            and 1 <= npairs <= limits.EXPERT_MAX_PAIRS and 1 <= k <= limits.EXPERT_MAX_TOP_K
            and 1 <= ncomb <= rows):
        raise ExpertProtocolError(ErrorCode.TOO_LARGE, "expert_request_combine sizes out of range")
    if n != _CREQ.size + 4 * rows * dim + 8 * npairs + 4 * ncomb + 8 * ncomb * k:
        raise _bad("expert_request_combine has the wrong length")
    x, pairs, work = _rows_and_pairs(p, _CREQ.size, rows, dim, npairs)
    off = _CREQ.size + 4 * rows * dim + 8 * npairs
    crow = np.frombuffer(p, dtype=_U32, count=ncomb, offset=off)
    experts = np.frombuffer(p, dtype=_U32, count=ncomb * k, offset=off + 4 * ncomb).reshape(ncomb, k)
    weights = np.frombuffer(p, dtype=_F32, count=ncomb * k, offset=off + 4 * ncomb + 4 * ncomb * k)
    weights = weights.reshape(ncomb, k)
    if npairs <= SMALL_PAIRS and ncomb * k <= SMALL_PAIRS:
        slots, raw = _small_combine(pairs.tolist(), rows, crow.tolist(), experts.tolist(), weights.tolist(), k)
    else:
        slots, raw = _large_combine(pairs, rows, crow, experts, weights, k)
    return ExpertCombineRequest(layer=layer, x=x, pairs=pairs, rows=crow, experts=experts, weights=weights,
                                slots=slots, work=work, raw=raw)  # the worker combines with these


def _large_combine(pairs: np.ndarray, rows: int, crow: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """The EXPERT_REQUEST_COMBINE checks of the combine fields against checked ``pairs`` (of ``rows`` x
    rows); -> (slot_pairs, raw_mask)."""
    if int(crow.max()) >= rows or (len(crow) > 1 and not bool(np.all(np.diff(crow.astype(np.int64)) > 0))):
        raise _bad("expert_request_combine rows are not strictly ascending rows of x")
    if k > 1 and not bool(np.all(np.diff(np.sort(experts, axis=1).astype(np.int64), axis=1) > 0)):
        raise _bad("expert_request_combine repeats an expert in a row's slots")
    if not bool(np.all(np.isfinite(weights))):
        raise _bad("expert_request_combine has a weight that is not finite")
    slots = _slot_pairs(pairs, rows, crow, experts)
    per_row = np.bincount(pairs[:, 0].astype(np.int64), minlength=rows)
    if bool(np.any(per_row[crow] != k)) or bool(np.any(slots < 0)):
        raise _bad("expert_request_combine combines a row whose pairs are not exactly its slot experts")
    return slots, _raw_mask(pairs, rows, crow)


def _small_combine(pairs: list[list[int]], rows: int, crow: list[int], experts: list[list[int]],
                   weights: list[list[float]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """``_large_combine`` in Python, for a decode-sized request (lists of its fields): the same checks in
    the same order, the same verdicts, slots and mask."""
    if max(crow) >= rows or any(b <= a for a, b in zip(crow, crow[1:])):
        raise _bad("expert_request_combine rows are not strictly ascending rows of x")
    if k > 1 and any(len(set(es)) != k for es in experts):
        raise _bad("expert_request_combine repeats an expert in a row's slots")
    if not all(math.isfinite(w) for ws in weights for w in ws):
        raise _bad("expert_request_combine has a weight that is not finite")
    index = {(r, e): i for i, (r, e) in enumerate(pairs)}
    slots = [[index.get((c, e), -1) for e in es] for c, es in zip(crow, experts)]
    per_row = collections.Counter(r for r, _ in pairs)
    if any(per_row[c] != k for c in crow) or any(i < 0 for s in slots for i in s):
        raise _bad("expert_request_combine combines a row whose pairs are not exactly its slot experts")
    combined = set(crow)
    return (np.array(slots, dtype=np.int64).reshape(len(crow), k),
            np.array([r not in combined for r, _ in pairs], dtype=bool))


def decode(data: bytes, max_message_bytes: int = limits.EXPERT_MAX_MESSAGE_BYTES) -> Envelope:
    """Parse exactly one whole message; raises :class:`ExpertProtocolError` for anything else."""
    dec = MessageDecoder(max_message_bytes)
    out = dec.feed(data)
    if len(out) != 1 or dec.pending_bytes:
        raise _bad("expected exactly one message")
    return out[0]


class MessageDecoder:
    """Incremental parser for a byte stream of messages: ``feed(bytes) -> [Envelope]``.

    The payload length is checked against ``max_message_bytes`` as soon as the header is in, before any
    payload is buffered. After an :class:`ExpertProtocolError` the decoder is unusable (close the stream).
    """

    def __init__(self, max_message_bytes: int = limits.EXPERT_MAX_MESSAGE_BYTES) -> None:
        self._max = max_message_bytes
        self._chunks: list[bytes] = []
        self._have = 0
        self._need: int | None = None  # total bytes of the message in progress, once its header is in
        self._failed = False

    @property
    def pending_bytes(self) -> int:
        return self._have

    def feed(self, data: bytes) -> list[Envelope]:
        if self._failed:
            raise _bad("decoder already failed")
        if not self._have and type(data) is bytes and len(data) >= HEADER_BYTES:  # one whole message: in place
            try:
                head = _parse_header(memoryview(data)[:HEADER_BYTES], self._max)
                if len(data) == HEADER_BYTES + head[3] + CRC_BYTES:
                    return [self._parse_frame(data, head)]
            except ExpertProtocolError:
                self._failed = True
                raise
        if data:
            self._chunks.append(bytes(data))
            self._have += len(data)
        out: list[Envelope] = []
        try:
            while True:
                if self._need is None:
                    if self._have < HEADER_BYTES:
                        break
                    head = self._peek(HEADER_BYTES)
                    _, _, _, length = _parse_header(head, self._max)
                    self._need = HEADER_BYTES + length + CRC_BYTES
                if self._have < self._need:
                    break
                frame = self._take(self._need)
                self._need = None
                out.append(self._parse_frame(frame))
        except ExpertProtocolError:
            self._failed = True
            raise
        return out

    def _peek(self, n: int) -> bytes:
        if len(self._chunks[0]) < n:
            self._chunks = [b"".join(self._chunks)]
        return self._chunks[0][:n]

    def _take(self, n: int) -> bytes:
        joined = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        frame, rest = joined[:n], joined[n:]
        self._chunks = [rest] if rest else []
        self._have = len(rest)
        return frame

    def _parse_frame(self, frame: bytes, head: tuple[int, MsgType, int, int] | None = None) -> Envelope:
        """One whole message (``head``: its header, if already parsed)."""
        body = memoryview(frame)[:-CRC_BYTES]
        crc = int.from_bytes(frame[-CRC_BYTES:], "little")
        if zlib.crc32(body) != crc:
            raise _bad("checksum mismatch")
        flags, kind, request_id, _ = _parse_header(body[:HEADER_BYTES], self._max) if head is None else head
        return Envelope(request_id, _parse_payload(kind, body[HEADER_BYTES:]), flags)
