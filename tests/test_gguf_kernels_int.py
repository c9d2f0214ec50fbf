"""Integer dot products for Q4_K/Q6_K/Q8_0 decode products (engine/kernels_int.py, numba on AVX-512 VNNI): the
numpy reference of their numerics is within 1e-5 of the exact product (CI runs that part without numba), the
compiled kernels give the reference's bits (so any CPU computing the same integers gets the same bits), a row's
bits depend on nothing but its own rows, and the kernel threads take them unless ``MESHD_KERNELS_INT=0``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")

from engine import kernels, kernels_int, quant  # noqa: E402
from engine.gguf_export import quantize  # noqa: E402

TYPES = ["Q4_K", "Q6_K", "Q8_0"]
needs_vnni = pytest.mark.skipif(not kernels_int.AVAILABLE, reason="numba (the fast extra) or AVX-512 VNNI missing")


def _weights(qtype: str, n: int, k: int, seed: int) -> quant.Packed:
    rng = np.random.default_rng(seed)
    # scales spanning orders of magnitude, an all-zero and an extreme block
    w = (rng.standard_normal((n, k)) * np.logspace(-3, 1, k)).astype(np.float32)
    w[3 % n, :256] = 0
    w[5 % n, :256] *= 1e4
    return quant.packed(quantize(w, qtype), qtype, (n, k))


def _activations(t: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, k)) * np.exp(rng.uniform(-6, 6, (t, k // 32, 1))).repeat(32, 1)
         .reshape(t, k)).astype(np.float32)
    x[0, 32:64] = 0  # an all-zero block
    x[0, 64:96] = np.float32(1e-40)  # subnormals
    x[t - 1, 96:128] *= np.float32(1e30)  # a huge block beside ordinary ones
    return x


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_is_within_1e_5_of_the_exact_product(qtype: str) -> None:
    ref = getattr(kernels_int, qtype.lower() + "_ref")
    p = _weights(qtype, 40, 768, 1)
    x = np.random.default_rng(2).standard_normal((3, 768)).astype(np.float32)
    exact = x.astype(np.float64) @ p.widen().astype(np.float64).T
    got = ref(x, p.data)
    assert got.dtype == np.float32 and got.shape == (3, 40)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    # the activation integers: |X| <= 2**ACT_BITS and X * 2**(E - ACT_BITS) within half a step of x
    xq, p32, finite = kernels_int.quantize_rows(x)
    assert finite.all() and np.abs(xq).max() <= 1 << kernels_int.ACT_BITS
    step = np.repeat(p32, 32, axis=1)
    assert (np.abs(xq * step - x.astype(np.float64)) <= step / 2).all()


@needs_vnni
@pytest.mark.parametrize("qtype", TYPES)
def test_compiled_kernel_gives_the_reference_bits(qtype: str) -> None:
    kern = getattr(kernels_int, qtype.lower())
    ref = getattr(kernels_int, qtype.lower() + "_ref")
    shapes = [(37, 256, 1), (300, 768, 3), (64, 1024, 4), (40, 512, 9)]  # 9: more rows than the stack lanes hold
    if qtype == "Q8_0":  # rows of whole 32-blocks but not of 256-element groups (experts' 384-wide down rows)
        shapes += [(50, 384, 2), (20, 416, 4), (9, 32, 1)]
    for n, k, t in shapes:
        data = _weights(qtype, n, k, n).data
        x = _activations(t, k, k)
        want = ref(x, data)
        got = np.full((t, n), np.nan, dtype=np.float32)
        kern(x, data, got, kernels.HALF, 0, n)
        assert got.tobytes() == want.tobytes(), (qtype, n, k, t)
        for s in range(t):  # a row alone, and a few weight rows alone: the same bits
            one = np.full((1, n), np.nan, dtype=np.float32)
            kern(np.ascontiguousarray(x[s:s + 1]), data, one, kernels.HALF, 0, n)
            assert one.tobytes() == want[s:s + 1].tobytes()
        part = np.full((t, n), np.nan, dtype=np.float32)
        kern(x, data, part, kernels.HALF, 1, 4)
        assert part[:, 1:4].tobytes() == want[:, 1:4].tobytes()
    # a non-finite activation makes its row NaN, the other rows stay as they were
    x = _activations(2, 256, 9)
    x[1, 7] = np.inf
    got = np.empty((2, 37), dtype=np.float32)
    kern(x, _weights(qtype, 37, 256, 4).data, got, kernels.HALF, 0, 37)
    assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()


@needs_vnni
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_every_scale_byte_and_half_gives_the_reference_bits(qtype: str) -> None:
    """Blocks of random bytes (every 6-bit scale and min, their packed high bits, every code), with the halves
    (d, dmin) drawn from every finite half including subnormals, zero and +-65504: the kernels unpack the scales
    in vector registers and convert the halves by ``vcvtph2ps``, the reference by numpy, and the bits agree."""
    bsz, halves = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[qtype]
    rng = np.random.default_rng(11)
    n, k = 64, 1024
    blocks = rng.integers(0, 256, (n, k // 256, bsz), dtype=np.uint8)
    finite = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    finite = finite[np.isfinite(finite.view(np.float16))]
    for o in halves:
        h = rng.choice(finite, (n, k // 256)).astype(np.uint16)
        h[0, 0], h[1, 0], h[2, 0], h[3, 0] = 0x0001, 0x83FF, 0x7BFF, 0xFBFF  # subnormals, +-65504
        blocks[:, :, o:o + 2] = h.view(np.uint8).reshape(n, k // 256, 2)
    data = blocks.reshape(n, -1)
    kern = getattr(kernels_int, qtype.lower())
    want = getattr(kernels_int, qtype.lower() + "_ref")
    for t in (1, 4):
        x = _activations(t, k, 5 + t)
        got = np.full((t, n), np.nan, dtype=np.float32)
        kern(x, data, got, kernels.HALF, 0, n)
        assert np.isfinite(got).all()
        assert got.tobytes() == want(x, data).tobytes(), (qtype, t)


@needs_vnni
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("helpers", [1, 2])
def test_kernel_threads_run_the_integer_kernels(qtype: str, helpers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import kernel_pool

    # Q8_0's integer kernel is there but decode keeps the float one (kernels_int.POOL_TYPES): tried here by address
    assert kernel_pool._CFUNCS[qtype].__name__.endswith("_int") == (qtype in kernels_int.POOL_TYPES)
    monkeypatch.setitem(kernel_pool._ADDR, qtype, int(getattr(kernel_pool, f"_c_{qtype.lower()}_int").address))
    p = _weights(qtype, 1500, 512, 3)
    x = _activations(2, 512, 4)
    want = getattr(kernels_int, qtype.lower() + "_ref")(x, p.data)
    pool = kernel_pool.Pool(helpers)
    out = np.full((2, 1500), np.nan, dtype=np.float32)
    pool.run([(x, qtype, p.data, out)])
    assert out.tobytes() == want.tobytes()
    if qtype in kernels_int.POOL_TYPES:
        assert p.matmul(x).tobytes() == want.tobytes()  # the engine's product for decode-sized T


@needs_vnni
def test_switch_keeps_the_float_kernels() -> None:
    code = ("from engine import kernel_pool as k; "
            "print(k._CFUNCS['Q4_K'].__name__, k._CFUNCS['Q6_K'].__name__, k._CFUNCS['Q8_0'].__name__)")
    env = {**os.environ, "MESHD_KERNELS_INT": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    from engine import kernels_q8  # the float Q8_0 kernel on AVX-512 (the generic one's bits)

    assert out == ["_c_q4_k_lut", "_c_q6_k_lut", "_c_q8_0_v" if kernels_q8.AVAILABLE else "_c_q8_0"]


@needs_vnni
def test_a_kept_table_quantizes_its_activations_on_every_run() -> None:
    """The decode plan builds a table once and runs it every token with new activations in the same buffers:
    each run quantizes them again (before any chunk), and the table alone keeps its quantization buffers."""
    import gc

    from engine import kernel_pool

    q4, q6 = _weights("Q4_K", 300, 512, 7), _weights("Q6_K", 200, 512, 8)
    x = _activations(1, 512, 1)
    outs = [np.empty((1, 300), dtype=np.float32), np.empty((1, 300), dtype=np.float32),
            np.empty((1, 200), dtype=np.float32)]
    # q and k share x and a layout (one buffer), v another layout of the same x
    prods = [(x, "Q4_K", q4.data, outs[0]), (x, "Q4_K", q4.data, outs[1]), (x, "Q6_K", q6.data, outs[2])]
    tbl, total, keep, _ = kernel_pool.table(prods)
    assert (tbl[:, 13] != 0).sum() == 2 and tbl[0, 12] == tbl[1, 12] != tbl[2, 12]
    del keep
    gc.collect()
    pool = kernel_pool.Pool(1)
    for step in range(3):
        x[...] = _activations(1, 512, 10 + step)
        if step == 1:
            pool.run_table(tbl, total, prods)
        else:
            kernel_pool.run_table_serial(tbl, total)
        assert outs[0].tobytes() == kernels_int.q4_k_ref(x, q4.data).tobytes()
        assert outs[1].tobytes() == outs[0].tobytes()
        assert outs[2].tobytes() == kernels_int.q6_k_ref(x, q6.data).tobytes()
