"""The stage protocol's codec (sans-I/O): length-prefixed frames on a PIPELINE stream.

Every frame, all integers little-endian::

    length u32 (bytes after this field) | magic b"MP" | version u8 | kind u8 | flags u8 | reserved u8 (0)
    | body (per kind, consumed exactly)

Bodies (``run``: the plan instance, ``step``: a request id on this stream, ``seq``: a sequence)::

    OPEN      run u64 | first u16 | last u16 | num_layers u16 | fp_len u8 | fingerprint
              [| numerics_len u8 | numerics]   (optional: the serving node's numerics tag, engine/numerics.py,
                                                printable ASCII; absent from an older serving node)
    READY     run u64 | first u16 | last u16 | load_ms u32
    FORWARD   run u64 | step u32 | n u16 | n x (seq u64 | start u32 | count u32) | tensor     flags: LAST_ONLY,
                                                                                           POLL
    RESULT    run u64 | step u32 | compute_us u32 | tensor                                 flags: LOGITS
    FREE      run u64 | n u16 | n x seq u64            (n = 0: every sequence of the run)
    ERROR     step u32 | code u16 | text_len u16 | utf-8 text
    KEEPALIVE step u32                                 (a stage still computing ``step``; sent to a
                                                        stage: a ping, echoed at once with the same step)

    tensor := dtype u8 | ndim u8 | ndim x u32 dims | raw little-endian bits (exactly prod(dims) x itemsize)

A FORWARD with one sequence carries its ``count`` new positions ``start..start+count-1`` as rows; with
several, each sequence has count 1 (one decode step of a micro-batch) and row s is sequence s. Activations
and logits travel as raw fp32 bits, nothing lossy. ``FrameDecoder.feed`` takes bytes in any chunking and
raises ``RemoteProtocolError(code, reason)`` for anything malformed: bad magic, unsupported version,
reserved bits, unknown kind or flags, a length over ``MAX_FRAME_BYTES`` (checked before buffering), a body
that is short or has bytes left over, bad tensor headers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from engine.pipeline import limits

MAGIC = b"MP"
PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
VERSION = 1
HEADER = struct.Struct("<I2sBBBB")  # length, magic, version, kind, flags, reserved
_FIXED = HEADER.size - 4  # header bytes counted in length


class Kind(IntEnum):
    """APPEND ONLY: frame kinds on the wire."""

    OPEN = 1
    READY = 2
    FORWARD = 3
    RESULT = 4
    FREE = 5
    ERROR = 6
    KEEPALIVE = 7


class DType(IntEnum):
    """APPEND ONLY: tensor element types on the wire."""

    F32 = 1
    F16 = 2


class ErrorCode(IntEnum):
    """APPEND ONLY: why a stage refused or failed a request."""

    PROTOCOL = 1  # a malformed frame; the stream is closed
    FINGERPRINT_MISMATCH = 2  # the stage holds another checkpoint
    BAD_RANGE = 3  # layers outside the model or against the stage's pin
    UNKNOWN_RUN = 4  # a frame for a run this stream did not open
    POSITION_MISMATCH = 5  # a sequence's start is not its cache length (state lost: replay it)
    TOO_MANY_SEQUENCES = 6  # MAX_LIVE_SEQUENCES reached
    COMPUTE_FAILED = 7  # the layers raised (message says why)
    LOAD_FAILED = 8  # the layers could not be loaded
    NUMERICS_MISMATCH = 9  # the stage computes with other numerics (engine/numerics.py) than the serving node
    CONTEXT_EXCEEDED = 10  # positions past the model's context (an older stage does not send it)
    LOADING = 11  # the stage node is still mapping and checking its --stage checkpoints: ask again once it
    #   advertises its offer (an older serving node reads it as any refusal: the code is a plain u16 here)


FLAG_LAST_ONLY = 0x01  # FORWARD: the last stage returns logits of the last row only
FLAG_POLL = 0x02  # FORWARD: once answered, poll the stream for the next frame a short while (transport.poll)
#   instead of sleeping: the serving node sets it when every pipeline process on its machine has a core
FLAG_LOGITS = 0x01  # RESULT: the tensor is logits (the last stage), not hidden states
_ALLOWED_FLAGS = {Kind.FORWARD: FLAG_LAST_ONLY | FLAG_POLL, Kind.RESULT: FLAG_LOGITS}

_NP = {DType.F32: np.dtype("<f4"), DType.F16: np.dtype("<f2")}
_FROM_NP = {np.dtype("float32"): DType.F32, np.dtype("float16"): DType.F16}
_NP_BY_CODE = {int(k): v for k, v in _NP.items()}


class RemoteProtocolError(Exception):
    """The peer sent something this protocol does not allow. ``code`` is an ``ErrorCode`` value."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Open:
    run: int
    first: int
    last: int
    num_layers: int
    fingerprint: bytes
    numerics: str = ""  # the serving node's numerics tag; "" = not said (an older serving node)


