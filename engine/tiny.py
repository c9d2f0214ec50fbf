"""The built-in ``tiny`` model: a deterministic small MoE checkpoint in Hugging Face format.

``create_tiny(dir, arch, seed)`` writes ``config.json``, ``model.safetensors`` (fp32),
``generation_config.json``, ``tokenizer.json`` (byte-level BPE trained with ``tokenizers`` on
``engine.tiny_corpus``) and ``tokenizer_config.json`` (ChatML template). Random weights come from
``numpy.random.default_rng(seed)`` drawn in a fixed tensor order, so the same seed gives byte-identical
files. The model writes nonsense; it exists for wiring and parity tests.

``ensure_tiny(state_dir)`` creates it once under ``<state_dir>/models/`` (atomically, so concurrent first
starts are safe) and returns its path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.tiny_corpus import CORPUS

TINY_VERSION = 2  # bump when the corpus, dims, init or template change (ensure_tiny then makes a fresh copy)
ARCHES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB = 1024  # BPE target; the corpus is a few KB, so merges may stop earlier
VOCAB_PAD = 64  # the model's vocab is the tokenizer's rounded up to this (exercises padded vocab)
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")

# Small dims so it runs fast: hidden 64, 4 layers, 4 query heads over 2 KV heads of 16, 8 experts top-2.
# glm4_moe / deepseek_v3: layer 0 dense, 4 groups of 2 experts (2 groups kept), one shared expert; glm4_moe
# with q/k/v bias, qk-norm and half-width rotary; deepseek_v3 latent attention with a q LoRA and YaRN.
HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
EXPERTS = 8
TOP_K = 2
EXPERT_WIDTH = 32
CONTEXT = 4096
MLA_Q_LORA, MLA_KV_LORA, MLA_ROPE, MLA_NOPE, MLA_V = 32, 32, 8, 16, 16  # deepseek_v3's latent attention

# Qwen3-style ChatML with tools (tool-free conversations render exactly as plain ChatML): tools are listed
# in the system turn, the assistant's calls are <tool_call> JSON blocks, tool results come back in a user
# turn as <tool_response> blocks.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls %}{%- set f = tc.function if tc.function else tc %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + f.name + '\\\", \\\"arguments\\\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> Tokenizer:
    """Train the tiny byte-level BPE tokenizer on the packaged corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def _config(arch: str, vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    common: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-6,
        "initializer_range": 0.02, "tie_word_embeddings": False, "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32",
        "use_cache": True, "num_experts_per_tok": TOP_K, "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
    if arch == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                "intermediate_size": 4 * HIDDEN, "moe_intermediate_size": EXPERT_WIDTH,
                "num_experts": EXPERTS, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "rope_theta": 1000000.0, "attention_bias": False,
                "sliding_window": None, "use_sliding_window": False, "max_window_layers": LAYERS}
    if arch in ("glm4_moe", "deepseek_v3"):
        ds = {"intermediate_size": 4 * HIDDEN, "moe_intermediate_size": EXPERT_WIDTH,
              "n_routed_experts": EXPERTS,
              "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
              "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 0,
              "attention_bias": arch == "glm4_moe"}
        if arch == "glm4_moe":
            return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common, **ds,
                    "use_qk_norm": True, "partial_rotary_factor": 0.5, "rope_theta": 1000000.0}
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common, **ds,
                "num_key_value_heads": HEADS, "head_dim": MLA_ROPE, "q_lora_rank": MLA_Q_LORA,
                "kv_lora_rank": MLA_KV_LORA, "qk_rope_head_dim": MLA_ROPE, "qk_nope_head_dim": MLA_NOPE,
                "v_head_dim": MLA_V, "rope_interleave": True, "rope_theta": 10000.0,
                "rope_scaling": {"type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": CONTEXT // 4, "beta_fast": 32,
                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
            "intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS, "rope_theta": 1000000.0,
            "sliding_window": None, "router_jitter_noise": 0.0}


