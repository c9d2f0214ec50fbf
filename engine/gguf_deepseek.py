"""GGUF architectures ``glm4moe`` and ``deepseek2`` (the DeepSeek-V3-style families of engine/deepseek.py),
as llama.cpp's ``convert_hf_to_gguf.py`` writes them (gguf-py 0.19 names; checked against the converter's
``Glm4MoeModel`` and ``DeepseekV2Model``):

* ``glm4moe`` -> ``glm4_moe``: grouped-query attention with q/k/v bias and per-head q/k norm, rotary on
  ``rope.dimension_count`` of ``attention.key_length`` (no q/k permutation: GLM uses NEOX rope), the
  pre-FFN norm named ``post_attention_norm``; ``block_count`` counts the ``nextn_predict_layers``
  multi-token-prediction layers stored last, which are skipped here.
* ``deepseek2`` -> ``deepseek_v3`` (also GLM-4.7-Flash, which the converter writes as deepseek2): latent
  attention. Newer converters store ``kv_b_proj`` split as ``attn_k_b`` [H, c, n] (the key half,
  transposed) and ``attn_v_b`` [H, v, c], with ``key_length = kv_lora_rank + rope`` and the per-head
  dims in ``key_length_mla`` / ``value_length_mla``; older ones store ``attn_kv_b`` whole with
  ``key_length = nope + rope``. Both load: the split pair as ``self_attn.k_b_proj`` / ``v_b_proj`` keys,
  which the latent attention takes in place of kv_b (widened per layer, as it widens kv_b). Rope pairs
  are interleaved (llama.cpp's NORM rope, HF's ``rope_interleave``). YaRN: the file's
  ``rope.scaling.yarn_log_multiplier`` is ``0.1 * mscale_all_dim``; HF's ``mscale`` is not stored and is
  taken equal to ``mscale_all_dim`` (true of DeepSeek-V3's config).

Both: routing from ``expert_gating_func`` (sigmoid only; DeepSeek-V2's softmax is refused),
``expert_group_count`` / ``expert_group_used_count``, ``expert_weights_scale``, ``expert_weights_norm``,
``expert_shared_count``, ``leading_dense_block_count``; the correction bias is ``exp_probs_b.bias``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .config import ConfigError

ARCHES = {"glm4moe": "glm4_moe", "deepseek2": "deepseek_v3"}
EXPORTS = {"glm4_moe": "glm4moe", "deepseek_v3": "deepseek2"}
_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID (1 is softmax)

# GGUF per-layer name -> Hugging Face name after ``model.layers.{i}.``
TENSOR_NAMES: dict[str, dict[str, str]] = {
    "glm4moe": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
    },
    "deepseek2": {
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
        "attn_k_b.weight": "self_attn.k_b_proj.weight",  # [H, c, n]: engine.deepseek.mla_tensors
        "attn_v_b.weight": "self_attn.v_b_proj.weight",  # [H, v, c]
        "attn_q_a.bias": "self_attn.q_a_proj.bias",
        "attn_kv_a_mqa.bias": "self_attn.kv_a_proj_with_mqa.bias",
    },
}
COMMON_NAMES = {
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# generic names (engine/gguf_file.TENSOR_NAMES) these architectures do not use
NOT_USED = {"glm4moe": ("ffn_norm.weight", "ffn_gate_inp_shexp.weight"),
            "deepseek2": ("attn_k.weight", "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                          "attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_gate_inp_shexp.weight")}


def hf_config(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """GGUF metadata of a glm4moe / deepseek2 file -> a Hugging Face style config dict."""

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}")
        return default if v is None else v

    def need(key: str) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise ConfigError(f"GGUF metadata {arch}.{key} is missing")
        return v

    gating = int(get("expert_gating_func", _SIGMOID if arch == "glm4moe" else 1))
    if gating != _SIGMOID:
        raise ConfigError(f"{arch}.expert_gating_func {gating} is not supported (only 2, sigmoid: "
                          f"DeepSeek-V3 and GLM routing; DeepSeek-V2's softmax routing is not)")
    mtp = int(get("nextn_predict_layers", 0))
    blocks = int(need("block_count"))
    heads = int(need("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    raw: dict[str, Any] = {
        "model_type": ARCHES[arch],
        "vocab_size": get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None),
        "hidden_size": need("embedding_length"),
        "num_hidden_layers": blocks - mtp,  # block_count counts the MTP layers stored last
        "num_nextn_predict_layers": mtp,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "max_position_embeddings": get("context_length", 4096),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "intermediate_size": need("feed_forward_length"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "n_routed_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "n_shared_experts": get("expert_shared_count", 0),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "n_group": get("expert_group_count", 1),
        "topk_group": get("expert_group_used_count", 1),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    rope_dim = int(need("rope.dimension_count"))
    if arch == "glm4moe":
        head_dim = int(need("attention.key_length"))
        raw.update(head_dim=head_dim, partial_rotary_factor=rope_dim / head_dim)
        # attention_bias / use_qk_norm are read from the tensors present (load_gguf sets them)
    else:
        c = int(need("attention.kv_lora_rank"))
        q_lora = get("attention.q_lora_rank")
        if get("attention.key_length_mla") is not None:  # newer converters: MQA view of the latent
            qk_head = int(need("attention.key_length_mla"))
            v_head = int(need("attention.value_length_mla"))
        else:
            qk_head = int(need("attention.key_length"))
            v_head = int(need("attention.value_length"))
        raw.update(kv_lora_rank=c, q_lora_rank=int(q_lora) if q_lora else None, qk_rope_head_dim=rope_dim,
                   qk_nope_head_dim=qk_head - rope_dim, v_head_dim=v_head, rope_interleave=True,
                   num_key_value_heads=heads)
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "yarn":
            raise ConfigError(f"{arch}.rope.scaling.type {scaling!r} is not supported "
                              f"(supported: none, yarn)")
        s: dict[str, Any] = {"rope_type": "yarn", "factor": float(need("rope.scaling.factor")),
                             "original_max_position_embeddings":
                                 int(need("rope.scaling.original_context_length")),
                             "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                             "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
        log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0))
        if log_mul:
            m = round(log_mul / 0.1, 6)  # stored as 0.1 * mscale_all_dim in fp32
            s.update(mscale=m, mscale_all_dim=m)
        att = get("rope.scaling.yarn_attn_factor")
        if att is not None:
            s["attention_factor"] = float(att)
        raw["rope_scaling"] = s
    return raw


def tensor_name(arch: str, rest: str) -> str | None:
    """The HF name (after ``model.layers.{i}.``) of GGUF per-layer tensor ``rest``; None if unknown here."""
    if rest in NOT_USED[arch]:
        return ""
    return TENSOR_NAMES[arch].get(rest) or COMMON_NAMES.get(rest)


# --- writing (tests and benchmarks: engine/gguf_export.py) ----------------------------------------------

def write_metadata(w: Any, cfg: Any, raw: dict[str, Any]) -> None:
    """The family's GGUF metadata, as convert_hf_to_gguf writes it (``w``: a gguf.GGUFWriter; ``raw`` the
    checkpoint's config.json)."""
    import gguf

    mla = cfg.mla
    mtp = 0 if mla is not None else cfg.mtp_layers  # the deepseek2 converter drops MTP layers (skip_mtp)
    w.add_block_count(cfg.num_layers + mtp)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(int(raw.get("n_shared_experts", 1)))
    w.add_leading_dense_block_count(len(cfg.mlp_only_layers))
    w.add_expert_group_count(cfg.router.n_group)
    w.add_expert_group_used_count(cfg.router.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.router.routed_scaling_factor)
    if cfg.norm_topk_prob or mla is None:  # deepseek2's converter writes it only when true
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    if mtp:
        w.add_nextn_predict_layers(mtp)
    if mla is None:
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.rotary_dim)
    else:
        w.add_head_count_kv(1)
        if mla.q_lora_rank is not None:
            w.add_q_lora_rank(mla.q_lora_rank)
        w.add_kv_lora_rank(mla.kv_lora_rank)
        w.add_key_length(mla.kv_lora_rank + mla.qk_rope_head_dim)
        w.add_value_length(mla.kv_lora_rank)
        w.add_key_length_mla(mla.qk_head_dim)
        w.add_value_length_mla(mla.v_head_dim)
        w.add_rope_dimension_count(mla.qk_rope_head_dim)
    r = cfg.rope
    if r.type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(r.factor)
        w.add_rope_scaling_orig_ctx_len(r.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(r.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(r.beta_slow)
        if mla is not None and r.mscale_all_dim:
            w.add_rope_scaling_yarn_log_mul(0.1 * r.mscale_all_dim)
    elif r.type != "default":
        raise ValueError(f"rope type {r.type!r}: not written for {cfg.model_type}")


def export_tensors(cfg: Any, get: Any, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array for a glm4_moe / deepseek_v3 checkpoint (``get(hf_key)``). ``split_kv_b``:
    kv_b as attn_k_b [H, c, n] + attn_v_b [H, v, c] (converters since 2025), else attn_kv_b whole."""

    def opt(key: str) -> np.ndarray | None:
        try:
            return get(key)
        except KeyError:
            return None

    out: dict[str, np.ndarray] = {"token_embd.weight": get("model.embed_tokens.weight"),
                                  "output_norm.weight": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = get("lm_head.weight")
    mla = cfg.mla
    for i in range(cfg.num_layers + (0 if mla is not None else cfg.mtp_layers)):  # glm4moe keeps MTP layers
        p, b, a = f"model.layers.{i}", f"blk.{i}", f"model.layers.{i}.self_attn"
        names = {"attn_norm.weight": f"{p}.input_layernorm.weight",
                 ("ffn_norm.weight" if mla else "post_attention_norm.weight"):
                     f"{p}.post_attention_layernorm.weight",
                 "attn_output.weight": f"{a}.o_proj.weight", "attn_output.bias": f"{a}.o_proj.bias"}
        if mla is None:
            for g in ("q", "k", "v"):
                names[f"attn_{g}.weight"] = f"{a}.{g}_proj.weight"
                names[f"attn_{g}.bias"] = f"{a}.{g}_proj.bias"
            names["attn_q_norm.weight"] = f"{a}.q_norm.weight"
            names["attn_k_norm.weight"] = f"{a}.k_norm.weight"
        else:
            names.update({"attn_q.weight": f"{a}.q_proj.weight", "attn_q_a.weight": f"{a}.q_a_proj.weight",
                          "attn_q_a.bias": f"{a}.q_a_proj.bias",
                          "attn_q_a_norm.weight": f"{a}.q_a_layernorm.weight",
                          "attn_q_b.weight": f"{a}.q_b_proj.weight",
                          "attn_kv_a_mqa.weight": f"{a}.kv_a_proj_with_mqa.weight",
                          "attn_kv_a_mqa.bias": f"{a}.kv_a_proj_with_mqa.bias",
                          "attn_kv_a_norm.weight": f"{a}.kv_a_layernorm.weight"})
            kv_b = opt(f"{a}.kv_b_proj.weight")
            if kv_b is None:
                pass
            elif split_kv_b:
                kv = kv_b.reshape(cfg.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
                k_b = kv[:, : mla.qk_nope_head_dim].transpose(0, 2, 1)  # [H, c, n]
                out[f"{b}.attn_k_b.weight"] = np.ascontiguousarray(k_b)
                out[f"{b}.attn_v_b.weight"] = np.ascontiguousarray(kv[:, mla.qk_nope_head_dim :])
            else:
                out[f"{b}.attn_kv_b.weight"] = kv_b
        for g in ("gate", "up", "down"):
            names[f"ffn_{g}.weight"] = f"{p}.mlp.{g}_proj.weight"
            names[f"ffn_{g}_shexp.weight"] = f"{p}.mlp.shared_experts.{g}_proj.weight"
        names["ffn_gate_inp.weight"] = f"{p}.mlp.gate.weight"
        names["exp_probs_b.bias"] = f"{p}.mlp.gate.e_score_correction_bias"
        for g, h in (("eh_proj", "eh_proj"), ("enorm", "enorm"), ("hnorm", "hnorm"),
                     ("shared_head_norm", "shared_head.norm")):
            names[f"nextn.{g}.weight"] = f"{p}.{h}.weight"
        for gname, key in names.items():
            v = opt(key)
            if v is not None:
                out[f"{b}.{gname}"] = v
        if cfg.is_sparse(i) and opt(f"{p}.mlp.experts.0.gate_proj.weight") is not None:
            for g in ("gate", "up", "down"):
                out[f"{b}.ffn_{g}_exps.weight"] = np.stack(
                    [get(f"{p}.mlp.experts.{e}.{g}_proj.weight") for e in range(cfg.num_experts)])
    return out
