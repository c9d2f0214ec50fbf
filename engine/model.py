"""The decoder forward pass shared by every supported family (Llama/Qwen3 dense, Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE), over memory-mapped weights.

Usage::

    model = Model.load(path)                  # config.json + safetensors, or a .gguf; weights mmap'd
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

import contextlib
import math
import mmap
import os
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from . import dense, families, prefill_threads
from .checkpoint import Checkpoint, ProgressFn, TensorRef, load_checkpoint
from .config import ModelConfig
from .decode_plan import DecodePlan, planned
from .deepseek import route_sigmoid
from .dense import matmul, matmul_many
from .dense import warm as warm_dense
from .fp8 import Fp8Tensor
from .gguf_file import is_gguf, load_gguf
from .limits import KERNEL_MAX_ROWS, KERNELS_SLOW_NOTICE_S, KV_MAP_MIN_BYTES
from .loader import _Loader, _widened  # noqa: F401 - engine.mla takes _Loader from here
from .moe import (ExpertExecutor, ForwardSteps, RoutedCall, drive, expert_ffn, local_executor, make_routing, route,
                  silu)
from .ops import RopeTable, apply_rope, attention, rmsnorm
from .quant import Packed, packed, warm_kernels

log = structlog.get_logger(__name__)

F32 = np.float32
_NONE = np.zeros(0, dtype=F32)  # an absent q/k norm, for the compiled attention
WARM_MAX_BYTES = 8 << 20  # ``Model.warm`` reads at most this per layer (~0.6 ms of memory reads)


def _zeros(shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Zeroed fp32 arrays of these shapes. From ``KV_MAP_MIN_BYTES`` up they are views of one anonymous memory
    mapping: its pages are zero and take no memory until written, so a cache's resident size follows the
    positions written, not its capacity (an allocator's zeroed heap block is written, all of it, up front)."""
    total = sum(math.prod(sh) for sh in shapes)
    if total * 4 < KV_MAP_MIN_BYTES:
        return [np.zeros(sh, dtype=F32) for sh in shapes]
    buf = np.frombuffer(mmap.mmap(-1, total * 4), dtype=F32)
    out, a = [], 0
    for sh in shapes:
        n = math.prod(sh)
        out.append(buf[a : a + n].reshape(sh))
        a += n
    return out


class KVCache:
    """Keys and values of one sequence, per layer ``[KV, capacity, hd]`` (values ``v_dim`` wide if given);
    ``length`` positions are valid. Latent attention (engine/mla.py) keeps its latent in ``k`` and its
    shared rope key in ``v``.

    Capacity grows by doubling. A forward pass writes its positions first and advances ``length`` only
    when it completes, so a failed step leaves the cache as it was. The arrays are zero pages that become
    resident as positions are written (``_zeros``), so capacity beyond the sequence costs address space only.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = 256,
                 first_layer: int = 0, *, v_dim: int | None = None) -> None:
        self.length = 0
        self.first_layer = first_layer  # a pipeline stage's cache holds layers first_layer.. only
        self._shape = (kv_heads, head_dim, head_dim if v_dim is None else v_dim)
        self.k, self.v = self._alloc(num_layers, capacity)

    def _alloc(self, num_layers: int, capacity: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        kvh, kd, vd = self._shape
        arrs = _zeros([(kvh, capacity, kd)] * num_layers + [(kvh, capacity, vd)] * num_layers)
        return arrs[:num_layers], arrs[num_layers:]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] if self.k else 0

    def reserve(self, n: int) -> None:
        """Make room for n positions in total."""
        cap = self.capacity
        if n <= cap:
            return
        k, v = self._alloc(len(self.k), max(n, 2 * cap))
        for new, old in zip((*k, *v), (*self.k, *self.v)):
            new[:, : self.length] = old[:, : self.length]
        self.k, self.v = k, v

    def truncate(self, n: int) -> None:
        """Forget positions from n on (e.g. to reuse a shared prompt prefix)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n



@contextlib.contextmanager
def _said_if_slow(path: str, after_s: float = KERNELS_SLOW_NOTICE_S) -> Generator[None, None, None]:
    """Log once if loading the compiled kernels takes longer than ``after_s``: the first load on a machine
    compiles them (minutes on a small machine), and a daemon would otherwise sit silent before it is ready."""
    t0 = time.monotonic()
    timer = threading.Timer(after_s, lambda: log.info(
        "kernels_compiling", path=path, hint="the first load on a machine compiles the engine's kernels into "
        "numba's cache (can take minutes); later loads read the cache"))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if (took := time.monotonic() - t0) >= after_s:
            log.info("kernels_ready", path=path, seconds=round(took, 1))

