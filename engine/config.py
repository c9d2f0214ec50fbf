"""Model configuration: one normalised view of a Hugging Face ``config.json`` for every family.

Both spellings load: configs as published on the Hub (``num_experts``, top-level ``rope_theta`` and
``rope_scaling``) and as transformers 5 writes them (``num_local_experts``, ``rope_parameters``).
Anything the engine cannot honour raises :class:`ConfigError` naming the field, never a silent fallback.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "llama", "qwen3", "qwen2")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

# Per-family defaults for fields a Hub config may leave out (the transformers config classes' defaults).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False, "attention_bias": False
    },
    "qwen2_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False, "qkv_bias": True},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "olmoe": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "norm_topk_prob": False, "attention_bias": False},
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
}


class ConfigError(Exception):
    """config.json is missing, malformed, or asks for something the engine does not implement."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding: ``theta`` plus an optional scaling (``default``, ``linear`` or ``llama3``)."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers, dense families)
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # "none" | "head" (Qwen3: per head, width head_dim) | "full" (OLMoE: the whole projection)
    qk_norm: str = "none"
    clip_qkv: float | None = None
    sliding_window: int | None = None  # keys older than this many positions are masked (Mixtral)
    # MoE (num_experts == 0 for dense families)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` has routed experts (else it has a dense MLP of ``intermediate_size``)."""
        if not self.is_moe or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory. Raises ConfigError."""
        path = Path(directory) / "config.json"
        try:
            raw = json.loads(path.read_text("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a JSON object")
        try:
            return cls.from_hf(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face config dict. Raises ConfigError naming the offending field."""
        mt = raw.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {mt!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        d = _DEFAULTS[mt]

        def get(name: str, default: Any = None) -> Any:
            v = raw.get(name)
            return d.get(name, default) if v is None else v

        def req_int(name: str, value: Any = None, minimum: int = 1) -> int:
            v = raw.get(name) if value is None else value
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ConfigError(f"{name} must be an integer >= {minimum}, got {v!r}")
            return v

        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")

        hidden = req_int("hidden_size")
        heads = req_int("num_attention_heads")
        kv_heads = req_int("num_key_value_heads", raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim_raw = raw.get("head_dim")
        if mt == "olmoe" or head_dim_raw is None:
            if hidden % heads:
                raise ConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
            head_dim = hidden // heads
        else:
            head_dim = req_int("head_dim")
        if head_dim % 2:
            raise ConfigError(f"head_dim {head_dim} must be even for rotary embeddings")

        rope = _rope(raw, float(get("rope_theta", 10000.0)))

        num_experts = 0
        top_k = 0
        moe_inter = 0
        norm_topk = False
        shared_inter = 0
        if mt in MOE_MODEL_TYPES:
            ne = raw.get("num_experts")
            if ne is None:
                ne = raw.get("num_local_experts")
            num_experts = req_int("num_experts", ne)
            top_k = req_int("num_experts_per_tok")
            if top_k > num_experts:
                raise ConfigError(f"num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
            if mt == "mixtral":
                moe_inter = req_int("intermediate_size")
                norm_topk = True  # Mixtral always renormalises its top-k weights
            elif mt == "olmoe":
                moe_inter = req_int("intermediate_size")
                norm_topk = bool(get("norm_topk_prob"))
            else:
                moe_inter = req_int("moe_intermediate_size")
                norm_topk = bool(get("norm_topk_prob"))
            if mt == "qwen2_moe":
                shared_inter = req_int("shared_expert_intermediate_size", minimum=0)

        sparse_step = 1
        mlp_only: tuple[int, ...] = ()
        if mt in ("qwen3_moe", "qwen2_moe"):
            sparse_step = req_int("decoder_sparse_step", raw.get("decoder_sparse_step") or 1)
            mo = raw.get("mlp_only_layers") or []
            if not (isinstance(mo, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in mo)):
                raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {mo!r}")
            mlp_only = tuple(mo)

        if mt in ("qwen3_moe", "qwen2_moe", "qwen3", "qwen2") and raw.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        window = None
        if mt == "mixtral" and raw.get("sliding_window") is not None:
            window = req_int("sliding_window")

        qk_norm = {"qwen3_moe": "head", "qwen3": "head", "olmoe": "full"}.get(mt, "none")
        if mt == "qwen2_moe":
            qkv_bias = bool(get("qkv_bias"))
            o_bias = False
        elif mt == "mixtral":
            qkv_bias = o_bias = False
        elif mt == "qwen2":  # q/k/v always carry a bias, o never
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(get("attention_bias", False))
        clip = raw.get("clip_qkv") if mt == "olmoe" else None
        if clip is not None and (not isinstance(clip, (int, float)) or clip <= 0):
            raise ConfigError(f"clip_qkv must be a positive number, got {clip!r}")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        inter = raw.get("intermediate_size")
        return cls(
            model_type=mt,
            vocab_size=req_int("vocab_size"),
            hidden_size=hidden,
            num_layers=req_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=(
                req_int("intermediate_size", inter) if inter is not None or not num_experts else 0
            ),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(get("mlp_bias", False)) if mt == "llama" else False,
            qk_norm=qk_norm,
            clip_qkv=float(clip) if clip is not None else None,
            sliding_window=window,
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=moe_inter,
            norm_topk_prob=norm_topk,
            decoder_sparse_step=sparse_step,
            mlp_only_layers=mlp_only,
            shared_expert_intermediate_size=shared_inter,
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            eos_token_ids=eos_ids,
        )


def _rope(raw: dict[str, Any], theta_default: float) -> RopeConfig:
    """Rotary settings from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (Hub)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and "rope_type" not in params:
        params = None  # per-layer-type dicts are not used by the supported families
    scaling = params if isinstance(params, dict) else raw.get("rope_scaling")
    theta = theta_default
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        theta = float(params["rope_theta"])
    elif raw.get("rope_theta") is not None:
        theta = float(raw["rope_theta"])
    if not (math.isfinite(theta) and theta > 0):
        raise ConfigError(f"rope_theta must be positive, got {theta!r}")
    if not scaling:
        return RopeConfig(theta=theta)
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, type="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        try:
            return RopeConfig(
                theta=theta,
                type="llama3",
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"rope_scaling llama3 is missing or has a bad field ({exc})") from None
    raise ConfigError(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
