"""Config parsing of the DeepSeek-V3-style families on the configs the real checkpoints ship (no torch):
DeepSeek-V3 (FP8, YaRN, MTP), GLM-4.5 (partial rotary, qk-norm), GLM-4.7-Flash; and their refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.config import ConfigError, ModelConfig
from engine.deepseek import SigmoidRouter, route_sigmoid
from engine.ops import RopeTable

DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (fields the engine reads)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "bos_token_id": 0, "eos_token_id": 1,
}
GLM45 = {  # zai-org/GLM-4.5 config.json
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92, "head_dim": 128,
    "num_attention_heads": 96, "num_key_value_heads": 8, "n_shared_experts": 1, "n_routed_experts": 160,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True,
    "partial_rotary_factor": 0.5, "rope_theta": 1000000, "rms_norm_eps": 1e-05, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
    "eos_token_id": [151329, 151336, 151338],
}
GLM47_FLASH = {  # zai-org/GLM-4.7-Flash config.json (glm4_moe_lite)
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "vocab_size": 154880,
    "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536, "num_hidden_layers": 47,
    "num_attention_heads": 20, "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
    "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8,
    "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
    "rope_theta": 1000000, "max_position_embeddings": 202752, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "norm_topk_prob": True,
}


def test_deepseek_v3_hub_config() -> None:
    c = ModelConfig.from_hf(DEEPSEEK_V3)
    assert c.router == SigmoidRouter(8, 4, 2.5) and c.top_k == 8 and c.num_experts == 256
    assert c.mlp_only_layers == (0, 1, 2) and c.is_sparse(3) and not c.is_sparse(2) and c.mtp_layers == 1
    assert c.shared_expert_intermediate_size == 2048 and c.fp8_block == (128, 128)
    m = c.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        1536, 512, 128, 64, 128) and m.interleave
    mscale = 0.1 * math.log(40) + 1.0
    assert m.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale)
    assert c.rope.type == "yarn" and c.rope.factor == 40 and c.rope.attention_factor == 1.0
    assert c.rotary_dim == 64 and c.num_kv_heads == 128


def test_glm45_and_glm47_flash_hub_configs() -> None:
    g = ModelConfig.from_hf(GLM45)
    assert g.rotary_dim == 64 and g.head_dim == 128 and g.qk_norm == "head" and g.qkv_bias and not g.o_bias
    assert g.mlp_only_layers == (0, 1, 2) and g.router == SigmoidRouter(1, 1, 2.5) and g.mla is None
    assert g.num_kv_heads == 8 and g.mtp_layers == 1
    f = ModelConfig.from_hf(GLM47_FLASH)
    assert f.mlp_only_layers == (0,) and f.mla.qk_head_dim == 256 and f.mla.v_head_dim == 256
    assert f.router.routed_scaling_factor == 1.8 and f.rope.type == "default"


def test_yarn_table_scales_cos_and_sin() -> None:
    c = ModelConfig.from_hf({**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "mscale": 0.707}})
    t = RopeTable(c.rope, 64)
    cos, sin = t.span(0, 3)
    assert cos[0, 0] == pytest.approx(c.rope.attention_factor) and c.rope.attention_factor < 1
    assert np.allclose(cos**2 + sin**2, c.rope.attention_factor**2, rtol=1e-5)


@pytest.mark.parametrize("change,match", [
    ({"n_group": 3}, "not a multiple of n_group 3"),
    ({"n_group": 256}, "fewer than 2 experts per group"),
    ({"topk_group": 9}, "topk_group 9 exceeds n_group 8"),
    ({"topk_group": 1, "num_experts_per_tok": 40}, "exceeds the 32 experts"),
    ({"topk_method": "greedy"}, "topk_method 'greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor must be a positive number"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt 'e5m2'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor must be 1 with latent attention"),
    ({"rope_scaling": {"type": "yarn", "factor": "x"}}, "rope_scaling yarn has a bad field"),
])
def test_refusals(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**DEEPSEEK_V3, **change})


def test_router_picks_only_from_kept_groups_and_weights_unbiased_scores() -> None:
    """4 groups of 2; bias lifts expert 7's group; weights come from the unbiased sigmoid scores."""
    logits = np.array([[3.0, 2.9, -1.0, -1.0, 0.0, 0.0, -3.0, -3.0]], np.float32)
    bias = np.array([0, 0, 0, 0, 0, 0, 0, 10.0], np.float32)
    r = route_sigmoid(logits, bias, 2, SigmoidRouter(4, 2, 2.0), True)
    assert r.experts.tolist() == [[7, 0]]  # group 3 (bias) and group 0 kept; 7 ranks first by biased score
    s = 1 / (1 + np.exp(-logits[0, [7, 0]].astype(np.float64)))
    assert np.allclose(r.weights[0], 2.0 * s / s.sum(), rtol=1e-6)
    r1 = route_sigmoid(logits, bias, 2, SigmoidRouter(4, 1, 1.0), False)
    assert r1.experts.tolist() == [[7, 6]]  # only group 3 kept
    assert [e for e, _ in r1.work] == [6, 7]
