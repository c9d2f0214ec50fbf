"""A worker's one-token requests on prebuilt kernel-table rows, as ``engine.decode_plan`` runs a local step's
experts.

``compute_request`` runs a decode request's experts through ``expert_ffn_many``: fresh gate/up/down outputs
and one kernel table built per round, per request. :class:`WorkerPlan` builds, once per layer (on its first
one-token request), each held expert's gate/up rows and down row of ``engine.kernel_pool``'s table over fixed
buffers (one input row, and gate/up/down outputs per expert index, shared by the layers), exactly as the local
decode plan builds its own. A request then copies its row in, runs the chosen experts' gate/up rows as one
kernel round, the compiled SwiGLU per expert, their down rows as a second round, and copies the outputs into
the reply in request order: the same products on the same values in the same rounds as ``expert_ffn_many``
(and as the local plan), so the same bits (``tests/test_experts_plan.py``), with no allocation and no table
built per request.

Taken only where every product is on a kernel the pool runs (packed types; fp32 when the pool runs fp32 rows)
and the SwiGLU is compiled; anything else (no numba, FP8 experts dequantized per use, an odd view, a request of
more than one row) returns False and ``compute_request`` runs. Used on the worker's event loop thread only;
a lock keeps a second caller on the general compute all the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from engine import dense
from engine.decode_plan import packed_ops, pool_of, run_rows, table_rows

F32 = np.float32
WeightsFn = Callable[[int, int], tuple[Any, Any, Any]]


class _LayerRows:
    __slots__ = ("gu", "gu_chunks", "down", "down_chunks", "gu_weights", "down_weights", "keep")

    def __init__(self, experts: int) -> None:
        self.gu: list[np.ndarray | None] = [None] * experts  # per expert: its 2 table rows (gate, up)
        self.gu_chunks = [0] * experts
        self.down: list[np.ndarray | None] = [None] * experts  # per expert: its down row
        self.down_chunks = [0] * experts
        self.gu_weights = self.down_weights = 0  # weight-row products of one expert's round
        self.keep: list[object] = []  # arrays the rows point into beyond the plan's buffers


class WorkerPlan:
    """Prebuilt kernel rows for the held experts of one checkpoint (module docstring)."""

    def __init__(self, weights: WeightsFn, hidden: int, inter: int, experts: int, holds: Callable[[int, int], bool],
                 fp8: Callable[[int, int], bool]) -> None:
        self._weights = weights
        self._holds = holds
        self._fp8 = fp8
        self.experts = experts
        self.x = np.zeros((1, hidden), dtype=F32)
        self.g = np.zeros((experts, 1, inter), dtype=F32)
        self.u = np.zeros((experts, 1, inter), dtype=F32)
        self.y = np.zeros((experts, hidden), dtype=F32)
        self._y3 = self.y.reshape(experts, 1, hidden)
        self._layers: dict[int, _LayerRows | None] = {}
        self._lock = threading.Lock()
        self.used = 0  # requests computed here (tests, status)

    def _layer(self, layer: int) -> _LayerRows | None:
        if layer in self._layers:
            return self._layers[layer]
        rows: _LayerRows | None = _LayerRows(self.experts)
        for e in range(self.experts):
            if not self._holds(layer, e):
                continue
            if self._fp8(layer, e):
                rows = None
                break
            gate, up, down = self._weights(layer, e)
            if not all(_contiguous(w) for w in (gate, up, down)) or not dense.swiglu_compiled(self.x, gate):
                rows = None
                break
            gu = table_rows([(self.x, gate, self.g[e]), (self.x, up, self.u[e])])
            dn = table_rows([(self.g[e], down, self._y3[e])])
            if gu is None or dn is None:
                rows = None
                break
            assert rows is not None  # noqa: S101 - set above, reset only with a break
            rows.gu[e], rows.gu_chunks[e], rows.gu_weights = gu[0], gu[1], gu[3]
            rows.down[e], rows.down_chunks[e], rows.down_weights = dn[0], dn[1], dn[3]
            rows.keep += (gu[2], dn[2])
        self._layers[layer] = rows
        return rows

    def compute(self, layer: int, x: np.ndarray, groups: list[tuple[int, np.ndarray]], out: np.ndarray) -> bool:
        """A one-row request's outputs into ``out`` [len(groups), D] in group order; False (``out`` untouched)
        when the plan does not take it."""
        if x.shape[0] != 1 or not groups or not self._lock.acquire(blocking=False):
            return False
        try:
            rows = self._layer(layer)
            if rows is None:
                return False
            sel = [e for e, _ in groups]
            for e in sel:
                if not 0 <= e < self.experts or rows.gu[e] is None:
                    return False
            ops = packed_ops()
            if ops is None:
                return False
            kernels, kernel_pool = ops
            mod = dense._kernels()
            swiglu = mod.swiglu  # type: ignore[union-attr]
            self.x[...] = x
            pool = pool_of(kernels)
            n = len(sel)
            run_rows(kernel_pool, pool, np.concatenate([rows.gu[e] for e in sel]),  # type: ignore[misc]
                     sum(rows.gu_chunks[e] for e in sel), rows.gu_weights * n)
            g, u = self.g, self.u
            for e in sel:
                swiglu(g[e], u[e])
            run_rows(kernel_pool, pool, np.concatenate([rows.down[e] for e in sel]),  # type: ignore[misc]
                     sum(rows.down_chunks[e] for e in sel), rows.down_weights * n)
            np.take(self.y, sel, axis=0, out=out)
            self.used += 1
            return True
        finally:
            self._lock.release()


def _contiguous(w: object) -> bool:
    data = w if isinstance(w, np.ndarray) else getattr(w, "data", None)  # a Packed weight's stored bytes
    return isinstance(data, np.ndarray) and data.flags.c_contiguous
