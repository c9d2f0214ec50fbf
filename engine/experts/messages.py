"""Expert RPC messages: their types, the protocol's constants (the header's layout among them) and errors.

The wire format, and the codec that writes and reads these messages, are ``engine.experts.rpc``, which
re-exports every name of this module that callers use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine import limits

MAGIC = b"MX"
PROTOCOL_MIN = 1
PROTOCOL_MAX = 5  # v3: FLAG_POLL; v4: HELLO_ACK carries the worker's numerics tag; v5: a hello may be
#   answered ERROR(LOADING) (a worker still loading answers it only to a hello offering v5: see LOADING_VERSION)
LOADING_VERSION = 5  # the first version whose coordinators parse ErrorCode.LOADING
FLAG_POLL = 0x0001
NONE = 0xFFFFFFFF  # "no layer / no expert" in ERROR
FINGERPRINT_BYTES = 32
DTYPE_F32 = 1

_HEADER = struct.Struct("<2sBBHHII")
HEADER_BYTES = _HEADER.size  # 16
CRC_BYTES = 4
_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")


class MsgType(IntEnum):
    """Message types. APPEND ONLY."""

    HELLO = 1
    HELLO_ACK = 2
    EXPERT_REQUEST = 3
    EXPERT_REPLY = 4
    ERROR = 5
    ECHO = 6
    ECHO_REPLY = 7
    EXPERT_REQUEST_COMBINE = 8
    EXPERT_REPLY_COMBINED = 9


# The protocol version that introduced each message type: the ``version`` its header carries. APPEND ONLY.
MSG_VERSION = {MsgType.HELLO: 1, MsgType.HELLO_ACK: 1, MsgType.EXPERT_REQUEST: 1, MsgType.EXPERT_REPLY: 1,
               MsgType.ERROR: 1, MsgType.ECHO: 1, MsgType.ECHO_REPLY: 1, MsgType.EXPERT_REQUEST_COMBINE: 2,
               MsgType.EXPERT_REPLY_COMBINED: 2}
_POLL_TYPES = frozenset((MsgType.EXPERT_REQUEST, MsgType.EXPERT_REQUEST_COMBINE, MsgType.ECHO))  # FLAG_POLL's


class ErrorCode(IntEnum):
    """Typed errors a peer may send. APPEND ONLY."""

    PROTOCOL = 1  # the peer sent something unparsable or out of sequence
    VERSION_UNSUPPORTED = 2  # no common protocol version
    FINGERPRINT_MISMATCH = 3  # the worker holds a different checkpoint
    NOT_HELD = 4  # the request names a (layer, expert) the worker does not hold
    TOO_LARGE = 5  # the request exceeds the worker's limits
    BAD_REQUEST = 6  # well-formed but inconsistent (dim does not match the model)
    INTERNAL = 7  # the worker failed computing
    SHUTTING_DOWN = 8  # the worker is stopping; retry elsewhere
    NUMERICS_MISMATCH = 9  # the worker computes with other numerics (engine/numerics.py) than the coordinator
    LOADING = 10  # the worker's experts are still loading: not an error, ask again soon. Sent only to a hello
    # offering LOADING_VERSION or later: an older coordinator's parser refuses a code it does not know


class ExpertProtocolError(Exception):
    """The one error the parser raises: ``code`` says which rule was broken, ``reason`` says how."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"{code.name.lower()}: {reason}")
        self.code = code
        self.reason = reason


def _bad(reason: str) -> ExpertProtocolError:
    return ExpertProtocolError(ErrorCode.PROTOCOL, reason)


# --- messages ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    fingerprint: bytes
    min_version: int = PROTOCOL_MIN
    max_version: int = PROTOCOL_MAX
    max_message_bytes: int = limits.EXPERT_MAX_MESSAGE_BYTES
    max_rows: int = limits.EXPERT_MAX_ROWS


@dataclass(frozen=True, slots=True)
class ShardRange:
    """Inclusive rectangle of held (layer, expert)s."""

    layer_first: int
    layer_last: int
    expert_first: int
    expert_last: int

    def contains(self, layer: int, expert: int) -> bool:
        return self.layer_first <= layer <= self.layer_last and self.expert_first <= expert <= self.expert_last


@dataclass(frozen=True, slots=True)
class HelloAck:
    version: int
    fingerprint: bytes
    capacity: float
    ranges: tuple[ShardRange, ...]
    max_message_bytes: int = limits.EXPERT_MAX_MESSAGE_BYTES
    max_rows: int = limits.EXPERT_MAX_ROWS
    numerics: str = ""  # the worker's numerics tag (engine/numerics.py), on the wire from v4; "": not said

    def holds(self, layer: int, expert: int) -> bool:
        return any(r.contains(layer, expert) for r in self.ranges)


