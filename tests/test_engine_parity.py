"""Parity of the numpy engine with Hugging Face transformers on tiny checkpoints the tests create.

For each family and awkward config option: a random model is built with transformers' own config class,
saved with ``save_pretrained`` (optionally sharded, bf16/fp16, or rewritten Hub-style / fused), loaded by
``engine.model.Model``, and compared on the same ids:

* teacher-forced log-probabilities at every position (prefill of part of the prompt, then one-token
  decode steps through the KV cache) within 1e-4 of the reference (fp32 runs observe ~1e-6);
* greedy decoding (each side with its own KV cache): every step's log-probabilities within 1e-4 and the
  same token; where the tokens differ, the step must be a near tie of the reference (top two within
  1e-4), and decoding goes on with the reference's token, so the steps after a tie are still compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.model import Model  # noqa: E402

pytestmark = pytest.mark.ref

LOGPROB_TOL = 1e-4
TIE_TOL = 1e-4
PROMPT = [3, 17, 42, 8, 25, 1, 33, 9, 14, 40, 2, 27]
GREEDY_STEPS = 10

torch.set_num_threads(2)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits and routing are far from ties (the default init is ~uniform).
    Sigmoid routers' ``e_score_correction_bias`` (a buffer) gets the scale of the scores it shifts, so a
    bias used for weighting, or ignored, changes the chosen experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 4
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in**0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def _build(cls_cfg: str, cls_model: str, seed: int = 0, **kw: object) -> torch.nn.Module:
    cfg = getattr(transformers, cls_cfg)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_model)(cfg).eval()
    _randomise(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def _logprobs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _ref_logprobs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(out.double(), dim=-1).numpy()


def _check(model: torch.nn.Module, path: Path, prompt: list[int] = PROMPT, split: int | None = None) -> Model:
    eng = Model.load(path)
    assert eng.config.vocab_size == model.config.vocab_size
    # 1. teacher forced: prefill part of the prompt, then decode the rest one token at a time.
    ref = _ref_logprobs(model, prompt)
    cache = eng.new_cache(capacity=4)  # small on purpose: growth is exercised
    split = len(prompt) // 2 if split is None else split
    parts = [eng.forward(prompt[:split], cache)] + [eng.forward([t], cache) for t in prompt[split:]]
    got = _logprobs(np.concatenate(parts))
    assert got.shape == ref.shape
    err = np.abs(got - ref).max()
    assert err < LOGPROB_TOL, f"teacher-forced logprob error {err}"
    # 2. greedy decoding with the cache, against the reference with its own cache.
    cache = eng.new_cache()
    logits = eng.forward(prompt, cache)[-1]
    seq = list(prompt)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    for step in range(GREEDY_STEPS):
        ref_lp = torch.log_softmax(out.logits[0, -1].double(), dim=-1).numpy()
        lp = _logprobs(logits[None])[0]
        err = np.abs(lp - ref_lp).max()
        assert err < LOGPROB_TOL, f"greedy step {step}: logprob error {err}"
        ref_tok, tok = int(ref_lp.argmax()), int(lp.argmax())
        if tok != ref_tok:  # allowed only at a near tie; both continue with the reference's token
            top2 = np.sort(ref_lp)[-2:]
            assert top2[1] - top2[0] < TIE_TOL, f"greedy diverged at step {step} (margin {top2[1] - top2[0]})"
        seq.append(ref_tok)
        logits = eng.forward([ref_tok], cache)[-1]
        with torch.no_grad():
            out = model(torch.tensor([[ref_tok]]), cache=out.cache, use_cache=True)
    return eng


def _save_half(model: torch.nn.Module, path: Path, dtype: str) -> torch.nn.Module:
    """Save in half precision; return the reference: that checkpoint loaded by transformers in fp32."""
    import copy

    copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(path)
    return type(model).from_pretrained(path, dtype=torch.float32).eval()


def _hub_style(path: Path) -> None:
    """Rewrite a transformers-5 config.json the way Hub checkpoints spell it."""
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    if "num_local_experts" in cfg and cfg["model_type"] != "mixtral":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = None if rp.get("rope_type") == "default" else rp
    p.write_text(json.dumps(cfg))


QWEN3_MOE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8, num_experts_per_tok=2,
    rope_theta=500.0,
)


def test_qwen3_moe_explicit_head_dim_gqa_sparse_step_mlp_only(tmp_path: Path) -> None:
    m = _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **QWEN3_MOE, norm_topk_prob=True,
               decoder_sparse_step=2, mlp_only_layers=[3])
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path)
    assert eng.sparse_layers == [1]  # layer 3 is sparse by step but listed in mlp_only_layers


def test_qwen3_moe_mqa_tied_padded_vocab_sharded_hub_config(tmp_path: Path) -> None:
    kw = {**QWEN3_MOE, "num_key_value_heads": 1, "vocab_size": 100, "tie_word_embeddings": True}
    m = _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed=1, **kw, norm_topk_prob=False)
    m.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    _hub_style(tmp_path)
    eng = _check(m, tmp_path)  # prompt ids < 64: the rest of the vocab is padding the prompt never uses
    assert len(eng.checkpoint.files) > 2
    assert eng.config.tie_word_embeddings and eng.config.num_kv_heads == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_qwen3_moe_half_storage(tmp_path: Path, dtype: str) -> None:
    m = _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed=2, **QWEN3_MOE, norm_topk_prob=True)
    m = _save_half(m, tmp_path, dtype)
    eng = _check(m, tmp_path)
    assert eng.checkpoint["model.embed_tokens.weight"].dtype == {"bfloat16": "BF16", "float16": "F16"}[dtype]


def test_qwen3_moe_fused_expert_tensors(tmp_path: Path) -> None:
    """Fused 3-D expert tensors (transformers 5's in-memory layout) load like per-expert ones."""
    from safetensors.numpy import load_file, save_file

    m = _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed=3, **QWEN3_MOE, norm_topk_prob=True)
    m.save_pretrained(tmp_path)
    flat = load_file(tmp_path / "model.safetensors")
    out: dict[str, np.ndarray] = {}
    for key, arr in flat.items():
        if ".mlp.experts." not in key:
            out[key] = arr
    for layer in range(QWEN3_MOE["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        n = QWEN3_MOE["num_experts"]
        gate = [flat[f"{p}.{e}.gate_proj.weight"] for e in range(n)]
        up = [flat[f"{p}.{e}.up_proj.weight"] for e in range(n)]
        out[f"{p}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        out[f"{p}.down_proj"] = np.stack([flat[f"{p}.{e}.down_proj.weight"] for e in range(n)])
    save_file(out, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _check(m, tmp_path)


def test_qwen2_moe_shared_expert_qkv_bias_mixed_layers(tmp_path: Path) -> None:
    m = _build("Qwen2MoeConfig", "Qwen2MoeForCausalLM", seed=4, vocab_size=64, hidden_size=32,
               intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=6,
               num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[1], norm_topk_prob=False)
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path)
    assert eng.sparse_layers == [3]
    assert eng.layers[3].shared is not None and eng.layers[0].q_bias is not None


def test_qwen2_moe_hub_config_norm_topk(tmp_path: Path) -> None:
    m = _build("Qwen2MoeConfig", "Qwen2MoeForCausalLM", seed=5, vocab_size=64, hidden_size=32,
               intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=6,
               num_experts_per_tok=3, norm_topk_prob=True)
    m.save_pretrained(tmp_path)
    _hub_style(tmp_path)
    _check(m, tmp_path)


def test_mixtral(tmp_path: Path) -> None:
    m = _build("MixtralConfig", "MixtralForCausalLM", seed=6, vocab_size=64, hidden_size=32,
               intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=6, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2)
    m.save_pretrained(tmp_path)
    assert "block_sparse_moe" in (tmp_path / "model.safetensors").read_bytes()[:20000].decode("latin-1")
    _hub_style(tmp_path)
    _check(m, tmp_path)


def test_mixtral_fp16_mqa_sliding_window(tmp_path: Path) -> None:
    m = _build("MixtralConfig", "MixtralForCausalLM", seed=7, vocab_size=64, hidden_size=32,
               intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=5, bos_token_id=1, eos_token_id=2)
    m = _save_half(m, tmp_path, "float16")
    eng = _check(m, tmp_path)
    assert eng.config.sliding_window == 5


def test_olmoe_full_width_qk_norm(tmp_path: Path) -> None:
    m = _build("OlmoeConfig", "OlmoeForCausalLM", seed=8, vocab_size=64, hidden_size=32,
               intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, eos_token_id=2, pad_token_id=1)
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path)
    assert eng.config.qk_norm == "full" and eng.layers[0].q_norm.shape == (32,)


def test_olmoe_bf16_norm_topk_clip_qkv(tmp_path: Path) -> None:
    m = _build("OlmoeConfig", "OlmoeForCausalLM", seed=9, vocab_size=64, hidden_size=32,
               intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.8,
               eos_token_id=2, pad_token_id=1)
    m = _save_half(m, tmp_path, "bfloat16")
    _hub_style(tmp_path)
    _check(m, tmp_path)


def test_llama_head_dim_bias_tied_llama3_rope(tmp_path: Path) -> None:
    m = _build("LlamaConfig", "LlamaForCausalLM", seed=10, vocab_size=64, hidden_size=32,
               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
               rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16})
    m.save_pretrained(tmp_path)
    _check(m, tmp_path)


def test_llama_mqa_hub_config(tmp_path: Path) -> None:
    m = _build("LlamaConfig", "LlamaForCausalLM", seed=11, vocab_size=64, hidden_size=32,
               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1)
    m.save_pretrained(tmp_path)
    _hub_style(tmp_path)
    _check(m, tmp_path)


def test_qwen3_dense_tied_gqa(tmp_path: Path) -> None:
    m = _build("Qwen3Config", "Qwen3ForCausalLM", seed=12, vocab_size=64, hidden_size=32,
               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, tie_word_embeddings=True)
    m.save_pretrained(tmp_path)
    _check(m, tmp_path)


def test_forward_batch_matches_reference(tmp_path: Path) -> None:
    """One batched decode step of sequences at different lengths gives each sequence's reference logprobs."""
    m = _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed=13, **QWEN3_MOE, norm_topk_prob=True)
    m.save_pretrained(tmp_path)
    eng = Model.load(tmp_path)
    lengths = [3, 7, 12, 5]
    caches = [eng.new_cache() for _ in lengths]
    for c, n in zip(caches, lengths):
        eng.forward(PROMPT[: n - 1], c)
    out = _logprobs(eng.forward_batch([PROMPT[n - 1] for n in lengths], caches))
    for row, n in zip(out, lengths):
        ref = _ref_logprobs(m, PROMPT[:n])[-1]
        assert np.abs(row - ref).max() < LOGPROB_TOL
    assert [c.length for c in caches] == lengths


def test_long_prompt_blocked_attention(tmp_path: Path) -> None:
    """A prompt longer than one attention query block (256) through prefill and the cache."""
    m = _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed=14, **QWEN3_MOE, norm_topk_prob=True)
    m.save_pretrained(tmp_path)
    prompt = [int(i) for i in np.random.default_rng(14).integers(0, 64, 300)]
    _check(m, tmp_path, prompt=prompt, split=290)
