"""The Mixture-of-Experts seam: one ``expert_ffn`` and a routed block that takes the expert executor.

Canonical order (the contract the expert-workers issue depends on; do not change it without a new
protocol version):

1. Routing, in fp32: ``probs = softmax(router_logits)`` over all experts of the layer ([T, E]). Each
   token's top-k experts are chosen by descending probability, ties broken by the lower expert index
   (a stable sort of ``-probs``). Slot ``j`` (0..k-1) is the j-th ranked expert. If ``norm_topk_prob``
   the k weights are divided by their sum. The DeepSeek-V3-style families route differently
   (``engine.deepseek.route_sigmoid``: sigmoid scores, a bias for choosing only, group-limited) but
   end the same way: slots ranked by the choosing score, ties to the lower index, weights in fp32.
2. Work list: the experts that received at least one token, in ascending expert index; for each, its
   rows are the token indices routed to it, ascending. This is ``route()``'s ``work``.
3. Execution: ``executor(layer, x, work)`` returns, for each work item in order, the array
   ``expert_ffn(x[rows], W_e)`` of shape [len(rows), D] in fp32 — the unweighted expert output, computed
   on exactly those rows (BLAS results may depend on the batch shape, so never on more or fewer rows).
   A remote executor sends x's needed rows and the (row, expert) pairs and must return these arrays
   bit for bit.
4. Combination, on the node that routed: ``out = 0``; for slot j = 0..k-1 in order:
   ``out += w[:, j, None] * Y[:, j, :]`` where ``Y[t, j]`` is token t's output from its j-th expert.
   The summation order is therefore fixed per token (slot order), independent of how experts were
   spread over workers. ``weighted_sum`` is this loop; every node that combines calls it.

Combining on a worker (the optional ``RoutedExecutor`` extension) keeps this order: a worker that holds
all k experts of a token in one request may run step 4 for that token itself, with the same fp32 slot
weights, in the same slot order, through the same ``weighted_sum`` (zeros, then ``+= w_j * y_j`` for
j = 0..k-1). Elementwise fp32 multiply and add are exactly rounded per element, so the row is the same
bits whichever node (and whichever subset of rows) computes it; step 3 still runs on exactly the rows of
the work list. Tokens whose experts are spread over several workers are combined by the routing node.

``expert_ffn`` is SwiGLU: ``down(silu(x @ gate.T) * (x @ up.T))`` with weights in Hugging Face layout
(``gate``/``up``: [I, D], ``down``: [D, I]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import prefill_threads
from .dense import matmul_many, swiglu, swiglu_compiled
from .limits import COMBINE_BLOCK_ROWS, EXPERT_GROUP_ROWS, KERNEL_MAX_ROWS

# One work item: (expert index, ascending row indices into x).
WorkItem = tuple[int, np.ndarray]
# executor(layer, x [T, D], work) -> one [len(rows), D] fp32 array per work item, in order.
ExpertExecutor = Callable[[int, np.ndarray, Sequence[WorkItem]], list[np.ndarray]]
# weights(layer, expert) -> (gate [I, D], up [I, D], down [D, I]) as fp32 arrays.
ExpertWeightsFn = Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def silu(x: np.ndarray) -> np.ndarray:
    # [..] -> [..]
    return x / (np.float32(1.0) + np.exp(-x))


def expert_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """SwiGLU feed-forward: [n, D] -> [n, D]. The one implementation every path calls."""
    return _ffn_items([(x, gate, up, down)])[0]


def expert_ffn_many(items: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """``[expert_ffn(x, gate, up, down) for ...]``, bit for bit: an item's bits depend on the item alone, never
    on the others in the call (an expert worker batches a request's items its own way). Decode-sized items
    (at most ``KERNEL_MAX_ROWS`` rows) with the products of all of them in two rounds of the compiled kernels'
    threads (every gate/up, then every down) instead of two per item; items with more rows (a prefill's, on an
    expert worker too) each on the prefill threads (``engine.prefill_threads``) when there are several, the
    largest first, their products in column pieces by shape (``engine.products``). BLAS is single-threaded in
    every process (pinned by ``engine.prefill_threads``), so no item's bits depend on a thread count."""
    return _ffn_items(items)


def _ffn_items(items: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    big = [i for i, it in enumerate(items) if it[0].shape[0] > KERNEL_MAX_ROWS]
    if not big:
        return _ffn_many(items)
    res: list[np.ndarray | None] = [None] * len(items)
    if len(big) < len(items):
        small = [i for i in range(len(items)) if items[i][0].shape[0] <= KERNEL_MAX_ROWS]
        for i, y in zip(small, _ffn_many([items[i] for i in small])):
            res[i] = y
    if len(big) > 1 and prefill_threads.threads() > 1:

        def one(i: int) -> None:
            res[i] = _ffn_many([items[i]])[0]

        prefill_threads.run([functools.partial(one, i) for i in sorted(big, key=lambda i: -items[i][0].shape[0])])
    else:
        for i, y in zip(big, _ffn_many([items[i] for i in big])):
            res[i] = y
    return res  # type: ignore[return-value]


def _ffn_many(items: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    gu = matmul_many([p for x, gate, up, _ in items for p in ((x, gate), (x, up))])  # x @ gate.T, x @ up.T
    hs = []
    for i, (x, gate, _, _) in enumerate(items):
        if swiglu_compiled(x, gate):  # decode rows of a model-sized expert: one compiled pass
            hs.append(swiglu(gu[2 * i], gu[2 * i + 1]))
            continue
        h = silu(gu[2 * i])  # [n, I]
        h *= gu[2 * i + 1]
        hs.append(h)
    return matmul_many([(h, item[3]) for h, item in zip(hs, items)])  # h @ down.T: [n, D] each


@dataclass(frozen=True, slots=True)
class Routing:
    """The outcome of routing T tokens: slot experts/weights and the canonical work list."""

    experts: np.ndarray  # [T, k] int64, slot order
    weights: np.ndarray  # [T, k] fp32
    work: list[WorkItem]  # ascending expert, ascending rows
    # Per work item, the flat slot index t * k + j of each of its rows (lets combine skip a search).
    positions: list[np.ndarray] | None = None


def route(router_logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> Routing:
    """Canonical routing (steps 1-2 of the module contract). [T, E] -> Routing."""
    logits = router_logits.astype(np.float32, copy=False)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)  # [T, E]
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # [T, k]
    weights = probs[np.arange(probs.shape[0])[:, None], experts]  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return make_routing(experts, weights)


def make_routing(experts: np.ndarray, weights: np.ndarray) -> Routing:
    """Step 2 for chosen slots: experts [T, k] int64 and weights [T, k] fp32 in slot order -> Routing."""
    top_k = experts.shape[1]
    if experts.shape[0] == 1:  # one token (decode): the same lists without the sort's array work
        slots = experts[0].tolist()
        if len(set(slots)) == top_k:
            order = sorted(range(top_k), key=slots.__getitem__)
            return Routing(experts=experts, weights=weights.astype(np.float32, copy=False),
                           work=[(slots[j], np.zeros(1, dtype=np.int64)) for j in order],
                           positions=[np.array([j], dtype=np.int64) for j in order])
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")  # groups by expert, ascending token within each
    tokens = order // top_k
    sorted_experts = flat[order]
    cuts = (np.flatnonzero(sorted_experts[1:] != sorted_experts[:-1]) + 1).tolist()
    starts = [0, *cuts]
    ends = [*cuts, len(flat)]
    heads = sorted_experts[starts].tolist()
    work: list[WorkItem] = [(ex, tokens[a:b]) for ex, a, b in zip(heads, starts, ends)]
    positions = [order[a:b] for a, b in zip(starts, ends)]
    return Routing(experts=experts, weights=weights.astype(np.float32, copy=False), work=work,
                   positions=positions)


def local_executor(weights: ExpertWeightsFn) -> ExpertExecutor:
    """An executor that runs every work item in this process with ``expert_ffn``.

    A prefill's items (more than ``KERNEL_MAX_ROWS`` rows in x) are spread over the prefill threads
    (``engine.prefill_threads``), each item whole on one thread, the largest first; without such threads a
    work list runs in groups of about ``EXPERT_GROUP_ROWS`` rows (each item whole, in order). Either way the
    gathered rows and gate/up activations alive at once stay bounded, and each item's products and SwiGLU are
    the same operations on the same rows whatever group or thread runs it, on single-threaded BLAS for a
    prefill's items either way (``expert_ffn_many``), so the outputs are the same bits."""

    def run(layer: int, x: np.ndarray, work: Sequence[WorkItem]) -> list[np.ndarray]:
        if x.shape[0] > KERNEL_MAX_ROWS and len(work) > 1 and prefill_threads.threads() > 1:
            return _run_threaded(weights, layer, x, work)
        out: list[np.ndarray] = []
        a = rows_in_group = 0
        for b, (_, rows) in enumerate(work):
            rows_in_group += len(rows)
            if rows_in_group >= EXPERT_GROUP_ROWS or b == len(work) - 1:
                out += expert_ffn_many([(x[r], *weights(layer, e)) for e, r in work[a : b + 1]])
                a, rows_in_group = b + 1, 0
        return out

    return run


def _run_threaded(weights: ExpertWeightsFn, layer: int, x: np.ndarray, work: Sequence[WorkItem]) -> list[np.ndarray]:
    """``local_executor``'s prefill: one task per work item on the prefill threads."""
    res: list[np.ndarray | None] = [None] * len(work)

    def item(i: int) -> None:
        e, rows = work[i]
        res[i] = expert_ffn(x[rows], *weights(layer, e))

    order = sorted(range(len(work)), key=lambda i: -len(work[i][1]))  # largest first: the last to finish is small
    prefill_threads.run([functools.partial(item, i) for i in order])
    return res  # type: ignore[return-value]


class RoutedExecutor(Protocol):
    """An executor that may also take a whole layer's routing and return the combined output.

    ``run_routed(layer, x, routing)`` must return exactly (bit for bit) what
    ``combine(routing, executor(layer, x, routing.work), T, D)`` would: [T, D] fp32. ``run_block`` uses it
    when the executor has it; the plain call keeps working for every other caller.
    """

    def __call__(self, layer: int, x: np.ndarray, work: Sequence[WorkItem]) -> list[np.ndarray]: ...

    def run_routed(self, layer: int, x: np.ndarray, routing: Routing) -> np.ndarray: ...


def weighted_sum(weights: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Step 4 for n rows: ``acc = 0``, then ``acc += w[:, j, None] * y[:, j]`` for j in slot order.

    [n, k] fp32, [n, k, D] fp32 -> [n, D] fp32 (into ``out`` if given). Elementwise, so each row's bits depend only
    on that row.
    """
    if out is None:
        acc = np.zeros((y.shape[0], y.shape[2]), dtype=np.float32)  # [n, D]
    else:
        acc = out
        acc[...] = 0
    for j in range(y.shape[1]):
        acc += weights[:, j, None] * y[:, j, :]
    return acc


def slot_positions(routing: Routing, item: int) -> np.ndarray:
    """Flat slot index ``t * k + j`` of each row of work item ``item``, in the item's row order."""
    if routing.positions is not None:
        return routing.positions[item]
    expert, rows = routing.work[item]
    slots = np.argmax(routing.experts[rows] == expert, axis=-1)  # [n]
    return rows * routing.experts.shape[1] + slots


def combine(routing: Routing, outputs: Sequence[np.ndarray], t: int, d: int) -> np.ndarray:
    """Step 4: weighted sum of per-(row, expert) outputs in slot order. -> [T, D] fp32."""
    top_k = routing.experts.shape[1]
    if t == 1 and routing.positions is not None:  # one token: weighted_sum's operations without gathering Y
        slot: list[np.ndarray | None] = [None] * top_k
        for pos, out in zip(routing.positions, outputs):
            slot[int(pos[0])] = out
        acc = np.zeros((1, d), dtype=np.float32)
        for j in range(top_k):
            acc += routing.weights[:, j, None] * slot[j]
        return acc
    pos = [slot_positions(routing, i) for i in range(len(outputs))]
    if t <= COMBINE_BLOCK_ROWS:  # a batched decode step's few tokens: Y [T, k, D] gathered whole, then summed
        y = np.empty((t, top_k, d), dtype=np.float32)
        flat = y.reshape(t * top_k, d)  # a view: row t * k + j is Y[t, j]
        for p, out in zip(pos, outputs):
            flat[p] = out
        return weighted_sum(routing.weights, y)
    # a prefill: Y[t, j] gathered from the work outputs one block of tokens at a time (never the whole [T, k, D]):
    # the rows of item i that fall in tokens a..b-1 are a contiguous run of its outputs, since its flat slot
    # indices ascend (the work list's rows ascend, module contract step 2)
    acc = np.empty((t, d), dtype=np.float32)

    def rows(a: int, b: int) -> None:
        starts = list(range(a, b, COMBINE_BLOCK_ROWS))
        bounds = np.array([*starts, b], dtype=np.int64) * top_k
        cuts = [np.searchsorted(p, bounds).tolist() for p in pos]  # per item: its rows in each block
        for n, lo in enumerate(starts):
            hi = min(b, lo + COMBINE_BLOCK_ROWS)
            y = np.empty((hi - lo, top_k, d), dtype=np.float32)  # Y[lo:hi]
            flat = y.reshape((hi - lo) * top_k, d)  # a view: row (t - lo) * k + j is Y[t, j]
            first = int(bounds[n])
            for p, c, out in zip(pos, cuts, outputs):
                r0, r1 = c[n], c[n + 1]
                if r1 > r0:
                    flat[p[r0:r1] - first] = out[r0:r1]
            weighted_sum(routing.weights[lo:hi], y, out=acc[lo:hi])

    # row ranges on the prefill threads (a row's gather and sum are the same bits in any range)
    prefill_threads.run_rows(t, rows)
    return acc


def moe_block(
    x: np.ndarray,
    router_logits: np.ndarray,
    top_k: int,
    norm_topk_prob: bool,
    executor: ExpertExecutor,
    layer: int,
) -> np.ndarray:
    """Routed-experts output for one layer: [T, D] -> [T, D]. Shared experts are added by the caller."""
    return run_block(executor, layer, x, route(router_logits, top_k, norm_topk_prob))


def run_block(executor: ExpertExecutor, layer: int, x: np.ndarray, routing: Routing) -> np.ndarray:
    """Steps 3-4 for one routed layer: [T, D] -> [T, D] fp32, through ``run_routed`` when the executor
    has it (``RoutedExecutor``), else its plain call and ``combine``."""
    run_routed = getattr(executor, "run_routed", None)
    if run_routed is not None:
        out = run_routed(layer, x, routing)
        if out.shape != x.shape or out.dtype != np.float32:
            raise RuntimeError(f"expert executor returned {out.dtype}{list(out.shape)} for layer {layer},"
                               f" expected float32{list(x.shape)}")
        return out
    outputs = executor(layer, x, routing.work)
    if len(outputs) != len(routing.work):
        raise RuntimeError(f"expert executor returned {len(outputs)} outputs for {len(routing.work)} items")
    for (expert, rows), out in zip(routing.work, outputs):
        if out.shape != (len(rows), x.shape[1]) or out.dtype != np.float32:
            raise RuntimeError(
                f"expert executor returned {out.dtype}{list(out.shape)} for layer {layer} expert {expert},"
                f" expected float32{[len(rows), x.shape[1]]}"
            )
    return combine(routing, outputs, x.shape[0], x.shape[1])


# A forward pass written as steps: it yields one RoutedCall per sparse layer, (layer, normed hidden x [T, D],
# routing), is sent that layer's routed-experts output [T, D] fp32, and returns the pass's logits. Whoever
# drives it decides where and on which thread each layer's experts run; the arithmetic is the same.
RoutedCall = tuple[int, np.ndarray, Routing]
ForwardSteps = Generator[RoutedCall, np.ndarray, np.ndarray]


def drive(steps: ForwardSteps, executor: ExpertExecutor,
          warm: Callable[[int], object] | None = None) -> np.ndarray:
    """Run a forward pass's steps with ``executor``; -> the pass's result.

    An executor with its own ``drive(steps, warm)`` runs the pass itself (the remote executor runs a decode
    step's layers on its event loop, without a thread hand-off per layer, and may call ``warm(layer + 1)``
    while a layer's experts are out on the network); any other executor gets one ``run_block`` per sparse
    layer on this thread.
    """
    own = getattr(executor, "drive", None)
    if own is not None:
        return own(steps, warm=warm)
    try:
        call = next(steps)
        while True:
            call = steps.send(run_block(executor, *call))
    except StopIteration as stop:
        return stop.value