@dataclass(frozen=True, slots=True, eq=False)
class ExpertRequest:
    layer: int
    x: np.ndarray  # [n_rows, dim] fp32
    pairs: np.ndarray  # [n_pairs, 2] uint32: (row into x, expert), strictly ascending by (expert, row)
    work: list[tuple[int, np.ndarray]] | None = field(default=None, repr=False)  # groups(), kept by the parser

    def groups(self) -> list[tuple[int, np.ndarray]]:
        """(expert, rows into x) in pair order: the work items this request carries."""
        return _groups(self.pairs) if self.work is None else self.work


# Up to this many pairs, a request's pairs are checked and grouped (and, by engine.experts.planning, built)
# in plain Python: a decode-sized request (a few pairs) then costs a handful of Python operations instead
# of a dozen numpy calls, which is what dominates its handling. Larger requests use numpy. Both give the
# same verdicts, groups and bytes.
SMALL_PAIRS = 64


def _groups(pairs: np.ndarray) -> list[tuple[int, np.ndarray]]:
    experts = pairs[:, 1]
    bounds = np.flatnonzero(np.diff(experts)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(experts)]))
    return [(int(experts[s]), pairs[s:e, 0].astype(np.int64)) for s, e in zip(starts, ends)]


@dataclass(frozen=True, slots=True, eq=False)
class ExpertCombineRequest:
    """An EXPERT_REQUEST (v2) that also asks the worker to combine ``rows`` in slot order."""

    layer: int
    x: np.ndarray  # [n_rows, dim] fp32
    pairs: np.ndarray  # [n_pairs, 2] uint32, as in ExpertRequest
    rows: np.ndarray  # [n_combined] uint32 rows into x, strictly ascending
    experts: np.ndarray  # [n_combined, k] uint32 slot experts
    weights: np.ndarray  # [n_combined, k] fp32 slot weights
    slots: np.ndarray | None = field(default=None, repr=False)  # slot_pairs(), kept by the parser
    work: list[tuple[int, np.ndarray]] | None = field(default=None, repr=False)  # groups(), kept by the parser
    raw: np.ndarray | None = field(default=None, repr=False)  # raw_mask(), kept by the parser

    def groups(self) -> list[tuple[int, np.ndarray]]:
        """(expert, rows into x) in pair order: the work items this request carries."""
        return _groups(self.pairs) if self.work is None else self.work

    def slot_pairs(self) -> np.ndarray:
        """[n_combined, k] int64: the index into ``pairs`` of (rows[c], experts[c, j]), -1 if absent."""
        if self.slots is not None:
            return self.slots
        return _slot_pairs(self.pairs, self.x.shape[0], self.rows, self.experts)

    def raw_mask(self) -> np.ndarray:
        """[n_pairs] bool: the pairs whose row is not combined (their outputs are sent raw)."""
        return _raw_mask(self.pairs, self.x.shape[0], self.rows) if self.raw is None else self.raw


def _raw_mask(pairs: np.ndarray, n_rows: int, rows: np.ndarray) -> np.ndarray:
    """[n_pairs] bool: the pairs whose row (into x of ``n_rows``) is not one of the combined ``rows``."""
    combined = np.zeros(n_rows, dtype=bool)
    combined[rows] = True
    return ~combined[pairs[:, 0]]


@dataclass(frozen=True, slots=True, eq=False)
class ExpertReply:
    layer: int
    out: np.ndarray  # [n_pairs, dim] fp32, request order
    compute_us: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class ExpertCombinedReply:
    """The reply to an ExpertCombineRequest: combined rows, then the other rows' raw pair outputs."""

    layer: int
    combined: np.ndarray  # [n_combined, dim] fp32, in the request's ``rows`` order
    out: np.ndarray  # [n_raw_pairs, dim] fp32: pairs of rows not combined, request order
    compute_us: int = 0


@dataclass(frozen=True, slots=True)
class ErrorMsg:
    code: ErrorCode
    text: str
    layer: int = NONE
    expert: int = NONE


@dataclass(frozen=True, slots=True)
class Echo:
    payload: bytes


@dataclass(frozen=True, slots=True)
class EchoReply:
    payload: bytes


Message = (Hello | HelloAck | ExpertRequest | ExpertReply | ErrorMsg | Echo | EchoReply | ExpertCombineRequest
           | ExpertCombinedReply)


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded message with its request id (a reply carries its request's id)."""

    request_id: int
    message: Message
    flags: int = 0  # header flags: FLAG_POLL on a request


def _slot_pairs(pairs: np.ndarray, n_x_rows: int, rows: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """ExpertCombineRequest.slot_pairs: the pair index of each (rows[c], experts[c, j]), -1 if absent."""
    n = n_x_rows + 1
    key = pairs[:, 1].astype(np.int64) * n + pairs[:, 0]  # ascending (the parser checks)
    want = experts.astype(np.int64) * n + rows.astype(np.int64)[:, None]  # [n_c, k]
    idx = np.minimum(np.searchsorted(key, want), len(key) - 1)
    return np.where(key[idx] == want, idx, -1)
