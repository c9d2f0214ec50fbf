"""The compiled decode step's small kernels (engine.dense_kernels) on their own: SwiGLU's polynomial exp against
float64 (no NaN or inf for any finite gate), the fused calls of the decode plan equal to their parts bit for bit,
and decode attention (with its cache prefetch) against a float64 reference at the cache's edges and in a
sliding window. Skipped without numba (the [fast] extra)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import dense

kern = dense._kernels()
pytestmark = pytest.mark.skipif(kern is None, reason="numba not installed (the [fast] extra)")
F32 = np.float32


def _rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(F32)


@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0, 60.0, 1000.0])
def test_swiglu_matches_float64_for_any_finite_gate(scale: float) -> None:
    g, u = _rand((3, 384), 1, scale), _rand((3, 384), 2)
    g[0, :4] = [-1e30, 1e30, -89.0, 89.0]  # past exp's fp32 range both ways
    out = g.copy()
    kern.swiglu(out, u)
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g64 / (1.0 + np.exp(-g64)) * u
    assert np.all(np.isfinite(out))
    # relative to the row's largest output: the only error is exp's (~3e-7) and the division's
    tol = 1e-6 * np.abs(ref).max(axis=1, keepdims=True) + 1e-30
    assert np.all(np.abs(out - ref) <= tol)


def test_fused_calls_equal_their_parts_bit_for_bit() -> None:
    g, u = _rand((16, 1, 384), 3, 4.0), _rand((16, 1, 384), 4)
    sel = np.array([9, 2, 15, 4], dtype=np.int64)
    a = g.copy()
    kern.swiglu_sel(a, u, sel)
    b = g.copy()
    for e in sel:
        kern.swiglu(b[e], u[e])
    assert np.array_equal(a, b)  # untouched experts untouched too

    x, o, w = _rand((1, 768), 5), _rand((1, 768), 6), _rand((768,), 7)
    x1, h1 = x.copy(), np.empty_like(x)
    kern.add_rmsnorm(x1, o, w, 1e-6, h1)
    x2, h2 = x.copy(), np.empty_like(x)
    x2 += o
    kern.rmsnorm_rows(x2, w, 1e-6, h2)
    assert np.array_equal(x1, x2) and np.array_equal(h1, h2)


def _attention64(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, lo: int, pos: int, scale: float) -> np.ndarray:
    nh, nkv = q.shape[0], kc.shape[0]
    out = np.empty((nh, vc.shape[2]))
    for h in range(nh):
        kv = h // (nh // nkv)
        s = kc[kv, lo:pos + 1].astype(np.float64) @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = p @ vc[kv, lo:pos + 1] / p.sum()
    return out.reshape(-1)


@pytest.mark.parametrize("cap,pos,window", [(64, 0, None), (64, 63, None), (200, 150, None), (200, 199, 37),
                                            (512, 300, 100)])
def test_attend_one_matches_float64_at_the_cache_edges(cap: int, pos: int, window: int | None) -> None:
    nh, nkv, hd = 12, 4, 64
    kc, vc = _rand((nkv, cap, hd), 8), _rand((nkv, cap, hd), 9)
    q, k, v = _rand((nh, hd), 10), _rand((nkv, hd), 11), _rand((nkv, hd), 12)
    half = hd // 2
    ang = pos / 10000.0 ** (np.arange(half) / half)
    cos, sin = np.cos(ang).astype(F32), np.sin(ang).astype(F32)
    lo = 0 if window is None else max(0, pos - window + 1)
    none = np.zeros(0, dtype=F32)
    out = np.empty(nh * hd, dtype=F32)
    qr, kr = q.copy(), k.copy()
    kern.attend_one(qr, kr, v.copy(), none, none, 1e-6, cos, sin, kc, vc, pos, lo, 0.125, out)
    assert np.array_equal(kc[:, pos], kr) and np.array_equal(vc[:, pos], v)  # the new position written
    ref = _attention64(qr, kc, vc, lo, pos, 0.125)
    assert np.abs(out - ref).max() <= 2e-6 * np.abs(vc).max()


@pytest.mark.parametrize("e", [8, 16, 40, 60])
@pytest.mark.parametrize("norm", [False, True])
def test_route_bits_do_not_depend_on_where_its_scratch_lies(e: int, norm: bool) -> None:
    # The softmax's scratch right after the logits (within 256 bytes: LLVM's overlap check then picks the loop's
    # sequential copy) or far from them (its vector copy) must give the same bits. With reassociation the two
    # copies added the softmax's sum in other orders, and a planned Q4_K_M step alternated between two
    # results as malloc put the scratch near the router's logits or not (docs/engine-model.md).
    k = 4
    near = np.empty(2 * e, dtype=F32)
    far_p = np.empty(1 << 16, dtype=F32)[-e:]
    for seed in range(200):
        logits = _rand((e,), 100 + seed, 4.0)
        near[:e] = logits
        got = []
        for lg, p in ((near[:e], near[e:]), (logits, far_p)):
            experts, weights = np.empty(k, dtype=np.int64), np.empty(k, dtype=F32)
            kern.route_into(lg, norm, experts, weights, p)
            got.append((experts.tobytes(), weights.tobytes()))
        assert got[0] == got[1], seed
    experts, weights = np.empty(k, dtype=np.int64), np.empty(k, dtype=F32)
    kern.route_one(logits, norm, experts, weights)  # route_one is route_into with a scratch of its own
    assert (experts.tobytes(), weights.tobytes()) == got[1]


def _attend_inputs(nh: int, nkv: int, hd: int, cap: int, pos: int, seed: int) -> tuple:
    r = np.random.default_rng(seed)
    kc, vc = (r.standard_normal((nkv, cap, hd)).astype(F32) for _ in range(2))
    q, k, v = r.standard_normal((nh, hd)).astype(F32), *(r.standard_normal((nkv, hd)).astype(F32) for _ in range(2))
    qn, kn = (r.standard_normal(hd).astype(F32) for _ in range(2))
    ang = pos / 10000.0 ** (np.arange(hd // 2) / (hd // 2))
    return q, k, v, qn, kn, np.cos(ang).astype(F32), np.sin(ang).astype(F32), kc, vc


@pytest.mark.parametrize("nh,nkv,hd,cap,pos", [(2, 1, 256, 8, 5), (12, 4, 64, 512, 300)])
def test_attend_one_bits_do_not_depend_on_where_its_arrays_lie(nh: int, nkv: int, hd: int, cap: int,
                                                                pos: int) -> None:
    # Every call with fresh copies of the same inputs, the heap churned in between: LLVM vectorises some loops
    # behind a run-time check of where two arrays lie from each other, and a vector copy that rounds otherwise
    # than its scalar copy (the output's division: a reciprocal in one, a division in the other) gave a planned
    # step other bits than the general pass now and then (the heap decided; ~1-3% of these calls).
    q, k, v, qn, kn, cos, sin, kc, vc = _attend_inputs(nh, nkv, hd, cap, pos, 20)
    rng = np.random.default_rng(21)
    junk: list[np.ndarray] = []
    seen = set()
    for _ in range(1500):
        junk.append(np.empty(int(rng.integers(1, 5000)), dtype=np.uint8))
        if len(junk) > 50:
            junk.pop(int(rng.integers(0, len(junk))))
        out = np.empty(nh * hd, dtype=F32)
        kc1, vc1 = kc.copy(), vc.copy()
        kern.attend_one(q.copy(), k.copy(), v.copy(), qn, kn, 1e-6, cos, sin, kc1, vc1, pos, 0, 0.125, out)
        seen.add(out.tobytes())
    assert len(seen) == 1


@pytest.mark.parametrize("helpers", [0, 1, 2])
def test_attention_round_gives_the_serial_bits(helpers: int) -> None:
    # The kernel threads' attention round (one chunk per KV head, engine.kernel_pool.attend_table) runs the
    # compiled kernel attend_one calls: the same bits whichever thread takes which head, the cache written alike.
    from engine import kernel_pool

    nh, nkv, hd, cap = 12, 4, 64, 512
    pool = kernel_pool.Pool(helpers) if helpers else None
    for pos, lo in ((0, 0), (5, 0), (300, 0), (300, 201), (511, 0)):
        q, k, v, qn, kn, cos, sin, kc, vc = _attend_inputs(nh, nkv, hd, cap, pos, 30 + pos)
        want, kcw, vcw = np.empty(nh * hd, dtype=F32), kc.copy(), vc.copy()
        kern.attend_one(q.copy(), k.copy(), v.copy(), qn, kn, 1e-6, cos, sin, kcw, vcw, pos, lo, 0.125, want)
        for _ in range(20 if helpers else 1):
            got, kcg, vcg = np.empty(nh * hd, dtype=F32), kc.copy(), vc.copy()
            qg, kg, vg = q.copy(), k.copy(), v.copy()
            prm = np.zeros(kern.ATTEND_WORDS, dtype=np.int64)
            kern.attend_params(prm, qg, kg, vg, qn, kn, 1e-6, cos, sin, kcg, vcg, 0, 0, 0.125, got)
            kern.attend_cache(prm, kcg, vcg, cos, sin, pos, lo)
            tbl, total = kernel_pool.attend_table(prm, nkv)
            if pool is None:
                kernel_pool.run_table_serial(tbl, total)
            else:
                pool.run_table(tbl, total, None)
            assert got.tobytes() == want.tobytes(), (pos, lo)
            assert kcg.tobytes() == kcw.tobytes() and vcg.tobytes() == vcw.tobytes()


def test_attend_one_refuses_what_does_not_fit() -> None:
    q, k, v, qn, kn, cos, sin, kc, vc = _attend_inputs(12, 4, 64, 16, 3, 40)
    out = np.empty(12 * 64, dtype=F32)
    none = np.zeros(0, dtype=F32)
    with pytest.raises(ValueError):  # a position past the cache
        kern.attend_one(q, k, v, none, none, 1e-6, cos, sin, kc, vc, 16, 0, 0.125, out)
    with pytest.raises(ValueError):  # a strided cache
        kern.attend_one(q, k, v, none, none, 1e-6, cos, sin, kc[:, ::2], vc[:, ::2], 3, 0, 0.125, out)
    with pytest.raises(ValueError):  # query heads not a multiple of the KV heads
        kern.attend_one(q[:10], k, v, none, none, 1e-6, cos, sin, kc, vc, 3, 0, 0.125, out[:640])


def test_general_pass_attention_takes_the_pool_with_the_serial_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # engine.dense.attend_one (the general pass, pipeline batches, remote-expert steps) splits a long attention
    # over the kernel threads; it must be the serial call's bits, and it must have taken the pool.
    from engine import kernel_pool, kernels

    pool = kernel_pool.Pool(1)
    monkeypatch.setattr(kernels, "_get_pool", lambda: pool)
    rounds = []
    real = pool.run_table
    monkeypatch.setattr(pool, "run_table", lambda *a: (rounds.append(a[1]), real(*a)))
    q, k, v, qn, kn, cos, sin, kc, vc = _attend_inputs(12, 4, 64, 512, 400, 50)
    want, kcw, vcw = np.empty(12 * 64, dtype=F32), kc.copy(), vc.copy()
    kern.attend_one(q.copy(), k.copy(), v.copy(), qn, kn, 1e-6, cos, sin, kcw, vcw, 400, 0, 0.125, want)
    got, kcg, vcg = np.empty(12 * 64, dtype=F32), kc.copy(), vc.copy()
    dense.attend_one(q.copy(), k.copy(), v.copy(), qn, kn, 1e-6, cos, sin, kcg, vcg, 400, 0, 0.125, got)
    assert rounds == [4]  # one round of the four KV heads
    assert got.tobytes() == want.tobytes() and kcg.tobytes() == kcw.tobytes() and vcg.tobytes() == vcw.tobytes()
