"""One sequence's decode step (one new token) planned once per model: the same operations as
``Model.forward`` on one token, in the same order on the same arrays' values, with less Python in between.

``Model.forward`` of one token through the local executor spends about as long in Python between the
compiled calls as in the weight products (the profile in docs/engine-model.md). The plan removes most
of it, without changing an operation:

- Work buffers are allocated once per model (hidden state, normed rows, q/k/v, attention output, the
  routed experts' gate/up/down outputs), so each product's kernel table (``engine.kernel_pool.table``: the
  addresses of x, the stored weight and out) is built once too. A layer's q/k/v round, its o-projection
  and every expert's gate/up and down products are prebuilt table rows; a token's expert round is the
  chosen experts' rows concatenated (one numpy take).
- The routed experts' combination and the residual add are one compiled call (``dense_kernels.
  combine_add``: ``acc = 0; acc += w_j * y_j`` in slot order, then ``x += acc``, with no fastmath, so the
  same fp32 roundings as ``engine.moe.combine`` and the pass's ``x += out``).

Everything else is the function the general pass calls: ``dense.rmsnorm``'s kernel, ``attend_one``,
``route_one``, the compiled SwiGLU, ``dense.matmul`` for the router and the output head. So the logits are
the general pass's bits (tested), and a pipeline stage (which runs the plan's layer-range form, below) or an
expert worker (the general pass) still computes exactly what the local pass does.

When every layer is of that form with every round a kernel-pool table (``DecodePlan.program``), a step runs
its layers as ``engine.plan_kernels.part`` calls instead of the Python loop of ``_layers``: one compiled call per
layer (the last layer's routed half, then this layer's attention half, the rounds published from compiled code)
with the router's numpy product between them, the same kernels through their addresses (the same bits;
``MESHD_PLAN_PARTS=0`` keeps the loop). A model (or a round) the
plan does not cover runs the general pass: batched decode, prefill, remote executors, latent attention,
sigmoid routers, shared experts, biases, and products that are not all on the packed kernels or all on the
fp32 kernel.

Layer ranges: a pipeline part (``Model.part``, or a stage's ``Model.load(layers=...)``) is planned the same
way; :func:`forward_span` runs one row of hidden state through its layers (``DecodePlan.span``), ending in the
hidden state or, on the part holding the head, the logits: a stage's one-token step and the serving node's
own range, with the bits of ``Model.span_steps`` (tested in tests/test_decode_plan.py). Inside
``kernels.single_threaded()`` the plan's products stay on the calling thread too (same bits).

Not thread-safe by itself: ``Model`` holds a lock and lets a second concurrent caller take the general
pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dense
from .limits import ATTEND_POOL_MIN_MACS, KERNEL_MAX_ROWS, KERNEL_POOL_MIN_WEIGHTS
from .fp8 import Fp8Tensor
from .moe import expert_ffn, make_routing, run_block
from .quant import Packed

if TYPE_CHECKING:
    from .model import KVCache, Layer, Model

F32 = np.float32
_NONE = np.zeros(0, dtype=F32)
# MESHD_PLAN_PARTS=0: the planned step's layers in the Python loop (DecodePlan._layers) instead of
# engine.plan_kernels' compiled calls (same bits; an A/B switch for bench/decode_rounds.py)
MESHD_PLAN_PARTS = os.environ.get("MESHD_PLAN_PARTS", "1")


def packed_ops() -> tuple[Any, Any] | None:
    """(engine.kernels, engine.kernel_pool) when the compiled kernels are there (numba, the ``[fast]`` extra)."""
    from . import kernels

    if not kernels.AVAILABLE:  # no numba, or MESHD_KERNELS=numpy (kernel_pool's modules then cannot load)
        return None
    from . import kernel_pool

    return kernels, kernel_pool


def pool_of(kernels: Any) -> Any:
    """The kernel threads' pool this thread may use now: None inside ``kernels.single_threaded()``."""
    return None if kernels.is_single_threaded() else kernels._get_pool()


