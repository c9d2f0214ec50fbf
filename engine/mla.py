"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): the ``Model`` of ``deepseek_v3`` and
``glm4_moe_lite`` checkpoints (everything but the attention is ``engine.model.Model``'s).

Per layer, for hidden h [T, D] (``r`` = qk_rope_head_dim, ``n`` = qk_nope_head_dim, ``c`` = kv_lora_rank):

* ``q = h Wq^T`` or, with ``q_lora_rank``, ``q = rmsnorm(h Wqa^T + bqa) Wqb^T``: [T, H, n + r];
* ``kv_a_proj_with_mqa``: ``[latent | k_rot] = h Wkva^T + bkva``; ``latent = rmsnorm(latent)`` [T, c];
  ``k_rot`` [T, r] is one rope key shared by every head;
* rope on ``q[..., n:]`` and ``k_rot`` (``rope_interleave``: the r dims are (x0, x1), (x2, x3) pairs,
  rotated as transformers does: even dims to the first half, odd to the second, on both q and k);
* ``kv_b_proj`` [H * (n + v), c] expands the latent to per-head ``k_nope`` [n] and value [v];
* scores ``q_nope . k_nope + q_rot . k_rot``, times ``softmax_scale`` ((n + r)^-1/2, times YaRN's
  mscale(factor, mscale_all_dim)^2), causal softmax, values, then ``o_proj``.

The KV cache holds what attention needs and no more: per layer and position the normalised latent (c
floats, in ``KVCache.k``) and the roped shared key (r floats, in ``KVCache.v``), c + r per position
instead of H * (n + r + v) for expanded keys and values (576 against 40960 for DeepSeek-V3).

Two exact-arithmetic-equivalent ways to attend, chosen per call by their multiply count (so the same
shapes always take the same path): *expanded* (run kv_b over the L cached latents, then ordinary
attention; cheap for a prefill) and *absorbed* (fold kv_b's key half into the queries, ``q_nope W_uk``
[T, H, c], and its value half after the weighted sum; cheap for decode: nothing is done per cached
position beyond the dot products).
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .deepseek import MLA_NORM_EPS, MlaConfig, mla_tensors
from .limits import ATTENTION_QUERY_BLOCK
from .model import F32, KVCache, Layer, Model, _Loader
from .ops import apply_rope, causal_mask, rmsnorm, softmax_
from .quant import Packed, dequantize


class MlaModel(Model):
    """A ``Model`` whose attention is multi-head latent attention (``config.mla``)."""

    def __init__(self, config: ModelConfig, *args: object, **kwargs: object) -> None:
        super().__init__(config, *args, **kwargs)  # type: ignore[arg-type]
        self.mla: MlaConfig = config.mla
        self.scale = self.mla.softmax_scale

    @staticmethod
    def _attention_layer(cfg: ModelConfig, ld: _Loader, i: int) -> Layer:
        m: MlaConfig = cfg.mla
        split = mla_tensors(cfg, i, split_kv_b=True)
        specs = mla_tensors(cfg, i)
        if split["k_b"][0] in ld.ckpt:  # GGUF deepseek2: kv_b stored split
            if specs["v"][0] in ld.ckpt:  # some files keep kv_b too: that one is used, the split pair skipped
                ld.used.update((split["k_b"][0], split["v_b"][0]))
            else:
                specs = split
        kb_spec, vb_spec = specs.pop("k_b", None), specs.pop("v_b", None)
        w = ld.group(specs)
        layer = Layer(attn_norm=w.pop("attn_norm"), mlp_norm=w.pop("mlp_norm"), q=w.pop("q"), k=w.pop("k"),
                      v=w.pop("v", np.zeros(0, dtype=F32)), o=w.pop("o"), k_bias=w.pop("k_bias", None),
                      o_bias=w.pop("o_bias", None))
        if kb_spec is not None and vb_spec is not None:  # widened per layer (a stage widens only its own)
            kb, vb = ld.ref(kb_spec), ld.ref(vb_spec)
            k_b = dequantize(kb.data, kb.dtype, kb.shape)  # [H, c, n]
            w["w_uk"] = np.ascontiguousarray(k_b.transpose(0, 2, 1))  # [H, n, c]
            w["w_uv"] = np.ascontiguousarray(dequantize(vb.data, vb.dtype, vb.shape), dtype=F32)  # [H, v, c]
        else:
            if isinstance(layer.v, Packed):  # bf16/fp16/quantized storage: kv_b is split and reshaped: widen
                layer.v = layer.v.widen()
            kvb = layer.v.reshape(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            w["w_uk"] = np.ascontiguousarray(kvb[:, : m.qk_nope_head_dim])  # [H, n, c]
            w["w_uv"] = np.ascontiguousarray(kvb[:, m.qk_nope_head_dim :])  # [H, v, c]
        layer.extra = w  # q_a, q_a_norm, q_a_bias, kv_a_norm, w_uk, w_uv
        layer.v = np.zeros((0, m.kv_lora_rank), dtype=F32)  # kv_b lives on split in w_uk/w_uv only
        return layer

    def new_cache(self, capacity: int = 256) -> KVCache:
        m = self.mla
        return KVCache(len(self.layers), 1, m.kv_lora_rank, capacity, self.first_layer, v_dim=m.qk_rope_head_dim)

    # ----- projections -------------------------------------------------------------------------------
    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [T, heads, r] -> roped [T, heads, r] (interleaved pairs come out de-interleaved, as in the
        reference; q and k get the same layout, so their dot products are the pairs')."""
        if self.mla.interleave:
            x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, cos, sin)

    def _project(self, layer: Layer, h: np.ndarray, cos: np.ndarray,
                 sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """h [T, D] -> q_nope [T, H, n], q_rot [T, H, r] (roped), latent [T, c], k_rot [T, r] (roped)."""
        m, e = self.mla, layer.extra
        t = h.shape[0]
        if "q_a" in e:
            qa = h @ e["q_a"].T
            if "q_a_bias" in e:
                qa += e["q_a_bias"]
            q = rmsnorm(qa, e["q_a_norm"], MLA_NORM_EPS) @ layer.q.T
        else:
            q = h @ layer.q.T
        q = q.reshape(t, self.config.num_heads, m.qk_head_dim)
        ckv = h @ layer.k.T  # [T, c + r]
        if layer.k_bias is not None:
            ckv += layer.k_bias
        latent = rmsnorm(ckv[:, : m.kv_lora_rank], e["kv_a_norm"], MLA_NORM_EPS)
        k_rot = self._rope(ckv[:, None, m.kv_lora_rank :], cos, sin)[:, 0]
        q_rot = self._rope(q[..., m.qk_nope_head_dim :], cos, sin)
        return q[..., : m.qk_nope_head_dim], q_rot, latent, k_rot

    # ----- attention ---------------------------------------------------------------------------------
    def _expanded_cheaper(self, t: int, length: int) -> bool:
        m, h = self.mla, self.config.num_heads
        c, n, r, v = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        expanded = length * c * h * (n + v) + h * t * length * (n + r + v)
        absorbed = t * h * c * (n + v) + h * t * length * (2 * c + r)
        return expanded < absorbed

    def _latent_attention(self, layer: Layer, q_nope: np.ndarray, q_rot: np.ndarray, latent: np.ndarray,
                          k_rot: np.ndarray, past: int) -> np.ndarray:
        """T queries at positions past.. over L = past + T cached positions -> [T, H * v]. Long prompts
        go in blocks of ``ATTENTION_QUERY_BLOCK`` queries (the expanded keys and values made once)."""
        t, length = q_nope.shape[0], latent.shape[0]
        e = layer.extra
        kv = None
        if self._expanded_cheaper(t, length):
            k_nope = np.matmul(latent, e["w_uk"].transpose(0, 2, 1))  # [H, L, n]
            values = np.matmul(latent, e["w_uv"].transpose(0, 2, 1))  # [H, L, v]
            kv = (k_nope, values)
        if t <= ATTENTION_QUERY_BLOCK:
            return self._attend_block(layer, q_nope, q_rot, latent, k_rot, past, kv)
        out = np.empty((t, self.config.num_heads * self.mla.v_head_dim), dtype=F32)
        for a in range(0, t, ATTENTION_QUERY_BLOCK):
            b = min(t, a + ATTENTION_QUERY_BLOCK)
            # queries a..b-1 see positions up to past+b-1
            part = None if kv is None else (kv[0][:, : past + b], kv[1][:, : past + b])
            out[a:b] = self._attend_block(layer, q_nope[a:b], q_rot[a:b], latent[: past + b],
                                          k_rot[: past + b], past + a, part)
        return out

    def _attend_block(self, layer: Layer, q_nope: np.ndarray, q_rot: np.ndarray, latent: np.ndarray,
                      k_rot: np.ndarray, past: int, kv: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """One block of T queries, expanded (``kv``: k_nope [H, L, n], values [H, L, v]) or absorbed."""
        t = q_nope.shape[0]
        e = layer.extra
        rot_scores = q_rot.transpose(1, 0, 2) @ k_rot.T  # [H, T, L]
        if kv is not None:
            scores = np.matmul(q_nope.transpose(1, 0, 2), kv[0].transpose(0, 2, 1))  # [H, T, L]
        else:
            q_lat = np.matmul(q_nope.transpose(1, 0, 2), e["w_uk"])  # [H, T, c]
            scores = q_lat @ latent.T  # [H, T, L]
        scores += rot_scores
        scores *= F32(self.scale)
        if t > 1:
            scores += causal_mask(past, t)
        softmax_(scores)
        if kv is not None:
            out = np.matmul(scores, kv[1])  # [H, T, v]
        else:
            ctx = scores @ latent  # [H, T, c]
            out = np.matmul(ctx, e["w_uv"].transpose(0, 2, 1))  # [H, T, v]
        return out.transpose(1, 0, 2).reshape(t, -1)

    def _attend(self, layer: Layer, h: np.ndarray, kc: np.ndarray, vc: np.ndarray, past: int,
                cos: np.ndarray, sin: np.ndarray, window: int | None) -> np.ndarray:
        t = h.shape[0]
        q_nope, q_rot, latent, k_rot = self._project(layer, h, cos, sin)
        lc, rc = kc[0], vc[0]  # [cap, c], [cap, r]
        lc[past : past + t] = latent
        rc[past : past + t] = k_rot
        return self._latent_attention(layer, q_nope, q_rot, lc[: past + t], rc[: past + t], past)

    def _attend_batch(self, layer: Layer, h: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]],
                      pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, window: int | None) -> np.ndarray:
        q_nope, q_rot, latent, k_rot = self._project(layer, h, cos, sin)
        att = np.empty((h.shape[0], self.config.num_heads * self.mla.v_head_dim), dtype=F32)
        for s, (kc, vc) in enumerate(kv):
            p = int(pos[s])
            lc, rc = kc[0], vc[0]
            lc[p] = latent[s]
            rc[p] = k_rot[s]
            att[s] = self._latent_attention(layer, q_nope[s : s + 1], q_rot[s : s + 1], lc[: p + 1],
                                            rc[: p + 1], p)[0]
        return att
