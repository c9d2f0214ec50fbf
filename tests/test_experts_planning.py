"""engine.experts.planning: building a layer's requests. A one-token request (a decode step) and a small
one are built in plain Python, a larger one with numpy; all must give the same bytes on the wire."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.experts import planning, rpc
from engine.moe import route


@st.composite
def _layer(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[int, np.ndarray]], list[int]]:
    t = draw(st.integers(1, 12))
    e = draw(st.integers(2, 8))
    k = draw(st.integers(1, min(e, 4)))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, 8)).astype(np.float32)
    work = route(rng.standard_normal((t, e)).astype(np.float32), k, True).work
    items = sorted(draw(st.sets(st.integers(0, len(work) - 1), min_size=1)))
    return x, work, items


@settings(max_examples=300, deadline=None)
@given(_layer())
def test_one_token_small_and_numpy_request_building_give_the_same_bytes(case: tuple[np.ndarray, list, list[int]]) -> None:
    x, work, items = case
    small = planning.token_rows(work, items), planning.request(3, x, work, items)  # one token: its own path
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rpc, "SMALL_PAIRS", 0)  # every request takes the numpy path
        tokens = planning.token_rows(work, items)
        large = tokens, planning.request(3, x, work, items, tokens)
    for a, b in zip(small[0], large[0]):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    assert rpc.encode(small[1], 1) == rpc.encode(large[1], 1)
    # and the worker reads back exactly the items' rows and experts
    got = rpc.decode(rpc.encode(small[1], 1)).message
    assert isinstance(got, rpc.ExpertRequest)
    rows_all, uniq = small[0]
    assert [(e, uniq[r].tolist()) for e, r in got.groups()] == [(work[i][0], work[i][1].tolist()) for i in items]
    assert got.x.tobytes() == x[uniq].tobytes()


@settings(max_examples=300, deadline=None)
@given(_layer(), st.integers(1, 3), st.integers(0, 2**31))
def test_whole_rows_and_combine_requests_match_the_numpy_path(case: tuple[np.ndarray, list, list[int]],
                                                               n_workers: int, seed: int) -> None:
    """Which tokens a worker may combine, and the combine request for them, do not depend on which path
    (lists for a decode step, numpy for larger layers) worked them out."""
    x, work, _ = case
    rng = np.random.default_rng(seed)
    t = x.shape[0]
    routing_logits = rng.standard_normal((t, max(e for e, _ in work) + 2)).astype(np.float32)
    routing = route(routing_logits, min(3, routing_logits.shape[1]), True)
    if seed % 5 == 0:  # a non-finite weight: never combined by a worker
        routing.weights[rng.integers(t), 0] = np.inf
    work = routing.work
    by_worker: dict[str, list[int]] = {}
    for i in range(len(work)):
        by_worker.setdefault(f"w{rng.integers(n_workers)}", []).append(i)
    small = planning.whole_rows(work, by_worker, routing)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rpc, "SMALL_PAIRS", 0)
        large = planning.whole_rows(work, by_worker, routing)
    assert small.dtype == large.dtype and small.tolist() == large.tolist()
    for w, items in enumerate(by_worker.values()):
        rows = np.flatnonzero(small == w)
        if t != 1 or not len(rows):
            continue
        req = planning.request(3, x, work, items)
        one = planning.combine_request(req, None, routing, rows)  # the one-token path
        tokens = planning.token_rows(work, items)
        general = planning.combine_request(planning.request(3, x, work, items, tokens), tokens, routing, rows)
        assert rpc.encode(one[0], 1) == rpc.encode(general[0], 1)
        assert one[1].dtype == general[1].dtype and one[1].tolist() == general[1].tolist()