def run_rows(kernel_pool: Any, pool: Any, tbl: np.ndarray, total: int, weights: int, keep: object = None) -> None:
    """One kernel round of prebuilt table rows (their arrays kept alive by the caller), decided as
    ``kernels.run_products`` decides: on ``pool`` (``pool_of``) when the round is big enough to share, else on
    this thread."""
    if pool is None or weights < KERNEL_POOL_MIN_WEIGHTS:
        kernel_pool.run_table_serial(tbl, total)
    else:
        pool.run_table(tbl, total, keep)


class Round:
    """Products ``out = x @ w.T`` over fixed buffers, run together as the general pass would run them:
    packed kernel products as one kernel-pool round from a prebuilt table, fp32 kernel products as one
    ``engine.dense`` round, anything else through ``dense.matmul_many`` (the general pass's own call) and
    copied into the buffers."""

    __slots__ = ("run", "table", "rows")

    def __init__(self, run: Callable[[], None], table: tuple[np.ndarray, int, object] | None = None,
                 rows: tuple[np.ndarray, int, int] | None = None) -> None:
        self.run = run
        # (table, chunks, arrays to keep alive): a round big enough for the kernel threads, which a caller that
        # holds the pool already (``DecodePlan._layers``) hands it directly; else None
        self.table = table
        self.rows = rows  # (table, chunks, weights) of a kernel-pool round, shared or not (engine.plan_kernels)

    @staticmethod
    def build(products: list[tuple[np.ndarray, object, np.ndarray]]) -> Round:
        rows = table_rows(products, tail=True)
        if rows is not None:
            tbl, total, keep, weights = rows
            return Round(_table_runner(tbl, total, keep, weights),
                         (tbl, total, keep) if weights >= KERNEL_POOL_MIN_WEIGHTS else None, (tbl, total, weights))
        prods = list(products)
        f32_run = getattr(dense, "_run", None)
        if f32_run is not None and all(dense._f32_kernel(x, w) for x, w, _ in prods):
            return Round(lambda: f32_run(prods))

        def general() -> None:
            for (_, _, out), got in zip(prods, dense.matmul_many([(x, w) for x, w, _ in prods])):
                out[...] = got
        return Round(general)


def _f32_in_tables() -> bool:
    """Whether fp32 kernel products run in ``engine.kernel_pool``'s rounds (an ``"F32"`` row type of
    ``engine.kernels``) rather than in ``engine.dense``'s own pool (``dense._run``): then they take table rows
    too, in the same rounds as packed products, as ``dense.matmul_many`` runs them."""
    if hasattr(dense, "_run"):
        return False  # (and an fp32 model does not import the packed kernels here)
    ops = packed_ops()
    return ops is not None and "F32" in getattr(ops[0], "ROW_TYPES", ())


def table_rows(products: list[tuple[np.ndarray, object, np.ndarray]],
               tail: bool = False) -> tuple[np.ndarray, int, list, int] | None:
    """The kernel-pool table of products (x, weight, out), or None if any is not on a kernel the pool runs:
    a Packed weight of a kernel type with at most ``KERNEL_MAX_ROWS`` rows (``engine.quant``'s rule), or an fp32
    weight on the fp32 kernel (``engine.dense``'s rule) when the pool runs those. ``tail``: the last product's
    last chunks finer (``kernel_pool.table``), for rows that end a round."""
    if not all(type(w) is Packed for _, w, _ in products) and not _f32_in_tables():
        return None
    ops = packed_ops()
    if ops is None:
        return None
    kernels, kernel_pool = ops
    prods = []
    for x, w, out in products:
        if not (x.dtype == F32 and x.flags.c_contiguous and out.flags.c_contiguous):
            return None
        if type(w) is Packed and w.qtype in kernels.TYPES and x.shape[0] <= KERNEL_MAX_ROWS:
            prods.append((x, w.qtype, w.data, out))
        elif type(w) is not Packed and dense._f32_kernel(x, w):
            prods.append((x, "F32", w, out))
        else:
            return None
    tbl, total, keep, weights = kernel_pool.table(prods, tail=tail)
    return tbl, total, [prods, keep], weights


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _table_runner(tbl: np.ndarray, total: int, keep: object, weights: int) -> Callable[[], None]:
    kernels, kernel_pool = packed_ops()  # type: ignore[misc]
    if weights < KERNEL_POOL_MIN_WEIGHTS:  # never shared: no pool to look up per run
        return lambda: kernel_pool.run_table_serial(tbl, total)
    return lambda: run_rows(kernel_pool, pool_of(kernels), tbl, total, weights, keep)


