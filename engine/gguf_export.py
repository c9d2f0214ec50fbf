"""Write a Hugging Face safetensors checkpoint as a GGUF file (tests and benchmarks; the daemon only reads).

``export_gguf(src_dir, out_file, mix)`` maps tensor names and metadata the way llama.cpp's
``convert_hf_to_gguf.py`` does (llama q/k rows permuted for ggml's rotary layout, experts stacked into
``ffn_*_exps``, a byte-level BPE ``tokenizer.json`` as ``tokenizer.ggml.*``), and stores each matrix in
the type ``mix`` picks. Q8_0, Q4_0 and BF16 are quantized with ``gguf.quants``; Q4_K, Q5_K and Q6_K (which
gguf-py can only dequantize) with the simple quantizers below, whose output ``gguf.quants.dequantize``
reads back (tests check the round trip). Rows that are not whole blocks of a type fall back to Q8_0
(and to F32 when not whole Q8_0 blocks), as llama.cpp falls back for such tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_deepseek
from .checkpoint import load_checkpoint, to_f32
from .config import ModelConfig
from .quant import BLOCKS, QK_K

F32 = np.float32


# --- K-quant quantizers (round to nearest, per-sub-block scales; not llama.cpp's search) ------------------

def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(F32)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [n, 8] -> the 12-byte K-quant packing [n, 12]."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=1)


def _quantize_k_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """x [n, 256] -> (d f16 [n,1], dmin f16 [n,1], sc [n,8], mn [n,8], q [n,256]) for Q4_K/Q5_K."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)  # [n, 8]
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    dmin_s = -lo
    d = _f16_round(scale.max(axis=-1, keepdims=True) / 63)  # [n, 1]
    dmin = _f16_round(dmin_s.max(axis=-1, keepdims=True) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(np.rint(scale / d), 0, 63), 0)
        mn = np.where(dmin > 0, np.clip(np.rint(dmin_s / dmin), 0, 63), 0)
        step = (d * sc)[:, :, None]
        q = np.where(step > 0, np.rint((sub + (dmin * mn)[:, :, None]) / step), 0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(n, QK_K)
    return d, dmin, sc, mn, q


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    # q [n, 256] 0..15 -> qs [n, 128]: byte c*32+l holds elements c*64+l (low) and c*64+32+l (high)
    n = q.shape[0]
    r = q.reshape(n, 4, 2, 32)
    return (r[:, :, 0] | (r[:, :, 1] << 4)).reshape(n, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] fp32 -> [n, 144] uint8 Q4_K blocks."""
    d, dmin, sc, mn, q = _quantize_k_affine(x, 15)
    return np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                           _pack_scales(sc, mn), _nibbles_k(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] fp32 -> [n, 176] uint8 Q5_K blocks."""
    d, dmin, sc, mn, q = _quantize_k_affine(x, 31)
    n = x.shape[0]
    high = (q >> 4).reshape(n, 8, 32)  # sub-block j's fifth bits go to bit j of qh[l]
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                           _pack_scales(sc, mn), qh, _nibbles_k(q & 0x0F)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] fp32 -> [n, 210] uint8 Q6_K blocks."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=-1)  # [n, 16]
    sub_scale = amax / 31
    d = _f16_round(sub_scale.max(axis=-1, keepdims=True) / 127)  # [n, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(np.rint(sub_scale / d), -128, 127), 0)
        step = (d * sc)[:, :, None]
        q = np.where(step != 0, np.rint(sub / step), 0)
    q6 = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 2, 2, 32)  # [n, half, s, ., 32]
    lo, hi = q6 & 0x0F, q6 >> 4
    lo = lo.reshape(n, 2, 2, 64)  # [n, half, s, l]: element half*128 + s*64 + l
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    hi = hi.reshape(n, 2, 4, 32)  # [n, half, p, l]: element half*128 + p*32 + l
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.astype(np.float16).view(np.uint8)],
                          axis=1)


