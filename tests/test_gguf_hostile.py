"""Hostile GGUF files: metadata arrays whose counts a file cannot hold, nested arrays, absurd dims and
offsets. Each is refused within seconds with one ``CheckpointError`` line naming the file, never a hang,
a ``MemoryError`` or a traceback.

The files are written here byte by byte (GGUF v3: magic, version, tensor count, key/value count, the
key/values, the tensor infos, padding to 32, data), so each names exactly the field it attacks.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointError
from engine.gguf_file import load_gguf
from engine.limits import GGUF_MAX_ARRAY_ITEMS

_STRING, _ARRAY, _U8, _U32 = 8, 9, 0, 4


def _s(b: str | bytes) -> bytes:
    raw = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(raw)) + raw


def _kv_str(key: str, value: str) -> bytes:
    return _s(key) + struct.pack("<I", _STRING) + _s(value)


def _array_head(key: str, item_type: int, count: int) -> bytes:
    return _s(key) + struct.pack("<IIQ", _ARRAY, item_type, count)


def _tensor(name: str, dims: list[int], qtype: int, offset: int) -> bytes:
    return (_s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", qtype, offset))


def _gguf(path: Path, kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"\0" * 64) -> Path:  # type: ignore[assignment]
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(body + b"\0" * (-len(body) % 32) + data)
    return path


_ARCH = _kv_str("general.architecture", "llama")


def _refused(path: Path, match: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        load_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and match in msg, msg
    assert len(msg) < 600, msg
    assert time.monotonic() - t0 < 5.0
    return msg


@pytest.mark.parametrize("item_type", [_U8, _U32, _STRING])
def test_an_array_count_larger_than_the_file_is_refused_at_once(tmp_path: Path, item_type: int) -> None:
    # before: the reader looped 2**60 times over empty reads past the end of the file
    p = _gguf(tmp_path / "a.gguf", [_ARCH, _array_head("tokenizer.ggml.tokens", item_type, 1 << 60)])
    _refused(p, "tokenizer.ggml.tokens")


def test_an_array_over_the_item_limit_is_refused_even_if_the_file_is_long_enough(tmp_path: Path) -> None:
    n = GGUF_MAX_ARRAY_ITEMS + 1
    p = _gguf(tmp_path / "a.gguf", [_ARCH, _array_head("x.y", _U8, n) + b"\0" * n])
    _refused(p, f"{n} items")


def test_nested_arrays_are_refused(tmp_path: Path) -> None:
    # before: 5000 levels of one-item arrays took a minute and ended in MemoryError
    nested = _s("x.y") + struct.pack("<I", _ARRAY) + struct.pack("<IQ", _ARRAY, 1) * 5000
    p = _gguf(tmp_path / "a.gguf", [_ARCH, nested])
    _refused(p, "nested")


def test_a_huge_architecture_string_is_named_in_a_short_line(tmp_path: Path) -> None:
    p = _gguf(tmp_path / "a.gguf", [_kv_str("general.architecture", "z" * 100_000)])
    _refused(p, "is not supported")


@pytest.mark.parametrize(
    ("dims", "offset", "match"),
    [([1 << 40, 1 << 40], 0, "not a readable GGUF"), ([1 << 63, 2], 0, "not a readable GGUF"),
     ([32, 2], 1 << 62, "truncated"), ([1] * 1000, 0, "not a readable GGUF")],
)
def test_absurd_tensor_dims_and_offsets_are_refused(tmp_path: Path, dims: list[int], offset: int, match: str) -> None:
    p = _gguf(tmp_path / "a.gguf", [_ARCH], [_tensor("token_embd.weight", dims, 0, offset)])
    _refused(p, match)


def test_the_cli_says_one_line_for_a_hostile_array(tmp_path: Path) -> None:
    p = _gguf(tmp_path / "a.gguf", [_ARCH, _array_head("tokenizer.ggml.merges", _STRING, 1 << 60)])
    r = subprocess.run([sys.executable, "-m", "meshd", "generate", "--model", str(p), "--state-dir",
                        str(tmp_path / "st"), "--prompt", "hi"], capture_output=True, text=True, timeout=60, check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(lines) == 1 and "tokenizer.ggml.merges" in lines[0], r.stderr
