"""One decode step of several sequences through a model part, each row with the bits of its lone step.

A pipeline process (the serving node's own range, a stage's range) runs the in-flight sequences' one-token
steps together: every weight product is one kernel round over all their rows, so each weight is read once
per step instead of once per sequence. The compiled kernels are row-invariant (docs/kernels.md: a row's
bits depend neither on the rows beside it in the call, nor on threads or chunking), and everything that is
not a product runs per row with the one-row functions the decode plan (``engine.decode_plan``) calls:
``rmsnorm_rows`` (row by row), ``attend_one``, the router's product and ``route_one`` on each row alone,
the compiled SwiGLU (element by element), ``combine_add`` per row in slot order, the residual adds
(element by element). So row b of :meth:`BatchStep.run` is bit for bit the planned lone step of sequence b
(tests/test_pipeline_batch.py), and a replay after a failure rebuilds the same caches.

The local engine's own batched step (``Model.forward_batch``) is not row-identical to its lone step, with
or without numba: above ``KERNEL_MAX_ROWS`` rows its products go to BLAS, the router is one gemm over the
rows and routing is numpy's softmax; docs/pipeline.md has the measurement.

:meth:`BatchStep.make` returns None (callers then run lone steps) unless the decode plan covers the part
with numba installed (softmax-routed experts without shared experts or biases, no latent attention). Products
on a kernel in the lone step are one round over all rows; the others (weights too small for the fp32 kernel,
stored types without one) run row by row with the lone step's one-row call, since a BLAS product's row bits
depend on the row count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine import dense, quant
from engine.decode_plan import DecodePlan, packed_ops, pool_of, run_rows

F32 = np.float32
_NONE = np.zeros(0, dtype=F32)


def _kernel_entry(w: object, x1: np.ndarray) -> tuple[str, np.ndarray] | None:
    """(row type, stored data) of weight ``w`` when the lone step's product with one row x1 runs on a compiled
    kernel, else None."""
    if type(w) is quant.Packed:
        return (w.qtype, w.data) if w.qtype in quant.KERNEL_TYPES else None  # type: ignore[attr-defined]
    if isinstance(w, np.ndarray) and dense._f32_kernel(x1, w):
        return "F32", w
    return None


class BatchStep:
    """The batched one-token step of a model part (see the module docstring)."""

    def __init__(self, model: Any, plan: DecodePlan,
                 entries: dict[int, tuple[str, np.ndarray] | None]) -> None:
        self.model = model
        self.plan = plan
        self._entries = entries  # id(weight) -> (row type, data), or None: not on a kernel
        kernels, self._kp = packed_ops()  # type: ignore[misc]
        self._kernels = kernels
        self._mod = dense._kernels()

    @classmethod
    def make(cls, model: Any) -> BatchStep | None:
        ops = packed_ops()
        if ops is None or dense._kernels() is None:
            return None
        plan = DecodePlan.make(model)
        if plan is None:
            return None
        c = model.config
        x1 = np.zeros((1, c.hidden_size), dtype=F32)
        g1 = np.zeros((1, max(1, c.moe_intermediate_size)), dtype=F32)
        entries: dict[int, tuple[str, np.ndarray] | None] = {}

        def need(w: object, x: np.ndarray) -> bool:
            entries[id(w)] = _kernel_entry(w, x)
            return True

        a1 = np.zeros((1, c.num_heads * c.head_dim), dtype=F32)
        for lp in plan.layers:
            layer = lp.layer
            if not all(need(w, x1) for w in (layer.q, layer.k, layer.v)) or not need(layer.o, a1):
                return None
            if lp.dense_mlp:
                i1 = np.zeros((1, layer.gate.shape[0]), dtype=F32)
                if not (dense.swiglu_compiled(x1, layer.gate) and need(layer.gate, x1) and need(layer.up, x1)
                        and need(layer.down, i1)):
                    return None
                continue
            if lp.general_experts or lp.f32_experts:
                return None
            for gate, up, down in layer.experts:
                if not (need(gate, x1) and need(up, x1) and need(down, g1)):
                    return None
        if model.lm_head is not None and not need(model.lm_head, x1):
            return None
        return cls(model, plan, entries)

    def _round(self, products: list[tuple[np.ndarray, object, np.ndarray]]) -> None:
        """out = x @ w.T for every (x, w, out): the kernel products in one round over all rows, any other
        (a small weight the lone step multiplies with BLAS) row by row, as the lone step's one-row call."""
        prods = []
        for x, w, out in products:
            entry = self._entries[id(w)]
            if entry is not None:
                prods.append((x, *entry, out))
                continue
            for r in range(x.shape[0]):
                out[r] = dense.matmul(x[r : r + 1], w)[0]
        if prods:
            tbl, total, keep, weights = self._kp.table(prods)
            run_rows(self._kp, pool_of(self._kernels), tbl, total, weights, (prods, keep))

    def run(self, x: np.ndarray, caches: Sequence[Any], logits: bool = False) -> np.ndarray:
        """Hidden states x [B, D] (row b: sequence b, at position ``caches[b].length``) through this part's
        layers -> [B, D], or with ``logits`` the final norm and head's [B, V]. Writes each row's keys and
        values into its cache (room reserved here), leaves ``length`` to the caller."""
        m, c = self.model, self.model.config
        if logits and m.lm_head is None:
            raise ValueError("this pipeline stage does not hold the output head")
        b, d = x.shape
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        eps = c.rms_norm_eps
        mod = self._mod
        rms, attend, swiglu, combine_add = mod.rmsnorm_rows, dense.attend_one, mod.swiglu, mod.combine_add
        xs = np.array(x, dtype=F32, order="C")  # the residual stream
        h = np.empty((b, d), dtype=F32)
        q = np.empty((b, nh * hd), dtype=F32)
        k = np.empty((b, nkv * hd), dtype=F32)
        v = np.empty((b, nkv * hd), dtype=F32)
        att = np.empty((b, nh * hd), dtype=F32)
        o = np.empty((b, d), dtype=F32)
        pos = [int(cache.length) for cache in caches]
        for cache, p in zip(caches, pos):
            cache.reserve(p + 1)
        rope = [m.rope.span(p, p + 1) for p in pos]
        window = c.sliding_window
        lo = [0 if window is None else max(0, p - window + 1) for p in pos]
        top_k, norm_topk = c.top_k, c.norm_topk_prob
        e_all = max(1, c.num_experts)
        # row r's output of expert e in y[r, e] (combine_add's form); only the chosen experts' slots are written
        # and read, so the rest stays untouched (for many experts, pages never made resident)
        y = np.empty((b, e_all, 1, d), dtype=F32)
        for j, lp in enumerate(self.plan.layers):
            layer = lp.layer
            rms(xs, layer.attn_norm, eps, h)
            self._round([(h, layer.q, q), (h, layer.k, k), (h, layer.v, v)])
            for r, cache in enumerate(caches):
                i = j + m.first_layer - cache.first_layer
                cos, sin = rope[r]
                attend(q[r].reshape(nh, hd), k[r].reshape(nkv, hd), v[r].reshape(nkv, hd), lp.q_norm,
                       lp.k_norm, eps, cos[0], sin[0], cache.k[i], cache.v[i], pos[r], lo[r], m.scale, att[r])
            self._round([(att, layer.o, o)])
            xs += o
            rms(xs, layer.mlp_norm, eps, h)
            if lp.dense_mlp:
                g = np.empty((b, layer.gate.shape[0]), dtype=F32)
                u = np.empty_like(g)
                self._round([(h, layer.gate, g), (h, layer.up, u)])
                swiglu(g, u)
                self._round([(g, layer.down, o)])
                xs += o
                continue
            chosen = []
            for r in range(b):
                rl = dense.matmul(h[r : r + 1], layer.router)
                chosen.append(dense.route_one(rl[0], top_k, norm_topk))
            rows: dict[int, list[int]] = {}
            for r, (ex, _) in enumerate(chosen):
                for e in ex[0].tolist():
                    rows.setdefault(e, []).append(r)
            order = sorted(rows)
            xe = {e: h[rows[e]] for e in order}  # (fancy indexing: a C-contiguous copy)
            inter = c.moe_intermediate_size
            ge = {e: np.empty((len(rows[e]), inter), dtype=F32) for e in order}
            ue = {e: np.empty_like(ge[e]) for e in order}
            ye = {e: np.empty((len(rows[e]), d), dtype=F32) for e in order}
            ex_w = layer.experts
            self._round([p for e in order for p in ((xe[e], ex_w[e][0], ge[e]), (xe[e], ex_w[e][1], ue[e]))])
            for e in order:
                swiglu(ge[e], ue[e])
            self._round([(ge[e], ex_w[e][2], ye[e]) for e in order])
            for e in order:
                y[rows[e], e, 0] = ye[e]
            for r, (ex, w) in enumerate(chosen):
                combine_add(xs[r : r + 1], w[0], ex[0], y[r])
        if not logits:
            return xs
        rms(xs, m.norm, eps, h)
        out = np.empty((b, c.vocab_size if m.lm_head is None else _rows(m.lm_head)), dtype=F32)
        self._round([(h, m.lm_head, out)])
        return out


def _rows(w: object) -> int:
    return int(w.shape[0])  # type: ignore[attr-defined]


def batch_step(model: Any) -> BatchStep | None:
    """The model part's :class:`BatchStep`, made on first use and kept on the model (None: not covered)."""
    got = model.__dict__.get("_pipeline_batch", False)
    if got is False:
        got = BatchStep.make(model)
        model.__dict__["_pipeline_batch"] = got
    return got  # type: ignore[no-any-return]
