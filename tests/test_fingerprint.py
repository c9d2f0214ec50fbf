"""One fingerprint for one checkpoint (engine/fingerprint.py): the model's in status and gossip is the one the
pipeline matches stages on, it follows the config and the weights, and the state dir keeps it across
restarts without hiding a change."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine import fingerprint as fpmod
from engine.fingerprint import fingerprint, short
from engine.pipeline.layout import fingerprint as pipeline_fingerprint
from engine.tiny import create_tiny


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    return create_tiny(tmp_path / "tiny")


def test_served_model_and_pipeline_show_the_same_fingerprint(tmp_path: Path) -> None:
    from meshd.api.engine_backend import load_engine_model

    state = tmp_path / "state"
    loaded = load_engine_model("tiny", state)
    fp = pipeline_fingerprint(loaded.path)  # what stages are matched on
    assert loaded.fingerprint == short(fp) == fp.hex()[:16]
    other = load_engine_model(f"other={loaded.path}", tmp_path / "state2")  # the same files, another name
    assert other.fingerprint == loaded.fingerprint


def test_follows_config_and_weights(ckpt: Path, tmp_path: Path) -> None:
    fp = fingerprint(ckpt)
    assert len(fp) == 32 and fingerprint(ckpt) == fp
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert fingerprint(ckpt) != fp  # an edited config is another model, also within one process
    weights = next(ckpt.glob("*.safetensors"))
    before = fingerprint(ckpt)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert fingerprint(ckpt) != before


def test_state_dir_cache_survives_a_restart_and_notices_changes(ckpt: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    fp = fingerprint(ckpt, cache_dir=state)
    assert len(list(state.glob("checkpoint-fp-*.json"))) == 1
    fpmod._cache.clear()  # a new process

    def no_hashing(*_a: object) -> bytes:
        raise AssertionError("hashed the weights again")

    monkeypatch.setattr(fpmod, "compute", no_hashing)
    assert fingerprint(ckpt, cache_dir=state) == fp  # from the state dir
    monkeypatch.undo()
    fpmod._cache.clear()
    weights = next(ckpt.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a new mtime on any clock
    assert fingerprint(ckpt, cache_dir=state) == fingerprint(ckpt) != fp  # stale entry recomputed
    bad = next(state.glob("checkpoint-fp-*.json"))
    bad.write_text("{not json")
    fpmod._cache.clear()
    assert fingerprint(ckpt, cache_dir=state) == fingerprint(ckpt)  # a broken cache file is recomputed


def test_unwritable_cache_dir_only_means_no_cache(ckpt: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert fingerprint(ckpt, cache_dir=blocker / "sub") == fingerprint(ckpt)
