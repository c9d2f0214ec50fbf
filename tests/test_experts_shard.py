"""Shard specs, shard validation and mapping, fingerprint, and HRW ownership."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.quant import Packed
import pytest
from experts_util import make_moe_checkpoint
from safetensors.numpy import load_file, save_file

from engine.experts.fingerprint import CACHE_NAME, compute_fingerprint, model_fingerprint
from engine.experts.ownership import WorkerInfo, build_map
from engine.experts.shard import ShardError, load_shard, parse_spec


def test_parse_spec() -> None:
    s = parse_spec("/models/q3@0-23/0-63")
    assert s.path == Path("/models/q3") and s.layers == ((0, 23),) and s.experts == ((0, 63),)
    s = parse_spec("/m@1,3-4/7")
    assert s.layers == ((1, 1), (3, 4)) and s.experts == ((7, 7),)
    assert parse_spec("/a@b/c").path == Path("/a@b/c")  # an @ that is not a suffix is part of the path
    assert parse_spec("/m").layers is None
    for bad in ("", "/m@5-2/0", "/m@0-3", "/m@0-3/", "/m@/0"):
        with pytest.raises(ShardError):
            parse_spec(bad)


def _f32(w: object) -> np.ndarray:
    return w.widen() if isinstance(w, Packed) else w  # type: ignore[return-value]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_shard_weights_match_checkpoint(tmp_path: Path, family: str, dtype: str) -> None:
    ck = make_moe_checkpoint(tmp_path / "m", family=family, dtype=dtype)
    shard = load_shard(f"{ck}@1-2/2-5")
    assert shard.layers == (1, 2) and shard.experts == (2, 3, 4, 5)
    assert shard.holds(1, 2) and not shard.holds(0, 2) and not shard.holds(1, 6)
    raw = load_file(str(ck / "model.safetensors")) if dtype == "F32" else None
    g, u, d = (_f32(w) for w in shard.weights(2, 5))  # kept in the stored type, widened here to compare
    assert g.dtype == np.float32 and g.shape == (16, 32) and d.shape == (32, 16)
    assert isinstance(shard.weights(2, 5)[0], np.ndarray if dtype == "F32" else Packed)
    if raw is not None:
        name = ("model.layers.2.block_sparse_moe.experts.5.w1.weight" if family == "mixtral"
                else "model.layers.2.mlp.experts.5.gate_proj.weight")
        assert g.tobytes() == raw[name].tobytes()
    with pytest.raises(KeyError):
        shard.weights(0, 0)
    # Only the held tensors' bytes are mapped (plus page rounding), not the whole file.
    assert shard.maps.mapped_bytes < (ck / "model.safetensors").stat().st_size
    assert shard.expert_bytes == 2 * 4 * 3 * 16 * 32 * (4 if dtype == "F32" else 2)
    shard.close()


def test_bf16_conversion_is_exact(tmp_path: Path) -> None:
    a = make_moe_checkpoint(tmp_path / "a", dtype="BF16", seed=3)
    shard = load_shard(str(a))
    g = _f32(shard.weights(0, 0)[0])
    assert np.all((g.view(np.uint32) & 0xFFFF) == 0)  # bf16 values widened, low bits zero
    assert np.isfinite(g).all() and np.abs(g).max() > 0


def test_shard_refuses_dense_layers_and_out_of_range(tmp_path: Path) -> None:
    ck = make_moe_checkpoint(tmp_path / "m", dense_layers=(1,))
    with pytest.raises(ShardError, match="layer 1 is dense"):
        load_shard(f"{ck}@0-2/0-7")
    with pytest.raises(ShardError, match="layer 5 does not exist"):
        load_shard(f"{ck}@5/0")
    with pytest.raises(ShardError, match="expert 8 does not exist"):
        load_shard(f"{ck}@0/0-8")
    assert load_shard(str(ck)).layers == (0, 2)  # the default skips dense layers
    with pytest.raises(ShardError, match="not a checkpoint directory"):
        load_shard(str(tmp_path / "nope"))


def test_missing_or_misshaped_expert_fails_naming_it(tmp_path: Path) -> None:
    ck = make_moe_checkpoint(tmp_path / "m")
    tensors = load_file(str(ck / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.6.up_proj.weight"]
    tensors["model.layers.1.mlp.experts.3.down_proj.weight"] = np.zeros((32, 15), np.float32)
    save_file(tensors, str(ck / "model.safetensors"))
    with pytest.raises(ShardError, match=r"missing expert tensor model\.layers\.2\.mlp\.experts\.6\.up_proj"):
        load_shard(f"{ck}@2/0-7")
    with pytest.raises(ShardError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight has shape"):
        load_shard(f"{ck}@1/0-7")
    assert load_shard(f"{ck}@0/0-7").holds(0, 7)  # the intact layer still loads


def test_fingerprint_tracks_config_and_expert_content(tmp_path: Path) -> None:
    a = make_moe_checkpoint(tmp_path / "a", seed=1)
    b = make_moe_checkpoint(tmp_path / "b", seed=1)
    c = make_moe_checkpoint(tmp_path / "c", seed=2)
    fa = model_fingerprint(a)
    assert len(fa) == 32 and fa == model_fingerprint(b) and fa != model_fingerprint(c)
    assert (a / CACHE_NAME).exists() and model_fingerprint(a) == fa
    # One expert value changed -> different fingerprint (the cache notices the file changed).
    t = load_file(str(b / "model.safetensors"))
    t["model.layers.2.mlp.experts.7.down_proj.weight"][0, 0] += 1e-6
    save_file(t, str(b / "model.safetensors"))
    assert model_fingerprint(b) != fa and compute_fingerprint(b) == model_fingerprint(b)
    # A config change too.
    cfg = json.loads((a / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (a / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(a) != fa
    # A non-expert tensor does not matter (the coordinator keeps those).
    t = load_file(str(c / "model.safetensors"))
    fc = model_fingerprint(c)
    t["model.embed_tokens.weight"][0, 0] += 1.0
    save_file(t, str(c / "model.safetensors"))
    assert model_fingerprint(c) == fc


def _keys(layers: int = 4, experts: int = 64) -> list[tuple[int, int]]:
    return [(la, e) for la in range(layers) for e in range(experts)]


def _w(node: str, cap: float = 1.0, keys: list[tuple[int, int]] | None = None) -> WorkerInfo:
    return WorkerInfo(node, cap, frozenset(keys if keys is not None else _keys()))


def test_hrw_is_deterministic_and_balanced() -> None:
    ws = [_w(f"n{i}") for i in range(3)]
    m1 = build_map(ws, _keys())
    m2 = build_map(list(reversed(ws)), _keys())
    assert dict(m1.ranked) == dict(m2.ranked)
    shares = m1.shares()
    assert sum(shares.values()) == 256 and all(60 <= v <= 110 for v in shares.values()), shares


def test_hrw_join_and_leave_move_only_their_share() -> None:
    keys = _keys()
    before = build_map([_w("a"), _w("b"), _w("c")], keys)
    after = build_map([_w("a"), _w("b"), _w("c"), _w("d")], keys)
    moved = [k for k in keys if before.owner(*k) != after.owner(*k)]
    assert moved and all(after.owner(*k) == "d" for k in moved)
    gone = build_map([_w("a"), _w("c")], keys)
    moved = [k for k in keys if before.owner(*k) != gone.owner(*k)]
    assert moved and all(before.owner(*k) == "b" for k in moved)
    assert before.holders(0, 0)[1:] == tuple(h for h in before.holders(0, 0)[1:])  # ranked fallbacks exist
    assert len(before.holders(0, 0)) == 3


def test_hrw_respects_capacity_and_holdings() -> None:
    keys = _keys(8, 64)
    m = build_map([_w("big", 3.0, keys), _w("small", 1.0, keys)], keys)
    s = m.shares()
    assert 0.65 < s["big"] / len(keys) < 0.85, s
    half = [k for k in keys if k[1] < 32]
    m = build_map([_w("a", 1.0, half), _w("b", 1.0, keys)], keys)
    assert all(m.owner(*k) == "b" for k in keys if k[1] >= 32)
    assert m.missing(keys) == []
    assert build_map([_w("a", 1.0, half)], keys).missing([(0, 40)]) == [(0, 40)]
    assert build_map([_w("z", 0.0, keys)], keys).missing([(0, 0)]) == [(0, 0)]


def test_fused_layout_gives_the_same_weights(tmp_path: Path) -> None:
    per = make_moe_checkpoint(tmp_path / "per", experts=4)
    t = load_file(str(per / "model.safetensors"))
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((per / "config.json").read_text())
    out = {k: v for k, v in t.items() if ".experts." not in k}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = np.stack([np.concatenate([t[f"{p}{e}.gate_proj.weight"], t[f"{p}{e}.up_proj.weight"]])
                                            for e in range(4)])
        out[p + "down_proj"] = np.stack([t[f"{p}{e}.down_proj.weight"] for e in range(4)])
    save_file(out, str(fused_dir / "model.safetensors"))
    a, b = load_shard(str(per)), load_shard(f"{fused_dir}@1/1-2")
    for e in (1, 2):
        for x, y in zip(map(_f32, a.weights(1, e)), map(_f32, b.weights(1, e))):
            assert x.tobytes() == y.tobytes()
    assert len(model_fingerprint(fused_dir)) == 32


def test_fingerprint_cache_falls_back_to_a_state_dir(tmp_path: Path) -> None:
    ck = make_moe_checkpoint(tmp_path / "ro")
    fp = compute_fingerprint(ck)
    (ck / CACHE_NAME).mkdir()  # the cache next to the checkpoint cannot be written (as if read-only)
    state = tmp_path / "state"
    assert model_fingerprint(ck, cache_dir=state) == fp
    cached = list(state.glob("experts-fp-*.json"))
    assert len(cached) == 1 and fp.hex() in cached[0].read_text()
    assert model_fingerprint(ck, cache_dir=state) == fp
