"""Zero-copy safetensors reading: memory-mapped tensors from ``model.safetensors`` or a sharded set.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the raw data;
offsets are relative to the end of the header. The header is parsed here (safetensors' numpy API cannot
represent bf16), and every tensor is a read-only ``np.ndarray`` view over one shared ``mmap`` of its file:
nothing is copied until the model widens it. bf16 tensors are viewed as ``uint16`` and widened by
:func:`to_f32`.

Every problem with the files raises :class:`CheckpointError` with a one-line message naming the file and,
where there is one, the tensor key.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# A header larger than this is not a real checkpoint header (the format's own reference caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> numpy storage dtype (bf16 is stored as its raw 16 bits).
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}

# progress(done_bytes, total_bytes) — called while a checkpoint is being prepared.
ProgressFn = Callable[[int, int], None]


class CheckpointError(Exception):
    """A checkpoint file is missing, truncated, malformed, or does not match the model's key map."""


@dataclass(frozen=True, slots=True)
class TensorRef:
    """One tensor of a checkpoint: where it lives and its zero-copy storage view."""

    key: str
    file: Path
    dtype: str  # "F32" | "F16" | "BF16" (safetensors, GGUF) | "Q8_0" | "Q4_0" | "Q4_K" | "Q5_K" | "Q6_K" (GGUF)
    shape: tuple[int, ...]
    data: np.ndarray  # read-only view over the file's mmap, storage dtype (bf16 as uint16, GGUF blocks as
    #                   uint8 [..., row bytes])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def to_f32(data: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a storage array to fp32. fp32 input is returned as is (no copy)."""
    if dtype == "F32":
        return data
    if dtype == "F16":
        return data.astype(np.float32)
    if dtype == "BF16":
        # bf16 is the top half of an fp32: shift the 16 bits up and reinterpret.
        return (data.astype(np.uint32) << 16).view(np.float32)
    from .quant import BLOCKS, QUANTIZED, dequantize

    if dtype in QUANTIZED:  # GGUF blocks: [..., row bytes] uint8
        bs, ts = BLOCKS[dtype]
        return dequantize(data, dtype, (*data.shape[:-1], data.shape[-1] // ts * bs))
    raise CheckpointError(f"unsupported dtype {dtype}")


def _read_header(path: Path, mm: mmap.mmap | None, size: int) -> tuple[dict, int]:
    if size < 8:
        raise CheckpointError(f"{path}: truncated file ({size} bytes, no safetensors header)")
    assert mm is not None
    n = int.from_bytes(mm[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes (not safetensors?)"
        )
    if 8 + n > size:
        raise CheckpointError(f"{path}: truncated file (header needs {8 + n} bytes, file has {size})")
    try:
        header = json.loads(bytes(mm[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: malformed safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not a JSON object)")
    return header, 8 + n


class SafetensorsFile:
    """One memory-mapped safetensors file. Tensors are views valid while this object (or they) live."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open ({exc.strerror})") from None
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)
        header, data_start = _read_header(self.path, self._mm, size)
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorRef] = {}
        for key, info in header.items():
            self.tensors[key] = self._ref(key, info, data_start, size)

    def _ref(self, key: str, info: object, data_start: int, size: int) -> TensorRef:
        where = f"{self.path}: tensor {key!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: malformed header entry")
        dtype = info.get("dtype")
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if dtype not in _DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {dtype!r} (supported: F32, F16, BF16)")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise CheckpointError(f"{where}: malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{where}: malformed data_offsets {offsets!r}")
        begin, end = offsets
        np_dtype = _DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        if begin < 0 or end - begin != count * np_dtype.itemsize:
            raise CheckpointError(f"{where}: data_offsets {offsets} do not match shape {shape} of {dtype}")
        if data_start + end > size:
            raise CheckpointError(
                f"{where}: truncated file (tensor ends at byte {data_start + end}, file has {size})"
            )
        if count == 0:
            data = np.zeros(shape, dtype=np_dtype)
        else:
            assert self._mm is not None
            data = np.frombuffer(self._mm, dtype=np_dtype, count=count, offset=data_start + begin)
            data = data.reshape(shape)
        return TensorRef(key=key, file=self.path, dtype=dtype, shape=tuple(shape), data=data)


class Checkpoint(Mapping[str, TensorRef]):
    """All tensors of a checkpoint directory, keyed by name (single file or sharded with an index)."""

    def __init__(self, directory: Path, files: list[SafetensorsFile], tensors: dict[str, TensorRef]) -> None:
        self.directory = directory
        self.files = files
        self._tensors = tensors

    def __getitem__(self, key: str) -> TensorRef:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def describe(self, key: str) -> str:
        """Where a key lives (or would live), for error messages."""
        if key in self._tensors:
            return f"{self._tensors[key].file}: tensor {key!r}"
        return f"{self.directory}: tensor {key!r}"


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Map every tensor of a checkpoint directory (or a single ``.safetensors`` file).

    A directory holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
    (``{"weight_map": {key: file}}``); every key the index names must be in the file it names, and no
    shard may hold a key the index does not list. Raises :class:`CheckpointError`.
    """
    p = Path(path)
    if p.is_file():
        f = SafetensorsFile(p)
        return Checkpoint(p.parent, [f], dict(f.tensors))
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such checkpoint directory")
    index_path = p / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text("utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise TypeError("weight_map is not a map of strings")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: malformed index ({exc})") from None
        shards: dict[str, SafetensorsFile] = {}
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name:
                raise CheckpointError(f"{index_path}: shard name {name!r} is not a plain file name")
            shards[name] = SafetensorsFile(p / name)
        tensors: dict[str, TensorRef] = {}
        for key, name in weight_map.items():
            shard = shards[name]
            if key not in shard.tensors:
                raise CheckpointError(f"{shard.path}: tensor {key!r} listed in {INDEX_FILE} is missing")
            tensors[key] = shard.tensors[key]
        for name, shard in shards.items():
            for key in shard.tensors:
                if weight_map.get(key) != name:
                    raise CheckpointError(f"{shard.path}: tensor {key!r} is not listed in {INDEX_FILE}")
        return Checkpoint(p, list(shards.values()), tensors)
    single = p / SINGLE_FILE
    if single.is_file():
        f = SafetensorsFile(single)
        return Checkpoint(p, [f], dict(f.tensors))
    raise CheckpointError(f"{p}: no {SINGLE_FILE} or {INDEX_FILE}")
