"""Parity with transformers 5 for the DeepSeek-V3-style families: ``glm4_moe``, ``glm4_moe_lite`` and
``deepseek_v3`` (same checks and tolerances as tests/test_engine_parity.py), their sigmoid group-limited
router on its own, and FP8 block-scaled checkpoints (the e4m3 decode bit for bit against torch).

Every config has groups > 1 where the family allows it, dense first layers, shared experts, a
non-zero ``e_score_correction_bias`` of the scores' scale and a ``routed_scaling_factor`` != 1, so a
router that ignored the bias, weighted with it, skipped the group limit or the scaling would fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_engine_parity import PROMPT, _build, _check, _hub_style, _logprobs, _ref_logprobs, _save_half  # noqa: E402

from engine.checkpoint import CheckpointError  # noqa: E402
from engine.fp8 import Fp8Tensor  # noqa: E402
from engine.model import Model  # noqa: E402

pytestmark = pytest.mark.ref

GLM = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
           n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, max_position_embeddings=512)
DSV3 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
            v_head_dim=10, routed_scaling_factor=2.5, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1}


def test_glm4_moe_groups_bias_qk_norm_partial_rotary(tmp_path: Path) -> None:
    m = _build("Glm4MoeConfig", "Glm4MoeForCausalLM", seed=20, **GLM, first_k_dense_replace=1,
               use_qk_norm=True, attention_bias=True, norm_topk_prob=True)
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path)
    c = eng.config
    assert eng.sparse_layers == [1, 2] and c.rotary_dim == 8 and c.qk_norm == "head"
    assert eng.layers[1].shared_expert_gate is None and eng.layers[1].router_bias is not None


def test_glm4_moe_hub_config_no_qk_norm_quarter_rotary_mtp_layer(tmp_path: Path) -> None:
    """Hub spelling (top-level rope_theta and partial_rotary_factor), two dense layers, no bias, no
    qk-norm, unnormalised weights; an MTP layer stored after the last layer is skipped, a stray one is not."""
    from safetensors.numpy import load_file, save_file

    m = _build("Glm4MoeConfig", "Glm4MoeForCausalLM", seed=21, **{**GLM, "num_hidden_layers": 4},
               first_k_dense_replace=2, use_qk_norm=False, attention_bias=False, norm_topk_prob=False,
               partial_rotary_factor=0.25)
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["partial_rotary_factor"] = cfg["rope_parameters"].pop("partial_rotary_factor")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _hub_style(tmp_path)
    flat = load_file(tmp_path / "model.safetensors")
    flat["model.layers.4.eh_proj.weight"] = np.zeros((32, 64), np.float32)  # the MTP layer (layer 4)
    save_file(flat, tmp_path / "model.safetensors", metadata={"format": "pt"})
    eng = _check(m, tmp_path)
    assert eng.sparse_layers == [2, 3] and eng.config.rotary_dim == 4 and eng.config.mtp_layers == 1
    flat["model.layers.5.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(flat, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.5.eh_proj.weight' is not used"):
        Model.load(tmp_path)


def test_deepseek_v3_q_lora_yarn_interleaved(tmp_path: Path) -> None:
    m = _build("DeepseekV3Config", "DeepseekV3ForCausalLM", seed=22, **DSV3, q_lora_rank=24,
               rope_parameters=YARN)
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path, prompt=PROMPT + PROMPT[:6])  # 18 positions: past the original 8
    assert eng.config.mla.interleave and eng.config.rope.type == "yarn"
    assert eng.mla.softmax_scale != 20**-0.5  # the YaRN mscale is in


def test_deepseek_v3_no_q_lora_bias_plain_rope_hub_bf16(tmp_path: Path) -> None:
    m = _build("DeepseekV3Config", "DeepseekV3ForCausalLM", seed=23, **DSV3, q_lora_rank=None,
               rope_interleave=False, attention_bias=True, norm_topk_prob=False)
    m = _save_half(m, tmp_path, "bfloat16")
    _hub_style(tmp_path)
    eng = _check(m, tmp_path)
    assert "q_a" not in eng.layers[0].extra and eng.layers[0].o_bias is not None


def test_deepseek_v3_hub_yarn_spelling(tmp_path: Path) -> None:
    m = _build("DeepseekV3Config", "DeepseekV3ForCausalLM", seed=24, **{**DSV3, "n_group": 2, "topk_group": 1},
               q_lora_rank=24, rope_parameters={**YARN, "mscale": 0.707, "factor": 2.5})
    m.save_pretrained(tmp_path)
    _hub_style(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"]["type"] = cfg["rope_scaling"].pop("rope_type")  # DeepSeek-V3's own spelling
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _check(m, tmp_path, prompt=PROMPT + PROMPT[:6])


def test_glm4_moe_lite_mlp_layer_types(tmp_path: Path) -> None:
    kw = {k: v for k, v in DSV3.items() if k != "first_k_dense_replace"}
    m = _build("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", seed=25,
               **{**kw, "num_hidden_layers": 4, "routed_scaling_factor": 1.8},
               q_lora_rank=24, mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path)
    assert eng.sparse_layers == [1, 3]


def test_mla_long_prompt_blocks_and_batch(tmp_path: Path) -> None:
    """A prompt over one query block (256) through prefill and the latent cache; a batched decode step
    of sequences at different lengths."""
    m = _build("DeepseekV3Config", "DeepseekV3ForCausalLM", seed=26, **DSV3, q_lora_rank=24)
    m.save_pretrained(tmp_path)
    prompt = [int(i) for i in np.random.default_rng(26).integers(0, 64, 300)]
    eng = _check(m, tmp_path, prompt=prompt, split=290)
    cache = eng.new_cache()
    assert [a.shape for a in (cache.k[0], cache.v[0])] == [(1, 256, 16), (1, 256, 8)]  # latent, rope key
    lengths = [3, 9, 5]
    caches = [eng.new_cache() for _ in lengths]
    for c, n in zip(caches, lengths):
        eng.forward(PROMPT[: n - 1], c)
    out = _logprobs(eng.forward_batch([PROMPT[n - 1] for n in lengths], caches))
    for row, n in zip(out, lengths):
        assert np.abs(row - _ref_logprobs(m, PROMPT[:n])[-1]).max() < 1e-4


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_router_matches_transformers(family: str) -> None:
    """The router alone on 400 tokens: same experts and weights (per expert) as transformers' router."""
    from engine.config import ModelConfig
    from engine.deepseek import route_sigmoid

    name = {"deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe"}[family]
    kw = {**GLM, "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}
    cfg = getattr(transformers, f"{name}Config")(**kw)
    mod = getattr(transformers.models, family)
    router = getattr(getattr(mod, f"modeling_{family}"), f"{name}TopkRouter")(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.5)
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    x = torch.randn(400, 32, generator=g)
    with torch.no_grad():
        logits, w_ref, idx_ref = router(x)
    mc = ModelConfig.from_hf(cfg.to_dict())
    r = route_sigmoid(logits.numpy(), router.e_score_correction_bias.numpy(), mc.top_k, mc.router,
                      mc.norm_topk_prob)
    for t in range(400):
        ref = dict(zip(idx_ref[t].tolist(), w_ref[t].tolist()))
        got = dict(zip(r.experts[t].tolist(), r.weights[t].tolist()))
        assert sorted(got) == sorted(ref), f"token {t}"
        assert all(abs(got[e] - ref[e]) < 1e-6 for e in got)
    plain = route_sigmoid(logits.numpy(), np.zeros(16, np.float32), mc.top_k, mc.router, mc.norm_topk_prob)
    assert (np.sort(plain.experts) != np.sort(r.experts)).any(axis=1).mean() > 0.2  # the bias matters


# ----- FP8 block-scaled weights ------------------------------------------------------------------------
def test_e4m3_decode_is_bit_exact_against_torch() -> None:
    from engine.fp8 import decode_e4m3

    bits = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(bits.copy()).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    got = decode_e4m3(bits)
    assert got.dtype == np.float32
    nan = np.isnan(ref)
    assert (np.isnan(got) == nan).all() and nan.sum() == 2
    assert got[~nan].view(np.uint32).tolist() == ref[~nan].view(np.uint32).tolist()  # incl. -0.0


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)], the dequantized fp32 weight)."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.to(torch.float32) * full