class _LayerPlan:
    __slots__ = ("layer", "qkv", "o", "gu_rows", "gu_chunks", "gu_weights", "down_rows", "down_chunks",
                 "down_weights", "dense_mlp", "q_norm", "k_norm", "f32_experts",
                 "general_experts", "gu_tbl", "down_tbl", "k_chunks", "gu_rows_t", "gu_chunks_t",
                 "down_rows_t", "down_chunks_t", "att_prm", "att_tbl")

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self.q_norm = _NONE if layer.q_norm is None else layer.q_norm
        self.k_norm = _NONE if layer.k_norm is None else layer.k_norm
        self.dense_mlp = not layer.sparse
        self.f32_experts = False  # the routed experts' products on engine.dense's fp32 kernel
        self.general_experts = False  # the routed experts through the local executor, as the general pass


class OneRowBuffers:
    """The work buffers of a one-token step over ``model``'s layers, allocated once (kernel tables point at them):
    the residual stream, the normed rows, q/k/v (and their per-head views), attention's output, o-proj's."""

    def __init__(self, model: Model) -> None:
        c = model.config
        self.model = model
        d, hd = c.hidden_size, c.head_dim
        self.eps = c.rms_norm_eps
        self.top_k = c.top_k
        self.norm_topk = c.norm_topk_prob
        self.x = np.zeros((1, d), dtype=F32)  # the residual stream
        self.h = np.zeros((1, d), dtype=F32)  # normed rows: attention's and the MLP's input (what is sent)
        self.q = np.zeros((1, c.num_heads * hd), dtype=F32)
        self.k = np.zeros((1, c.num_kv_heads * hd), dtype=F32)
        self.v = np.zeros((1, c.num_kv_heads * hd), dtype=F32)
        self.q3 = self.q.reshape(c.num_heads, hd)
        self.k3 = self.k.reshape(c.num_kv_heads, hd)
        self.v3 = self.v.reshape(c.num_kv_heads, hd)
        self.att = np.zeros((1, c.num_heads * hd), dtype=F32)
        self.o = np.zeros((1, d), dtype=F32)


