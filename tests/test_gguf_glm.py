"""GGUF architectures ``glm4moe`` and ``deepseek2`` (issue 17), as llama.cpp's convert_hf_to_gguf writes
them: random transformers models (groups > 1, a correction bias of the scores' scale, dense first layer,
shared experts, q/k/v bias and qk-norm, partial rotary; latent attention with and without q LoRA, YaRN)
exported with ``engine.gguf_export`` (kv_b split into attn_k_b/attn_v_b as converters write it since
2025, or whole as attn_kv_b as older files have it), in F32, Q8_0 and Q4_K_M.

The reference is transformers in fp32 on the GGUF's weights dequantized by ``gguf.quants`` and mapped back
to Hugging Face names by this file's own table (not the engine's): logits within 1e-4 relative, the same
greedy tokens.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine import quant  # noqa: E402
from engine.checkpoint import CheckpointError  # noqa: E402
from engine.config import ConfigError  # noqa: E402
from engine.gguf_deepseek import hf_config  # noqa: E402
from engine.gguf_export import export_gguf  # noqa: E402
from engine.mla import MlaModel  # noqa: E402
from engine.model import Model  # noqa: E402

torch.set_num_threads(2)
REL_TOL = 1e-4
IDS = [3, 17, 42, 8, 25, 1, 33, 9, 14, 40, 2, 27, 5, 60, 11, 7, 19, 30]  # 18: past YaRN's original 16

GLM = dict(vocab_size=128, hidden_size=256, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
           n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
           max_position_embeddings=256, norm_topk_prob=True)
DSV3 = dict(vocab_size=128, hidden_size=256, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, routed_scaling_factor=2.5, max_position_embeddings=256,
            norm_topk_prob=True)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}


def _build(cls_cfg: str, cls_model: str, path: Path, seed: int, **kw: object) -> None:
    cfg = getattr(transformers, cls_cfg)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_model)(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):  # of the sigmoid scores' scale, so it moves choices
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dtype.is_floating_point and not name.endswith("inv_freq"):
                fan_in = p.shape[-1] if p.dim() > 1 else 4
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in**0.5))
    model.save_pretrained(path)


# --- the reference: GGUF -> dequantized fp32 Hugging Face checkpoint, by this file's own table -----------

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def _reference_dir(src: Path, gguf_path: Path, out: Path) -> Path:
    from safetensors.numpy import save_file

    cfg = json.loads((src / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    r = gguf.GGUFReader(str(gguf_path))
    tensors: dict[str, np.ndarray] = {}
    split: dict[int, dict[str, np.ndarray]] = {}
    for t in r.tensors:
        shape = tuple(int(v) for v in reversed(t.shape.tolist()))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name in _GLOBAL:
            tensors[_GLOBAL[t.name]] = w
            continue
        m = re.match(r"blk\.(\d+)\.(.+)", t.name)
        i, rest = int(m[1]), m[2]
        if i >= layers:
            continue  # the MTP layer: transformers does not run it either
        p = f"model.layers.{i}"
        if rest.endswith("_exps.weight"):
            for e in range(w.shape[0]):
                tensors[f"{p}.mlp.experts.{e}.{rest.split('_')[1]}_proj.weight"] = np.ascontiguousarray(w[e])
        elif rest in ("attn_k_b.weight", "attn_v_b.weight"):
            split.setdefault(i, {})[rest] = w
        else:
            tensors[f"{p}.{_LAYER[rest]}"] = np.ascontiguousarray(w)
    for i, pair in split.items():  # k_b [H, c, n] (transposed by the converter), v_b [H, v, c]
        k_b, v_b = pair["attn_k_b.weight"], pair["attn_v_b.weight"]
        heads = k_b.shape[0]
        rows = [np.concatenate([k_b[h].T, v_b[h]], axis=0) for h in range(heads)]
        tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = np.ascontiguousarray(np.concatenate(rows))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    cfg["dtype"] = "float32"
    cfg["num_nextn_predict_layers"] = 0
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _ref_logits(ref: Path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    m = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0].numpy()
        for _ in range(6):
            seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    return logits, seq[len(ids):]


def _greedy(model: Model, ids: list[int], steps: int = 6) -> list[int]:
    cache = model.new_cache()
    logits = model.forward(ids, cache)[-1]
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model.forward([out[-1]], cache)[-1]
    return out


def _parity(src: Path, tmp: Path, mix: str, split_kv_b: bool = True) -> Model:
    g = tmp / f"m-{mix}-{split_kv_b}.gguf"
    chosen = export_gguf(src, g, mix, split_kv_b=split_kv_b)
    if mix != "F32":
        assert mix.split("_K_M")[0] in "".join(chosen.values()), chosen  # really quantized
    ref = _reference_dir(src, g, tmp / f"ref-{mix}-{split_kv_b}")
    model = Model.load(g)
    want, want_tokens = _ref_logits(ref, IDS)
    got = model.forward(IDS, model.new_cache())
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= REL_TOL, f"{mix}: relative logit error {err}"
    assert _greedy(model, IDS) == want_tokens
    return model


@pytest.fixture(scope="module")
def glm_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("glm") / "src"
    _build("Glm4MoeConfig", "Glm4MoeForCausalLM", src, seed=30, **GLM, use_qk_norm=True, attention_bias=True)
    return src


@pytest.fixture(scope="module")
def dsv3_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("dsv3") / "src"
    _build("DeepseekV3Config", "DeepseekV3ForCausalLM", src, seed=31, **DSV3, q_lora_rank=32,
           rope_parameters=YARN)
    return src


@pytest.mark.ref
@pytest.mark.parametrize("mix", ["F32", "Q8_0", "Q4_K_M"])
def test_glm4moe_gguf_matches_transformers(glm_src: Path, tmp_path: Path, mix: str) -> None:
    model = _parity(glm_src, tmp_path, mix)
    c = model.config
    assert c.model_type == "glm4_moe" and c.qkv_bias and c.qk_norm == "head" and c.rotary_dim == 16
    assert c.router.n_group == 4 and c.router.topk_group == 2 and c.router.routed_scaling_factor == 2.5
    assert model.sparse_layers == [1, 2] and c.shared_expert_intermediate_size == 64
    if mix != "F32":  # kept as stored
        assert isinstance(model.layers[1].experts[0][2], quant.Packed)


@pytest.mark.ref
@pytest.mark.parametrize("mix,split", [("F32", True), ("F32", False), ("Q8_0", True), ("Q4_K_M", True),
                                       ("Q8_0", False)])
def test_deepseek2_gguf_matches_transformers(dsv3_src: Path, tmp_path: Path, mix: str, split: bool) -> None:
    model = _parity(dsv3_src, tmp_path, mix, split)
    assert isinstance(model, MlaModel)
    m = model.config.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (32, 32, 32, 16, 32)
    assert model.config.rope.type == "yarn" and model.config.rope.mscale_all_dim == 1.0
    # the cache holds the latent and the shared rope key only
    cache = model.new_cache(8)
    assert cache.k[0].shape == (1, 8, 32) and cache.v[0].shape == (1, 8, 16)


@pytest.mark.ref
def test_deepseek2_without_q_lora(tmp_path: Path) -> None:
    _build("DeepseekV3Config", "DeepseekV3ForCausalLM", tmp_path / "src", seed=32, **DSV3, q_lora_rank=None)
    model = _parity(tmp_path / "src", tmp_path, "Q8_0")
    assert model.config.mla.q_lora_rank is None and model.config.rope.type == "default"


@pytest.mark.ref
def test_glm4moe_mtp_layer_is_skipped_a_stray_layer_is_not(glm_src: Path, tmp_path: Path) -> None:
    """block_count counts the nextn (MTP) layer stored last; the engine skips it. A layer beyond it is
    refused by name."""
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "mtp"
    shutil.copytree(glm_src, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    flat = load_file(src / "model.safetensors")
    n = cfg["num_hidden_layers"]
    for k in list(flat):
        if k.startswith(f"model.layers.{n - 1}."):
            flat[k.replace(f"layers.{n - 1}.", f"layers.{n}.")] = flat[k] * 0.5
    save_file(flat, str(src / "model.safetensors"), metadata={"format": "pt"})
    g = tmp_path / "mtp.gguf"
    export_gguf(src, g, "F32")
    r = gguf.GGUFReader(str(g))
    assert int(r.fields["glm4moe.block_count"].contents()) == n + 1
    assert any(t.name.startswith(f"blk.{n}.") for t in r.tensors)
    model = Model.load(g)
    assert model.config.num_layers == n and model.config.mtp_layers == 1
    ref = Model.load(glm_src)
    assert np.array_equal(model.forward(IDS, model.new_cache()), ref.forward(IDS, ref.new_cache()))
    # a tensor of a layer past the MTP one is refused, naming it
    w = gguf.GGUFWriter(str(tmp_path / "stray.gguf"), "glm4moe")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.add_tensor(f"blk.{n + 1}.attn_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=f"model.layers.{n + 1}.input_layernorm.weight' is not used"):
        Model.load(tmp_path / "stray.gguf")


def test_softmax_gating_and_other_scalings_are_refused() -> None:
    meta = {"deepseek2.block_count": 2, "deepseek2.attention.head_count": 4, "deepseek2.expert_gating_func": 1}
    with pytest.raises(ConfigError, match="expert_gating_func 1 is not supported"):
        hf_config(meta, "deepseek2")
    meta = {"deepseek2.block_count": 2, "deepseek2.attention.head_count": 4}  # no gating key: V2's softmax
    with pytest.raises(ConfigError, match="DeepSeek-V2's softmax"):
        hf_config(meta, "deepseek2")
    meta = {**{f"glm4moe.{k}": v for k, v in dict(
        block_count=2, embedding_length=64, **{"attention.head_count": 4, "attention.layer_norm_rms_epsilon": 1e-5,
                                              "rope.dimension_count": 16, "attention.key_length": 32,
                                              "rope.scaling.type": "linear"},
        feed_forward_length=128, expert_feed_forward_length=32, expert_count=8, expert_used_count=2).items()}}
    with pytest.raises(ConfigError, match="rope.scaling.type 'linear' is not supported"):
        hf_config(meta, "glm4moe")


@pytest.mark.ref
def test_deepseek2_stage_range_load_equals_full_load(dsv3_src: Path, tmp_path: Path) -> None:
    """A pipeline stage loads a layer range of the file (``load(layers=)``): its layers, the split kv_b
    included, are the full model's bit for bit."""
    g = tmp_path / "m.gguf"
    export_gguf(dsv3_src, g, "Q8_0")
    full = Model.load(g)
    part = Model.load(g, layers=(1, 2))
    assert isinstance(part, MlaModel) and part.first_layer == 1 and len(part.layers) == 2
    for a, b in zip(full.layers[1:], part.layers):
        for name in ("w_uk", "w_uv", "kv_a_norm", "q_a_norm"):
            assert np.array_equal(a.extra[name], b.extra[name]), name
        assert np.array_equal(a.router_bias, b.router_bias)
        assert isinstance(b.q, quant.Packed) and np.array_equal(a.q.widen(), b.q.widen())
    assert not np.array_equal(full.layers[1].extra["w_uk"], full.layers[2].extra["w_uk"])


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_meshd_generate_on_a_gguf_of_the_family_matches_its_safetensors(tmp_path: Path, arch: str) -> None:
    """A real `meshd generate` process on an F32 GGUF (tokenizer and chat template from the file) prints
    what it prints for the safetensors checkpoint the file was written from: same tokens, same logprobs."""
    import subprocess
    import sys

    from engine.tiny import create_tiny

    src = create_tiny(tmp_path / arch, arch=arch, seed=5)
    g = tmp_path / f"{arch}.gguf"
    export_gguf(src, g, "F32")
    outs = []
    for model in (src, g):
        p = subprocess.run([sys.executable, "-m", "meshd", "generate", "--model", str(model), "--prompt",
                            "The mesh holds", "--max-tokens", "12", "--temperature", "0.8", "--seed", "3",
                            "--ignore-eos", "--json", "--state-dir", str(tmp_path / "st")],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        outs.append((out["text"], out["tokens"], out["logprobs"]))
    assert outs[0] == outs[1] and len(outs[0][1]) == 12
