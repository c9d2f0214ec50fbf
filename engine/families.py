"""An explicit tensor-key map per model family.

Every family is described by the names of its checkpoint tensors and their expected shapes. The model
asks for *roles* (``"q"``, ``"router"``, ...) and gets back ``(key, shape)``; nothing is found by pattern
guessing, and a checkpoint holding a key that no role claims is refused (see ``IGNORABLE``).

Routed experts come in two layouts, both loaded without copying:

* per expert, as the Hub ships them and as transformers ``save_pretrained`` writes them:
  ``{layer}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` (Mixtral:
  ``{layer}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``);
* fused 3-D, as transformers 5 holds them in memory: ``{layer}.mlp.experts.gate_up_proj`` [E, 2I, D]
  (gate rows first, then up) and ``{layer}.mlp.experts.down_proj`` [E, D, I], router
  ``{layer}.mlp.gate.weight``.
"""

from __future__ import annotations

import re

from .config import ModelConfig

Spec = tuple[str, tuple[int, ...]]

# Keys some exporters leave in a checkpoint that carry nothing the forward pass uses.
IGNORABLE = (re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),)
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def global_tensors(cfg: ModelConfig) -> dict[str, Spec]:
    """Embedding, final norm and (untied) output head."""
    v, d = cfg.vocab_size, cfg.hidden_size
    out = {
        "embed": ("model.embed_tokens.weight", (v, d)),
        "norm": ("model.norm.weight", (d,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight", (v, d))
    return out


def attention_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """Norms and attention projections of one decoder layer."""
    p = f"model.layers.{layer}"
    d, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out: dict[str, Spec] = {
        "attn_norm": (f"{p}.input_layernorm.weight", (d,)),
        "mlp_norm": (f"{p}.post_attention_layernorm.weight", (d,)),
        "q": (f"{p}.self_attn.q_proj.weight", (q_out, d)),
        "k": (f"{p}.self_attn.k_proj.weight", (kv_out, d)),
        "v": (f"{p}.self_attn.v_proj.weight", (kv_out, d)),
        "o": (f"{p}.self_attn.o_proj.weight", (d, q_out)),
    }
    if cfg.qkv_bias:
        out["q_bias"] = (f"{p}.self_attn.q_proj.bias", (q_out,))
        out["k_bias"] = (f"{p}.self_attn.k_proj.bias", (kv_out,))
        out["v_bias"] = (f"{p}.self_attn.v_proj.bias", (kv_out,))
    if cfg.o_bias:
        out["o_bias"] = (f"{p}.self_attn.o_proj.bias", (d,))
    if cfg.qk_norm == "head":
        out["q_norm"] = (f"{p}.self_attn.q_norm.weight", (hd,))
        out["k_norm"] = (f"{p}.self_attn.k_norm.weight", (hd,))
    elif cfg.qk_norm == "full":
        out["q_norm"] = (f"{p}.self_attn.q_norm.weight", (q_out,))
        out["k_norm"] = (f"{p}.self_attn.k_norm.weight", (kv_out,))
    return out


def dense_mlp_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """The dense SwiGLU MLP of a dense layer."""
    p = f"model.layers.{layer}.mlp"
    d, i = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, Spec] = {
        "gate": (f"{p}.gate_proj.weight", (i, d)),
        "up": (f"{p}.up_proj.weight", (i, d)),
        "down": (f"{p}.down_proj.weight", (d, i)),
    }
    if cfg.mlp_bias:
        out["gate_bias"] = (f"{p}.gate_proj.bias", (i,))
        out["up_bias"] = (f"{p}.up_proj.bias", (i,))
        out["down_bias"] = (f"{p}.down_proj.bias", (d,))
    return out


def moe_prefix(cfg: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}"


def fused_expert_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """Fused 3-D layout of one sparse layer (router + all experts)."""
    p = f"model.layers.{layer}.mlp"
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {
        "router": (f"{p}.gate.weight", (e, d)),
        "gate_up": (f"{p}.experts.gate_up_proj", (e, 2 * i, d)),
        "down": (f"{p}.experts.down_proj", (e, d, i)),
    }


def expert_tensors(cfg: ModelConfig, layer: int, expert: int) -> dict[str, Spec]:
    """Per-expert layout: one expert's gate, up and down projections."""
    p = f"{moe_prefix(cfg, layer)}.experts.{expert}"
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    return {
        "gate": (f"{p}.{names[0]}.weight", (i, d)),
        "up": (f"{p}.{names[1]}.weight", (i, d)),
        "down": (f"{p}.{names[2]}.weight", (d, i)),
    }


def router_tensor(cfg: ModelConfig, layer: int) -> Spec:
    return (f"{moe_prefix(cfg, layer)}.gate.weight", (cfg.num_experts, cfg.hidden_size))


def router_bias_tensor(cfg: ModelConfig, layer: int) -> Spec | None:
    """The sigmoid routers' ``e_score_correction_bias`` [E] (added for choosing experts only)."""
    if cfg.router is None:
        return None
    return (f"{moe_prefix(cfg, layer)}.gate.e_score_correction_bias", (cfg.num_experts,))


def is_ignorable(cfg: ModelConfig, key: str) -> bool:
    """Keys that carry nothing the forward pass uses: exporters' leftovers, and multi-token-prediction
    layers stored after the last layer (``model.layers.{n}.*``, n >= num_layers)."""
    if any(p.match(key) for p in IGNORABLE):
        return True
    m = _LAYER_KEY.match(key)
    return bool(m) and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.mtp_layers


def shared_expert_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """The always-on shared expert: Qwen2-MoE's with its sigmoid gate, the DeepSeek-V3 style's ungated
    (``mlp.shared_experts``, width ``moe_intermediate_size * n_shared_experts``)."""
    if cfg.shared_expert_intermediate_size == 0:
        return {}
    p = f"model.layers.{layer}.mlp"
    d, i = cfg.hidden_size, cfg.shared_expert_intermediate_size
    if cfg.router is not None:
        return {
            "shared_gate": (f"{p}.shared_experts.gate_proj.weight", (i, d)),
            "shared_up": (f"{p}.shared_experts.up_proj.weight", (i, d)),
            "shared_down": (f"{p}.shared_experts.down_proj.weight", (d, i)),
        }
    if cfg.model_type != "qwen2_moe":
        return {}
    return {
        "shared_gate": (f"{p}.shared_expert.gate_proj.weight", (i, d)),
        "shared_up": (f"{p}.shared_expert.up_proj.weight", (i, d)),
        "shared_down": (f"{p}.shared_expert.down_proj.weight", (d, i)),
        "shared_expert_gate": (f"{p}.shared_expert_gate.weight", (1, d)),
    }
