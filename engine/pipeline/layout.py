"""What the planner needs to know about a checkpoint: its fingerprint and the bytes of each layer.

``fingerprint(path)``: the checkpoint's fingerprint (engine/fingerprint.py, the one status and gossip show),
re-exported here for the planner's callers.
``need_of(model, fingerprint)``: per-layer weight bytes, the output head's bytes and one token's
activation bytes, from the loaded (memory-mapped) checkpoint's tensor index.
"""

from __future__ import annotations

import re
from typing import Any

from engine.fingerprint import fingerprint
from engine.pipeline.planner import Need

__all__ = ["embed_bytes", "fingerprint", "need_of"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