@dataclass(frozen=True, slots=True)
class Ready:
    run: int
    first: int
    last: int
    load_ms: int


@dataclass(frozen=True, slots=True)
class SeqSpan:
    seq: int
    start: int
    count: int


# FORWARD and RESULT are made once per hop on each side, with the caches cold: not frozen, as a frozen dataclass's
# __init__ sets each field through object.__setattr__ (measured after a 64 MB sweep: 28 us against 15 for a
# RESULT). Nothing changes a frame once made; they compare by identity, as before (eq=False).
@dataclass(eq=False, slots=True)
class Forward:
    run: int
    step: int
    spans: tuple[SeqSpan, ...]
    x: np.ndarray  # [rows, D]
    last_only: bool = False
    poll: bool = False  # after answering, poll for the next frame (the serving node expects it within ms)


@dataclass(eq=False, slots=True)
class Result:
    run: int
    step: int
    compute_us: int
    x: np.ndarray  # hidden [rows, D] or logits [rows, V]
    logits: bool = False


@dataclass(frozen=True, slots=True)
class Free:
    run: int
    seqs: tuple[int, ...] = ()  # empty: the whole run


@dataclass(frozen=True, slots=True)
class Error:
    step: int
    code: int
    text: str


@dataclass(frozen=True, slots=True)
class Keepalive:
    step: int


Frame = Open | Ready | Forward | Result | Free | Error | Keepalive

_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")


def _tensor(x: np.ndarray) -> tuple[bytes, memoryview]:
    """A tensor's header and its raw bits (a view: ``encode`` copies each byte once, into the frame)."""
    dt = _FROM_NP.get(x.dtype)
    if dt is None:
        raise ValueError(f"cannot send {x.dtype} tensors")
    if not 1 <= x.ndim <= limits.MAX_DIMS:
        raise ValueError(f"cannot send a rank-{x.ndim} tensor")
    head = struct.pack(f"<BB{x.ndim}I", dt, x.ndim, *x.shape)
    return head, memoryview(np.ascontiguousarray(x, dtype=_NP[dt])).cast("B")


def encode(frame: Frame) -> bytes:
    """One frame's bytes. Raises ``ValueError`` for a frame this protocol cannot carry."""
    fast = _encode_step(frame)
    return fast if fast is not None else _encode_general(frame)