def _weights(arch: str, vocab: int, seed: int) -> dict[str, np.ndarray]:
    # Tensors are drawn in this fixed order; scales keep logits spread (few near-ties) and routing decisive.
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        return (np.float32(1.0) + normal((n,), 0.1)).astype(np.float32)

    if arch in ("glm4_moe", "deepseek_v3"):
        return _weights_deepseek(arch, vocab, normal, norm_weight)
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((vocab, HIDDEN), 1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = normal((q_out, HIDDEN), HIDDEN ** -0.5)
        w[p + "self_attn.k_proj.weight"] = normal((kv_out, HIDDEN), HIDDEN ** -0.5)
        w[p + "self_attn.v_proj.weight"] = normal((kv_out, HIDDEN), HIDDEN ** -0.5)
        w[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q_out), q_out ** -0.5)
        if arch == "qwen3_moe":
            w[p + "self_attn.q_norm.weight"] = norm_weight(HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = norm_weight(HEAD_DIM)
        w[p + "post_attention_layernorm.weight"] = norm_weight(HIDDEN)
        moe = p + ("mlp." if arch == "qwen3_moe" else "block_sparse_moe.")
        w[moe + "gate.weight"] = normal((EXPERTS, HIDDEN), 2.0 * HIDDEN ** -0.5)
        for e in range(EXPERTS):
            gate = normal((EXPERT_WIDTH, HIDDEN), HIDDEN ** -0.5)
            up = normal((EXPERT_WIDTH, HIDDEN), HIDDEN ** -0.5)
            down = normal((HIDDEN, EXPERT_WIDTH), EXPERT_WIDTH ** -0.5)
            x = f"{moe}experts.{e}."
            if arch == "qwen3_moe":
                w[x + "gate_proj.weight"], w[x + "up_proj.weight"], w[x + "down_proj.weight"] = gate, up, down
            else:
                w[x + "w1.weight"], w[x + "w3.weight"], w[x + "w2.weight"] = gate, up, down
    w["model.norm.weight"] = norm_weight(HIDDEN)
    w["lm_head.weight"] = normal((vocab, HIDDEN), 0.3)
    return w


def _weights_deepseek(arch: str, vocab: int, normal: Any, norm_weight: Any) -> dict[str, np.ndarray]:
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((vocab, HIDDEN), 1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = norm_weight(HIDDEN)
        if arch == "glm4_moe":
            q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
            for name, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                w[a + name + ".weight"] = normal((n, HIDDEN), HIDDEN ** -0.5)
                w[a + name + ".bias"] = normal((n,), 0.1)
            w[a + "q_norm.weight"] = norm_weight(HEAD_DIM)
            w[a + "k_norm.weight"] = norm_weight(HEAD_DIM)
            w[a + "o_proj.weight"] = normal((HIDDEN, q_out), q_out ** -0.5)
        else:
            qk = MLA_NOPE + MLA_ROPE
            w[a + "q_a_proj.weight"] = normal((MLA_Q_LORA, HIDDEN), HIDDEN ** -0.5)
            w[a + "q_a_layernorm.weight"] = norm_weight(MLA_Q_LORA)
            w[a + "q_b_proj.weight"] = normal((HEADS * qk, MLA_Q_LORA), MLA_Q_LORA ** -0.5)
            w[a + "kv_a_proj_with_mqa.weight"] = normal((MLA_KV_LORA + MLA_ROPE, HIDDEN), HIDDEN ** -0.5)
            w[a + "kv_a_layernorm.weight"] = norm_weight(MLA_KV_LORA)
            w[a + "kv_b_proj.weight"] = normal((HEADS * (MLA_NOPE + MLA_V), MLA_KV_LORA), MLA_KV_LORA ** -0.5)
            w[a + "o_proj.weight"] = normal((HIDDEN, HEADS * MLA_V), (HEADS * MLA_V) ** -0.5)
        w[p + "post_attention_layernorm.weight"] = norm_weight(HIDDEN)
        m = p + "mlp."
        if i == 0:  # first_k_dense_replace = 1
            w[m + "gate_proj.weight"] = normal((4 * HIDDEN, HIDDEN), HIDDEN ** -0.5)
            w[m + "up_proj.weight"] = normal((4 * HIDDEN, HIDDEN), HIDDEN ** -0.5)
            w[m + "down_proj.weight"] = normal((HIDDEN, 4 * HIDDEN), (4 * HIDDEN) ** -0.5)
            continue
        w[m + "gate.weight"] = normal((EXPERTS, HIDDEN), 2.0 * HIDDEN ** -0.5)
        w[m + "gate.e_score_correction_bias"] = normal((EXPERTS,), 0.2)
        for e in range(EXPERTS):
            x = f"{m}experts.{e}."
            w[x + "gate_proj.weight"] = normal((EXPERT_WIDTH, HIDDEN), HIDDEN ** -0.5)
            w[x + "up_proj.weight"] = normal((EXPERT_WIDTH, HIDDEN), HIDDEN ** -0.5)
            w[x + "down_proj.weight"] = normal((HIDDEN, EXPERT_WIDTH), EXPERT_WIDTH ** -0.5)
        w[m + "shared_experts.gate_proj.weight"] = normal((EXPERT_WIDTH, HIDDEN), HIDDEN ** -0.5)
        w[m + "shared_experts.up_proj.weight"] = normal((EXPERT_WIDTH, HIDDEN), HIDDEN ** -0.5)
        w[m + "shared_experts.down_proj.weight"] = normal((HIDDEN, EXPERT_WIDTH), EXPERT_WIDTH ** -0.5)
    w["model.norm.weight"] = norm_weight(HIDDEN)
    w["lm_head.weight"] = normal((vocab, HIDDEN), 0.3)
    return w


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def create_tiny(directory: str | Path, arch: str = "qwen3_moe", seed: int = 0) -> Path:
    """Write the tiny checkpoint into ``directory`` (created if needed; existing files are overwritten).

    Raises ``ValueError`` for an unknown ``arch``. Same (arch, seed) -> byte-identical files.
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown tiny arch {arch!r} (supported: {', '.join(ARCHES)})")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = {t: int(tok.token_to_id(t)) for t in SPECIAL_TOKENS}
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-n_tok // VOCAB_PAD) * VOCAB_PAD
    tok.save(str(d / "tokenizer.json"), pretty=True)
    tok_config = {
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True} for t in SPECIAL_TOKENS},
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT, "tokenizer_class": "PreTrainedTokenizerFast",
        "errors": "replace", "split_special_tokens": False,
    }
    (d / "tokenizer_config.json").write_text(_dump(tok_config), encoding="utf-8")
    (d / "config.json").write_text(_dump(_config(arch, vocab, ids)), encoding="utf-8")
    gen = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
           "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
    (d / "generation_config.json").write_text(_dump(gen), encoding="utf-8")
    save_file(_weights(arch, vocab, seed), str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def ensure_tiny(state_dir: str | Path, arch: str = "qwen3_moe", seed: int = 0) -> Path:
    """Path of the tiny checkpoint under ``state_dir``, creating it on first use."""
    models_dir = Path(state_dir) / "models"
    target = models_dir / f"tiny-v{TINY_VERSION}-{arch}-s{seed}"
    if all((target / f).is_file() for f in FILES):
        return target
    Path(state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)  # a state dir is private (SPEC)
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=models_dir))
    try:
        create_tiny(tmp, arch=arch, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race (target exists and is complete), or a stale partial dir.
            if not all((target / f).is_file() for f in FILES):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
