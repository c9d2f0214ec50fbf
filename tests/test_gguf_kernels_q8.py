"""The AVX-512 Q8_0 kernel (engine/kernels_q8.py) gives the bits of the generic one in engine/kernels.py, which
every other CPU runs: a mesh of mixed machines stays byte-identical. And the kernel threads take it where it is
available."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")

from engine import kernels, quant  # noqa: E402
from engine.gguf_export import export_gguf, quantize  # noqa: E402
from gguf_helpers import decode_hash  # noqa: E402

q8 = pytest.importorskip("engine.kernels_q8") if kernels.AVAILABLE else None
pytestmark = pytest.mark.skipif(q8 is None or not q8.AVAILABLE,
                                reason="numba (the fast extra) not installed, or not an AVX-512 CPU")

# (weight rows, K, activation rows): odd and even 32-block counts, the experts' 384-wide rows, 1-4 rows (one pass)
# and 5 and 8 (passes of four)
SHAPES = ((37, 32, 1), (300, 384, 1), (300, 384, 3), (64, 416, 4), (5, 1024, 2), (33, 96, 5), (17, 384, 8))


def _generic(x: np.ndarray, data: np.ndarray, r0: int, r1: int) -> np.ndarray:
    out = np.full((x.shape[0], data.shape[0]), np.nan, dtype=np.float32)
    kernels._q8_0(x, data, out, kernels.HALF, r0, r1)
    return out


def test_q8_kernel_gives_the_generic_kernels_bits() -> None:
    from engine import kernel_pool

    rng = np.random.default_rng(8)
    for n, k, t in SHAPES:
        # scales spanning orders of magnitude, and some all-zero and extreme blocks
        w = (rng.standard_normal((n, k)) * np.logspace(-3, 1, k)).astype(np.float32)
        w[3, :32] = 0
        w[4] = 0
        w[2, -32:] *= 1e4
        data = quant.packed(quantize(w, "Q8_0"), "Q8_0", (n, k)).data
        x = rng.standard_normal((t, k)).astype(np.float32)
        x[-1, :32] *= 1e-30  # tiny activations: products near the subnormal range
        want = _generic(x, data, 0, n)
        got = np.full((t, n), np.nan, dtype=np.float32)
        q8.q8_0(x, data, got, kernels.HALF, 0, n)
        assert got.tobytes() == want.tobytes(), (n, k, t)
        part = np.full((t, n), np.nan, dtype=np.float32)  # a row range leaves the other rows alone
        q8.q8_0(x, data, part, kernels.HALF, 1, n - 1)
        assert part[:, 1:-1].tobytes() == want[:, 1:-1].tobytes() and np.isnan(part[:, [0, -1]]).all()
        for s in range(t):  # an activation row's bits do not depend on the rows beside it
            alone = np.full((1, n), np.nan, dtype=np.float32)
            q8.q8_0(np.ascontiguousarray(x[s:s + 1]), data, alone, kernels.HALF, 0, n)
            assert alone.tobytes() == want[s:s + 1].tobytes(), (n, k, t, s)
        pool = np.full((t, n), np.nan, dtype=np.float32)
        kernels.run(x, "Q8_0", data, pool, 0, n)  # the kernel threads' path
        assert pool.tobytes() == want.tobytes()
    assert kernel_pool._ADDR["Q8_0"] == int(kernel_pool._CFUNCS["Q8_0"].address)
    assert kernel_pool._CFUNCS["Q8_0"].__name__ == "_c_q8_0_v"


def test_every_finite_half_scale_gives_the_generic_bits() -> None:
    """Blocks of random code bytes under every finite half as the scale (subnormals, zero, +-65504): the weight
    ``d * q`` is exact whichever way the half is read, so both kernels take the same products."""
    rng = np.random.default_rng(9)
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    halves = halves[np.isfinite(halves.view(np.float16))]
    rng.shuffle(halves)
    n, k = len(halves) // 12, 384
    blocks = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = halves[: n * 12].reshape(n, 12, 1).view(np.uint8)
    data = blocks.reshape(n, -1)
    for t in (1, 4):
        x = rng.standard_normal((t, k)).astype(np.float32) * np.float32(1e-3)
        want = _generic(x, data, 0, n)
        got = np.full((t, n), np.nan, dtype=np.float32)
        q8.q8_0(x, data, got, kernels.HALF, 0, n)
        assert got.tobytes() == want.tobytes(), t


def test_switch_keeps_the_generic_kernel() -> None:
    import os
    import subprocess
    import sys

    code = "from engine import kernel_pool as k; print(k._CFUNCS['Q8_0'].__name__)"
    env = {**os.environ, "MESHD_KERNELS_Q8": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out == ["_c_q8_0"]


def test_decode_bytes_are_the_generic_kernels(tmp_path) -> None:  # noqa: ANN001
    """A Q4_K_M file whose experts' down projections (rows of 384) are Q8_0: its decode gives the same bytes with
    this kernel as with the generic one (a node on another CPU), in fresh processes."""
    from experts_util import make_moe_checkpoint

    src = make_moe_checkpoint(tmp_path / "src", family="qwen3_moe", layers=2, experts=4, hidden=256, inter=384,
                              top_k=2, vocab=256)
    g = tmp_path / "m.gguf"
    export_gguf(src, g, "Q4_K_M")
    import gguf

    assert "Q8_0" in {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(g).tensors}
    assert decode_hash(g) == decode_hash(g, MESHD_KERNELS_Q8="0")
