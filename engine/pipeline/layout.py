"""What the planner needs to know about a checkpoint: its fingerprint and the bytes of each layer.

``fingerprint(path)``: SHA-256 over a domain tag, the canonical ``config.json`` and every weight file's
name and bytes (a GGUF checkpoint: every file of the set, whose bytes hold its metadata too), read with
``pread`` (no mapping, no resident pages left behind), so two checkpoints with the same shapes but other
weights differ. Computed once per process per (path, sizes, mtimes).
``need_of(model, fingerprint)``: per-layer weight bytes, the output head's bytes and one token's
activation bytes, from the loaded (memory-mapped) checkpoint's tensor index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from engine.pipeline.planner import Need

_DOMAIN = b"meshd/pipeline-fp/v1\x00"
_READ = 8 * 1024 * 1024
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_cache: dict[tuple[str, tuple[tuple[str, int, int], ...]], bytes] = {}


def fingerprint(path: str | os.PathLike[str]) -> bytes:
    """32 bytes identifying the checkpoint's config and weights. Raises ``OSError``/``ValueError``."""
    from engine.gguf_file import is_gguf, split_files

    p = Path(path)
    gguf = is_gguf(p)
    if gguf:  # the file(s) hold the metadata (the config) and every tensor's bytes and type
        files = list(split_files(p))
    else:
        files = sorted(
            f for f in p.iterdir() if f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json")
        )
    if not files:
        raise ValueError(f"{p}: no safetensors files")
    key = (str(p.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    hit = _cache.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256(_DOMAIN)
    if gguf:
        h.update(b"gguf\x00")
    else:
        config = json.loads((p / "config.json").read_text("utf-8"))
        h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for f in files:
        h.update(f"\x00{f.name}\x00{f.stat().st_size}\x00".encode())
        fd = os.open(f, os.O_RDONLY)
        try:
            pos = 0
            while chunk := os.pread(fd, _READ, pos):
                h.update(chunk)
                pos += len(chunk)
        finally:
            os.close(fd)
    out = h.digest()
    _cache[key] = out
    return out


def need_of(model: Any, fp: bytes) -> Need:
    """The planner's ``Need`` for a loaded model (bytes as stored; the embeddings stay with the serving node)."""
    cfg = model.config
    per_layer = [0] * cfg.num_layers
    head = 0
    tied_names = {"model.norm.weight", "lm_head.weight"}
    for name, t in model.checkpoint.items():
        m = _LAYER.search(name)
        if m is not None and int(m.group(1)) < cfg.num_layers:
            per_layer[int(m.group(1))] += t.nbytes
        elif name in tied_names:
            head += t.nbytes
    if cfg.tie_word_embeddings:
        head += (
            model.checkpoint["model.embed_tokens.weight"].nbytes
            if "model.embed_tokens.weight" in model.checkpoint
            else 0
        )
    return Need(fp.hex(), tuple(per_layer), head, cfg.hidden_size * 4)


def embed_bytes(model: Any) -> int:
    t = model.checkpoint.get("model.embed_tokens.weight") if hasattr(model.checkpoint, "get") else None
    return int(t.nbytes) if t is not None else 0