@dataclass(slots=True)
class Layer:
    """Weights of one decoder layer. Matrices are ``engine.quant`` weights (an fp32 array, or a ``Packed``
    view in the stored type; ``x @ w.T`` works for both), vectors fp32 arrays."""

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
    experts: list[tuple[np.ndarray | Packed, np.ndarray | Packed, np.ndarray | Packed]] = field(default_factory=list)
    expert_dtypes: tuple[str, str, str] = ("F32", "F32", "F32")  # stored types of the routed experts
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    shared_expert_gate: np.ndarray | None = None
    router_bias: np.ndarray | None = None  # sigmoid routers' e_score_correction_bias [E]
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # family weights (latent attention's)

    @property
    def sparse(self) -> bool:
        return self.router is not None


class Model:
    """A loaded model: config, fp32 weight views, and the forward pass."""

    def __init__(self, config: ModelConfig, layers: list[Layer], embed: TensorRef, norm: np.ndarray,
                 lm_head: np.ndarray | Packed | None, checkpoint: Checkpoint | None = None,
                 path: Path | None = None, first_layer: int = 0) -> None:
        self.config = config
        self.layers = layers  # layers first_layer.. (all of them unless a pipeline stage)
        self.first_layer = first_layer
        self._embed = embed
        self._embed_w = packed(embed.data, embed.dtype, embed.shape)
        self.norm = norm
        self.lm_head = lm_head  # [V, D]; None on a pipeline stage that does not hold the last layer
        self.checkpoint = checkpoint
        self.path = path
        self.rope = RopeTable(config.rope, config.rotary_dim or config.head_dim)
        self.scale = config.head_dim**-0.5
        self._local = local_executor(self.expert_weights)
        # decode attention (one new position per sequence) compiled: engine.dense.step_kernels
        self._step = dense.step_kernels(config.hidden_size, config.num_heads, config.head_dim, config.qk_norm,
                                        config.clip_qkv)
        # one sequence's one-token decode through the local executor: engine.decode_plan (same bits, less
        # Python), made on first use; MESHD_DECODE_PLAN=0 keeps the general pass (A/B benchmarks)
        self._plan: DecodePlan | None | bool = os.environ.get("MESHD_DECODE_PLAN", "1") != "0" and self._step
        self._plan_lock = threading.Lock()

    # ----- loading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str], progress: ProgressFn | None = None,
             widen_experts: bool | None = None, prefetch: bool | None = None,
             layers: tuple[int, int] | None = None) -> Model:
        """Load ``config.json`` and the safetensors weights of a checkpoint directory, or a GGUF file (or the
        first file of a split set; ``engine.gguf_file``).

        Every matrix stays in its stored type as a zero-copy view of the file mapping (fp32 as the array,
        fp16/bf16/quantized as ``engine.quant.Packed``, multiplied tile by tile); only vectors (norms,
        biases) are widened. ``widen_experts`` widens the routed experts to fp32 here instead (more memory;
        the same bits on the numpy tiles, the same values within rounding with the compiled kernels). Raises
        ``ConfigError`` or ``CheckpointError`` (message names the file and tensor key).
        ``progress(done_bytes, total_bytes)`` is called as tensors are taken. ``prefetch`` (default: when
        a progress callback is given) reads every page of the weights during the load, so the progress
        reflects the disk and the first forward pass does not stall on page faults.

        ``layers=(first, last)`` loads only those decoder layers (a pipeline stage): the other layers'
        pages are never touched, and the final norm and output head are taken only with the last layer.
        """
        p = Path(path)
        permuted: dict[str, int] = {}
        if is_gguf(p):
            src = load_gguf(p)
            cfg, ckpt, permuted = src.config, src.checkpoint, src.permuted
        else:
            cfg = ModelConfig.load(p)
            ckpt = load_checkpoint(p)
        first, last = layers if layers is not None else (0, cfg.num_layers - 1)
        if not 0 <= first <= last < cfg.num_layers:
            raise ValueError(f"layers {first}-{last} outside the model's 0-{cfg.num_layers - 1}")
        widen_experts = bool(widen_experts)
        ld = _Loader(ckpt, progress, progress is not None if prefetch is None else prefetch, permuted,
                     cfg.fp8_block)
        if cfg.mla is not None and cls is Model:
            from .mla import MlaModel

            cls = MlaModel
        g = families.global_tensors(cfg)
        embed = ld.ref(g["embed"]) if first == 0 else ckpt[g["embed"][0]]
        head = last == cfg.num_layers - 1
        norm = ld.f32(g["norm"]) if head else np.zeros(0, dtype=F32)
        lm_head = None
        if head:
            lm_head = ld.weight(g["lm_head"]) if "lm_head" in g else packed(embed.data, embed.dtype, embed.shape)
        loaded = [cls._load_layer(cfg, ld, i, widen_experts) for i in range(first, last + 1)]
        if layers is None:
            ld.check_unexpected(cfg)
        ws = [w for lay in loaded for w in (lay.q, lay.o, *(lay.experts[0] if lay.experts else ()))]
        with _said_if_slow(str(p)):
            warm_kernels(ws)
            warm_dense(ws)
            if dense.step_kernels(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.qk_norm, cfg.clip_qkv):
                dense.warm_step()
        log.info("model_loaded", path=str(p), model_type=cfg.model_type, layers=cfg.num_layers,
                 first_layer=first, last_layer=last, weight_bytes=ckpt.nbytes, files=len(ckpt.files))
        return cls(cfg, loaded, embed, norm, lm_head, ckpt, p, first_layer=first)

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
            layer.router = ld.weight(fused["router"])
            gu, dn = ld.ref(fused["gate_up"]), ld.ref(fused["down"])
            inter, d = cfg.moe_intermediate_size, cfg.hidden_size
            for e in range(cfg.num_experts):
                w = (packed(gu.data[e, :inter], gu.dtype, (inter, d)), packed(gu.data[e, inter:], gu.dtype, (inter, d)),
                     packed(dn.data[e], dn.dtype, (d, inter)))
                layer.experts.append(_widened(w) if widen_experts else w)
            layer.expert_dtypes = (gu.dtype, gu.dtype, dn.dtype)
        else:
            layer.router = ld.weight(families.router_tensor(cfg, i))
            for e in range(cfg.num_experts):
                sp = families.expert_tensors(cfg, i, e)
                w = (ld.expert(sp["gate"]), ld.expert(sp["up"]), ld.expert(sp["down"]))
                layer.experts.append(_widened(w) if widen_experts else w)  # type: ignore[arg-type]
                layer.expert_dtypes = (ld.ckpt[sp["gate"][0]].dtype, ld.ckpt[sp["up"][0]].dtype,
                                       ld.ckpt[sp["down"][0]].dtype)
        shared = ld.group(families.shared_expert_tensors(cfg, i))
        if shared:
            layer.shared = (shared["shared_gate"], shared["shared_up"], shared["shared_down"])
            layer.shared_expert_gate = shared.get("shared_expert_gate")  # None: added ungated
        return layer

    # ----- API ---------------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(len(self.layers), c.num_kv_heads, c.head_dim, capacity, self.first_layer)

    def part(self, first: int, last: int) -> Model:
        """A view holding layers first..last of this model (same weight arrays, nothing copied); it has
        the output head only if ``last`` is the model's last layer. ``first > last``: no layers."""
        lo, hi = first - self.first_layer, last - self.first_layer + 1
        if first <= last and not (0 <= lo and hi <= len(self.layers)):
            held = f"{self.first_layer}-{self.last_layer}"
            raise ValueError(f"layers {first}-{last} are not all held here ({held})")
        head = last == self.config.num_layers - 1
        return type(self)(self.config, self.layers[lo:hi] if first <= last else [], self._embed, self.norm,
                     self.lm_head if head else None, self.checkpoint, self.path, first_layer=max(0, first))

    @property
    def last_layer(self) -> int:
        return self.first_layer + len(self.layers) - 1

    def expert_weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, D], up [I, D], down [D, I]) of one routed expert, as ``engine.quant`` weights (fp32
        arrays or ``Packed`` in the stored type; ``expert_ffn`` takes either)."""
        if not self.first_layer <= layer <= self.last_layer:
            raise ValueError(f"layer {layer} is not held here ({self.first_layer}-{self.last_layer})")
        lay = self.layers[layer - self.first_layer]
        if not lay.sparse:
            raise ValueError(f"layer {layer} has no routed experts")
        w = lay.experts[expert]
        if any(isinstance(a, Fp8Tensor) for a in w):  # FP8 routed experts: dequantized per use
            return tuple(a.f32() if isinstance(a, Fp8Tensor) else a for a in w)  # type: ignore[return-value]
        return w  # type: ignore[return-value]

    @property
    def local_executor(self) -> ExpertExecutor:
        """Runs every routed expert in this process with ``expert_ffn``."""
        return self._local

    @property
    def sparse_layers(self) -> list[int]:
        return [self.first_layer + i for i, lay in enumerate(self.layers) if lay.sparse]

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
        if not self.first_layer <= i <= self.last_layer:
            return 0
        lay = self.layers[i - self.first_layer]
        covered = 0
        for a in (lay.attn_norm, lay.q, lay.k, lay.v, lay.o, lay.mlp_norm, lay.router):
            if not isinstance(a, np.ndarray) or a.size == 0 or not a.flags.c_contiguous or a.dtype != F32:
                continue
            n = min(a.size, (WARM_MAX_BYTES - covered) // 4)  # a big matrix: its first rows
            if n == 0:  # the budget is spent
                break
            a.reshape(-1)[:n].view(np.uint32)[::16].max()
            covered += 4 * n
        return covered

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """[T] -> [T, D] fp32 (a copy of the rows)."""
        w = self._embed_w
        return w.take(ids) if isinstance(w, Packed) else w[ids]

    def _check_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        # a decode step's one token (a list from a caller, an int64 array from engine.generate.forward_last):
        # the checks below without numpy's reductions, ~8 us cheaper
        if (type(ids) is list and len(ids) == 1 and type(ids[0]) is int
                and 0 <= ids[0] < self.config.vocab_size):
            return np.array(ids, dtype=np.int64)
        if (type(ids) is np.ndarray and ids.shape == (1,) and ids.dtype == np.int64
                and 0 <= ids[0] < self.config.vocab_size):
            return ids
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
        if self._plan is not False and (executor is None or executor is self._local):
            arr = self._check_ids(ids)
            logits = planned(self, executor, arr.shape[0], cache, lambda plan: plan.step(arr, cache))
            if logits is not None:
                cache.length += 1
                return logits
            ids = arr
        remote_plan = getattr(executor, "decode_steps", None)  # a remote executor's planned one-token step
        steps = remote_plan(self, ids, cache) if remote_plan is not None else None
        if steps is None:
            steps = self.forward_steps(ids, cache, last_only=last_only)
        return drive(steps, executor or self._local, self.warm)

    def forward_steps(self, ids: Sequence[int] | np.ndarray, cache: KVCache, *,
                      last_only: bool = False) -> ForwardSteps:
        """``forward`` as steps: yields each sparse layer's routed call, returns the logits."""
        arr = self._check_ids(ids)
        t, past = arr.shape[0], cache.length
        cache.reserve(past + t)
        return self._forward_steps(arr, cache, t, past, last_only)

    def _forward_steps(self, arr: np.ndarray, cache: KVCache, t: int, past: int, last_only: bool) -> ForwardSteps:
        x = self.embed(arr)  # [T, D]
        x = yield from self.span_steps(x, cache, past)
        cache.length = past + t
        return self._logits(x[-1:] if last_only else x)

    def span_steps(self, x: np.ndarray, cache: KVCache,
                   past: int) -> Generator[RoutedCall, np.ndarray, np.ndarray]:
        """The layers held here on hidden states x [T, D] at positions past..past+T-1 -> [T, D]; writes those
        positions into ``cache`` (room reserved by the caller) but leaves ``cache.length`` to the caller.
        The whole model runs exactly this over all its layers; a pipeline stage runs it over its range."""
        t = x.shape[0]
        cos, sin = self.rope.span(past, past + t)
        window = self.config.sliding_window
        for j, layer in enumerate(self.layers):
            i = self.first_layer + j
            h = self._norm(x, layer.attn_norm)
            kc, vc = cache.k[i - cache.first_layer], cache.v[i - cache.first_layer]
            # no name holds attention's output [T, H * hd] once o has taken it (the routed layer's peak follows)
            x, h = self._add_norm(x, self._out(layer, self._attend(layer, h, kc, vc, past, cos, sin, window)),
                                  layer.mlp_norm)
            x += yield from self._mlp(i, layer, h)
        return x

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
        pos = np.array([c.length for c in caches], dtype=np.int64)
        x = self.embed(arr)  # [B, D]
        x = yield from self.span_batch_steps(x, caches, pos)
        for c in caches:
            c.length += 1
        return self._logits(x)

    def span_batch_steps(self, x: np.ndarray, caches: Sequence[KVCache],
                         pos: np.ndarray) -> Generator[RoutedCall, np.ndarray, np.ndarray]:
        """One decode step of B sequences through the layers held here: x [B, D], sequence s at position
        pos[s] -> [B, D]; writes each position into its cache, leaves ``length`` to the caller."""
        b = x.shape[0]
        cos, sin = self.rope.gather(pos)
        window = self.config.sliding_window
        for j, layer in enumerate(self.layers):
            i = self.first_layer + j
            h = self._norm(x, layer.attn_norm)
            kv = [(c.k[i - c.first_layer], c.v[i - c.first_layer]) for c in caches]
            att = self._attend_batch(layer, h, kv, pos, cos, sin, window)
            x = x + self._out(layer, att)
            x += yield from self._mlp(i, layer, self._norm(x, layer.mlp_norm))
        return x

    # ----- pieces ------------------------------------------------------------------------------------
    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """RMSNorm of hidden states [T, D]; compiled for decode rows when the model's step is, in row ranges on
        the prefill threads for a prefill's (each row the same bits either way)."""
        t = x.shape[0]
        if self._step and t <= KERNEL_MAX_ROWS:
            return dense.rmsnorm(x, w, self.config.rms_norm_eps)
        if t <= KERNEL_MAX_ROWS or prefill_threads.threads() == 1:
            return rmsnorm(x, w, self.config.rms_norm_eps)
        out = np.empty(x.shape, dtype=F32)

        def rows(a: int, b: int) -> None:
            out[a:b] = rmsnorm(x[a:b], w, self.config.rms_norm_eps)

        prefill_threads.run_rows(t, rows)
        return out

    def _add_norm(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The residual add and the next norm: (x + y, RMSNorm(x + y)) of [T, D] each, a prefill's in row ranges
        on the prefill threads (elementwise and per row: the same bits)."""
        t = x.shape[0]
        if t <= KERNEL_MAX_ROWS or prefill_threads.threads() == 1:
            x = x + y
            return x, self._norm(x, w)
        xs = np.empty(x.shape, dtype=F32)
        out = np.empty(x.shape, dtype=F32)

        def rows(a: int, b: int) -> None:
            np.add(x[a:b], y[a:b], out=xs[a:b])
            out[a:b] = rmsnorm(xs[a:b], w, self.config.rms_norm_eps)

        prefill_threads.run_rows(t, rows)
        return xs, out

    def _attend(self, layer: Layer, h: np.ndarray, kc: np.ndarray, vc: np.ndarray, past: int,
                cos: np.ndarray, sin: np.ndarray, window: int | None) -> np.ndarray:
        """Attention of a layer for T new positions after ``past``: normed h [T, D] -> [T, H * hd] (before
        o_proj); writes the new keys and values into the layer's cache arrays kc, vc."""
        t = h.shape[0]
        if t == 1 and self._step:
            return self._attend_one(layer, h, kc, vc, past, cos[0], sin[0], window)
        if t <= KERNEL_MAX_ROWS or prefill_threads.threads() == 1:
            q, k, v = self._qkv(layer, h, cos, sin)
            kc[:, past : past + t] = k.transpose(1, 0, 2)
            vc[:, past : past + t] = v.transpose(1, 0, 2)
        else:  # a prefill: the products on BLAS's threads, the row-wise rest in row ranges on the prefill threads
            c = self.config
            qs, ks, vs = matmul_many([(h, layer.q), (h, layer.k), (h, layer.v)])  # h @ w.T each
            q = np.empty((t, c.num_heads, c.head_dim), dtype=F32)

            def rows(a: int, b: int) -> None:
                q[a:b], k, v = self._qkv_rows(layer, qs[a:b], ks[a:b], vs[a:b], cos[a:b], sin[a:b])
                kc[:, past + a : past + b] = k.transpose(1, 0, 2)
                vc[:, past + a : past + b] = v.transpose(1, 0, 2)

            prefill_threads.run_rows(t, rows)
            del qs, ks, vs  # q/k/v before rope: free before attention's pieces allocate (1.25 MiB at 256 tokens)
        return attention(q, kc[:, : past + t], vc[:, : past + t], past, self.scale, window)

    def _attend_batch(self, layer: Layer, h: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]],
                      pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, window: int | None) -> np.ndarray:
        """Attention of a layer for one new position per sequence: h [B, D] -> [B, H * hd]; ``kv`` holds
        each sequence's cache arrays of this layer."""
        if self._step:
            return np.concatenate([self._attend_one(layer, h[s : s + 1], kc, vc, int(pos[s]), cos[s], sin[s], window)
                                   for s, (kc, vc) in enumerate(kv)])
        q, k, v = self._qkv(layer, h, cos, sin)  # [B, heads, hd]
        att = np.empty((h.shape[0], q.shape[1] * q.shape[2]), dtype=F32)
        for s, (kc, vc) in enumerate(kv):
            p = int(pos[s])
            kc[:, p] = k[s]
            vc[:, p] = v[s]
            att[s] = attention(q[s : s + 1], kc[:, : p + 1], vc[:, : p + 1], p, self.scale, window)[0]
        return att

    def _attend_one(self, layer: Layer, h: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: int,
                    cos: np.ndarray, sin: np.ndarray, window: int | None) -> np.ndarray:
        """``_attend`` of one new position at ``pos``, compiled (``engine.dense_kernels.attend_one``: head
        norms, rope, cache write and attention in one call): h [1, D] -> [1, H * hd]."""
        c = self.config
        q, k, v = matmul_many([(h, layer.q), (h, layer.k), (h, layer.v)])
        if layer.q_bias is not None:
            q += layer.q_bias
            k += layer.k_bias
            v += layer.v_bias
        out = np.empty((1, c.num_heads * c.head_dim), dtype=F32)
        lo = 0 if window is None else max(0, pos - window + 1)
        dense.attend_one(np.ascontiguousarray(q).reshape(c.num_heads, c.head_dim),
                         np.ascontiguousarray(k).reshape(c.num_kv_heads, c.head_dim),
                         np.ascontiguousarray(v).reshape(c.num_kv_heads, c.head_dim),
                         _NONE if layer.q_norm is None else layer.q_norm,
                         _NONE if layer.k_norm is None else layer.k_norm, c.rms_norm_eps,
                         cos, sin, kc, vc, pos, lo, self.scale, out[0])
        return out

    def _qkv(self, layer: Layer, h: np.ndarray, cos: np.ndarray,
             sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[T, D] -> q [T, H, hd], k/v [T, KV, hd] with biases, q/k norms, clipping and rope applied."""
        q, k, v = matmul_many([(h, layer.q), (h, layer.k), (h, layer.v)])  # h @ w.T each
        return self._qkv_rows(layer, q, k, v, cos, sin)

    def _qkv_rows(self, layer: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray,
                  sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_qkv`` after its products, on rows of them (q [T, H * hd], k/v [T, KV * hd], modified in place;
        cos/sin of those rows' positions): every step is per row, so a range of rows gives those rows' bits."""
        c = self.config
        t = q.shape[0]
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
        out = matmul(att, layer.o)  # [T, D]
        if layer.o_bias is not None:
            out += layer.o_bias
        return out

    def _mlp(self, i: int, layer: Layer, h: np.ndarray) -> Generator[RoutedCall, np.ndarray, np.ndarray]:
        """Feed-forward of layer i on normed h [T, D] -> [T, D]; a sparse layer yields its routed call."""
        if not layer.sparse:
            if layer.gate_bias is None:
                return expert_ffn(h, layer.gate, layer.up, layer.down)  # type: ignore[arg-type]
            a = matmul(h, layer.gate) + layer.gate_bias
            a = silu(a) * (matmul(h, layer.up) + layer.up_bias)
            return matmul(a, layer.down) + layer.down_bias
        c = self.config
        logits = matmul(h, layer.router)  # [T, E]
        if c.router is not None:
            bias = layer.router_bias
            routing = route_sigmoid(logits, bias, c.top_k, c.router, c.norm_topk_prob)  # type: ignore[arg-type]
        elif self._step and logits.shape[0] == 1:  # one token: softmax and top-k in one compiled call
            routing = make_routing(*dense.route_one(logits[0], c.top_k, c.norm_topk_prob))
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
        if self.lm_head is None:
            raise ValueError("this pipeline stage does not hold the output head")
        return matmul(self._norm(x, self.norm), self.lm_head)  # [T, V]

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head: hidden [T, D] -> logits [T, V] fp32 (the last stage's job)."""
        return self._logits(x)
