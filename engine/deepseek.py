"""DeepSeek-V3-style families: ``glm4_moe`` (GLM-4.5/4.6/4.7), ``glm4_moe_lite`` (GLM-4.7-Flash) and
``deepseek_v3``, as transformers 5 models them (``models/glm4_moe``, ``glm4_moe_lite``, ``deepseek_v3``).

What they share, and what this module holds:

* routing (:func:`route_sigmoid`): ``scores = sigmoid(x W^T)`` in fp32; ``e_score_correction_bias`` is
  added for *choosing* only; choice is group-limited (``n_group`` groups of experts, each scored by the
  sum of its two best biased scores; only the ``topk_group`` best groups compete); the weights are the
  unbiased scores of the chosen experts, divided by their sum (+1e-20) when ``norm_topk_prob``, times
  ``routed_scaling_factor``;
* shared experts: one SwiGLU of width ``moe_intermediate_size * n_shared_experts``, added ungated;
* the first ``first_k_dense_replace`` layers (``glm4_moe_lite``: the ``mlp_layer_types`` marked
  ``dense``) have a dense SwiGLU of ``intermediate_size``;
* multi-token-prediction layers stored after the last layer are skipped on load
  (``num_nextn_predict_layers``).

``glm4_moe`` keeps grouped-query attention (q/k/v bias with ``attention_bias``, per-head q/k RMSNorm
with ``use_qk_norm``, rotary on the first ``partial_rotary_factor`` of ``head_dim``: default 0.5).
``deepseek_v3`` and ``glm4_moe_lite`` use multi-head latent attention (``engine/mla.py``), configured by
:class:`MlaConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ConfigError, RopeConfig, yarn_softmax_mscale
from .moe import Routing, make_routing

F32 = np.float32
MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the RMSNorm default

_SCALING_DEFAULT = {"glm4_moe": 1.0, "glm4_moe_lite": 1.8, "deepseek_v3": 2.5}
_FIRST_DENSE_DEFAULT = {"glm4_moe": 1, "deepseek_v3": 3}


@dataclass(frozen=True, slots=True)
class SigmoidRouter:
    n_group: int
    topk_group: int
    routed_scaling_factor: float


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Multi-head latent attention dims. q_lora_rank None: q is one projection of the hidden state."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleave: bool  # rope dims stored as interleaved pairs (x0, x1), (x2, x3), ...
    softmax_scale: float  # (nope + rope) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


ReqInt = Callable[..., int]


def parse_extra(raw: dict[str, Any], mt: str, head_dim: int, rope: RopeConfig,
                req_int: ReqInt) -> dict[str, Any]:
    """The ModelConfig fields these families add or override. Raises ConfigError naming the field."""
    layers = req_int("num_hidden_layers")
    experts = raw.get("n_routed_experts") or raw.get("num_experts") or raw.get("num_local_experts")
    experts = req_int("n_routed_experts", experts)
    top_k = req_int("num_experts_per_tok")
    moe_inter = req_int("moe_intermediate_size")
    n_group = req_int("n_group", raw.get("n_group") or 1)
    topk_group = req_int("topk_group", raw.get("topk_group") or 1)
    if experts % n_group:
        raise ConfigError(f"n_routed_experts {experts} is not a multiple of n_group {n_group}")
    per_group = experts // n_group
    if per_group < 2:
        raise ConfigError(f"n_group {n_group} leaves fewer than 2 experts per group "
                          f"(a group scores its top 2)")
    if topk_group > n_group:
        raise ConfigError(f"topk_group {topk_group} exceeds n_group {n_group}")
    if top_k > topk_group * per_group:
        raise ConfigError(f"num_experts_per_tok {top_k} exceeds the {topk_group * per_group} experts of "
                          f"topk_group {topk_group} groups")
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func {scoring!r} is not supported (only sigmoid)")
    method = raw.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ConfigError(f"topk_method {method!r} is not supported (only noaux_tc)")
    scale = raw.get("routed_scaling_factor")
    scale = _SCALING_DEFAULT[mt] if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ConfigError(f"routed_scaling_factor must be a positive number, got {scale!r}")
    shared = req_int("n_shared_experts", raw.get("n_shared_experts", 1), minimum=0)

    if mt == "glm4_moe_lite":
        types = raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        if not (isinstance(types, list) and len(types) == layers and set(types) <= {"dense", "sparse"}):
            raise ConfigError(f"mlp_layer_types must list 'dense' or 'sparse' for each of {layers} layers")
        dense = tuple(i for i, t in enumerate(types) if t == "dense")
    else:
        first = raw.get("first_k_dense_replace")
        first = _FIRST_DENSE_DEFAULT[mt] if first is None else first
        dense = tuple(range(min(req_int("first_k_dense_replace", first, minimum=0), layers)))
    mtp = raw.get("num_nextn_predict_layers")
    mtp = raw.get("num_mtp_layers", 0) if mtp is None else mtp
    attention_bias = bool(raw.get("attention_bias", False))
    out: dict[str, Any] = {
        "router": SigmoidRouter(n_group, topk_group, float(scale)),
        "mlp_only_layers": dense,
        "shared_expert_intermediate_size": moe_inter * shared,
        "mtp_layers": req_int("num_nextn_predict_layers", mtp, minimum=0),
    }
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is None:
        partial = 0.5 if mt == "glm4_moe" else 1.0
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    rotary = int(head_dim * partial)
    if rotary < 2 or rotary % 2:
        raise ConfigError(f"partial_rotary_factor {partial} of head_dim {head_dim} gives an odd or empty "
                          f"rotary width {rotary}")
    out["rotary_dim"] = rotary
    if mt == "glm4_moe":
        out["qkv_bias"] = attention_bias
        out["o_bias"] = False
        out["qk_norm"] = "head" if raw.get("use_qk_norm") else "none"
        return out
    # latent attention
    if rotary != head_dim:
        raise ConfigError("partial_rotary_factor must be 1 with latent attention (the rope part is "
                          "qk_rope_head_dim wide)")
    q_lora = raw.get("q_lora_rank")
    nope = req_int("qk_nope_head_dim", minimum=0)
    mla = MlaConfig(
        q_lora_rank=None if q_lora is None else req_int("q_lora_rank"),
        kv_lora_rank=req_int("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=head_dim,
        v_head_dim=req_int("v_head_dim"),
        interleave=bool(raw.get("rope_interleave", True)),
        softmax_scale=(nope + head_dim) ** -0.5 * yarn_softmax_mscale(rope),
    )
    out.update(mla=mla, qkv_bias=attention_bias, o_bias=attention_bias, qk_norm="none")
    return out


def mla_tensors(cfg: Any, layer: int, split_kv_b: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Norms and latent-attention projections of one decoder layer (roles as the Layer fields: ``q`` is
    q_proj or q_b_proj, ``k`` kv_a_proj_with_mqa, ``v`` kv_b_proj, ``o`` o_proj; the rest go to
    ``Layer.extra``). ``split_kv_b``: kv_b as GGUF deepseek2 files store it since 2025
    (engine/gguf_deepseek.py), ``k_b`` [H, c, n] (the key half, transposed) and ``v_b`` [H, v, c], in place
    of ``v``."""
    m: MlaConfig = cfg.mla
    p = f"model.layers.{layer}"
    a = f"{p}.self_attn"
    d, h = cfg.hidden_size, cfg.num_heads
    out = {
        "attn_norm": (f"{p}.input_layernorm.weight", (d,)),
        "mlp_norm": (f"{p}.post_attention_layernorm.weight", (d,)),
        "k": (f"{a}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, d)),
        "kv_a_norm": (f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,)),
    }
    if split_kv_b:
        out["k_b"] = (f"{a}.k_b_proj.weight", (h, m.kv_lora_rank, m.qk_nope_head_dim))
        out["v_b"] = (f"{a}.v_b_proj.weight", (h, m.v_head_dim, m.kv_lora_rank))
    else:
        out["v"] = (f"{a}.kv_b_proj.weight", (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    out["o"] = (f"{a}.o_proj.weight", (d, h * m.v_head_dim))
    if m.q_lora_rank is None:
        out["q"] = (f"{a}.q_proj.weight", (h * m.qk_head_dim, d))
    else:
        out["q_a"] = (f"{a}.q_a_proj.weight", (m.q_lora_rank, d))
        out["q_a_norm"] = (f"{a}.q_a_layernorm.weight", (m.q_lora_rank,))
        out["q"] = (f"{a}.q_b_proj.weight", (h * m.qk_head_dim, m.q_lora_rank))
    if cfg.o_bias:  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        if m.q_lora_rank is not None:
            out["q_a_bias"] = (f"{a}.q_a_proj.bias", (m.q_lora_rank,))
        out["k_bias"] = (f"{a}.kv_a_proj_with_mqa.bias", (m.kv_lora_rank + m.qk_rope_head_dim,))
        out["o_bias"] = (f"{a}.o_proj.bias", (d,))
    return out


def route_sigmoid(logits: np.ndarray, bias: np.ndarray, top_k: int, router: SigmoidRouter,
                  norm_topk_prob: bool) -> Routing:
    """Group-limited sigmoid routing (module docstring). logits [T, E] fp32, bias [E] -> Routing.

    Slots are ranked by descending biased score, ties to the lower expert index (stable sorts), as in
    ``engine.moe``'s contract; a group's rank likewise (ties to the lower group).
    """
    logits = logits.astype(F32, copy=False)
    t, e = logits.shape
    scores = F32(1.0) / (F32(1.0) + np.exp(-logits))  # [T, E]
    choice = scores + bias.astype(F32, copy=False)  # [T, E]
    g = router.n_group
    if g > 1 and router.topk_group < g:
        grouped = choice.reshape(t, g, e // g)
        top2 = np.sort(grouped, axis=-1)[..., -2:]  # [T, G, 2] ascending
        group_scores = top2[..., 1] + top2[..., 0]  # [T, G]
        keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, : router.topk_group]  # [T, topk_group]
        mask = np.zeros((t, g), dtype=bool)
        mask[np.arange(t)[:, None], keep] = True
        choice = np.where(np.repeat(mask, e // g, axis=1), choice, F32(-np.inf))
    experts = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]  # [T, k]
    weights = scores[np.arange(t)[:, None], experts]  # [T, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + F32(1e-20))
    weights = weights * F32(router.routed_scaling_factor)
    return make_routing(experts, weights.astype(F32, copy=False))