def _encode_general(frame: Frame) -> bytes:
    flags = 0
    bits: bytes | memoryview = b""  # a tensor's raw bits, after the body's other fields
    if isinstance(frame, Open):
        if len(frame.fingerprint) > limits.MAX_FINGERPRINT_BYTES:
            raise ValueError("fingerprint too long")
        kind = Kind.OPEN
        body = (
            struct.pack(
                "<QHHHB", frame.run, frame.first, frame.last, frame.num_layers, len(frame.fingerprint)
            )
            + frame.fingerprint
        )
        if frame.numerics:
            tag = frame.numerics.encode("ascii")
            if len(tag) > limits.MAX_NUMERICS_BYTES:
                raise ValueError("numerics tag too long")
            body += bytes([len(tag)]) + tag
    elif isinstance(frame, Ready):
        kind, body = Kind.READY, struct.pack("<QHHI", frame.run, frame.first, frame.last, frame.load_ms)
    elif isinstance(frame, Forward):
        kind = Kind.FORWARD
        flags = (FLAG_LAST_ONLY if frame.last_only else 0) | (FLAG_POLL if frame.poll else 0)
        spans = b"".join(struct.pack("<QII", s.seq, s.start, s.count) for s in frame.spans)
        head, bits = _tensor(frame.x)
        body = struct.pack("<QIH", frame.run, frame.step, len(frame.spans)) + spans + head
    elif isinstance(frame, Result):
        kind = Kind.RESULT
        flags = FLAG_LOGITS if frame.logits else 0
        head, bits = _tensor(frame.x)
        body = struct.pack("<QII", frame.run, frame.step, frame.compute_us) + head
    elif isinstance(frame, Free):
        kind = Kind.FREE
        body = struct.pack(f"<QH{len(frame.seqs)}Q", frame.run, len(frame.seqs), *frame.seqs)
    elif isinstance(frame, Error):
        kind = Kind.ERROR
        text = frame.text.encode()[: limits.MAX_ERROR_TEXT_BYTES]
        body = struct.pack("<IHH", frame.step, frame.code, len(text)) + text
    elif isinstance(frame, Keepalive):
        kind, body = Kind.KEEPALIVE, _U32.pack(frame.step)
    else:
        raise ValueError(f"not a frame: {type(frame).__name__}")
    length = _FIXED + len(body) + len(bits)
    if length > limits.MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes over the limit {limits.MAX_FRAME_BYTES}")
    return b"".join((HEADER.pack(length, MAGIC, VERSION, kind, flags, 0), body, bits))


_KINDS = {int(k): k for k in Kind}

# A decode step's two frames, whole, in one struct each (``_encode_step``, ``_decode_step``): a FORWARD of one
# sequence and a RESULT, each with a 2-D fp32 tensor. Same bytes and same frames as the general codec (a property
# test holds them equal), with a handful of Python operations instead of a few dozen: on the hop they run with
# cold caches (the stage has just streamed its weights through them), where each one costs a cache miss or more.
_FWD1 = struct.Struct("<I2sBBBBQIHQIIBBII")  # header | run step n=1 | seq start count | F32 2 rows cols
_RES = struct.Struct("<I2sBBBBQIIBBII")  # header | run step compute_us | F32 2 rows cols
_F32 = np.dtype("<f4")
_FWD_FLAGS, _RES_FLAGS = _ALLOWED_FLAGS[Kind.FORWARD], _ALLOWED_FLAGS[Kind.RESULT]
# plain ints and sizes for the step codec's checks (each enum member or module attribute looked up on the hop is
# one more cold lookup)
_K_FWD, _K_RES, _DT_F32, _MAX_DIM = int(Kind.FORWARD), int(Kind.RESULT), int(DType.F32), limits.MAX_DIM
_FWD1_SIZE, _RES_SIZE = _FWD1.size, _RES.size
# bytes to leave before a FORWARD (50-byte head) or a RESULT (36) read into an owned buffer (``decode_one(at=)``):
# its rows then start 16-byte aligned (a ``bytearray``'s bytes are), as a copy's would, and are viewed in place
FORWARD_LEAD, RESULT_LEAD = -_FWD1_SIZE % 16, -_RES_SIZE % 16


def _encode_step(frame: Frame) -> bytes | None:
    """``encode`` of a one-sequence FORWARD or a RESULT with a 2-D fp32 tensor; None for any other frame."""
    parts = step_parts(frame)
    return None if parts is None else b"".join(parts[0])


