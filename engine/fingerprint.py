"""A checkpoint's fingerprint: the one identity of a model's weights, shown in status and gossip.

``fingerprint(path, cache_dir=None)`` -> 32 bytes: SHA-256 over a domain tag, the canonical ``config.json``
and every weight file's name, size and bytes (a GGUF checkpoint: every file of the set, whose bytes hold its
metadata too), read with ``pread`` (no mapping, no resident pages left behind), so two checkpoints with the
same shapes but other weights differ. Its first 16 hex digits name the model in the membership record and in
``meshd status`` (``models[].fingerprint``) whether or not ``--pipeline`` is on, and pipeline stages are
matched on all 32 bytes (engine/pipeline/planner.py). Expert workers are matched on their own fingerprint of
the routed expert tensors (engine/experts/fingerprint.py), which a worker can compute without the rest.

Computed once per process per (path, file names, sizes, mtimes). With ``cache_dir`` (the node's state
dir) the result is also kept on disk under the same key, so a restart does not read the weights again
(hashing runs at ~0.8 GB/s on the reference machine: ~25 s for a 20 GB checkpoint). A stale, unreadable or
malformed cache file is recomputed; an unwritable directory only means no cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

_DOMAIN = b"meshd/pipeline-fp/v1\x00"  # the wire and the gossip carry these bytes: keep the tag
_READ = 1024 * 1024  # bytes per read while hashing, into one reused buffer (the hash's only memory)
_CACHE_VERSION = 1
_cache: dict[tuple[str, tuple[tuple[str, int, int], ...]], bytes] = {}


def _files(p: Path) -> tuple[bool, list[Path]]:
    from engine.gguf_file import is_gguf, split_files

    if is_gguf(p):  # the file(s) hold the metadata (the config) and every tensor's bytes and type
        return True, list(split_files(p))
    files = sorted(
        f for f in p.iterdir() if f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json")
    )
    return False, files


def _key(p: Path, gguf: bool, files: list[Path]) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    stats = [*files] if gguf else [p / "config.json", *files]
    return str(p.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in stats)


def _cache_file(cache_dir: Path, resolved: str) -> Path:
    return cache_dir / f"checkpoint-fp-{hashlib.sha256(resolved.encode()).hexdigest()[:32]}.json"


def _read_cache(file: Path, key: tuple[str, tuple[tuple[str, int, int], ...]]) -> bytes | None:
    try:
        doc: Any = json.loads(file.read_text("utf-8"))
        if (isinstance(doc, dict) and doc.get("v") == _CACHE_VERSION and doc.get("path") == key[0]
                and doc.get("files") == [list(f) for f in key[1]]):
            fp = bytes.fromhex(str(doc["fingerprint"]))
            if len(fp) == 32:
                return fp
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        pass
    return None


def _write_cache(file: Path, key: tuple[str, tuple[tuple[str, int, int], ...]], fp: bytes) -> None:
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        files = [list(f) for f in key[1]]
        doc = {"v": _CACHE_VERSION, "path": key[0], "files": files, "fingerprint": fp.hex()}
        tmp.write_text(json.dumps(doc), "utf-8")
        os.replace(tmp, file)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def compute(p: Path, gguf: bool, files: list[Path]) -> bytes:
    """The fingerprint, hashed from the files (no cache)."""
    h = hashlib.sha256(_DOMAIN)
    if gguf:
        h.update(b"gguf\x00")
    else:
        config = json.loads((p / "config.json").read_text("utf-8"))
        h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    buf = bytearray(_READ)
    view = memoryview(buf)
    for f in files:
        h.update(f"\x00{f.name}\x00{f.stat().st_size}\x00".encode())
        fd = os.open(f, os.O_RDONLY)
        try:
            pos = 0
            while n := os.preadv(fd, [buf], pos):
                h.update(view[:n])
                pos += n
        finally:
            os.close(fd)
    return h.digest()


def fingerprint(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> bytes:
    """32 bytes identifying the checkpoint's config and weights. Raises ``OSError``/``ValueError``."""
    p = Path(path)
    gguf, files = _files(p)
    if not files:
        raise ValueError(f"{p}: no safetensors files")
    key = _key(p, gguf, files)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    file = _cache_file(Path(cache_dir), key[0]) if cache_dir is not None else None
    out = _read_cache(file, key) if file is not None else None
    if out is None:
        out = compute(p, gguf, files)
        if file is not None:
            _write_cache(file, key, out)
    _cache[key] = out
    return out


def short(fp: bytes) -> str:
    """How status, logs and the membership record show a fingerprint: its first 16 hex digits."""
    return fp.hex()[:16]
