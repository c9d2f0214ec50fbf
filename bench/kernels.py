"""Compiled decode kernels (engine/kernels.py, the ``fast`` extra) against the numpy tiles they replace.

    python bench/kernels.py [--rounds 200]

For every packed type, on the two product shapes of the engine benchmark's checkpoint (a 1536x768 attention-
or expert-sized matrix, a 1024x1024 one) with one activation row (decode): the numpy tiles (``Packed.tiled``:
dequantize 64 Ki weights into an fp32 tile with numpy, BLAS over it; the compiled dequantization is turned off
for this column, as on a process without numba), the kernel on one thread, the kernel on the
machine's kernel threads (``engine.kernels.threads()``), and fp32 BLAS over the widened matrix as a yardstick.
Median and range of ``--rounds`` timed calls, each side warmed up the same (20 calls) and timed alone (one
process, one side at a time). The engine uses a kernel where it measures >= 2x the tiles (issue 20's rule);
the ``kernel/tiles`` column is that ratio. Weights stay in cache here (0.3-1 MB): this is compute, not memory.
A second table times the prefill tiles' dequantization (a 1 Mi-weight tile), numpy against compiled.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import kernels, quant  # noqa: E402
from engine.gguf_export import quantize  # noqa: E402


def _time(fn, rounds: int) -> tuple[float, float, float]:  # noqa: ANN001
    for _ in range(20):
        fn()
    xs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs), min(xs), max(xs)


def _numpy_only(fn):  # noqa: ANN001, ANN202
    """Run ``fn`` with the tiles' compiled dequantization off: the numpy path a process without numba takes."""
    orig = kernels.dequantize_blocks
    kernels.dequantize_blocks = lambda blocks, qtype: None
    try:
        return fn()
    finally:
        kernels.dequantize_blocks = orig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="timed calls per side (default 200)")
    args = ap.parse_args()
    if not kernels.AVAILABLE:
        sys.exit("numba is not installed (pip install 'meshd[fast]'): nothing to compare")
    kernels.warm()
    nth = kernels.threads()
    rng = np.random.default_rng(0)
    print(f"kernel threads {nth}; G weights/s, median [min-max] of {args.rounds} calls, 1 activation row")
    print()
    print("| type | shape | numpy tiles | kernel, 1 thread | kernel, threads | kernel/tiles | fp32 BLAS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, k in ((1536, 768), (1024, 1024)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((1, k)).astype(np.float32)
        wide = w.copy()
        fp32 = _time(lambda: x @ wide.T, args.rounds)
        for qtype in kernels.TYPES:
            p = quant.packed(quantize(w, qtype), qtype, (n, k))
            out = np.empty((1, n), dtype=np.float32)
            tiles = _numpy_only(lambda: _time(lambda: p.tiled(x), args.rounds))
            one = _time(lambda: kernels.run(x, qtype, p.data, out, 0, n), args.rounds)
            many = _time(lambda: kernels.gemm(x, qtype, p.data), args.rounds)

            def g(t: tuple[float, float, float]) -> str:
                return f"{n * k / t[0] / 1e9:.2f} [{n * k / t[2] / 1e9:.2f}-{n * k / t[1] / 1e9:.2f}]"

            print(f"| {qtype} | {n}x{k} | {g(tiles)} | {g(one)} | {g(many)} | {tiles[0] / min(one[0], many[0]):.1f}x"
                  f" | {g(fp32)} |")
    # the prefill tiles' dequantization: numpy against the compiled one (bit for bit the same values)
    print()
    print("| type | numpy dequantize_blocks | compiled | compiled/numpy |")
    print("| --- | --- | --- | --- |")
    n, k = 1024, 1024  # one prefill tile's worth (MATMUL_PREFILL_TILE_WEIGHTS)
    w = rng.standard_normal((n, k)).astype(np.float32)
    for qtype in kernels.DEQUANT_TYPES:
        blocks = quantize(w, qtype).reshape(-1, kernels.BLOCK_BYTES[qtype])
        ref = _time(lambda: quant.dequantize_blocks(blocks, qtype), max(10, args.rounds // 10))
        comp = _time(lambda: kernels.dequantize_blocks(blocks, qtype), max(10, args.rounds // 10))
        print(f"| {qtype} | {n * k / ref[0] / 1e9:.2f} | {n * k / comp[0] / 1e9:.2f} | {ref[0] / comp[0]:.1f}x |")


if __name__ == "__main__":
    main()