def step_parts(frame: Frame, step: int | None = None) -> tuple[tuple[bytes, Any], int] | None:
    """A one-sequence FORWARD or a RESULT with a 2-D fp32 tensor as ((its header, its tensor), bytes in all),
    the tensor's bits not yet copied (a C-contiguous array: ``bytes.join`` or a socket reads them once); with
    ``step``, as if ``frame.step`` were that. None for any other frame (``encode`` takes it). The parts joined
    are ``encode``'s bytes."""
    x = getattr(frame, "x", None)
    if x is None:
        return None
    dt = x.dtype
    if (dt is not _F32 and dt != _F32) or x.ndim != 2:
        return None
    rows, cols = x.shape
    if step is None:
        step = frame.step
    if type(frame) is Forward:
        if len(frame.spans) != 1:
            return None
        s = frame.spans[0]
        length = _FWD1_SIZE - 4 + 4 * rows * cols
        if length > limits.MAX_FRAME_BYTES:
            return None
        flags = (FLAG_LAST_ONLY if frame.last_only else 0) | (FLAG_POLL if frame.poll else 0)
        head = _FWD1.pack(length, MAGIC, VERSION, _K_FWD, flags, 0, frame.run, step, 1, s.seq, s.start,
                          s.count, _DT_F32, 2, rows, cols)
    elif type(frame) is Result:
        length = _RES_SIZE - 4 + 4 * rows * cols
        if length > limits.MAX_FRAME_BYTES:
            return None
        head = _RES.pack(length, MAGIC, VERSION, _K_RES, FLAG_LOGITS if frame.logits else 0, 0, frame.run,
                         step, frame.compute_us, _DT_F32, 2, rows, cols)
    else:
        return None
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    return (head, x), length + 4


def _decode_step(data: bytes | bytearray, max_frame_bytes: int, owned: bool = False, at: int = 0) -> Frame | None:
    """``data[at:]`` as exactly one well-formed one-sequence FORWARD or RESULT with a 2-D fp32 tensor, or None
    (the general decoder then decodes it, or says what is wrong with it). ``owned``: ``data`` is a ``bytearray``
    nobody else refers to, and the tensor is a view of it rather than a copy where its rows start 16-byte
    aligned (a FORWARD at ``FORWARD_LEAD``, a RESULT at ``RESULT_LEAD``)."""
    n = len(data) - at
    if n >= _FWD1_SIZE and data[at + 7] == _K_FWD:
        (length, magic, version, _, flags, reserved, run, step, seqs, seq, start, count, dtype, ndim, rows,
         cols) = _FWD1.unpack_from(data, at)
        size = _FWD1_SIZE
        if seqs != 1 or count != rows or not count or flags & ~_FWD_FLAGS:
            return None
    elif n >= _RES_SIZE and data[at + 7] == _K_RES:
        length, magic, version, _, flags, reserved, run, step, us, dtype, ndim, rows, cols = _RES.unpack_from(
            data, at)
        size = _RES_SIZE
        if flags & ~_RES_FLAGS:
            return None
    else:
        return None
    if (length + 4 != n or length > max_frame_bytes or magic != MAGIC or version != VERSION or reserved
            or dtype != _DT_F32 or ndim != 2 or rows > _MAX_DIM or not 0 < cols <= _MAX_DIM
            or n != size + 4 * rows * cols):
        return None
    if owned and (at + size) % 16 == 0 and type(data) is bytearray:
        # the message's own buffer: writable, nothing else holds it, and the rows start 16-byte aligned, as a
        # copy's would (rows aligned otherwise, e.g. a RESULT's 36 bytes into a buffer: a numpy reduction over
        # them could round differently than over a copy's, so those are copied)
        x = np.ndarray((rows, cols), _F32, data, at + size)
    else:
        x = np.frombuffer(data, _F32, rows * cols, at + size).reshape(rows, cols).astype(np.float32)  # a copy
    if size == _FWD1_SIZE:
        return Forward(run, step, (SeqSpan(seq, start, count),), x, bool(flags & FLAG_LAST_ONLY),
                       bool(flags & FLAG_POLL))
    return Result(run, step, us, x, bool(flags & FLAG_LOGITS))


