"""Model fingerprint: which checkpoint a worker holds, so a different one is refused by name.

``fingerprint = SHA-256(b"meshd/experts-fp/v1\\0" || canonical config.json || manifest)`` where the
manifest lists, for every routed expert tensor of every sparse layer in name order, its name, dtype
(the stored type: a Q4_K and a Q8_0 file of the same model differ), shape and the SHA-256 of its bytes. A
GGUF's "config.json" is its metadata as the engine reads it (``engine.gguf_file``). Hashing reads the files with ``pread`` (no mapping, so it leaves no
resident pages behind) and the result is cached next to the checkpoint in
``.meshd-experts-fingerprint.json``, keyed by each file's size and mtime; a stale or unreadable cache is
recomputed, an unwritable directory just means no cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import structlog

from engine.experts.layout import MoeLayout, layout_from_config, read_config
from engine.experts.tensors import TensorFileError, TensorInfo, index_checkpoint
from engine.gguf_file import is_gguf, split_files

log = structlog.get_logger(__name__)

CACHE_NAME = ".meshd-experts-fingerprint.json"
_DOMAIN = b"meshd/experts-fp/v1\x00"
_READ_BYTES = 8 * 1024 * 1024  # hashing read size: large enough to run at disk speed


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def expert_tensors(layout: MoeLayout, index: dict[str, TensorInfo]) -> list[TensorInfo]:
    """Every routed expert tensor (per-expert or fused) in name order; raises naming a missing one."""
    out = []
    for layer in layout.sparse_layers:
        fused = layout.fused_names(layer)
        if fused[0] in index:
            names: list[str] = list(fused)
        else:
            names = [n for expert in range(layout.num_experts) for n in layout.expert_names(layer, expert)]
        for name in names:
            if name not in index:
                raise TensorFileError(f"checkpoint has no tensor {name}")
            out.append(index[name])
    return sorted(out, key=lambda t: t.name)


def _hash_range(t: TensorInfo) -> str:
    h = hashlib.sha256()
    fd = os.open(t.file, os.O_RDONLY)
    try:
        pos = t.begin
        while pos < t.end:
            chunk = os.pread(fd, min(_READ_BYTES, t.end - pos), pos)
            if not chunk:
                raise TensorFileError(f"{t.file} is truncated inside {t.name}")
            h.update(chunk)
            pos += len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def _stat_key(path: Path) -> list[list[Any]]:
    if is_gguf(path):
        files = split_files(path)
    else:
        files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    key = []
    for f in files:
        st = f.stat()
        key.append([f.name, st.st_size, st.st_mtime_ns])
    return key


def compute_fingerprint(path: Path) -> bytes:
    """The 32-byte fingerprint of the checkpoint at ``path`` (no cache)."""
    cfg = read_config(path)
    layout = layout_from_config(cfg)
    index = index_checkpoint(path)
    h = hashlib.sha256(_DOMAIN)
    h.update(_canonical(cfg))
    for t in expert_tensors(layout, index):
        h.update(_canonical([t.name, t.dtype, list(t.shape), _hash_range(t)]))
    return h.digest()


def _cache_files(path: Path, cache_dir: Path | None) -> list[Path]:
    files = [path.with_name(f"{path.name}{CACHE_NAME}") if is_gguf(path) else path / CACHE_NAME]
    if cache_dir is not None:
        tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
        files.append(cache_dir / f"experts-fp-{tag}.json")
    return files


def model_fingerprint(path: Path, *, use_cache: bool = True, cache_dir: Path | None = None) -> bytes:
    """The checkpoint's fingerprint, from a still-valid cache, else computed and cached.

    The cache lives next to the checkpoint, or in ``cache_dir`` (e.g. the state dir) when the checkpoint
    directory is read-only.
    """
    path = Path(path)
    try:
        key = _stat_key(path)
    except OSError as e:
        raise TensorFileError(f"cannot read {path}: {e.strerror}") from None
    caches = _cache_files(path, cache_dir) if use_cache else []
    for cache in caches:
        try:
            doc = json.loads(cache.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and doc.get("v") == 1 and doc.get("files") == key:
                fp = bytes.fromhex(str(doc["fingerprint"]))
                if len(fp) == 32:
                    return fp
        except (OSError, ValueError, KeyError, UnicodeDecodeError):
            pass
    fp = compute_fingerprint(path)
    for cache in caches:
        tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"v": 1, "files": key, "fingerprint": fp.hex()}), encoding="utf-8")
            os.replace(tmp, cache)
            break
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
    else:
        if caches:
            log.debug("experts_fingerprint_not_cached", path=str(path))
    return fp
