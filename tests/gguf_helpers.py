"""Helpers for GGUF tests: random transformers models, GGUF files written from them, and the fp32
reference (transformers with the GGUF's weights dequantized by ``gguf.quants``, not by the engine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

QWEN3_MOE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256)


def build(cls_cfg: str, cls_model: str, path: Path, seed: int = 0, dtype: str | None = None, **kw: object):
    """A random transformers model saved to ``path`` (weights large enough to keep routing off ties)."""
    import torch
    import transformers

    cfg = getattr(transformers, cls_cfg)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_model)(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 4
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in**0.5))
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    return model


_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "{moe}.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def reference_dir(src: Path, gguf_path: Path, out: Path) -> Path:
    """``src``'s config with every weight replaced by the GGUF's, dequantized with gguf.quants."""
    import gguf
    from safetensors.numpy import save_file

    cfg = json.loads((src / "config.json").read_text())
    mt = cfg["model_type"]
    moe = "block_sparse_moe" if mt == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if mt == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    r = gguf.GGUFReader(str(gguf_path))
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for t in r.tensors:
        shape = tuple(int(v) for v in reversed(t.shape.tolist()))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        name = t.name
        glob = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
        if name in glob:
            tensors[glob[name]] = w
            continue
        m = re.match(r"blk\.(\d+)\.(.+)", name)
        i, rest = int(m[1]), m[2]
        p = f"model.layers.{i}"
        exps = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
        if rest in exps:
            for e in range(w.shape[0]):
                tensors[f"{p}.{moe}.experts.{e}.{names[exps[rest]]}.weight"] = np.ascontiguousarray(w[e])
            continue
        if mt in ("llama", "mixtral") and rest in ("attn_q.weight", "attn_k.weight", "attn_q.bias",
                                                    "attn_k.bias"):
            h = heads if rest.startswith("attn_q") else kv
            w = w.reshape(h, w.shape[0] // h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if rest == "ffn_gate_inp_shexp.weight":
            w = w.reshape(1, -1)
        tensors[f"{p}.{_LAYER[rest].format(moe=moe)}"] = np.ascontiguousarray(w)
    save_file(tensors, str(out / "model.safetensors"))
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


_DECODE = r"""
import hashlib, sys
from engine import dense
from engine.model import Model
m = Model.load(sys.argv[1])
if sys.argv[2] == "f32-kernel":  # the check is void unless fp32 products take the compiled kernel
    assert dense.uses_kernel([m.layers[0].q])
c = m.new_cache(32)
h = hashlib.sha256()
logits = m.forward([1, 5, 9, 3, 7], c)
h.update(logits.tobytes())
tok = int(logits[-1].argmax())
for _ in range(5):
    logits = m.forward([tok], c)
    h.update(logits.tobytes())
    tok = int(logits[-1].argmax())
print(h.hexdigest())
"""


def decode_hash(path: Path, f32_kernel: bool = False, **env: str) -> str:
    """sha256 of the logits of a 5-token prefill and 5 greedy decode steps on ``path``, in a fresh interpreter
    with ``env`` added (``MESHD_KERNEL_THREADS``, ``MESHD_KERNELS``); ``f32_kernel`` first asserts that the fp32
    products take the compiled kernel."""
    p = subprocess.run([sys.executable, "-c", _DECODE, str(path), "f32-kernel" if f32_kernel else "-"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1]