class _Reader:
    """Reads a body exactly; any shortfall or excess is a ``RemoteProtocolError``."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise RemoteProtocolError(ErrorCode.PROTOCOL, "frame body is truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(_U16.unpack(self.take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def tensor(self) -> np.ndarray:
        code = self.u8()
        np_dt = _NP_BY_CODE.get(code)
        if np_dt is None:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, f"unknown dtype {code}")
        ndim = self.u8()
        if not 1 <= ndim <= limits.MAX_DIMS:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, f"tensor rank {ndim} outside 1-{limits.MAX_DIMS}")
        dims = struct.unpack_from(f"<{ndim}I", self.take(4 * ndim))
        n = np_dt.itemsize
        for d in dims:
            if d > limits.MAX_DIM:
                raise RemoteProtocolError(ErrorCode.PROTOCOL, f"tensor dimension over {limits.MAX_DIM}")
            n *= d
        raw = self.take(n)
        arr = np.frombuffer(raw, dtype=np_dt).reshape(dims).copy()  # writable, owns its bytes
        return arr.astype(np.float32, copy=False) if code == DType.F32 else arr

    def done(self) -> None:
        if self.pos != len(self.data):
            raise RemoteProtocolError(
                ErrorCode.PROTOCOL, f"{len(self.data) - self.pos} bytes left over in a frame"
            )


def decode_body(kind: int, flags: int, body: memoryview) -> Frame:
    """One frame from its kind, flags and body. Raises ``RemoteProtocolError``."""
    k = _KINDS.get(kind)
    if k is None:
        raise RemoteProtocolError(ErrorCode.PROTOCOL, f"unknown frame kind {kind}")
    if flags & ~_ALLOWED_FLAGS.get(k, 0):
        raise RemoteProtocolError(ErrorCode.PROTOCOL, f"unknown flags {flags:#x} on {k.name}")
    r = _Reader(body)
    frame: Frame
    if k is Kind.OPEN:
        run, first, last, n = r.u64(), r.u16(), r.u16(), r.u16()
        fp_len = r.u8()
        if fp_len > limits.MAX_FINGERPRINT_BYTES:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, "fingerprint too long")
        fp = bytes(r.take(fp_len))
        tag = ""
        if r.pos < len(r.data):
            tag_len = r.u8()
            if not 1 <= tag_len <= limits.MAX_NUMERICS_BYTES:
                raise RemoteProtocolError(ErrorCode.PROTOCOL, f"numerics tag of {tag_len} bytes")
            raw = bytes(r.take(tag_len))
            if not (raw.isascii() and raw.decode("ascii").isprintable() and b" " not in raw):
                raise RemoteProtocolError(ErrorCode.PROTOCOL, "numerics tag is not printable ASCII")
            tag = raw.decode("ascii")
        frame = Open(run, first, last, n, fp, tag)
        if not first <= last < n:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, f"bad layer range {first}-{last} of {n}")
    elif k is Kind.READY:
        frame = Ready(r.u64(), r.u16(), r.u16(), r.u32())
    elif k is Kind.FORWARD:
        run, step, n = r.u64(), r.u32(), r.u16()
        if not 1 <= n <= limits.MAX_SEQS_PER_FRAME:
            raise RemoteProtocolError(
                ErrorCode.PROTOCOL, f"{n} sequences in a frame (1-{limits.MAX_SEQS_PER_FRAME})"
            )
        spans = tuple(SeqSpan(r.u64(), r.u32(), r.u32()) for _ in range(n))
        x = r.tensor()
        rows = sum(s.count for s in spans)
        if x.ndim != 2 or x.shape[0] != rows or rows == 0 or (n > 1 and rows != n):
            raise RemoteProtocolError(
                ErrorCode.PROTOCOL, f"activations {list(x.shape)} do not match {n} sequences of {rows} rows"
            )
        frame = Forward(run, step, spans, x, bool(flags & FLAG_LAST_ONLY), bool(flags & FLAG_POLL))
    elif k is Kind.RESULT:
        run, step, us = r.u64(), r.u32(), r.u32()
        x = r.tensor()
        if x.ndim != 2:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, f"result of rank {x.ndim}, expected 2")
        frame = Result(run, step, us, x, bool(flags & FLAG_LOGITS))
    elif k is Kind.FREE:
        run, n = r.u64(), r.u16()
        frame = Free(run, tuple(r.u64() for _ in range(n)))
    elif k is Kind.ERROR:
        step, code, n = r.u32(), r.u16(), r.u16()
        if n > limits.MAX_ERROR_TEXT_BYTES:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, "error text too long")
        try:
            text = bytes(r.take(n)).decode()
        except UnicodeDecodeError:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, "error text is not UTF-8") from None
        frame = Error(step, code, text)
    else:
        frame = Keepalive(r.u32())
    r.done()
    return frame


class FrameDecoder:
    """Bytes in (any chunking), frames out. After a ``RemoteProtocolError`` the decoder is unusable."""

    def __init__(self, max_frame_bytes: int = limits.MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes
        self._need: int | None = None  # body length of the frame being buffered, once its header is checked
        self._failed = False

    @property
    def buffered(self) -> int:
        """Bytes held of a frame not yet whole (what the next ``feed`` calls must complete)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        if self._failed:
            raise RemoteProtocolError(ErrorCode.PROTOCOL, "decoder already failed")
        if not self._buf and self._need is None and len(data) >= HEADER.size:
            whole = self._whole_frame(data)  # the usual case: exactly one frame, decoded where it lies
            if whole is not None:
                return [whole]
        self._buf += data
        out: list[Frame] = []
        try:
            while True:
                if self._need is None:
                    if len(self._buf) < HEADER.size:
                        # check what we have of the magic early: garbage need not wait for 10 bytes
                        if len(self._buf) > 4 and bytes(self._buf[4:6]) != MAGIC[: len(self._buf) - 4]:
                            raise RemoteProtocolError(ErrorCode.PROTOCOL, "bad frame magic")
                        break
                    length, magic, version, kind, flags, reserved = HEADER.unpack_from(self._buf)
                    if magic != MAGIC:
                        raise RemoteProtocolError(ErrorCode.PROTOCOL, "bad frame magic")
                    if not PROTOCOL_MIN <= version <= PROTOCOL_MAX:
                        raise RemoteProtocolError(
                            ErrorCode.PROTOCOL, f"unsupported stage protocol version {version}"
                        )
                    if reserved:
                        raise RemoteProtocolError(ErrorCode.PROTOCOL, "reserved bits set")
                    if length < _FIXED or length > self._max:
                        raise RemoteProtocolError(
                            ErrorCode.PROTOCOL, f"frame length {length} outside {_FIXED}-{self._max}"
                        )
                    self._need = length - _FIXED
                if len(self._buf) < HEADER.size + self._need:
                    break
                _, _, _, kind, flags, _ = HEADER.unpack_from(self._buf)
                end = HEADER.size + self._need
                body = memoryview(bytes(self._buf[HEADER.size : end]))
                del self._buf[:end]
                self._need = None
                out.append(decode_body(kind, flags, body))
        except RemoteProtocolError:
            self._failed = True
            raise
        return out

    def _whole_frame(self, data: bytes) -> Frame | None:
        """``data`` if it is exactly one well-formed frame, decoded without buffering; None when it is not
        exactly one frame (``feed`` buffers it then, and reports what is wrong)."""
        length, magic, version, kind, flags, reserved = HEADER.unpack_from(data)
        if (
            length + 4 != len(data)
            or magic != MAGIC
            or not PROTOCOL_MIN <= version <= PROTOCOL_MAX
            or reserved
            or length > self._max
        ):
            return None
        try:
            return _decode_step(data, self._max) or decode_body(kind, flags, memoryview(data)[HEADER.size :])
        except RemoteProtocolError:
            self._failed = True
            raise


def decode_one(data: bytes | bytearray, max_frame_bytes: int = limits.MAX_FRAME_BYTES, owned: bool = False,
               at: int = 0) -> Frame:
    """``data[at:]`` as exactly one whole frame (a direct channel's message: ``engine.pipeline.direct``). Raises
    ``RemoteProtocolError`` for anything else (a malformed frame, a partial one, bytes after it). ``owned``:
    ``data`` is a ``bytearray`` the caller hands over (``DirectChannel.recv_owned``): a step frame's tensor is
    then a view of it, not a copy, where its rows start 16-byte aligned (``FORWARD_LEAD``, ``RESULT_LEAD``)."""
    fast = _decode_step(data, max_frame_bytes, owned, at)
    if fast is not None:
        return fast
    if at:
        data = data[at:]
    dec = FrameDecoder(max_frame_bytes)
    frames = dec.feed(data)
    if len(frames) != 1 or dec._buf or dec._need is not None:
        raise RemoteProtocolError(ErrorCode.PROTOCOL, "a direct message must be exactly one frame")
    return frames[0]