_OWN: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """fp32 [..., K] -> stored bytes [..., K / block * block bytes] (uint8), or fp32/fp16 arrays."""
    import gguf

    w = np.ascontiguousarray(w, dtype=F32)
    if qtype == "F32":
        return w
    if qtype == "F16":
        return w.astype(np.float16)
    bs, ts = BLOCKS[qtype]
    if qtype in _OWN:
        blocks = _OWN[qtype](w.reshape(-1, bs))
        return blocks.reshape(*w.shape[:-1], w.shape[-1] // bs * ts)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


# --- type mixes ----------------------------------------------------------------------------------------

def mix_type(mix: str, name: str, k: int) -> str:
    """The stored type of GGUF tensor ``name`` (rows of ``k``) in ``mix`` (a type, or Q4_K_M / Q5_K_M)."""
    if name.endswith("norm.weight") or name.endswith(".bias") or "ffn_gate_inp" in name:
        want = "F32"
    elif mix in ("Q4_K_M", "Q5_K_M"):
        base = "Q4_K" if mix == "Q4_K_M" else "Q5_K"
        want = "Q6_K" if any(s in name for s in ("attn_v", "ffn_down", "output.weight")) else base
    else:
        want = mix
    if want != "F32" and k % BLOCKS[want][0]:
        want = "Q8_0" if k % 32 == 0 else "F32"
    return want


# --- export --------------------------------------------------------------------------------------------

_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe",
         "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # HF rotate-half rows -> ggml's interleaved order (convert_hf_to_gguf's LlamaModel.permute)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {"token_embd.weight": get("model.embed_tokens.weight"),
                                  "output_norm.weight": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = get("lm_head.weight")
    moe = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        out[f"{b}.attn_norm.weight"] = get(f"{p}.input_layernorm.weight")
        out[f"{b}.ffn_norm.weight"] = get(f"{p}.post_attention_layernorm.weight")
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            for kind in ("weight", "bias"):
                try:
                    w = get(f"{p}.self_attn.{h}_proj.{kind}")
                except KeyError:
                    continue
                if cfg.model_type in ("llama", "mixtral") and g in ("q", "k"):
                    w = _permute(w, cfg.num_heads if g == "q" else cfg.num_kv_heads)
                out[f"{b}.attn_{g}.{kind}"] = w
        for g in ("q", "k"):
            try:
                out[f"{b}.attn_{g}_norm.weight"] = get(f"{p}.self_attn.{g}_norm.weight")
            except KeyError:
                pass
        if not cfg.is_sparse(i):
            for g, h in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                out[f"{b}.ffn_{g}.weight"] = get(f"{p}.mlp.{h}.weight")
            continue
        out[f"{b}.ffn_gate_inp.weight"] = get(f"{p}.{moe}.gate.weight")
        for g, h in zip(("gate", "up", "down"), names):
            out[f"{b}.ffn_{g}_exps.weight"] = np.stack(
                [get(f"{p}.{moe}.experts.{e}.{h}.weight") for e in range(cfg.num_experts)])
        if cfg.shared_expert_intermediate_size:
            for g in ("gate", "up", "down"):
                out[f"{b}.ffn_{g}_shexp.weight"] = get(f"{p}.mlp.shared_expert.{g}_proj.weight")
            out[f"{b}.ffn_gate_inp_shexp.weight"] = get(f"{p}.mlp.shared_expert_gate.weight").reshape(-1)
    return out


def _eos_meta(w: Any, src: Path, cfg: ModelConfig) -> None:
    """Tokenizer metadata when ``src`` has a tokenizer, and one ``eos_token_id``: config.json's first
    eos id, else the tokenizer's ``eos_token`` (written once: GGUFWriter overwrites a repeated key).
    Without a tokenizer, ``tokenizer.ggml.model = "none"``: llama.cpp requires the key and reads "none" as
    a model without a vocabulary (``vocab_size`` dummy tokens), as its converter writes such models."""
    has_tokenizer = (src / "tokenizer.json").is_file()
    if not has_tokenizer:
        w.add_tokenizer_model("none")
    eos = _tokenizer_meta(w, src) if has_tokenizer else None
    if cfg.eos_token_ids:
        eos = cfg.eos_token_ids[0]
    if eos is not None:
        w.add_eos_token_id(eos)


def _tokenizer_meta(w: Any, src: Path) -> int | None:
    """Write the tokenizer's metadata; -> the id of tokenizer_config.json's ``eos_token``, if any."""
    tj = json.loads((src / "tokenizer.json").read_text("utf-8"))
    model = tj["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    tokens = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for t, a in added.items():
        types[a["id"]] = 3 if a.get("special") else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    cfg_path = src / "tokenizer_config.json"
    if cfg_path.is_file():
        tc = json.loads(cfg_path.read_text("utf-8"))
        if isinstance(tc.get("chat_template"), str):
            w.add_chat_template(tc["chat_template"])
        eos = tc.get("eos_token")
        if isinstance(eos, str) and eos in vocab:
            return vocab[eos]
    return None


def export_gguf(src: str | Path, out: str | Path, mix: str = "F32",
                types: Callable[[str, int], str] | None = None, split_kv_b: bool = True) -> dict[str, str]:
    """Write checkpoint ``src`` to ``out`` in ``mix``; -> GGUF tensor name -> stored type. ``split_kv_b``
    (deepseek2): latent attention's kv_b as attn_k_b + attn_v_b, as converters since 2025 write it."""
    import gguf

    src, out = Path(src), Path(out)
    cfg = ModelConfig.load(src)
    ckpt = load_checkpoint(src)
    if cfg.model_type in gguf_deepseek.EXPORTS:
        return _export_deepseek(src, out, cfg, ckpt, mix, types, split_kv_b)
    arch = _ARCH[cfg.model_type]

    def get(key: str) -> np.ndarray:
        t = ckpt[key]
        return np.asarray(to_f32(t.data, t.dtype), dtype=F32)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size or cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.is_moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        if cfg.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    _eos_meta(w, src, cfg)
    return _write_tensors(w, _tensors(cfg, get), mix, types)


def _export_deepseek(src: Path, out: Path, cfg: ModelConfig, ckpt: Any, mix: str,
                     types: Callable[[str, int], str] | None, split_kv_b: bool) -> dict[str, str]:
    import gguf

    def get(key: str) -> np.ndarray:
        t = ckpt[key]
        return np.asarray(to_f32(t.data, t.dtype), dtype=F32)

    w = gguf.GGUFWriter(str(out), gguf_deepseek.EXPORTS[cfg.model_type])
    gguf_deepseek.write_metadata(w, cfg, json.loads((src / "config.json").read_text("utf-8")))
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    _eos_meta(w, src, cfg)
    return _write_tensors(w, gguf_deepseek.export_tensors(cfg, get, split_kv_b), mix, types)


def _write_tensors(w: Any, tensors: dict[str, np.ndarray], mix: str,
                   types: Callable[[str, int], str] | None) -> dict[str, str]:
    import gguf

    chosen: dict[str, str] = {}
    for name, arr in tensors.items():
        qtype = (types or (lambda n, k: mix_type(mix, n, k)))(name, arr.shape[-1])
        if arr.ndim == 1:
            qtype = "F32"
        data = quantize(arr, qtype)
        if qtype in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
        chosen[name] = qtype
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return chosen