def test_fp8_block_scaled_checkpoint(tmp_path: Path) -> None:
    """Every linear weight of the layers as float8_e4m3fn with 16x8 block scales (shapes not multiples
    of the block, as real checkpoints have); the reference is transformers on the dequantized weights.
    Loaded twice: experts widened at load, and kept as fp8 bytes and dequantized on every use."""
    from safetensors.torch import save_file

    m = _build("DeepseekV3Config", "DeepseekV3ForCausalLM", seed=27, **DSV3, q_lora_rank=24)
    block = (16, 8)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                # in memory fused [E, 2I, D] / [E, D, I]; FP8 checkpoints ship experts one by one
                base = name.rsplit(".", 1)[0]
                for e in range(p.shape[0]):
                    halves = p[e].chunk(2) if name.endswith("gate_up_proj") else (p[e],)
                    names = ("gate_proj", "up_proj") if len(halves) == 2 else ("down_proj",)
                    deqs = []
                    for part, half in zip(names, halves):
                        key = f"{base}.{e}.{part}.weight"
                        out[key], out[key + "_scale_inv"], deq = _quantize(half.detach(), block)
                        deqs.append(deq)
                    p[e].copy_(torch.cat(deqs))
                continue
            if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
                out[name] = p.detach().clone()
                continue
            q, s, deq = _quantize(p.detach(), block)
            out[name], out[name + "_scale_inv"] = q, s
            p.copy_(deq)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                out[name] = b.clone()
    m.save_pretrained(tmp_path)  # config.json (the weights are replaced below)
    (tmp_path / "model.safetensors").unlink()
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = _check(m, tmp_path)
    assert eng.checkpoint["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == "F8_E4M3"
    lazy = Model.load(tmp_path, widen_experts=False)
    assert isinstance(lazy.layers[1].experts[0][0], Fp8Tensor)  # routed experts stay FP8 in memory
    wide = Model.load(tmp_path, widen_experts=True)
    assert isinstance(wide.layers[1].experts[0][0], np.ndarray)
    a = wide.forward(PROMPT, wide.new_cache())
    assert eng.forward(PROMPT, eng.new_cache()).tobytes() == a.tobytes()
    assert lazy.forward(PROMPT, lazy.new_cache()).tobytes() == a.tobytes()
    cfg["quantization_config"]["weight_block_size"] = [32, 32]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"kv_b_proj.weight_scale_inv. has shape \[6, 2\], expected \[3, 1\]"):
        Model.load(tmp_path)


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_tiny_checkpoints_match_transformers(tmp_path: Path, arch: str) -> None:
    """`meshd model create-tiny --arch glm4_moe|deepseek_v3` (numpy-written) as transformers reads it."""
    from engine.tiny import create_tiny

    path = create_tiny(tmp_path / arch, arch=arch, seed=3)
    ref = getattr(transformers, {"glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[arch])
    m = ref.from_pretrained(path, dtype=torch.float32).eval()
    eng = _check(m, path)
    assert eng.sparse_layers == [1, 2, 3] and eng.config.model_type == arch


@pytest.mark.parametrize("expanded", [True, False])
def test_mla_expanded_and_absorbed_paths_each_match(tmp_path: Path, expanded: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of attending (normally chosen by cost), forced for prefill and decode alike."""
    from engine.mla import MlaModel

    monkeypatch.setattr(MlaModel, "_expanded_cheaper", lambda self, t, length: expanded)
    m = _build("DeepseekV3Config", "DeepseekV3ForCausalLM", seed=28, **DSV3, q_lora_rank=24, rope_parameters=YARN)
    m.save_pretrained(tmp_path)
    _check(m, tmp_path)
