"""GGUF checkpoints and weights kept in their stored type.

Every file is written here: random transformers models exported with ``engine.gguf_export`` (gguf's own
``GGUFWriter``; Q8_0/Q4_0/BF16 quantized by ``gguf.quants``, Q4_K/Q5_K/Q6_K by our quantizer, checked by
round trip against ``gguf.quants.dequantize``). The reference is transformers in fp32 with the GGUF's
weights dequantized by ``gguf.quants`` (not by the engine).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine import quant  # noqa: E402
from engine.checkpoint import CheckpointError  # noqa: E402
from engine.gguf_export import export_gguf, quantize  # noqa: E402
from engine.model import Model  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]
REL_TOL = 1e-4
IDS = [3, 17, 42, 8, 25, 1, 33, 9, 14, 40, 2, 27]


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# --- dequantization: bit for bit gguf.quants ----------------------------------------------------------

@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype: str) -> None:
    w = (_rng(1).standard_normal((6, 512)) * np.linspace(0.01, 3, 512)).astype(np.float32)
    w[0, :40] = 0.0  # an all-zero block
    data = quantize(w, qtype)
    want = np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]), dtype=np.float32)
    got = quant.dequantize(data if qtype in ("F32", "F16") else data.view(np.uint8 if qtype != "BF16"
                                                                          else np.uint16), qtype, (6, 512))
    assert got.view(np.uint32).tobytes() == want.reshape(6, 512).view(np.uint32).tobytes()
    # the tiles a matmul uses are the same bits as the whole
    p = quant.packed(data, qtype, (6, 512))
    if isinstance(p, quant.Packed):
        assert p.rows(2, 5).tobytes() == want.reshape(6, 512)[2:5].tobytes()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_own_k_quantizers_round_trip_through_gguf(qtype: str) -> None:
    """Random blocks (any bits) dequantize identically; our quantizer's output reads back close."""
    bs, ts = quant.BLOCKS[qtype]
    raw = _rng(2).integers(0, 256, (64, ts), dtype=np.uint8)
    raw[:, :4] = np.frombuffer(np.float16([0.01, 0.02]).tobytes(), np.uint8)  # sane d/dmin (K4/K5)
    want = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]), dtype=np.float32)
    assert quant.dequantize_blocks(raw, qtype).tobytes() == want.tobytes()
    x = _rng(3).standard_normal((16, 1024)).astype(np.float32)
    back = np.asarray(gguf.quants.dequantize(quantize(x, qtype), gguf.GGMLQuantizationType[qtype]))
    rel = np.sqrt(((back - x) ** 2).mean() / (x**2).mean())
    assert rel < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[qtype], rel


