"""The coordinator's planned decode step: one sequence's one-token forward pass as steps (``engine.moe.drive``)
with the routed experts remote, on the decode plan's pieces.

``engine.decode_plan`` runs a local one-token step with prebuilt buffers and kernel tables, but it computes the
routed experts itself. With the experts on workers, ``Model.forward`` ran the general pass (``forward_steps``):
per layer a dozen fresh arrays, a kernel table built per product round, and the Python between them, on the
coordinator's critical path between one layer's reply and the next layer's request (pinned timeline, session 4:
the pass 399 us per layer against 305 us for the same work in a local planned step).

:class:`RemoteDecodePlan` is that plan's attention, router and residual with the routed layer left as a step:
for each layer, ``rmsnorm`` into a fixed buffer, the q/k/v round and the o round from prebuilt tables
(``decode_plan.Round``), ``attend_one`` into the cache, ``x += o``, the MLP norm, the router product and
``route_one``, then it yields ``(layer, h, routing)`` and adds the output it is sent (``x += out``). Every
operation is the one the general pass runs on the same values (``decode_plan``'s own claim, tested there), so the
logits are the general pass's bits, and a remote step's equal a local step's (``tests/test_experts_plan.py``).

Covered: what ``decode_plan`` covers for attention (plain ``Model``, compiled decode step, softmax router, no
latent attention, no q/k/v/o biases, an output head) and sparse layers without shared experts; dense layers run
``expert_ffn`` as the general pass does. Anything else returns None and the general pass runs. ``MESHD_DECODE_PLAN=0``
turns it off with the local plan (A/B benchmarks).

One plan per model, its buffers used by one pass at a time: a second concurrent one-token pass takes the
general pass.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

from engine import dense
from engine.decode_plan import OneRowBuffers, Round
from engine.moe import ForwardSteps, expert_ffn, make_routing

if TYPE_CHECKING:
    from engine.model import KVCache, Model

F32 = np.float32
_NONE = np.zeros(0, dtype=F32)


class _Layer:
    __slots__ = ("layer", "index", "qkv", "o", "q_norm", "k_norm", "sparse")

    def __init__(self, layer: object, index: int, qkv: Round, o: Round) -> None:
        self.layer = layer
        self.index = index  # the model's layer number (what the routed call names)
        self.qkv, self.o = qkv, o
        self.q_norm = _NONE if layer.q_norm is None else layer.q_norm  # type: ignore[attr-defined]
        self.k_norm = _NONE if layer.k_norm is None else layer.k_norm  # type: ignore[attr-defined]
        self.sparse = bool(layer.sparse)  # type: ignore[attr-defined]


class RemoteDecodePlan(OneRowBuffers):
    """The planned one-token step of ``model`` with its routed experts left to the executor (module docstring);
    :meth:`make` returns None when the model is not covered."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.layers: list[_Layer] = []
        self.busy = threading.Lock()

    @classmethod
    def make(cls, model: Model) -> RemoteDecodePlan | None:
        from engine.model import Model

        c = model.config
        if type(model) is not Model or not model._step or c.router is not None or c.mla is not None:
            return None
        if model.lm_head is None or os.environ.get("MESHD_DECODE_PLAN", "1") == "0":
            return None
        plan = cls(model)
        for j, layer in enumerate(model.layers):
            if any(b is not None for b in (layer.q_bias, layer.k_bias, layer.v_bias, layer.o_bias)):
                return None
            if layer.sparse and layer.shared is not None:
                return None
            if not layer.sparse and layer.gate_bias is not None:
                return None
            qkv = Round.build([(plan.h, layer.q, plan.q), (plan.h, layer.k, plan.k), (plan.h, layer.v, plan.v)])
            o = Round.build([(plan.att, layer.o, plan.o)])
            plan.layers.append(_Layer(layer, model.first_layer + j, qkv, o))
        return plan

    def steps(self, token: np.ndarray, cache: KVCache) -> ForwardSteps:
        """The step of one token (int64 [1], checked) after the cache's positions, as steps (room for one
        position reserved by the caller). The buffers are taken once the generator starts (and given back
        when it ends or is closed); while another pass holds them, this one runs the general pass."""
        if not self.busy.acquire(blocking=False):
            return (yield from self.model.forward_steps(token, cache, last_only=True))
        try:
            m = self.model
            mod = dense._kernels()
            rms, attend = mod.rmsnorm_rows, dense.attend_one  # type: ignore[union-attr]
            pos = cache.length
            cos, sin = m.rope.span(pos, pos + 1)
            cos, sin = cos[0], sin[0]
            window = m.config.sliding_window
            lo = 0 if window is None else max(0, pos - window + 1)
            x, h, eps, scale = self.x, self.h, self.eps, m.scale
            x[:] = m.embed(token)
            q3, k3, v3, att1 = self.q3, self.k3, self.v3, self.att[0]
            for lp in self.layers:
                layer = lp.layer
                rms(x, layer.attn_norm, eps, h)
                lp.qkv.run()
                i = lp.index - cache.first_layer
                attend(q3, k3, v3, lp.q_norm, lp.k_norm, eps, cos, sin, cache.k[i], cache.v[i], pos, lo, scale, att1)
                lp.o.run()
                x += self.o
                rms(x, layer.mlp_norm, eps, h)
                if not lp.sparse:
                    x += expert_ffn(h, layer.gate, layer.up, layer.down)
                    continue
                logits = dense.matmul(h, layer.router)
                out = yield (lp.index, h, make_routing(*dense.route_one(logits[0], self.top_k, self.norm_topk)))
                x += out
            cache.length = pos + 1
            rms(x, m.norm, eps, h)
            return dense.matmul(h, m.lm_head)
        finally:
            self.busy.release()


_plans: weakref.WeakKeyDictionary[Model, RemoteDecodePlan | None] = weakref.WeakKeyDictionary()
_plans_lock = threading.Lock()


def decode_steps(model: Model, ids: object, cache: KVCache) -> ForwardSteps | None:
    """The planned steps of a one-token forward of ``model`` with remote experts, or None (more than one token,
    or a model the plan does not cover): the caller runs the general pass."""
    arr = np.asarray(ids)
    if arr.shape != (1,):
        return None
    with _plans_lock:
        if model in _plans:
            plan = _plans[model]
        else:
            plan = _plans[model] = RemoteDecodePlan.make(model)
    if plan is None:
        return None
    arr = model._check_ids(arr)
    cache.reserve(cache.length + 1)
    return plan.steps(arr, cache)
