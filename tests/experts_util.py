"""Helpers for the expert-workers tests: small MoE checkpoints written by the test itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def make_moe_checkpoint(path: Path, family: str = "qwen3_moe", layers: int = 3, experts: int = 8,
                        hidden: int = 32, inter: int = 16, top_k: int = 2, dtype: str = "F32", seed: int = 0,
                        dense_layers: tuple[int, ...] = (), vocab: int = 64) -> Path:
    """Write config.json + model.safetensors with random routed experts and routers (and the rest)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg: dict[str, object] = {"model_type": family, "num_hidden_layers": layers, "hidden_size": hidden,
                              "num_experts_per_tok": top_k, "vocab_size": vocab, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "head_dim": hidden // 2, "rms_norm_eps": 1e-6,
                              "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}
    if family == "mixtral":
        cfg.update(num_local_experts=experts, intermediate_size=inter)
    else:
        cfg.update(num_experts=experts, moe_intermediate_size=inter, intermediate_size=inter * 2,
                   mlp_only_layers=list(dense_layers), decoder_sparse_step=1, norm_topk_prob=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors: dict[str, np.ndarray] = {}

    def w(*shape: int) -> np.ndarray:
        a = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if dtype == "BF16":
            return (a.view(np.uint32) >> 16).astype(np.uint16)
        return a

    ones = np.ones(hidden, np.float32)
    tensors["model.embed_tokens.weight"] = w(vocab, hidden)
    tensors["model.norm.weight"] = ones.copy() if dtype == "F32" else (ones.view(np.uint32) >> 16).astype(np.uint16)
    tensors["lm_head.weight"] = w(vocab, hidden)
    hd = hidden // 2
    for layer in range(layers):
        a = f"model.layers.{layer}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            tensors[a + n + ".weight"] = tensors["model.norm.weight"].copy()
        tensors[a + "self_attn.q_proj.weight"] = w(2 * hd, hidden)
        tensors[a + "self_attn.k_proj.weight"] = w(hd, hidden)
        tensors[a + "self_attn.v_proj.weight"] = w(hd, hidden)
        tensors[a + "self_attn.o_proj.weight"] = w(hidden, 2 * hd)
        if family == "qwen3_moe":
            tensors[a + "self_attn.q_norm.weight"] = tensors["model.norm.weight"][:hd].copy()
            tensors[a + "self_attn.k_norm.weight"] = tensors["model.norm.weight"][:hd].copy()
        if layer in dense_layers:
            tensors[a + "mlp.gate_proj.weight"] = w(inter * 2, hidden)
            tensors[a + "mlp.up_proj.weight"] = w(inter * 2, hidden)
            tensors[a + "mlp.down_proj.weight"] = w(hidden, inter * 2)
            continue
        for e in range(experts):
            if family == "mixtral":
                p = f"{a}block_sparse_moe.experts.{e}."
                tensors[p + "w1.weight"], tensors[p + "w3.weight"], tensors[p + "w2.weight"] = (
                    w(inter, hidden), w(inter, hidden), w(hidden, inter))
            else:
                p = f"{a}mlp.experts.{e}."
                tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"], tensors[p + "down_proj.weight"] = (
                    w(inter, hidden), w(inter, hidden), w(hidden, inter))
        router = "block_sparse_moe.gate" if family == "mixtral" else "mlp.gate"
        tensors[f"{a}{router}.weight"] = w(experts, hidden)
    if dtype == "BF16":
        # safetensors.numpy has no bf16 dtype: write as F16-sized raw and patch the header's dtype string.
        save_file({k: v.view(np.float16) if v.dtype == np.uint16 else v for k, v in tensors.items()},
                  str(path / "model.safetensors"))
        raw = (path / "model.safetensors").read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = raw[8:8 + n].rstrip(b" ").replace(b'"F16"', b'"BF16"')
        header += b" " * (-len(header) % 8)
        (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return path


def router_weights(path: Path, layer: int, family: str) -> np.ndarray:
    from engine.experts.tensors import RangeMaps, as_f32, index_checkpoint

    router = "block_sparse_moe.gate" if family == "mixtral" else "mlp.gate"
    info = index_checkpoint(path)[f"model.layers.{layer}.{router}.weight"]
    return np.array(as_f32(RangeMaps([info]).array(info), info.dtype))