def test_tiled_matmul_matches_the_widened_product() -> None:
    w = _rng(4).standard_normal((700, 512)).astype(np.float32)  # 700 rows: several tiles, a partial last
    x = _rng(5).standard_normal((3, 512)).astype(np.float32)
    for qtype in ("BF16", "Q8_0", "Q6_K"):
        p = quant.packed(quantize(w, qtype), qtype, (700, 512))
        assert isinstance(p, quant.Packed)
        np.testing.assert_allclose(x @ p.T, x @ p.widen().T, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(x[:1] @ p.T, x[:1] @ p.widen().T, rtol=1e-5, atol=1e-4)


# --- models: logits against transformers on the dequantized weights ------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from gguf_helpers import QWEN3_MOE, build, reference_dir  # noqa: E402

torch.set_num_threads(2)


def _reference_logits(ref: Path, ids: list[int]) -> np.ndarray:
    m = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy()


def _greedy(model: Model, ids: list[int], steps: int = 6) -> list[int]:
    cache = model.new_cache()
    logits = model.forward(ids, cache)[-1]
    out = []
    for _ in range(steps):
        t = int(logits.argmax())
        out.append(t)
        logits = model.forward([t], cache)[-1]
    return out


def _ref_greedy(ref: Path, ids: list[int], steps: int = 6) -> list[int]:
    m = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def _parity(src: Path, tmp: Path, mix: str) -> Model:
    g = tmp / f"m-{mix}.gguf"
    export_gguf(src, g, mix)
    ref = reference_dir(src, g, tmp / f"ref-{mix}")
    model = Model.load(g)
    want = _reference_logits(ref, IDS)
    got = model.forward(IDS, model.new_cache())
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= REL_TOL, f"{mix}: relative logit error {err}"
    assert _greedy(model, IDS) == _ref_greedy(ref, IDS)
    return model


@pytest.fixture(scope="module")
def qwen3_moe_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("q3moe") / "src"
    build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", src, **QWEN3_MOE)
    return src


@pytest.mark.ref
@pytest.mark.parametrize("mix", [*TYPES, "Q4_K_M"])
def test_qwen3_moe_gguf_matches_transformers(qwen3_moe_src: Path, tmp_path: Path, mix: str) -> None:
    model = _parity(qwen3_moe_src, tmp_path, mix)
    q = model.layers[0].q
    if mix == "F32":
        assert isinstance(q, np.ndarray)
    else:  # kept as stored: no fp32 copy of any matrix
        assert isinstance(q, quant.Packed) and q.qtype == ("Q4_K" if mix == "Q4_K_M" else mix)
        assert isinstance(model.layers[0].experts[0][2], quant.Packed)


FAMILIES = {
    # name: (config class, model class, kwargs, type mix)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False), "Q8_0"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True), "Q4_K_M"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256), "Q6_K"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256), "Q5_K"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=300, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256), "Q4_0"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256), "Q8_0"),
}


@pytest.mark.ref
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_architecture_matches_transformers(tmp_path: Path, family: str) -> None:
    cls_cfg, cls_model, kw, mix = FAMILIES[family]
    build(cls_cfg, cls_model, tmp_path / "src", seed=7, **kw)
    _parity(tmp_path / "src", tmp_path, mix)


@pytest.mark.ref
def test_bf16_safetensors_stay_bf16_and_match_transformers(tmp_path: Path) -> None:
    build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", tmp_path / "bf16", dtype="bfloat16", **QWEN3_MOE)
    model = Model.load(tmp_path / "bf16")
    assert isinstance(model.layers[0].q, quant.Packed) and model.layers[0].q.data.dtype == np.uint16
    assert isinstance(model.layers[1].experts[3][0], quant.Packed) and isinstance(model.lm_head, quant.Packed)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0].numpy()
    got = model.forward(IDS, model.new_cache())
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= REL_TOL
    assert _greedy(model, IDS) == _ref_greedy(tmp_path / "bf16", IDS)


def test_split_gguf_loads_as_one(qwen3_moe_src: Path, tmp_path: Path) -> None:
    whole = tmp_path / "m.gguf"
    export_gguf(qwen3_moe_src, whole, "Q8_0")
    # split: the metadata in the first file, tensors spread over three
    r = gguf.GGUFReader(str(whole))
    tensors = list(r.tensors)
    parts = [tensors[:5], tensors[5:12], tensors[12:]]
    for n, chunk in enumerate(parts, 1):
        w = gguf.GGUFWriter(str(tmp_path / f"s-{n:05d}-of-00003.gguf"), "qwen3moe")
        if n == 1:
            for key, field in r.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                w.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
        w.add_uint16("split.no", n - 1)
        w.add_uint16("split.count", 3)
        for t in chunk:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    a = Model.load(whole)
    b = Model.load(tmp_path / "s-00001-of-00003.gguf")
    assert a.forward(IDS, a.new_cache()).tobytes() == b.forward(IDS, b.new_cache()).tobytes()
    with pytest.raises(CheckpointError, match="part 2 of a split GGUF"):
        Model.load(tmp_path / "s-00002-of-00003.gguf")
    (tmp_path / "s-00003-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match="s-00003-of-00003.gguf: missing part"):
        Model.load(tmp_path / "s-00001-of-00003.gguf")


# --- bad files: one line naming the tensor or type ---------------------------------------------------------

@pytest.fixture(scope="module")
def good_gguf(qwen3_moe_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = tmp_path_factory.mktemp("good") / "m.gguf"
    export_gguf(qwen3_moe_src, g, "Q8_0")
    return g


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_truncated_gguf_names_the_tensor(good_gguf: Path, tmp_path: Path) -> None:
    data = good_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError) as e:
        Model.load(bad)
    last = gguf.GGUFReader(str(good_gguf)).tensors[-1].name
    assert f"truncated: tensor {last!r}" in _one_line(e)


def test_corrupt_gguf_is_refused(good_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError) as e:
        Model.load(bad)
    assert "junk.gguf: not a readable GGUF file" in _one_line(e)
    bad.write_bytes(b"NOPE" + good_gguf.read_bytes()[4:])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        Model.load(bad)


def _tiny_gguf(path: Path, arch: str, qtype: gguf.GGMLQuantizationType, raw: np.ndarray) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_type_and_architecture_are_named(good_gguf: Path, tmp_path: Path) -> None:
    # an IQ2_XS tensor (a type we do not compute with) in an otherwise good file
    r = gguf.GGUFReader(str(good_gguf))
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "qwen3moe")
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name == "blk.1.attn_v.weight":
            n, k = (int(v) for v in reversed(t.shape.tolist()))
            raw = np.zeros((n, k // 256 * 74), np.uint8)
            w.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.IQ2_XS)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError) as e:
        Model.load(tmp_path / "iq.gguf")
    msg = _one_line(e)
    assert "'blk.1.attn_v.weight' has type IQ2_XS" in msg and "not supported" in msg
    _tiny_gguf(tmp_path / "gemma.gguf", "gemma2", gguf.GGMLQuantizationType.F32, np.zeros((4, 4), np.float32))
    with pytest.raises(CheckpointError) as e:
        Model.load(tmp_path / "gemma.gguf")
    assert "GGUF architecture 'gemma2' is not supported" in _one_line(e)


