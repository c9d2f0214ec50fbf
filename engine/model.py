"""The decoder forward pass shared by every supported family (Llama/Qwen3 dense, Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE), over memory-mapped weights.

Usage::

    model = Model.load(path)                  # config.json + safetensors, weights mmap'd
    cache = model.new_cache()
    logits = model.forward(prompt_ids, cache) # [T, V] fp32, appends T positions to the cache
    logits = model.forward([next_id], cache)  # one decode step
    model.forward_batch(ids, caches)          # one decode step of B sequences -> [B, V]

The routed-expert part of every sparse layer goes through an executor (default:
:meth:`Model.local_executor`), so a remote executor plugs in without touching this file. Both passes are
written as steps (``forward_steps``/``forward_batch_steps``, the ``engine.moe.ForwardSteps`` protocol):
they yield each sparse layer's routed call and are sent its output, and ``engine.moe.drive`` runs them
with the executor, which may run the layers on another thread (the remote executor's event loop).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from . import families
from .checkpoint import Checkpoint, CheckpointError, ProgressFn, TensorRef, load_checkpoint, to_f32
from .config import ModelConfig
from .deepseek import route_sigmoid
from .fp8 import Fp8Tensor, scale_key, scale_shape
from .moe import ExpertExecutor, ForwardSteps, RoutedCall, drive, expert_ffn, local_executor, route, silu
from .ops import RopeTable, apply_rope, attention, rmsnorm

log = structlog.get_logger(__name__)

F32 = np.float32
WARM_MAX_BYTES = 8 << 20  # ``Model.warm`` reads at most this per layer (~0.6 ms of memory reads)


_PAGE = 4096


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 if unknown, which keeps narrow experts narrow)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class KVCache:
    """Keys and values of one sequence, per layer ``[KV, capacity, hd]`` (values ``v_dim`` wide if given);
    ``length`` positions are valid. Latent attention (engine/mla.py) keeps its latent in ``k`` and its
    shared rope key in ``v``.

    Capacity grows by doubling. A forward pass writes its positions first and advances ``length`` only
    when it completes, so a failed step leaves the cache as it was.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = 256, *,
                 v_dim: int | None = None) -> None:
        self.length = 0
        self._shape = (kv_heads, head_dim, head_dim if v_dim is None else v_dim)
        self.k = [np.zeros((kv_heads, capacity, head_dim), dtype=F32) for _ in range(num_layers)]
        self.v = [np.zeros((kv_heads, capacity, self._shape[2]), dtype=F32) for _ in range(num_layers)]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] if self.k else 0

    def reserve(self, n: int) -> None:
        """Make room for n positions in total."""
        cap = self.capacity
        if n <= cap:
            return
        new = max(n, 2 * cap)
        kvh, kd, vd = self._shape
        for store, hd in ((self.k, kd), (self.v, vd)):
            for i, old in enumerate(store):
                grown = np.zeros((kvh, new, hd), dtype=F32)
                grown[:, : self.length] = old[:, : self.length]
                store[i] = grown

    def truncate(self, n: int) -> None:
        """Forget positions from n on (e.g. to reuse a shared prompt prefix)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n


@dataclass(slots=True)
class Layer:
    """Weights of one decoder layer (fp32 arrays, views of the mmap where storage is fp32)."""

    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    # dense MLP (dense layers)
    gate: np.ndarray | None = None
    up: np.ndarray | None = None
    down: np.ndarray | None = None
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    # sparse layers
    router: np.ndarray | None = None
    experts: list[tuple[TensorRef, TensorRef, TensorRef] | tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=list
    )
    experts_f32: bool = True
    expert_dtypes: tuple[str, str, str] = ("F32", "F32", "F32")  # storage dtypes of the fused layout
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    shared_expert_gate: np.ndarray | None = None
    router_bias: np.ndarray | None = None  # sigmoid routers' e_score_correction_bias [E]
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # family weights (latent attention's)

    @property
    def sparse(self) -> bool:
        return self.router is not None


class _Loader:
    """Takes tensors out of a checkpoint by explicit key, checking shape, and tracks what was used."""

    def __init__(self, ckpt: Checkpoint, progress: ProgressFn | None, prefetch: bool,
                 block: tuple[int, int] = (128, 128)) -> None:
        self.ckpt = ckpt
        self.block = block
        self.used: set[str] = set()
        self.progress = progress
        self.prefetch = prefetch
        self.total = ckpt.nbytes
        self.done = 0

    def ref(self, spec: families.Spec) -> TensorRef:
        key, shape = spec
        if key not in self.ckpt:
            raise CheckpointError(
                f"{self.ckpt.directory}: missing tensor {key!r} (expected shape {list(shape)})"
            )
        t = self.ckpt[key]
        if t.shape != shape:
            raise CheckpointError(
                f"{t.file}: tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}"
            )
        self.used.add(key)
        if self.prefetch and t.data.size:
            # Fault the tensor's pages in now (one byte per page) rather than during the first forward.
            t.data.reshape(-1).view(np.uint8)[::_PAGE].sum()
        self.done += t.nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)
        return t

    def weight(self, spec: families.Spec) -> TensorRef | Fp8Tensor:
        """A tensor as stored: its TensorRef, or for F8_E4M3 bytes an Fp8Tensor with its block scales."""
        t = self.ref(spec)
        if t.dtype != "F8_E4M3":
            return t
        try:
            sshape = scale_shape(t.shape, self.block)
        except ValueError as exc:
            raise CheckpointError(f"{t.file}: tensor {t.key!r}: {exc}") from None
        s = self.ref((scale_key(t.key), sshape))
        return Fp8Tensor(t.key, t.data, to_f32(s.data, s.dtype), self.block)

    def f32(self, spec: families.Spec) -> np.ndarray:
        return widen(self.weight(spec))

    def group(self, specs: dict[str, families.Spec]) -> dict[str, np.ndarray]:
        return {role: self.f32(spec) for role, spec in specs.items()}

    def check_unexpected(self, cfg: ModelConfig) -> None:
        tied = cfg.tie_word_embeddings
        for key in self.ckpt:
            if key in self.used or families.is_ignorable(cfg, key):
                continue
            if tied and key == "lm_head.weight":
                continue  # some exporters keep the tied head; the embedding is used, as the reference does
            raise CheckpointError(
                f"{self.ckpt.describe(key)} is not used by the {self.ckpt.directory.name!r} model"
            )


def widen(w: TensorRef | Fp8Tensor) -> np.ndarray:
    """A stored tensor in fp32 (fp32 storage: the view itself)."""
    if isinstance(w, Fp8Tensor):
        return w.f32()
    return to_f32(w.data, w.dtype)


class Model:
    """A loaded model: config, fp32 weight views, and the forward pass."""

    def __init__(self, config: ModelConfig, layers: list[Layer], embed: TensorRef, norm: np.ndarray,
                 lm_head: np.ndarray, checkpoint: Checkpoint | None = None, path: Path | None = None) -> None:
        self.config = config
        self.layers = layers
        self._embed = embed
        self.norm = norm
        self.lm_head = lm_head  # [V, D]
        self.checkpoint = checkpoint
        self.path = path
        self.rope = RopeTable(config.rope, config.rotary_dim or config.head_dim)
        self.scale = config.head_dim**-0.5
        self._local = local_executor(self.expert_weights)

    # ----- loading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str], progress: ProgressFn | None = None,
             widen_experts: bool | None = None, prefetch: bool | None = None) -> Model:
        """Load ``config.json`` and the safetensors weights of a checkpoint directory.

        fp32 tensors stay zero-copy views of the file mapping; fp16/bf16 tensors are widened to fp32 here.
        Routed experts stored in fp16/bf16 are widened here too if ``widen_experts`` (default: when the
        whole model in fp32 takes at most half of the available memory), else on every use (slower, but
        the resident size stays the checkpoint's). Results are identical either way. Raises
        ``ConfigError`` or ``CheckpointError`` (message names the file and tensor key).
        ``progress(done_bytes, total_bytes)`` is called as tensors are taken. ``prefetch`` (default: when
        a progress callback is given) reads every page of the weights during the load, so the progress
        reflects the disk and the first forward pass does not stall on page faults.
        """
        p = Path(path)
        cfg = ModelConfig.load(p)
        ckpt = load_checkpoint(p)
        if widen_experts is None:
            f32_bytes = sum(t.nbytes * 4 // t.data.itemsize for t in ckpt.values())
            widen_experts = f32_bytes <= _available_bytes() // 2
        ld = _Loader(ckpt, progress, progress is not None if prefetch is None else prefetch, cfg.fp8_block)
        if cfg.mla is not None and cls is Model:
            from .mla import MlaModel

            cls = MlaModel
        g = families.global_tensors(cfg)
        embed = ld.ref(g["embed"])
        norm = ld.f32(g["norm"])
        lm_head = ld.f32(g["lm_head"]) if "lm_head" in g else to_f32(embed.data, embed.dtype)
        layers = [cls._load_layer(cfg, ld, i, widen_experts) for i in range(cfg.num_layers)]
        ld.check_unexpected(cfg)
        log.info("model_loaded", path=str(p), model_type=cfg.model_type, layers=cfg.num_layers,
                 weight_bytes=ckpt.nbytes, files=len(ckpt.files))
        return cls(cfg, layers, embed, norm, lm_head, ckpt, p)

    @staticmethod
    def _attention_layer(cfg: ModelConfig, ld: _Loader, i: int) -> Layer:
        return Layer(**ld.group(families.attention_tensors(cfg, i)))

    @classmethod
    def _load_layer(cls, cfg: ModelConfig, ld: _Loader, i: int, widen_experts: bool) -> Layer:
        layer = cls._attention_layer(cfg, ld, i)
        if not cfg.is_sparse(i):
            for role, arr in ld.group(families.dense_mlp_tensors(cfg, i)).items():
                setattr(layer, role, arr)
            return layer
        fused = families.fused_expert_tensors(cfg, i)
        bias = families.router_bias_tensor(cfg, i)
        if bias is not None:
            layer.router_bias = ld.f32(bias)
        if fused["gate_up"][0] in ld.ckpt:
            layer.router = ld.f32(fused["router"])
            gu, dn = ld.ref(fused["gate_up"]), ld.ref(fused["down"])
            inter = cfg.moe_intermediate_size
            layer.experts_f32 = (gu.dtype == "F32" and dn.dtype == "F32") or widen_experts
            for e in range(cfg.num_experts):
                w = (gu.data[e, :inter], gu.data[e, inter:], dn.data[e])
                if widen_experts:
                    w = (to_f32(w[0], gu.dtype), to_f32(w[1], gu.dtype), to_f32(w[2], dn.dtype))
                layer.experts.append(w)
            layer.expert_dtypes = (gu.dtype, gu.dtype, dn.dtype)
        else:
            layer.router = ld.f32(families.router_tensor(cfg, i))
            dtypes: set[str] = set()
            for e in range(cfg.num_experts):
                sp = families.expert_tensors(cfg, i, e)
                refs = (ld.weight(sp["gate"]), ld.weight(sp["up"]), ld.weight(sp["down"]))
                dtypes.update("F8_E4M3" if isinstance(r, Fp8Tensor) else r.dtype for r in refs)
                layer.experts.append(refs)  # type: ignore[arg-type]
            layer.experts_f32 = dtypes == {"F32"} or widen_experts
            if layer.experts_f32:
                refs = layer.experts
                layer.experts = [(widen(g), widen(u), widen(d)) for g, u, d in refs]  # type: ignore[arg-type]
        shared = ld.group(families.shared_expert_tensors(cfg, i))
        if shared:
            layer.shared = (shared["shared_gate"], shared["shared_up"], shared["shared_down"])
            layer.shared_expert_gate = shared.get("shared_expert_gate")  # None: added ungated
        return layer

    # ----- API ---------------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity)

    def expert_weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, D], up [I, D], down [D, I]) of one routed expert, fp32;
        widened here if stored narrower and not widened at load."""
        lay = self.layers[layer]
        if not lay.sparse:
            raise ValueError(f"layer {layer} has no routed experts")
        w = lay.experts[expert]
        if lay.experts_f32:
            return w  # type: ignore[return-value]
        if isinstance(w[0], (TensorRef, Fp8Tensor)):
            return tuple(widen(r) for r in w)  # type: ignore[return-value,arg-type]
        out = tuple(to_f32(a, dt) for a, dt in zip(w, lay.expert_dtypes))  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    @property
    def local_executor(self) -> ExpertExecutor:
        """Runs every routed expert in this process with ``expert_ffn``."""
        return self._local

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i, lay in enumerate(self.layers) if lay.sparse]

    def warm(self, i: int) -> int:
        """Read layer ``i``'s attention weights into the CPU caches, in the order the pass uses them, up to
        ``WARM_MAX_BYTES`` (of a matrix that does not fit, its first rows); -> the bytes covered (0 past
        the last layer).

        An executor calls it while layer ``i - 1``'s routed experts are out on the network: the pass has
        nothing else to do until they come back, and layer ``i``'s attention comes soon after (a shared expert
        of layer ``i - 1``, if any, runs first). Covers the norms, q/k/v/o and the router; biases and q/k
        norms are a few KB and left out. One load per 64-byte cache line (a strided integer max: no
        arithmetic on the values, no copy). Read-only, so the results do not change.
        """
        if not 0 <= i < len(self.layers):
            return 0
        lay = self.layers[i]
        covered = 0
        for a in (lay.attn_norm, lay.q, lay.k, lay.v, lay.o, lay.mlp_norm, lay.router):
            if a is None or a.size == 0 or not a.flags.c_contiguous or a.dtype != F32:
                continue
            n = min(a.size, (WARM_MAX_BYTES - covered) // 4)  # a big matrix: its first rows
            if n == 0:  # the budget is spent
                break
            a.reshape(-1)[:n].view(np.uint32)[::16].max()
            covered += 4 * n
        return covered

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """[T] -> [T, D] fp32 (a copy of the rows)."""
        return to_f32(self._embed.data[ids], self._embed.dtype)

    def _check_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("ids must be a non-empty 1-D sequence of integers")
        arr = arr.astype(np.int64, copy=False)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.vocab_size}): {lo if lo < 0 else hi}")
        return arr

    def forward(self, ids: Sequence[int] | np.ndarray, cache: KVCache,
                executor: ExpertExecutor | None = None, *, last_only: bool = False) -> np.ndarray:
        """Run T new tokens after the cache's positions: [T] -> logits [T, V] fp32; appends T positions.

        ``last_only`` returns only the last position's logits ([1, V]), skipping the output head for the
        others (a prefill that only needs the next token).
        """
        return drive(self.forward_steps(ids, cache, last_only=last_only), executor or self._local, self.warm)

    def forward_steps(self, ids: Sequence[int] | np.ndarray, cache: KVCache, *,
                      last_only: bool = False) -> ForwardSteps:
        """``forward`` as steps: yields each sparse layer's routed call, returns the logits."""
        arr = self._check_ids(ids)
        t, past = arr.shape[0], cache.length
        cache.reserve(past + t)
        return self._forward_steps(arr, cache, t, past, last_only)

    def _forward_steps(self, arr: np.ndarray, cache: KVCache, t: int, past: int, last_only: bool) -> ForwardSteps:
        cos, sin = self.rope.span(past, past + t)
        x = self.embed(arr)  # [T, D]
        window = self.config.sliding_window
        for i, layer in enumerate(self.layers):
            h = rmsnorm(x, layer.attn_norm, self.config.rms_norm_eps)
            kc, vc = cache.k[i], cache.v[i]
            att = self._attend(layer, h, kc, vc, past, cos, sin, window)
            x = x + self._out(layer, att)
            x += yield from self._mlp(i, layer, rmsnorm(x, layer.mlp_norm, self.config.rms_norm_eps))
        cache.length = past + t
        return self._logits(x[-1:] if last_only else x)

    def forward_batch(self, ids: Sequence[int] | np.ndarray, caches: Sequence[KVCache],
                      executor: ExpertExecutor | None = None) -> np.ndarray:
        """One decode step of B sequences: ids [B] (one new token each) -> logits [B, V].

        Each sequence has its own cache (any lengths); each gets one position appended.
        """
        return drive(self.forward_batch_steps(ids, caches), executor or self._local, self.warm)

    def forward_batch_steps(self, ids: Sequence[int] | np.ndarray, caches: Sequence[KVCache]) -> ForwardSteps:
        """``forward_batch`` as steps: yields each sparse layer's routed call, returns the logits."""
        arr = self._check_ids(ids)
        b = arr.shape[0]
        if len(caches) != b:
            raise ValueError(f"{b} ids for {len(caches)} caches")
        if len({id(c) for c in caches}) != b:
            raise ValueError("each sequence needs its own cache")
        for c in caches:
            c.reserve(c.length + 1)
        return self._forward_batch_steps(arr, list(caches))

    def _forward_batch_steps(self, arr: np.ndarray, caches: list[KVCache]) -> ForwardSteps:
        b = arr.shape[0]
        pos = np.array([c.length for c in caches], dtype=np.int64)
        cos, sin = self.rope.gather(pos)
        x = self.embed(arr)  # [B, D]
        window = self.config.sliding_window
        for i, layer in enumerate(self.layers):
            h = rmsnorm(x, layer.attn_norm, self.config.rms_norm_eps)
            kv = [(c.k[i], c.v[i]) for c in caches]
            att = self._attend_batch(layer, h, kv, pos, cos, sin, window)
            x = x + self._out(layer, att)
            x += yield from self._mlp(i, layer, rmsnorm(x, layer.mlp_norm, self.config.rms_norm_eps))
        for c in caches:
            c.length += 1
        return self._logits(x)

    # ----- pieces ------------------------------------------------------------------------------------
    def _attend(self, layer: Layer, h: np.ndarray, kc: np.ndarray, vc: np.ndarray, past: int,
                cos: np.ndarray, sin: np.ndarray, window: int | None) -> np.ndarray:
        """Attention of a layer for T new positions after ``past``: normed h [T, D] -> [T, H * hd] (before
        o_proj); writes the new keys and values into the layer's cache arrays kc, vc."""
        t = h.shape[0]
        q, k, v = self._qkv(layer, h, cos, sin)
        kc[:, past : past + t] = k.transpose(1, 0, 2)
        vc[:, past : past + t] = v.transpose(1, 0, 2)
        return attention(q, kc[:, : past + t], vc[:, : past + t], past, self.scale, window)

    def _attend_batch(self, layer: Layer, h: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]],
                      pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, window: int | None) -> np.ndarray:
        """Attention of a layer for one new position per sequence: h [B, D] -> [B, H * hd]; ``kv`` holds
        each sequence's cache arrays of this layer."""
        q, k, v = self._qkv(layer, h, cos, sin)  # [B, heads, hd]
        att = np.empty((h.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
        for s, (kc, vc) in enumerate(kv):
            p = int(pos[s])
            kc[:, p] = k[s]
            vc[:, p] = v[s]
            att[s] = attention(q[s : s + 1], kc[:, : p + 1], vc[:, : p + 1], p, self.scale, window)[0]
        return att

    def _qkv(self, layer: Layer, h: np.ndarray, cos: np.ndarray,
             sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[T, D] -> q [T, H, hd], k/v [T, KV, hd] with biases, q/k norms, clipping and rope applied."""
        c = self.config
        t = h.shape[0]
        q = h @ layer.q.T
        k = h @ layer.k.T
        v = h @ layer.v.T
        if layer.q_bias is not None:
            q += layer.q_bias
            k += layer.k_bias
            v += layer.v_bias
        if c.qk_norm == "full":
            q = rmsnorm(q, layer.q_norm, c.rms_norm_eps)
            k = rmsnorm(k, layer.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            np.clip(q, -c.clip_qkv, c.clip_qkv, out=q)
            np.clip(k, -c.clip_qkv, c.clip_qkv, out=k)
            np.clip(v, -c.clip_qkv, c.clip_qkv, out=v)
        q = q.reshape(t, c.num_heads, c.head_dim)
        k = k.reshape(t, c.num_kv_heads, c.head_dim)
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm == "head":
            q = rmsnorm(q, layer.q_norm, c.rms_norm_eps)
            k = rmsnorm(k, layer.k_norm, c.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @staticmethod
    def _out(layer: Layer, att: np.ndarray) -> np.ndarray:
        out = att @ layer.o.T  # [T, D]
        if layer.o_bias is not None:
            out += layer.o_bias
        return out

    def _mlp(self, i: int, layer: Layer, h: np.ndarray) -> Generator[RoutedCall, np.ndarray, np.ndarray]:
        """Feed-forward of layer i on normed h [T, D] -> [T, D]; a sparse layer yields its routed call."""
        if not layer.sparse:
            if layer.gate_bias is None:
                return expert_ffn(h, layer.gate, layer.up, layer.down)  # type: ignore[arg-type]
            a = h @ layer.gate.T + layer.gate_bias  # type: ignore[union-attr]
            a = silu(a) * (h @ layer.up.T + layer.up_bias)  # type: ignore[union-attr]
            return a @ layer.down.T + layer.down_bias  # type: ignore[union-attr]
        c = self.config
        logits = h @ layer.router.T  # type: ignore[union-attr]  # [T, E]
        if c.router is not None:
            bias = layer.router_bias
            routing = route_sigmoid(logits, bias, c.top_k, c.router, c.norm_topk_prob)  # type: ignore[arg-type]
        else:
            routing = route(logits, c.top_k, c.norm_topk_prob)
        out = yield (i, h, routing)
        if layer.shared is not None:
            shared = expert_ffn(h, *layer.shared)
            if layer.shared_expert_gate is None:
                out += shared
            else:
                gate = h @ layer.shared_expert_gate.T  # [T, 1]
                out += (F32(1.0) / (F32(1.0) + np.exp(-gate))) * shared
        return out

    def _logits(self, x: np.ndarray) -> np.ndarray:
        x = rmsnorm(x, self.norm, self.config.rms_norm_eps)
        return x @ self.lm_head.T  # [T, V]