class DecodePlan(OneRowBuffers):
    """The planned one-token decode step of ``model`` (see the module docstring); :meth:`make` returns None
    when the model is not covered."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        c = model.config
        d = c.hidden_size
        self.att1 = self.att[0]
        e, inter = max(1, c.num_experts), max(1, c.moe_intermediate_size)
        self.g = np.zeros((e, 1, inter), dtype=F32)  # routed experts' gate outputs (then SwiGLU), by expert
        self.u = np.zeros((e, 1, inter), dtype=F32)
        self.y = np.zeros((e, 1, d), dtype=F32)  # routed experts' outputs, by expert
        self.sel = np.zeros(max(1, c.top_k), dtype=np.int64)  # a token's routed experts, by slot (route_one)
        self.wts = np.zeros(max(1, c.top_k), dtype=F32)  # ... and their weights
        self.layers: list[_LayerPlan] = []
        self.head: Round | None = None  # the output head's product into self.logits (a part without it: None)
        self.logits = np.zeros((1, c.vocab_size if model.lm_head is not None else 1), dtype=F32)
        self.packed = False  # some layer's experts run from prebuilt kernel-pool table rows
        self.keep: list[object] = []
        self.program: tuple[Any, np.ndarray, np.ndarray] | None = None  # engine.plan_kernels' form (_program)
        self._head_addr = 0  # the head's round table in the program (0: none)

    @classmethod
    def make(cls, model: Model) -> DecodePlan | None:
        """The plan of ``model``, or None (the general pass then runs every step)."""
        from .model import Model

        c = model.config
        if type(model) is not Model:  # a subclass (latent attention) has its own pieces
            return None
        if not model._step or c.router is not None or c.mla is not None:
            return None  # (a part without the output head is planned too: its layer-range form, ``span``)
        plan = cls(model)
        for layer in model.layers:
            lp = plan._plan_layer(layer)
            if lp is None:
                return None
            plan.layers.append(lp)
        if model.lm_head is not None:  # prebuilt like every other product (no kernel table built per token)
            plan.head = Round.build([(plan.h, model.lm_head, plan.logits)])
        plan.program = plan._program()
        return plan

    def _program(self) -> tuple[Any, np.ndarray, np.ndarray] | None:
        """The layers as ``engine.plan_kernels``' program (its module, the layers' words, the plan's words), or
        None when some layer is not of the form it runs (every round a kernel-pool table, routed experts on
        prebuilt rows of one shape, fp32 norms): then the Python loop of :meth:`_layers` runs every step."""
        ops = packed_ops()
        if ops is None or not self.layers or MESHD_PLAN_PARTS == "0":
            return None
        c = self.model.config
        d = c.hidden_size

        def vec(a: object) -> bool:
            return type(a) is np.ndarray and a.dtype == F32 and a.shape == (d,) and a.flags.c_contiguous

        for lp in self.layers:
            if (lp.dense_mlp or lp.general_experts or lp.f32_experts or lp.k_chunks is None or lp.qkv.rows is None
                    or lp.o.rows is None or not vec(lp.layer.attn_norm) or not vec(lp.layer.mlp_norm)):
                return None
        if self.model.lm_head is not None and not vec(self.model.norm):
            return None
        from . import plan_kernels as pk

        k = len(self.sel)
        prog = np.zeros((len(self.layers), pk.LAYER_WORDS), dtype=np.int64)
        for row, lp in zip(prog, self.layers):
            (qkv, qkv_total, qkv_w), (o, o_total, o_w) = lp.qkv.rows, lp.o.rows  # type: ignore[misc]
            row[pk.L_ATTN_NORM], row[pk.L_MLP_NORM] = _addr(lp.layer.attn_norm), _addr(lp.layer.mlp_norm)
            row[pk.L_QKV:pk.L_QKV_POOL + 1] = _addr(qkv), qkv.shape[0], qkv_total, qkv_w >= KERNEL_POOL_MIN_WEIGHTS
            row[pk.L_O:pk.L_O_POOL + 1] = _addr(o), o.shape[0], o_total, o_w >= KERNEL_POOL_MIN_WEIGHTS
            row[pk.L_ATT_PRM], row[pk.L_ATT_TBL] = _addr(lp.att_prm), _addr(lp.att_tbl)
            for first, plain, last, tbl, total, weights in (
                    (pk.L_GU_PLAIN, lp.gu_rows, lp.gu_rows_t, lp.gu_tbl, lp.k_chunks[0], lp.gu_weights),
                    (pk.L_DN_PLAIN, lp.down_rows, lp.down_rows_t, lp.down_tbl, lp.k_chunks[1], lp.down_weights)):
                row[first:first + 7] = (_addr(plain), _addr(last), plain.shape[1], last.shape[1], _addr(tbl), total,
                                        weights * k >= KERNEL_POOL_MIN_WEIGHTS)
        # each router's x @ w.T when dense.matmul would compute exactly that (an fp32 array off the fp32 kernel:
        # quant.matmul's one-row case), as a product with its transposed view made here; else None
        self._routers = [lp.layer.router.T if (type(lp.layer.router) is np.ndarray and lp.layer.router.dtype == F32
                                               and lp.layer.router.ndim == 2
                                               and not dense._f32_kernel(self.h, lp.layer.router)) else None
                         for lp in self.layers]
        g = np.zeros(pk.PLAN_WORDS, dtype=np.int64)
        self._eps64 = np.array([self.eps], dtype=np.float64)  # rmsnorm's eps, read by address
        self._route_p = np.zeros(max(1, c.num_experts), dtype=F32)  # routing's scratch
        g[[pk.G_X, pk.G_H, pk.G_O, pk.G_G, pk.G_U, pk.G_Y, pk.G_SEL, pk.G_WTS, pk.G_P, pk.G_EPS]] = [
            _addr(a) for a in (self.x, self.h, self.o, self.g, self.u, self.y, self.sel, self.wts, self._route_p,
                               self._eps64)]
        g[[pk.G_D, pk.G_E, pk.G_I, pk.G_K, pk.G_NKV, pk.G_NORM_TOPK]] = (d, self.g.shape[0], self.g.shape[2], k,
                                                                       c.num_kv_heads, bool(self.norm_topk))
        if self.head is not None and self.head.rows is not None:
            head, head_total, head_w = self.head.rows
            g[[pk.G_HEAD_NORM, pk.G_HEAD_ROWS, pk.G_HEAD_TOTAL, pk.G_HEAD_POOL]] = (
                _addr(self.model.norm), head.shape[0], head_total, head_w >= KERNEL_POOL_MIN_WEIGHTS)
            self._head_addr = _addr(head)
        g[pk.G_HA] = ops[1]._HALF_ADDR
        g[[pk.G_RMS, pk.G_ADD_RMS, pk.G_ROUTE, pk.G_SWIGLU_SEL, pk.G_COMBINE]] = pk.FUNCS
        self._no_logits = np.zeros((1, self.g.shape[0]), dtype=F32)  # part()'s router logits when it routes nothing
        return pk, prog, g

    def _plan_layer(self, layer: Layer) -> _LayerPlan | None:
        if any(b is not None for b in (layer.q_bias, layer.k_bias, layer.v_bias, layer.o_bias)):
            return None
        lp = _LayerPlan(layer)
        self._plan_attention(lp)
        qkv = Round.build([(self.h, layer.q, self.q), (self.h, layer.k, self.k), (self.h, layer.v, self.v)])
        o = Round.build([(self.att, layer.o, self.o)])
        lp.qkv, lp.o = qkv, o
        if not layer.sparse:
            return lp if layer.gate_bias is None else None
        if layer.shared is not None or not layer.experts:
            return None
        if all(dense.swiglu_compiled(self.h, gate) and dense._f32_kernel(self.h, gate) and dense._f32_kernel(self.h, up)
               and dense._f32_kernel(self.g[0], down) for gate, up, down in layer.experts) and hasattr(dense, "_run"):
            lp.f32_experts = True
            return lp
        if any(isinstance(a, Fp8Tensor) for w in layer.experts for a in w):
            lp.general_experts = True
            return lp
        # each expert's rows twice: as a round's middle (plain) and as its end (the last slot's: finer last chunks)
        gu_rows, gu_chunks, down_rows, down_chunks = [], [], [], []
        gu_rows_t, gu_chunks_t, down_rows_t, down_chunks_t = [], [], [], []
        gu_weights = down_weights = 0
        for ex, (gate, up, down) in enumerate(layer.experts):
            if not dense.swiglu_compiled(self.h, gate):
                lp.general_experts = True
                return lp
            gu_prods = [(self.h, gate, self.g[ex]), (self.h, up, self.u[ex])]
            dn_prods = [(self.g[ex], down, self.y[ex])]
            gu, gu_t = table_rows(gu_prods), table_rows(gu_prods, tail=True)
            dn, dn_t = table_rows(dn_prods), table_rows(dn_prods, tail=True)
            if gu is None or dn is None or gu_t is None or dn_t is None:
                lp.general_experts = True
                return lp
            self.keep += (gu[2], dn[2], gu_t[2], dn_t[2])  # arrays the rows point into (table() may copy a view)
            for rows, chunks, r in ((gu_rows, gu_chunks, gu), (down_rows, down_chunks, dn), (gu_rows_t, gu_chunks_t, gu_t),
                                    (down_rows_t, down_chunks_t, dn_t)):
                rows.append(r[0])
                chunks.append(r[1])
            gu_weights, down_weights = gu[3], dn[3]
        if len({r.shape for r in gu_rows_t}) > 1 or len({r.shape for r in down_rows_t}) > 1:
            lp.general_experts = True  # (experts of different shapes: none the engine loads)
            return lp
        lp.gu_rows, lp.gu_rows_t = np.stack(gu_rows), np.stack(gu_rows_t)  # [E, 2, cols], [E, 2 or 3, cols]
        lp.down_rows, lp.down_rows_t = np.stack(down_rows), np.stack(down_rows_t)  # [E, 1, cols], [E, 1 or 2, cols]
        lp.gu_chunks, lp.gu_chunks_t, lp.down_chunks, lp.down_chunks_t = gu_chunks, gu_chunks_t, down_chunks, down_chunks_t
        k = len(self.sel)  # a token's rounds: its experts' rows copied into fixed tables (no allocation)
        cols = lp.gu_rows.shape[2]
        lp.gu_tbl = np.empty(((k - 1) * lp.gu_rows.shape[1] + lp.gu_rows_t.shape[1], cols), dtype=np.int64)
        lp.down_tbl = np.empty(((k - 1) * lp.down_rows.shape[1] + lp.down_rows_t.shape[1], cols), dtype=np.int64)
        same = all(len(set(c)) == 1 for c in (gu_chunks, gu_chunks_t, down_chunks, down_chunks_t))  # (all, really)
        lp.k_chunks = ((gu_chunks[0] * (k - 1) + gu_chunks_t[0], down_chunks[0] * (k - 1) + down_chunks_t[0])
                       if same else None)
        lp.gu_weights, lp.down_weights = gu_weights, down_weights
        self.packed = True
        return lp

    def _plan_attention(self, lp: _LayerPlan) -> None:
        """The layer's attention as a kernel-pool round of its KV heads (``kernel_pool.attend_table``): a block of
        ``attend_one``'s arguments (the plan's buffers; cache, position and angles set per step) and its table."""
        ops = packed_ops()
        if ops is None:  # pragma: no cover - a planned model has the compiled step kernels, hence numba
            raise RuntimeError("a decode plan needs the compiled kernels")
        c = self.model.config
        mod = dense._kernels()
        lp.att_prm = np.zeros(mod.ATTEND_WORDS, dtype=np.int64)
        kc = np.zeros((c.num_kv_heads, 1, c.head_dim), dtype=F32)  # placeholders until the first step's cache
        cos, sin = self.model.rope.span(0, 1)
        mod.attend_params(lp.att_prm, self.q3, self.k3, self.v3, lp.q_norm, lp.k_norm, self.eps, cos[0], sin[0],
                          kc, kc, 0, 0, self.model.scale, self.att1)
        lp.att_tbl = ops[1].attend_table(lp.att_prm, c.num_kv_heads)[0]

    def step(self, token: np.ndarray, cache: KVCache) -> np.ndarray:
        """Logits [1, V] of one token (int64 [1], checked by the caller) after the cache's positions; writes
        its keys and values at ``cache.length`` (room reserved by the caller) and leaves ``length`` to it."""
        m = self.model
        if m.lm_head is None:
            raise ValueError("this pipeline stage does not hold the output head")
        self.x[:] = m.embed(token)
        if self.program is None:
            self._layers(cache)
        elif self._parts(cache, True):
            return self.logits.copy()  # (the caller keeps it past the next step)
        return self._head()

    def span(self, x: np.ndarray, cache: KVCache, logits: bool = False) -> np.ndarray:
        """The layer-range form (a pipeline stage's or the serving node's own range): hidden state x [1, D]
        through this model's layers at position ``cache.length`` -> the hidden state after them [1, D] (a new
        array), or with ``logits`` the final norm and output head's logits [1, V] (the model must hold them).
        The same operations as ``Model.span_steps`` (then ``Model.logits``) on one row through the local
        executor, so the same bits; writes the keys and values, leaves ``cache.length`` to the caller."""
        if logits and self.model.lm_head is None:
            raise ValueError("this pipeline stage does not hold the output head")
        self.x[:] = x
        if self.program is None:
            self._layers(cache)
        elif logits and self._parts(cache, True):
            return self.logits.copy()
        elif not logits:
            self._parts(cache, False)
        return self._head() if logits else self.x.copy()

    def _parts(self, cache: KVCache, head: bool) -> bool:
        """:meth:`_layers` (then, with ``head``, the final norm and the head's round into ``self.logits`` if the
        head is a kernel-pool round: returns whether it ran) as ``engine.plan_kernels.part`` calls: one per
        layer, with the router's product between them here, as :meth:`_layers` computes it. The same operations
        in the same order on the same buffers."""
        pk, prog, g = self.program  # type: ignore[misc]
        m = self.model
        c = m.config
        pool = pool_of(packed_ops()[0])  # type: ignore[index]
        pos = cache.length
        cos, sin = m.rope.span(pos, pos + 1)
        cos, sin = cos[0], sin[0]
        window = c.sliding_window
        lo = 0 if window is None else max(0, pos - window + 1)
        g[pk.G_POS], g[pk.G_LO] = pos, lo
        g[pk.G_ATT_POOL] = pool is not None and c.num_heads * (pos + 1 - lo) * 2 * c.head_dim >= ATTEND_POOL_MIN_MACS
        g[pk.G_CTL] = 0 if pool is None else pool._addr
        g[pk.G_HEAD] = head = self._head_addr if head else 0
        part, h, matmul, routers = pk.part, self.h, dense.matmul, self._routers
        gen_shift = pk.kp.GEN_SHIFT
        off = m.first_layer - cache.first_layer
        ks, vs = cache.k, cache.v
        n = len(self.layers)
        logits = self._no_logits
        if pool is not None and pool._ctl[5]:  # a helper went to sleep between tokens: part() cannot wake it
            with pool._round:
                pool.wake()
        for j in range(n + 1):
            kc, vc = (ks[j + off], vs[j + off]) if j < n else (ks[off], vs[off])  # (the last call attends nowhere)
            if pool is None:
                part(prog, g, j, j > 0, logits, kc, vc, cos, sin, 0)
            else:
                with pool._round:
                    try:
                        gen = part(prog, g, j, j > 0, logits, kc, vc, cos, sin, pool._gen)
                    except BaseException:  # (attend_cache's checks) the rounds it published are counted
                        pool._gen = int(pool._ctl[0]) >> gen_shift
                        raise
                    if gen < 0:  # it found a helper asleep (preempted for 200 us): wake it for the next call
                        pool._gen = ~gen
                        pool.wake()
                    else:
                        pool._gen = gen
            if j < n:  # the router: numpy's product, as _layers computes it (dense.matmul's own x @ w.T when
                rt = routers[j]  # that is what it runs: the transposed view made once)
                if rt is not None:
                    logits = h @ rt
                else:
                    logits = matmul(h, self.layers[j].layer.router)
                    if not (logits.flags.c_contiguous and logits.dtype == F32):
                        logits = np.ascontiguousarray(logits, dtype=F32)
        return bool(head)

    def _head(self) -> np.ndarray:
        m = self.model
        dense._kernels().rmsnorm_rows(self.x, m.norm, self.eps, self.h)
        if self.head is None:
            return dense.matmul(self.h, m.lm_head)
        self.head.run()
        return self.logits.copy()  # (the caller keeps it past the next step)

    def _layers(self, cache: KVCache) -> None:
        """Every planned layer over ``self.x`` (in place) at position ``cache.length``."""
        m = self.model
        c = m.config
        ops = packed_ops()
        kernel_pool, pool = ops[1], pool_of(ops[0])  # type: ignore[index]
        take_rows, run_serial = kernel_pool.take_rows, kernel_pool.run_table_serial
        mod = dense._kernels()
        rms, attend_cache, add_rms, route = mod.rmsnorm_rows, mod.attend_cache, mod.add_rmsnorm, mod.route_one
        swiglu, swiglu_sel, combine_add = mod.swiglu, mod.swiglu_sel, mod.combine_add
        pos = cache.length
        cos, sin = m.rope.span(pos, pos + 1)
        cos, sin = cos[0], sin[0]
        window = c.sliding_window
        lo = 0 if window is None else max(0, pos - window + 1)
        nkv = c.num_kv_heads
        # attention split by KV head over the kernel threads when it is big enough (the same kernel either way)
        att_pool = pool if c.num_heads * (pos + 1 - lo) * 2 * c.head_dim >= ATTEND_POOL_MIN_MACS else None
        x, h, eps, o = self.x, self.h, self.eps, self.o
        g, u, y = self.g, self.u, self.y
        sel, wts, norm_topk = self.sel, self.wts, self.norm_topk
        f32_run = getattr(dense, "_run", None)
        for j, lp in enumerate(self.layers):
            layer = lp.layer
            rms(x, layer.attn_norm, eps, h)
            if pool is not None and lp.qkv.table is not None:  # lp.qkv.run() without looking the pool up again
                pool.run_table(*lp.qkv.table)
            else:
                lp.qkv.run()
            i = j + m.first_layer - cache.first_layer
            attend_cache(lp.att_prm, cache.k[i], cache.v[i], cos, sin, pos, lo)  # attend_one's arguments
            if att_pool is None:
                run_serial(lp.att_tbl, nkv)
            else:
                att_pool.run_table(lp.att_tbl, nkv, None)
            if pool is not None and lp.o.table is not None:
                pool.run_table(*lp.o.table)
            else:
                lp.o.run()
            add_rms(x, o, layer.mlp_norm, eps, h)  # x += o; h = rmsnorm(x): the general pass's two steps
            if lp.dense_mlp:
                x += expert_ffn(h, layer.gate, layer.up, layer.down)
                continue
            logits = dense.matmul(h, layer.router)
            route(logits[0], norm_topk, sel, wts)  # dense.route_one's call, into the plan's buffers
            if lp.general_experts:
                routing = make_routing(sel[None].copy(), wts[None].copy())
                x += run_block(m.local_executor, j + m.first_layer, h, routing)
                continue
            if lp.f32_experts:  # engine.dense's rounds, as expert_ffn_many runs them
                ex = layer.experts
                slots = sel.tolist()
                f32_run([p for e in slots for p in ((h, ex[e][0], g[e]), (h, ex[e][1], u[e]))])
                for e in slots:
                    swiglu(g[e], u[e])
                f32_run([(g[e], ex[e][2], y[e]) for e in slots])
                combine_add(x, wts, sel, y)
                continue
            if lp.k_chunks is None:
                slots = sel.tolist()
                gu_total = sum(lp.gu_chunks[e] for e in slots[:-1]) + lp.gu_chunks_t[slots[-1]]
                down_total = sum(lp.down_chunks[e] for e in slots[:-1]) + lp.down_chunks_t[slots[-1]]
            else:
                gu_total, down_total = lp.k_chunks
            take_rows(lp.gu_rows, lp.gu_rows_t, sel, lp.gu_tbl)
            run_rows(kernel_pool, pool, lp.gu_tbl, gu_total, lp.gu_weights * len(sel))
            swiglu_sel(g, u, sel)
            take_rows(lp.down_rows, lp.down_rows_t, sel, lp.down_tbl)
            run_rows(kernel_pool, pool, lp.down_tbl, down_total, lp.down_weights * len(sel))
            combine_add(x, wts, sel, y)


def planned(model: Model, executor: object, rows: int, cache: KVCache,
            run: Callable[[DecodePlan], np.ndarray]) -> np.ndarray | None:
    """``run(plan)`` with ``model``'s plan (made on first use, kept on the model), room for one more position
    reserved in ``cache`` (``length`` left to the caller); None when the plan is not taken: more than one row,
    another executor than the local one, a model the plan does not cover, or a second thread in the plan at
    once. The caller then runs the general pass, which has the same bits."""
    if model._plan is False or rows != 1:
        return None
    if executor is not None and executor is not model.local_executor:
        return None
    if not model._plan_lock.acquire(blocking=False):
        return None
    try:
        if model._plan is True:
            model._plan = DecodePlan.make(model) or False
        plan = model._plan
        if not plan:
            return None
        cache.reserve(cache.length + 1)
        return run(plan)  # type: ignore[arg-type]
    finally:
        model._plan_lock.release()


def forward_span(model: Model, x: np.ndarray, cache: KVCache, executor: object = None,
                 logits: bool = False) -> np.ndarray | None:
    """``DecodePlan.span`` of ``model`` (a pipeline part: any layer range, with or without the head) for one
    row x [1, D] at ``cache.length`` through :func:`planned`; None when the plan is not taken (the caller then
    runs ``span_steps``, same bits)."""
    return planned(model, executor, x.shape[0], cache, lambda plan: plan.span(x, cache, logits))