def test_cli_reports_a_bad_gguf_in_one_line(good_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good_gguf.read_bytes()[:-1000])
    p = subprocess.run([sys.executable, "-m", "meshd", "generate", "--model", str(bad), "--state-dir",
                        str(tmp_path / "st"), "--prompt", "hello"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "truncated: tensor" in lines[0], p.stderr


@pytest.mark.skipif(not __import__("engine.kernels").kernels.AVAILABLE, reason="numba (the fast extra) not installed")
@pytest.mark.parametrize("qtype", ["BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_compiled_kernels_match_the_numpy_tiles(qtype: str) -> None:
    from engine import kernels

    w = _rng(8).standard_normal((300, 512)).astype(np.float32)
    x = _rng(9).standard_normal((2, 512)).astype(np.float32)
    p = quant.packed(quantize(w, qtype), qtype, (300, 512))
    got = kernels.gemm(x, qtype, p.data)
    np.testing.assert_allclose(got, x @ p.widen().T, rtol=1e-5, atol=1e-4)


_RSS_PROBE = r"""
import sys
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from engine.model import Model
from engine import dense, kernels
import numpy as np
kernels.warm()  # the runtime (numba, if installed) is paid before the baseline: a fixed cost, not the weights'
dense.warm_step()  # likewise the compiled decode step's kernels (engine.dense_kernels)
before = status('VmRSS:')
m = Model.load(sys.argv[1], prefetch=False)
c = m.new_cache(16)
tok = int(m.forward([1, 2, 3, 4], c)[-1].argmax())
for _ in range(4):
    tok = int(m.forward([tok], c)[-1].argmax())
print(status('VmHWM:') - before)
"""


@pytest.mark.parametrize("mix", ["Q8_0", "BF16"])
def test_resident_memory_stays_near_the_file_size(tmp_path: Path, mix: str) -> None:
    """Weights stay as stored: a run's peak RSS grows by at most 1.15x the file (plus 8 MiB of activations,
    KV cache and allocator slack), where widening to fp32 would take 3.8x (Q8_0) or 2x (bf16)."""
    from experts_util import make_moe_checkpoint

    src = make_moe_checkpoint(tmp_path / "src", family="qwen3_moe", layers=4, experts=8, hidden=512, inter=512,
                              top_k=2, vocab=256)
    g = tmp_path / "m.gguf"
    export_gguf(src, g, mix)
    size = g.stat().st_size
    p = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(g)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    grown = int(p.stdout.strip().splitlines()[-1])
    assert grown <= 1.15 * size + (8 << 20), f"peak RSS grew {grown / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"


def test_expert_fingerprint_covers_the_quantization_type(qwen3_moe_src: Path, tmp_path: Path) -> None:
    from engine.experts.fingerprint import compute_fingerprint, model_fingerprint
    from engine.experts.shard import load_shard

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    export_gguf(qwen3_moe_src, a, "Q8_0")
    export_gguf(qwen3_moe_src, b, "Q6_K")
    fa = model_fingerprint(a, cache_dir=tmp_path / "cache")
    assert fa == compute_fingerprint(a) == model_fingerprint(a, cache_dir=tmp_path / "cache")
    assert fa != compute_fingerprint(b)
    shard = load_shard(f"{b}@1/0-1")  # a worker holds the blocks as stored
    g, _, d = shard.weights(1, 1)
    assert isinstance(g, quant.Packed) and g.qtype == "Q6_K" and d.shape == (256, 256)
    shard.close()
