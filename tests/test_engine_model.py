"""Engine model tests that need no torch: ops against naive loops, the safetensors reader, config
normalisation, error messages, zero-copy loading, determinism, caches, executors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from engine import families
from engine.checkpoint import CheckpointError, load_checkpoint, to_f32
from engine.quant import Packed
from engine.config import SUPPORTED_MODEL_TYPES, ConfigError, ModelConfig
from engine.model import Model
from engine.moe import ForwardSteps, drive, local_executor
from engine.ops import RopeTable, apply_rope, attention, naive_attention, rmsnorm

RNG = np.random.default_rng(0)


# ----- helpers ----------------------------------------------------------------------------------------
def bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 storage bits (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]], truncate: int = 0) -> None:
    """Minimal safetensors writer: {key: (dtype name, array in storage dtype)}."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for key, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[key] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    data = struct.pack("<Q", len(h)) + h + b"".join(blobs)
    path.write_bytes(data[: len(data) - truncate] if truncate else data)


TINY = {
    "model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
    "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "mlp_only_layers": [1], "rope_theta": 1000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def tiny_tensors(raw: dict) -> dict[str, np.ndarray]:
    cfg = ModelConfig.from_hf(raw)
    specs = dict(families.global_tensors(cfg).values())
    for i in range(cfg.num_layers):
        specs.update(families.attention_tensors(cfg, i).values())
        if cfg.is_sparse(i):
            specs.update([families.router_tensor(cfg, i)])
            for e in range(cfg.num_experts):
                specs.update(families.expert_tensors(cfg, i, e).values())
            specs.update(families.shared_expert_tensors(cfg, i).values())
        else:
            specs.update(families.dense_mlp_tensors(cfg, i).values())
    out = {}
    for key, shape in specs.items():
        scale = 0.2 if len(shape) == 1 else 1.0 / np.sqrt(shape[-1])
        base = 1.0 if key.endswith("norm.weight") else 0.0
        out[key] = (base + scale * RNG.standard_normal(shape)).astype(np.float32)
    return out


def make_ckpt(path: Path, raw: dict | None = None, dtype: str = "F32",
              tensors: dict[str, np.ndarray] | None = None, truncate: int = 0) -> dict[str, np.ndarray]:
    raw = dict(TINY if raw is None else raw)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    ts = tiny_tensors(raw) if tensors is None else tensors
    conv = {"F32": lambda a: a, "F16": lambda a: a.astype(np.float16), "BF16": bf16_bits}[dtype]
    write_safetensors(path / "model.safetensors", {k: (dtype, conv(v)) for k, v in ts.items()}, truncate)
    return ts


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    make_ckpt(tmp_path / "m")
    return tmp_path / "m"


# ----- ops against naive loops ------------------------------------------------------------------------
def test_rmsnorm_matches_loop() -> None:
    x = RNG.standard_normal((5, 3, 16)).astype(np.float32)
    w = RNG.standard_normal(16).astype(np.float32)
    got = rmsnorm(x, w, 1e-5)
    for idx in np.ndindex(5, 3):
        row = x[idx].astype(np.float64)
        ref = row / np.sqrt(sum(v * v for v in row) / 16 + 1e-5) * w
        np.testing.assert_allclose(got[idx], ref, rtol=1e-5, atol=1e-6)


def test_rope_matches_pairwise_rotation() -> None:
    from engine.config import RopeConfig

    hd = 8
    table = RopeTable(RopeConfig(theta=500.0), hd, capacity=2)  # grows past its capacity below
    x = RNG.standard_normal((4, 3, hd)).astype(np.float32)
    cos, sin = table.span(5, 9)
    got = apply_rope(x, cos, sin)
    for t in range(4):
        for h in range(3):
            for i in range(hd // 2):
                ang = (5 + t) / 500.0 ** (2 * i / hd)
                a, b = x[t, h, i], x[t, h, i + hd // 2]
                assert got[t, h, i] == pytest.approx(a * np.cos(ang) - b * np.sin(ang), abs=2e-5)
                assert got[t, h, i + hd // 2] == pytest.approx(b * np.cos(ang) + a * np.sin(ang), abs=2e-5)
    c2, s2 = table.gather(np.array([8, 5]))
    np.testing.assert_array_equal(c2, cos[[3, 0]])
    np.testing.assert_array_equal(s2, sin[[3, 0]])


@pytest.mark.parametrize("heads,kv,t,past,window", [
    (4, 4, 5, 0, None),  # multi-head
    (6, 2, 4, 3, None),  # grouped-query
    (4, 1, 1, 6, None),  # multi-query, one decode step
    (4, 2, 6, 2, 3),  # sliding window
])
def test_attention_matches_loop(heads: int, kv: int, t: int, past: int, window: int | None) -> None:
    hd = 8
    q = RNG.standard_normal((t, heads, hd)).astype(np.float32)
    k = RNG.standard_normal((kv, past + t, hd)).astype(np.float32)
    v = RNG.standard_normal((kv, past + t, hd)).astype(np.float32)
    got = attention(q, k, v, past, hd**-0.5, window)
    np.testing.assert_allclose(got, naive_attention(q, k, v, past, hd**-0.5, window), rtol=1e-5, atol=1e-5)


def test_attention_query_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than one query block gives the same result as one block (bounded score memory)."""
    from engine import ops

    hd, t, past = 8, 11, 4
    q = RNG.standard_normal((t, 6, hd)).astype(np.float32)
    k = RNG.standard_normal((2, past + t, hd)).astype(np.float32)
    v = RNG.standard_normal((2, past + t, hd)).astype(np.float32)
    for window in (6, None):  # a sliding window masks every block in full; causal only the new keys' columns
        monkeypatch.setattr(ops, "ATTENTION_QUERY_BLOCK", 256)
        whole = attention(q, k, v, past, hd**-0.5, window)
        naive = naive_attention(q, k, v, past, hd**-0.5, window)
        np.testing.assert_allclose(whole, naive, rtol=1e-5, atol=1e-5)
        for block in (3, 1):
            monkeypatch.setattr(ops, "ATTENTION_QUERY_BLOCK", block)
            got = attention(q, k, v, past, hd**-0.5, window)
            np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)


def test_one_token_ids_checked_like_any(tiny: Path) -> None:
    """A decode step's id (a one-element list or int64 array: checked without numpy's reductions) is refused
    out of range or of a non-integer type with the same one-line errors, and a good one decodes the same."""
    m = Model.load(tiny)
    for bad, msg in (([40], "out of range"), ([-1], "out of range"), (np.array([40]), "out of range"),
                     (np.array([-3]), "out of range"), ([True], "integers"), ([2.0], "integers"),
                     (np.array([2.0]), "integers"), ([], "integers")):
        with pytest.raises(ValueError, match=msg):
            m.forward(bad, m.new_cache())
    outs = []
    for ids in ([3], np.array([3]), np.array([3], dtype=np.int32), (3,)):
        cache = m.new_cache()
        m.forward([1, 2], cache)
        outs.append(m.forward(ids, cache))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


# ----- checkpoint reader ------------------------------------------------------------------------------
def test_reader_dtypes_and_zero_copy(tmp_path: Path) -> None:
    a = RNG.standard_normal((3, 5)).astype(np.float32)
    f = tmp_path / "x.safetensors"
    write_safetensors(f, {"a": ("F32", a), "h": ("F16", a.astype(np.float16)), "b": ("BF16", bf16_bits(a))})
    ck = load_checkpoint(f)
    np.testing.assert_array_equal(to_f32(ck["a"].data, "F32"), a)
    np.testing.assert_array_equal(to_f32(ck["h"].data, "F16"), a.astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(to_f32(ck["b"].data, "BF16"), a, rtol=2**-8)
    assert ck["b"].data.dtype == np.uint16
    data = ck["a"].data
    assert not data.flags.owndata and not data.flags.writeable  # a view over the read-only mapping
    assert to_f32(data, "F32") is data


def test_reader_reads_safetensors_library_output(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    a = RNG.standard_normal((4, 2)).astype(np.float32)
    save_file({"w": a, "h": a.astype(np.float16)}, tmp_path / "s.safetensors")
    ck = load_checkpoint(tmp_path / "s.safetensors")
    np.testing.assert_array_equal(ck["w"].data, a)
    assert ck["h"].dtype == "F16" and ck["h"].shape == (4, 2)


def test_truncated_file_names_file_and_key(tmp_path: Path) -> None:
    make_ckpt(tmp_path / "m", truncate=7)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '[^']+': truncated file"):
        load_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "m")


def test_garbage_header(tmp_path: Path) -> None:
    f = tmp_path / "g.safetensors"
    f.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(CheckpointError, match="g.safetensors: malformed safetensors header"):
        load_checkpoint(f)
    f.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        load_checkpoint(f)
    h = json.dumps({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + bytes(8))
    with pytest.raises(CheckpointError, match="tensor 'x': unsupported dtype 'I64'"):
        load_checkpoint(f)
    h = json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + bytes(8))
    with pytest.raises(CheckpointError, match="tensor 'x': data_offsets"):
        load_checkpoint(f)


def test_missing_tensor_names_key(tmp_path: Path) -> None:
    ts = tiny_tensors(TINY)
    del ts["model.layers.2.mlp.experts.3.up_proj.weight"]
    make_ckpt(tmp_path / "m", tensors=ts)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.3\.up_proj"):
        Model.load(tmp_path / "m")


def test_bad_shape_names_file_and_key(tmp_path: Path) -> None:
    ts = tiny_tensors(TINY)
    ts["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 16), dtype=np.float32)
    make_ckpt(tmp_path / "m", tensors=ts)
    with pytest.raises(CheckpointError) as err:
        Model.load(tmp_path / "m")
    msg = str(err.value)
    assert "model.safetensors" in msg and "'model.layers.0.self_attn.k_proj.weight'" in msg
    assert "[8, 16]" in msg and "[16, 16]" in msg


def test_unexpected_tensor_is_refused(tmp_path: Path) -> None:
    ts = tiny_tensors(TINY)
    ts["model.layers.0.mlp.experts.9.up_proj.weight"] = np.zeros((8, 16), dtype=np.float32)
    make_ckpt(tmp_path / "m", tensors=ts)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.9"
                       r"\.up_proj\.weight' is not used"):
        Model.load(tmp_path / "m")


def test_unsupported_model_type_lists_supported(tmp_path: Path) -> None:
    make_ckpt(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        Model.load(tmp_path / "m")
    msg = str(err.value)
    assert "config.json" in msg and "'gpt2'" in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "e").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(tmp_path / "e")
    with pytest.raises(ConfigError, match="config.json: not found"):
        Model.load(tmp_path / "e")


def test_sharded_index_checks(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    a = np.ones((2, 2), dtype=np.float32)
    write_safetensors(d / "model-00001-of-00002.safetensors", {"a": ("F32", a)})
    write_safetensors(d / "model-00002-of-00002.safetensors", {"b": ("F32", 2 * a)})
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = load_checkpoint(d)
    assert sorted(ck) == ["a", "b"] and ck["b"].data[0, 0] == 2.0 and len(ck.files) == 2
    index["weight_map"]["c"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: tensor 'c' listed in"):
        load_checkpoint(d)
    del index["weight_map"]["c"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    write_safetensors(d / "model-00002-of-00002.safetensors", {"b": ("F32", a), "d": ("F32", a)})
    with pytest.raises(CheckpointError, match=r"00002\.safetensors: tensor 'd' is not listed"):
        load_checkpoint(d)
    index["weight_map"]["b"] = "model-00003-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"00003-of-00002\.safetensors: file not found"):
        load_checkpoint(d)


# ----- config -----------------------------------------------------------------------------------------
def test_config_hub_and_transformers5_spellings_agree() -> None:
    hub = dict(TINY)
    v5 = {k: v for k, v in TINY.items() if k not in ("num_experts", "rope_theta")}
    v5["num_local_experts"] = 4
    v5["rope_parameters"] = {"rope_theta": 1000.0, "rope_type": "default"}
    assert ModelConfig.from_hf(hub) == ModelConfig.from_hf(v5)
    c = ModelConfig.from_hf(hub)
    assert (c.num_experts, c.rope.theta, c.head_dim, c.qk_norm) == (4, 1000.0, 8, "head")
    assert [c.is_sparse(i) for i in range(3)] == [True, False, True]


def test_config_fields() -> None:
    c = ModelConfig.from_hf({**TINY, "head_dim": None, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert c.head_dim == 4 and [c.is_sparse(i) for i in range(3)] == [False, True, False]
    mix = ModelConfig.from_hf({**TINY, "model_type": "mixtral", "num_experts": None, "num_local_experts": 4,
                               "intermediate_size": 8, "norm_topk_prob": False})
    assert mix.norm_topk_prob and mix.moe_intermediate_size == 8 and mix.rope.theta == 1000.0
    ol = ModelConfig.from_hf({**TINY, "model_type": "olmoe", "head_dim": 2, "intermediate_size": 8})
    assert ol.qk_norm == "full" and ol.head_dim == 4  # OLMoE derives head_dim
    q2 = ModelConfig.from_hf({**TINY, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 12})
    assert q2.qkv_bias and not q2.o_bias and q2.qk_norm == "none"
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ll = ModelConfig.from_hf({**TINY, "model_type": "llama", "rope_scaling": scaling})
    assert ll.rope.type == "llama3" and not ll.is_moe


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "exceeds num_experts"),
    ({"vocab_size": "many"}, "vocab_size must be an integer"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"mlp_only_layers": "all"}, "mlp_only_layers"),
])
def test_config_errors(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**TINY, **change})


# ----- model behaviour --------------------------------------------------------------------------------
def test_weights_are_views_of_the_mapping(tiny: Path) -> None:
    m = Model.load(tiny)
    ck = m.checkpoint
    assert np.shares_memory(m.layers[0].q, ck["model.layers.0.self_attn.q_proj.weight"].data)
    gate, up, down = m.expert_weights(2, 3)
    assert np.shares_memory(down, ck["model.layers.2.mlp.experts.3.down_proj.weight"].data)
    assert np.shares_memory(m.lm_head, ck["lm_head.weight"].data)


def test_progress_reports_every_byte(tiny: Path) -> None:
    calls: list[tuple[int, int]] = []
    m = Model.load(tiny, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (m.checkpoint.nbytes, m.checkpoint.nbytes)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))


def test_deterministic_bytes(tiny: Path) -> None:
    ids = [1, 5, 7, 3, 9, 22, 39, 0]
    outs = []
    for _ in range(2):
        m = Model.load(tiny)
        c = m.new_cache()
        outs.append(np.concatenate([m.forward(ids, c), m.forward([4], c)]).tobytes())
    assert outs[0] == outs[1]


def test_warm_covers_a_layers_attention_weights_up_to_its_budget(tiny: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``Model.warm`` (run while a layer's experts are out on the network) reads the next layer's attention
    weights in the order the pass uses them, stops at its budget, and changes no result."""
    import engine.model as model_mod

    m = Model.load(tiny)
    ids = [1, 5, 7]
    before = m.forward(ids, m.new_cache()).tobytes()
    lay = m.layers[1]
    used = [a for a in (lay.attn_norm, lay.q, lay.k, lay.v, lay.o, lay.mlp_norm, lay.router) if a is not None]
    assert m.warm(1) == sum(a.nbytes for a in used) > 0
    assert m.warm(len(m.layers)) == 0 and m.warm(-1) == 0  # past the last layer: nothing
    monkeypatch.setattr(model_mod, "WARM_MAX_BYTES", lay.attn_norm.nbytes + 64)
    assert m.warm(1) == lay.attn_norm.nbytes + 64  # the norm, then q's first 64 bytes
    assert m.forward(ids, m.new_cache()).tobytes() == before


def test_forward_passes_give_an_executor_with_drive_the_models_warm(tiny: Path) -> None:
    """An executor that runs passes itself (the remote one) gets ``Model.warm`` with each pass."""
    m = Model.load(tiny)
    got: list[object] = []

    class Driving:
        def __call__(self, layer: int, x: np.ndarray, work: list) -> list[np.ndarray]:
            return m.local_executor(layer, x, work)

        def drive(self, steps: ForwardSteps, warm: object = None) -> np.ndarray:
            got.append(warm)
            return drive(steps, m.local_executor)

    ex = Driving()
    ref = m.forward([1, 5], m.new_cache())
    assert m.forward([1, 5], m.new_cache(), executor=ex).tobytes() == ref.tobytes()
    caches = [m.new_cache(), m.new_cache()]
    for c in caches:
        m.forward([3], c)
    m.forward_batch([4, 6], caches, executor=ex)
    assert got == [m.warm, m.warm]


def test_chunked_prefill_and_batch_match_single(tiny: Path) -> None:
    m = Model.load(tiny)
    ids = [1, 5, 7, 3, 9, 22, 39, 0, 12]
    whole = m.forward(ids, m.new_cache())
    c = m.new_cache(capacity=2)
    parts = np.concatenate([m.forward(ids[:4], c), m.forward(ids[4:7], c), m.forward(ids[7:8], c),
                            m.forward(ids[8:], c)])
    np.testing.assert_allclose(parts, whole, rtol=1e-4, atol=1e-5)
    caches = [m.new_cache() for _ in range(3)]
    for c, n in zip(caches, (2, 5, 8)):
        m.forward(ids[:n], c)
    batch = m.forward_batch([ids[2], ids[5], ids[8]], caches)
    np.testing.assert_allclose(batch, whole[[2, 5, 8]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_storage_matches_rounded_fp32(tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ts = make_ckpt(tmp_path / "h", dtype=dtype)
    rounded = {
        k: (v.astype(np.float16).astype(np.float32) if dtype == "F16"
            else to_f32(bf16_bits(v), "BF16")) for k, v in ts.items()
    }
    make_ckpt(tmp_path / "f", tensors=rounded)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a = Model.load(tmp_path / "h").forward(ids, Model.load(tmp_path / "h").new_cache())
    b = Model.load(tmp_path / "f").forward(ids, Model.load(tmp_path / "f").new_cache())
    # Same fp32 values; only BLAS blocking over differently aligned buffers may differ.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Experts widened at load or on every use: the same bytes.
    lazy = Model.load(tmp_path / "h", widen_experts=False)
    eager = Model.load(tmp_path / "h", widen_experts=True)
    # kept in the stored type unless widened at load
    assert isinstance(lazy.layers[0].experts[0][0], Packed) and isinstance(eager.layers[0].experts[0][0], np.ndarray)
    assert isinstance(lazy.layers[0].q, Packed) and lazy.layers[0].q.data.dtype == np.uint16 if dtype == "BF16" \
        else isinstance(lazy.layers[0].q, Packed)
    want = eager.forward(ids, eager.new_cache())
    # with the compiled kernels (decode-sized expert products over bf16): the same values within rounding
    np.testing.assert_allclose(lazy.forward(ids, lazy.new_cache()), want, rtol=1e-5, atol=1e-5)
    # on the numpy tiles (what a process without the kernels runs): the same bytes
    from engine import quant

    monkeypatch.setattr(quant, "KERNEL_TYPES", ())
    assert lazy.forward(ids, lazy.new_cache()).tobytes() == want.tobytes()


def test_executor_seam(tiny: Path) -> None:
    m = Model.load(tiny)
    ids = [1, 2, 3, 4, 5]
    calls: list[tuple[int, list[int]]] = []
    base = local_executor(m.expert_weights)

    def spy(layer, x, work):
        calls.append((layer, [e for e, _ in work]))
        return base(layer, x, work)

    ref = m.forward(ids, m.new_cache())
    got = m.forward(ids, m.new_cache(), executor=spy)
    assert got.tobytes() == ref.tobytes()
    assert sorted({layer for layer, _ in calls}) == m.sparse_layers == [0, 2]

    def broken(layer, x, work):
        return base(layer, x, work)[:-1]

    def misshaped(layer, x, work):
        return [y[:, :-1] for y in base(layer, x, work)]

    with pytest.raises(RuntimeError, match=r"expert executor returned float32\[\d+, 15\] for layer 0"):
        m.forward([1, 2], m.new_cache(), executor=misshaped)

    c = m.new_cache()
    m.forward([1, 2], c)
    with pytest.raises(RuntimeError, match="expert executor returned"):
        m.forward([3, 4], c, executor=broken)
    assert c.length == 2  # a failed step does not advance the cache
    # ... nor leave anything in it: the next step equals the same step on a cache that never failed (same
    # shapes on both sides: one token against the last row of a 3-token prefill differs in the last bits
    # on CPUs whose BLAS takes another kernel for one row, e.g. OpenBLAS on AVX-512)
    clean = m.new_cache()
    m.forward([1, 2], clean)
    assert m.forward([3], c).tobytes() == m.forward([3], clean).tobytes()


def test_bad_ids(tiny: Path) -> None:
    m = Model.load(tiny)
    for bad in ([], [40], [-1], [[1, 2]], [1.5]):
        with pytest.raises(ValueError):
            m.forward(bad, m.new_cache())
    with pytest.raises(ValueError, match="caches"):
        m.forward_batch([1, 2], [m.new_cache()])
    c = m.new_cache()
    with pytest.raises(ValueError, match="own cache"):
        m.forward_batch([1, 2], [c, c])


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_fused_expert_layout_matches_per_expert(tmp_path: Path, dtype: str) -> None:
    ts = make_ckpt(tmp_path / "per", dtype=dtype)
    fused = {k: v for k, v in ts.items() if ".mlp.experts." not in k}
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [np.concatenate([ts[f"{p}.{e}.gate_proj.weight"], ts[f"{p}.{e}.up_proj.weight"]])
                   for e in range(4)]
        fused[f"{p}.gate_up_proj"] = np.stack(gate_up)
        fused[f"{p}.down_proj"] = np.stack([ts[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    make_ckpt(tmp_path / "fused", dtype=dtype, tensors=fused)
    ids = [2, 7, 1, 8, 2, 8]
    per = Model.load(tmp_path / "per")
    want = per.forward(ids, per.new_cache())
    for widen in (False, True):
        m = Model.load(tmp_path / "fused", widen_experts=widen)
        np.testing.assert_allclose(m.forward(ids, m.new_cache()), want, rtol=1e-5, atol=1e-5)
        g, u, d = (_f32(w) for w in m.expert_weights(2, 3))
        np.testing.assert_array_equal(g, _f32(per.expert_weights(2, 3)[0]))
        np.testing.assert_array_equal(d, _f32(per.expert_weights(2, 3)[2]))


def _f32(w: object) -> np.ndarray:
    return w.widen() if isinstance(w, Packed) else w  # type: ignore[return-value]


def test_last_only(tiny: Path) -> None:
    m = Model.load(tiny)
    c1, c2 = m.new_cache(), m.new_cache()
    full = m.forward([4, 8, 15, 16], c1)
    last = m.forward([4, 8, 15, 16], c2, last_only=True)
    assert last.shape == (1, 40) and c2.length == 4
    np.testing.assert_allclose(last[0], full[-1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_moe_block_matches_per_token_loop(norm: bool) -> None:
    from engine.moe import expert_ffn, moe_block

    t, d, i, e, k = 6, 8, 5, 5, 2
    x = RNG.standard_normal((t, d)).astype(np.float32)
    logits = RNG.standard_normal((t, e)).astype(np.float32)
    w = [tuple(RNG.standard_normal(s).astype(np.float32) for s in ((i, d), (i, d), (d, i))) for _ in range(e)]
    got = moe_block(x, logits, k, norm, local_executor(lambda layer, ex: w[ex]), 0)
    for row in range(t):
        p = np.exp(logits[row] - logits[row].max())
        p /= p.sum()
        top = sorted(range(e), key=lambda j: -p[j])[:k]
        wt = p[top] / (p[top].sum() if norm else 1.0)
        ref = sum(wt[j] * expert_ffn(x[row : row + 1], *w[top[j]])[0] for j in range(k))
        np.testing.assert_allclose(got[row], ref, rtol=1e-5, atol=1e-5)


def test_combine_fast_path_is_byte_identical() -> None:
    import dataclasses

    from engine.moe import combine, route

    for t, e, k in ((1, 16, 4), (9, 6, 2), (40, 8, 3)):
        r = route(RNG.standard_normal((t, e)).astype(np.float32), k, True)
        assert r.positions is not None
        outs = [RNG.standard_normal((len(rows), 7)).astype(np.float32) for _, rows in r.work]
        slow = combine(dataclasses.replace(r, positions=None), outs, t, 7)
        assert combine(r, outs, t, 7).tobytes() == slow.tobytes()


def test_a_slow_kernel_load_is_said_once_and_a_fast_one_not_at_all():
    """A starting daemon must not sit silent while the first load compiles the kernels (minutes on a small
    machine): past the threshold one line says so, and the end says how long it took; a quick load says
    nothing."""
    import time

    from structlog.testing import capture_logs

    from engine.model import _said_if_slow

    with capture_logs() as logs:
        with _said_if_slow("ck", after_s=0.05):
            time.sleep(0.3)
        with _said_if_slow("fast", after_s=5.0):
            pass
    events = [(e["event"], e["path"]) for e in logs]
    assert events == [("kernels_compiling", "ck"), ("kernels_ready", "ck")], events
    assert "compiles" in logs[0]["hint"] and logs[1]["seconds"] >= 0.25
