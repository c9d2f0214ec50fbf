"""Safetensors index and range mappings: find tensors by name, map only the bytes of chosen ones.

Reading a header reads only the header (8-byte length + JSON). :class:`RangeMaps` memory-maps page-aligned
windows that cover exactly the chosen tensors (adjacent ones merged), so the pages of every other tensor
are never mapped, let alone touched.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.quant import QUANTIZED, row_bytes

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit for the JSON header
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class TensorFileError(Exception):
    """A checkpoint file is missing, unreadable or malformed; the message names it."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string (F32, BF16, ...)
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor infos of one safetensors file (absolute offsets), reading only its header."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise TensorFileError(f"{file} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise TensorFileError(f"{file} has a {n}-byte header")
            header = f.read(n)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise TensorFileError(f"cannot read {file}: {e.strerror}") from None
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise TensorFileError(f"{file} has a malformed header") from None
    if not isinstance(meta, dict):
        raise TensorFileError(f"{file} has a malformed header")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, t in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = str(t["dtype"]), tuple(int(v) for v in t["shape"]), t["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise TensorFileError(f"{file}: tensor {name} has a malformed entry") from None
        if not 0 <= b <= e or base + e > size:
            raise TensorFileError(f"{file}: tensor {name} lies outside the file")
        out[name] = TensorInfo(name, file, dtype, shape, base + b, base + e)
    return out


def index_checkpoint(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of every ``*.safetensors`` file in ``path`` (headers only), or of a GGUF (by the
    engine's Hugging Face key names)."""
    from engine.gguf_file import is_gguf, load_gguf

    if is_gguf(path):
        from engine.checkpoint import CheckpointError

        try:
            src = load_gguf(path)
        except CheckpointError as e:
            raise TensorFileError(str(e)) from None
        return {k: TensorInfo(k, f, src.checkpoint[k].dtype, src.checkpoint[k].shape, b, e)
                for k, (f, b, e) in src.offsets.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TensorFileError(f"{path} has no *.safetensors files")
    index: dict[str, TensorInfo] = {}
    for f in files:
        index.update(read_header(f))
    return index


def as_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values of a tensor read as its storage dtype (exact for F32/F16/BF16; F32 is not copied)."""
    if dtype == "F32":
        return raw
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return raw.astype(np.float32)
    raise TensorFileError(f"unsupported dtype {dtype}")


class RangeMaps:
    """Read-only mappings covering exactly the given tensors; ``array(info)`` is a zero-copy view."""

    def __init__(self, tensors: Iterable[TensorInfo]) -> None:
        self._maps: list[tuple[Path, int, int, mmap.mmap]] = []  # (file, start, end, map)
        self.mapped_bytes = 0
        by_file: dict[Path, list[TensorInfo]] = {}
        for t in tensors:
            by_file.setdefault(t.file, []).append(t)
        page = mmap.ALLOCATIONGRANULARITY
        for file, infos in by_file.items():
            runs: list[list[int]] = []
            for t in sorted(infos, key=lambda t: t.begin):
                start = t.begin - t.begin % page
                if runs and start <= runs[-1][1]:
                    runs[-1][1] = max(runs[-1][1], t.end)
                else:
                    runs.append([start, t.end])
            try:
                with open(file, "rb") as f:
                    for start, end in runs:
                        if end > start:
                            m = mmap.mmap(f.fileno(), end - start, access=mmap.ACCESS_READ, offset=start)
                            self._maps.append((file, start, end, m))
                            self.mapped_bytes += end - start
            except OSError as e:
                raise TensorFileError(f"cannot map {file}: {e.strerror}") from None

    def array(self, t: TensorInfo) -> np.ndarray:
        """The tensor's storage as a read-only numpy array of its shape (no copy, no page touched); GGUF
        blocks as uint8 [..., row bytes]."""
        dt = _DTYPES.get(t.dtype)
        shape = t.shape
        if dt is None and t.dtype in QUANTIZED:
            dt, shape = np.dtype(np.uint8), (*t.shape[:-1], row_bytes(t.dtype, t.shape[-1]))
        if dt is None:
            raise TensorFileError(f"tensor {t.name} has unsupported dtype {t.dtype}")
        for file, start, end, m in self._maps:
            if file == t.file and start <= t.begin and t.end <= end:
                count = t.nbytes // dt.itemsize
                return np.frombuffer(m, dtype=dt, count=count, offset=t.begin - start).reshape(shape)
        raise KeyError(t.name)

    def close(self) -> None:
        for *_, m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # arrays still view it; the mapping goes away with them
        self._maps.clear()
