"""Compiled decode kernels (engine/kernels.py, the ``fast`` extra) against the numpy tiles they replace and
against an earlier revision's kernels (``--baseline``), all in one run.

    python bench/kernels.py [--rounds 200] [--baseline 5a404c5] [--main 8a5eab4] [--only 7,8] [--alternations 5]
        [--decode /tmp/compact-bench/model-Q4_K_M.gguf] [--fp32 /tmp/compact-bench] [--int-base main]

Table 1, for every packed type on the two product shapes of the engine benchmark's checkpoint (1536x768,
1024x1024) with 1 and 8 activation rows: G weights/s (weights of the matrix per second of one call, whatever
the number of rows) of the numpy tiles (``Packed.tiled`` with the compiled dequantization turned off: what a
process without numba computes), the baseline revision's kernel and this tree's kernel, each on one thread and
on the machine's kernel threads (``engine.kernels.threads()``), and fp32 BLAS over the widened matrix as a
yardstick. The engine takes the kernel for up to ``KERNEL_MAX_ROWS`` rows and the tiles above that.
Weights stay in cache here (0.3-1 MB): this is compute, not memory.

Table 2, one decode layer of that checkpoint as the engine issues it (q/k/v in one round, o, the gate/up of
4 experts in one round, their 4 down projections in one round: 4 rounds, 5.5 M weights; the experts' down
projections have 384-wide rows, so the K-quant rows use Q8_0 for them as Q4_K_M files do): microseconds per
layer and G weights/s, baseline against this tree. This includes the kernel threads' hand-offs.

Table 3 times the prefill tiles' dequantization (a 1 Mi-weight tile), numpy against compiled.

Table 4, fp32 weights (engine.dense's decode products): fp32 BLAS, the row kernel (``dense_kernels.f32_rows``)
called alone, and the same products through ``--main``'s engine/dense.py (its own lock-based helper thread,
loaded with ``git show``) against this tree's (the kernel threads' pool, one round for fp32 and packed alike):
one product of 1 and 8 rows over a set of matrices larger than the caches (memory, not compute: GB/s), and one
decode layer's fp32 products as the engine issues them (4 rounds).

Table 5 (session 5), the K-quant kernels this tree runs on AVX-512 (engine/kernels_lut.py: per-sub-block tables
and a permute per 16 weights) against the generic ones of engine/kernels.py (what every other CPU runs; the same
bits), called directly on one thread, 1 and 8 activation rows, weights in cache; the two sides alternate
``--alternations`` times (each ``--rounds`` calls) and the table gives the median and range of those medians.

Table 6 (with ``--decode PATH``, e.g. ``/tmp/compact-bench/model-Q4_K_M.gguf`` written by bench/engine.py): a
whole planned decode of that GGUF checkpoint in this process, the generic K-quant kernels against the lookup ones
(the kernel threads' table entries switched, the decode plan rebuilt), ``--alternations`` blocks of 40 steps each
after a 64-token prompt (the cache kept between 100 and 200 positions): ms per token, median and range.

Table 7 (session 6), the integer Q4_K/Q6_K/Q8_0 kernels (engine/kernels_int.py, AVX-512 VNNI) against the float
ones (the lookup kernels; Q8_0's of engine/kernels.py),
one thread, 1 and 4 activation rows, weights in cache: called directly over all rows, and through the kernel
threads' table run serially (the pool's row chunks of KERNEL_CHUNK_WEIGHTS, and the integer kernels' quantization of
the activations, once per run of the table).
Table 8 (with ``--decode``): a whole planned decode, float (lookup) against integer kernels, as table 6.

Table 9 (session 9), on AVX2 CPUs without AVX-512: engine/kernels_avx2.py's Q4_K/Q6_K/Q8_0 kernels against the
generic ones (same bits), one thread, 1 and 4 activation rows, weights in cache, alternated as table 5; with
``--decode`` also the whole planned decode of that checkpoint on either set (the plan rebuilt per side) and, with
``--fp32 DIR`` (bench/engine.py's fp32 checkpoint directory), our fp32 decode in the same process and rounds: ms
per token in wall time and in the calling thread's CPU time (with ``MESHD_KERNEL_THREADS=1`` all the work; what
other processes do to the core counts less), median [range] over ``--alternations`` rounds of 40 steps, and the
Q4_K_M/fp32 ratios per side.

Table 10 (session 10, AVX-512 VNNI): this tree's integer Q4_K/Q6_K kernels against ``--int-base``'s (default
main; its engine/kernels_int.py imported beside this tree's), one thread, 1 and 4 activation rows, weights in
cache, on one prepared activation buffer, the two sides' outputs compared bit for bit; with ``--decode`` the
whole planned decode with either pair in the kernel threads' table (the first logits compared), and our fp32 with
``--fp32``, rounds alternating as table 9; ratios paired per round.

Median and range of ``--rounds`` timed calls, each side warmed up the same (20 calls) and timed alone (one
process, one side at a time). The baseline is the revision's engine/kernels.py, loaded with ``git show``
(left out when git or the revision is not there); it must be self-contained, i.e. older than
engine/kernel_pool.py (5a404c5 is: the kernels and pool before session 3). Figures: docs/kernels.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import kernels, quant  # noqa: E402
from engine.gguf_export import quantize  # noqa: E402

BASELINE = "5a404c5"  # the kernels before session 3 (docs/engine-model.md "Quiet rerun")
MAIN = "8a5eab4"  # main at the start of session 4: fp32 products on engine.dense's own helper thread


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


def _baseline(rev: str) -> ModuleType | None:
    """engine/kernels.py as of ``rev``, imported as ``engine._kernels_baseline`` (its numba cache beside it)."""
    if not rev:
        return None
    got = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:engine/kernels.py"], capture_output=True,
                         text=True, check=False)
    if got.returncode != 0:
        print(f"baseline {rev}: not available ({got.stderr.strip()[:100]}); left out")
        return None
    d = Path(tempfile.gettempdir()) / f"meshd-bench-kernels-{rev}"
    d.mkdir(exist_ok=True)
    f = d / "_kernels_baseline.py"
    if not f.exists() or f.read_text() != got.stdout:
        f.write_text(got.stdout)
    spec = importlib.util.spec_from_file_location("engine._kernels_baseline", f)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.warm()
    return mod


def _g(n: int, t: tuple[float, float, float]) -> str:
    return f"{n / t[0] / 1e9:.2f} [{n / t[2] / 1e9:.2f}-{n / t[1] / 1e9:.2f}]"


def products(rounds: int, base: ModuleType | None, rng: np.random.Generator) -> None:
    print("| type | shape | rows | numpy tiles | base, 1 thread | new, 1 thread | base, threads | new, threads"
          " | new/base (threads) | fp32 BLAS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, k in ((1536, 768), (1024, 1024)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        for t in (1, 8):
            x = rng.standard_normal((t, k)).astype(np.float32)
            wide = w.copy()
            fp32 = _time(lambda: x @ wide.T, rounds)
            for qtype in kernels.TYPES:
                p = quant.packed(quantize(w, qtype), qtype, (n, k))
                out = np.empty((t, n), dtype=np.float32)
                tiles = _numpy_only(lambda: _time(lambda: p.tiled(x), rounds))
                one = _time(lambda: kernels.run(x, qtype, p.data, out, 0, n), rounds)
                many = _time(lambda: kernels.gemm(x, qtype, p.data), rounds)
                if base is not None:
                    b_one = _time(lambda: base.run(x, qtype, p.data, out, 0, n), rounds)
                    b_many = _time(lambda: base.gemm(x, qtype, p.data), rounds)
                    bcols = f"{_g(n * k, b_one)} | {_g(n * k, one)} | {_g(n * k, b_many)} | {_g(n * k, many)}"
                    ratio = f"{b_many[0] / many[0]:.2f}x"
                else:
                    bcols, ratio = f"- | {_g(n * k, one)} | - | {_g(n * k, many)}", "-"
                print(f"| {qtype} | {n}x{k} | {t} | {_g(n * k, tiles)} | {bcols} | {ratio} | {_g(n * k, fp32)} |")


def layer(rounds: int, base: ModuleType | None, rng: np.random.Generator) -> None:
    hidden, kv, inter, experts = 768, 256, 384, 4
    print("| type | base, us/layer | new, us/layer | base G weights/s | new G weights/s | new/base |")
    print("| --- | --- | --- | --- | --- | --- |")
    for qtype in kernels.TYPES:
        down_type = "Q8_0" if qtype.endswith("_K") else qtype

        def mk(n: int, k: int, q: str = qtype) -> tuple[str, np.ndarray]:
            return q, quant.packed(quantize(rng.standard_normal((n, k)).astype(np.float32), q), q, (n, k)).data

        qkv = [mk(hidden, hidden), mk(kv, hidden), mk(kv, hidden)]
        o = mk(hidden, hidden)
        gu = [mk(inter, hidden) for _ in range(2 * experts)]
        down = [mk(hidden, inter, down_type) for _ in range(experts)]
        h = rng.standard_normal((1, hidden)).astype(np.float32)
        a = rng.standard_normal((1, inter)).astype(np.float32)
        weights = sum(d.shape[0] * (inter if q == down_type and d.shape[1] < 300 else hidden)
                      for q, d in qkv + [o] + gu) + experts * hidden * inter

        def step(mod: ModuleType) -> None:
            mod.gemm_many([(h, q, d) for q, d in qkv])
            mod.gemm(h, *o)
            mod.gemm_many([(h, q, d) for q, d in gu])
            mod.gemm_many([(a, q, d) for q, d in down])

        sides = [("new", kernels)] + ([("base", base)] if base is not None else [])
        got = {name: _time(lambda: step(mod), rounds) for name, mod in sides}
        new = got["new"]
        b = got.get("base")
        bus = f"{b[0] * 1e6:.0f} [{b[1] * 1e6:.0f}-{b[2] * 1e6:.0f}]" if b else "-"
        print(f"| {qtype} (down {down_type}) | {bus} | {new[0] * 1e6:.0f} [{new[1] * 1e6:.0f}-{new[2] * 1e6:.0f}]"
              f" | {_g(weights, b) if b else '-'} | {_g(weights, new)} | {f'{b[0] / new[0]:.2f}x' if b else '-'} |")


def dequant(rounds: int, rng: np.random.Generator) -> None:
    print("| type | numpy dequantize_blocks | compiled | compiled/numpy |")
    print("| --- | --- | --- | --- |")
    n, k = 1024, 1024  # one prefill tile's worth (MATMUL_PREFILL_TILE_WEIGHTS)
    w = rng.standard_normal((n, k)).astype(np.float32)
    for qtype in kernels.DEQUANT_TYPES:
        blocks = quantize(w, qtype).reshape(-1, kernels.BLOCK_BYTES[qtype])
        ref = _time(lambda: quant.dequantize_blocks(blocks, qtype), max(10, rounds // 10))
        comp = _time(lambda: kernels.dequantize_blocks(blocks, qtype), max(10, rounds // 10))
        print(f"| {qtype} | {n * k / ref[0] / 1e9:.2f} | {n * k / comp[0] / 1e9:.2f} | {ref[0] / comp[0]:.1f}x |")


def _main_dense(rev: str) -> ModuleType | None:
    """engine/dense.py as of ``rev`` (fp32 products on its own helper thread), as ``engine._dense_main``."""
    if not rev:
        return None
    got = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:engine/dense.py"], capture_output=True,
                         text=True, check=False)
    if got.returncode != 0 or "class _Pool" not in got.stdout:
        print(f"main {rev}: no engine/dense.py with its own pool ({got.stderr.strip()[:100]}); left out")
        return None
    d = Path(tempfile.gettempdir()) / f"meshd-bench-dense-{rev.replace('/', '_')}"
    d.mkdir(exist_ok=True)
    f = d / "_dense_main.py"
    f.write_text(got.stdout)
    spec = importlib.util.spec_from_file_location("engine._dense_main", f)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod if mod._kernels() is not None else None


def f32(rounds: int, old: ModuleType | None, rng: np.random.Generator) -> None:
    from engine import dense

    kern = dense._kernels()
    if kern is None:
        print("fp32 row kernel: not available (MESHD_KERNELS=numpy?)")
        return
    sets = {(n, k): [rng.standard_normal((n, k)).astype(np.float32) for _ in range(max(4, (256 << 20) // (n * k * 4)))]
            for n, k in ((1536, 768), (1024, 1024))}
    print("| shape | rows | fp32 BLAS | row kernel alone, 1 thread | main's dense, threads | this tree, threads"
          " | this/main |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    r = max(5, rounds // 20)
    for (n, k), mats in sets.items():
        nbytes = sum(m.nbytes for m in mats)
        for t in (1, 8):
            x = rng.standard_normal((t, k)).astype(np.float32)
            out = np.empty((t, n), dtype=np.float32)

            def gbs(v: tuple[float, float, float]) -> str:
                return f"{nbytes / v[0] / 1e9:.1f} [{nbytes / v[2] / 1e9:.1f}-{nbytes / v[1] / 1e9:.1f}]"

            blas = _time(lambda: [x @ m.T for m in mats], r)
            alone = _time(lambda: [kern.f32_rows(x, m, out, 0, n) for m in mats], r)
            xs = x[: min(t, 4)]  # the engine takes the kernel for at most KERNEL_MAX_ROWS rows: 8 rows -> 4 here
            new = _time(lambda: [dense.matmul(xs, m) for m in mats], r)
            base = _time(lambda: [old.matmul(xs, m) for m in mats], r) if old is not None else None
            print(f"| {n}x{k} | {t} (kernel {xs.shape[0]}) | {gbs(blas)} | {gbs(alone)} | {gbs(base) if base else '-'}"
                  f" | {gbs(new)} | {f'{base[0] / new[0]:.2f}x' if base else '-'} |")
    hidden, kv, inter, experts = 768, 256, 384, 4  # one decode layer of the engine benchmark's checkpoint
    w = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in
         [("q", (hidden, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, hidden))]
         + [(f"g{e}", (inter, hidden)) for e in range(experts)] + [(f"u{e}", (inter, hidden)) for e in range(experts)]
         + [(f"d{e}", (hidden, inter)) for e in range(experts)]}
    h = rng.standard_normal((1, hidden)).astype(np.float32)
    a = rng.standard_normal((1, inter)).astype(np.float32)
    nbytes = sum(m.nbytes for m in w.values())

    def step(mod: ModuleType) -> None:
        mod.matmul_many([(h, w["q"]), (h, w["k"]), (h, w["v"])])
        mod.matmul(h, w["o"])
        mod.matmul_many([(h, w[f"{p}{e}"]) for e in range(experts) for p in "gu"])
        mod.matmul_many([(a, w[f"d{e}"]) for e in range(experts)])

    new = _time(lambda: step(dense), rounds)
    base = _time(lambda: step(old), rounds) if old is not None else None
    us = lambda v: f"{v[0] * 1e6:.0f} [{v[1] * 1e6:.0f}-{v[2] * 1e6:.0f}]"  # noqa: E731
    print()
    print("| one fp32 decode layer (4 rounds, weights in cache) | main's dense, us | this tree, us | this/main |")
    print("| --- | --- | --- | --- |")
    print(f"| {nbytes / 1e6:.1f} MB | {us(base) if base else '-'} | {us(new)} |"
          f" {f'{base[0] / new[0]:.2f}x' if base else '-'} |")


def lookup(rounds: int, alternations: int, rng: np.random.Generator) -> None:
    try:
        from engine import kernels_lut
    except ImportError:
        kernels_lut = None  # type: ignore[assignment]
    if kernels_lut is None or not kernels_lut.AVAILABLE:
        print("lookup kernels: not available on this CPU (no AVX-512)")
        return
    generic = {"Q4_K": lambda x, d, o, n: kernels._q45_k(x, d, o, kernels.HALF, 0, n, False),
               "Q5_K": lambda x, d, o, n: kernels._q45_k(x, d, o, kernels.HALF, 0, n, True),
               "Q6_K": lambda x, d, o, n: kernels._q6_k(x, d, o, kernels.HALF, 0, n)}
    print("| type | shape | rows | generic, 1 thread | lookup, 1 thread | lookup/generic |")
    print("| --- | --- | --- | --- | --- | --- |")
    for qtype, old in generic.items():
        new = getattr(kernels_lut, qtype.lower())
        for n, k in ((1536, 768), (1024, 1024)):
            w = rng.standard_normal((n, k)).astype(np.float32)
            data = quant.packed(quantize(w, qtype), qtype, (n, k)).data
            for t in (1, 8):
                x = rng.standard_normal((t, k)).astype(np.float32)
                out = np.empty((t, n), dtype=np.float32)
                got: dict[str, list[float]] = {"generic": [], "lookup": []}
                for _ in range(alternations):
                    got["generic"].append(_time(lambda: old(x, data, out, n), rounds)[0])
                    got["lookup"].append(_time(lambda: new(x, data, out, kernels.HALF, 0, n), rounds)[0])

                def g(v: list[float]) -> str:
                    return f"{n * k / statistics.median(v) / 1e9:.2f} [{n * k / max(v) / 1e9:.2f}-{n * k / min(v) / 1e9:.2f}]"

                ratio = statistics.median(got["generic"]) / statistics.median(got["lookup"])
                print(f"| {qtype} | {n}x{k} | {t} | {g(got['generic'])} | {g(got['lookup'])} | {ratio:.2f}x |")


def _decode_alternating(path: str, sides: dict[str, dict[str, int]], alternations: int, keep: str
                        ) -> tuple[Any, dict[str, list[float]]]:
    """A planned greedy decode of ``path``, the kernel threads' entries switched to each side's addresses in turn
    (the plan rebuilt), ``alternations`` times: 5 untimed then 40 timed steps a turn, the cache kept between 100
    and 200 positions. -> (the model, each side's median ms/token per turn); ``keep``'s addresses stay."""
    from engine import kernel_pool
    from engine.model import Model

    m = Model.load(path)
    cache = m.new_cache(1024)
    tok = int(np.argmax(m.forward(list(range(10, 74)), cache)[-1]))

    def run(n: int) -> float:
        nonlocal tok
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = m.forward([tok], cache)
            ts.append(time.perf_counter() - t0)
            tok = int(np.argmax(logits[-1]))
            if cache.length > 200:
                cache.truncate(100)
        return statistics.median(ts) * 1e3

    got: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for _ in range(alternations):
            for name, addrs in sides.items():
                kernel_pool._ADDR.update(addrs)
                m._plan = True  # rebuilt on the next step, with these kernels in its tables
                run(5)
                got[name].append(run(40))
    finally:
        kernel_pool._ADDR.update(sides[keep])
    return m, got


def decode(path: str, alternations: int) -> None:
    from engine import kernel_pool

    if not hasattr(kernel_pool, "_c_q4_k_lut"):
        print("lookup kernels: not available on this CPU (no AVX-512)")
        return
    sides = {name: {q: int(getattr(kernel_pool, f"_c_{q.lower()}{suffix}").address) for q in ("Q4_K", "Q5_K", "Q6_K")}
             for name, suffix in (("generic", ""), ("lookup", "_lut"))}
    m, got = _decode_alternating(path, sides, alternations, "lookup")
    g, lk = statistics.median(got["generic"]), statistics.median(got["lookup"])
    print(f"| {Path(path).name} | generic ms/token | lookup ms/token | generic/lookup |")
    print("| --- | --- | --- | --- |")
    print(f"| decode ({type(m._plan).__name__}) | {g:.3f} [{min(got['generic']):.3f}-{max(got['generic']):.3f}] |"
          f" {lk:.3f} [{min(got['lookup']):.3f}-{max(got['lookup']):.3f}] | {g / lk:.3f}x |")


def integer(rounds: int, alternations: int, rng: np.random.Generator) -> None:
    """Table 7: engine/kernels_int.py against the lookup kernels, one thread, weights in cache; 'direct' is one
    call over all rows, 'chunks' the kernel threads' table run serially (the pool's row chunks of
    KERNEL_CHUNK_WEIGHTS, after the integer kernels' one quantization of the activations)."""
    from engine import kernel_pool, kernels_int, kernels_lut

    if not kernels_int.AVAILABLE:
        print("integer kernels: not available (no AVX-512 VNNI, or MESHD_KERNELS_INT=0)")
        return
    print("| type | shape | rows | path | float (lookup), 1 thread | integer, 1 thread | integer/float |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    float_fn = {"Q4_K": kernels_lut.q4_k, "Q6_K": kernels_lut.q6_k, "Q8_0": kernels._q8_0}
    addr = {q: {"lookup": int(getattr(kernel_pool, f"_c_{q.lower()}{'' if q == 'Q8_0' else '_lut'}").address),
                "integer": int(getattr(kernel_pool, f"_c_{q.lower()}_int").address)} for q in kernels_int.TYPES}
    for qtype in kernels_int.TYPES:
        for n, k in ((1536, 768), (1024, 1024)):
            w = rng.standard_normal((n, k)).astype(np.float32)
            data = quant.packed(quantize(w, qtype), qtype, (n, k)).data
            for t in (1, 4):
                x = rng.standard_normal((t, k)).astype(np.float32)
                out = np.empty((t, n), dtype=np.float32)
                tables = {}
                was = kernel_pool._ADDR[qtype]
                for side in ("lookup", "integer"):
                    kernel_pool._ADDR[qtype] = addr[qtype][side]
                    tables[side] = kernel_pool.table([(x, qtype, data, out)])
                kernel_pool._ADDR[qtype] = was
                for path in ("direct", "chunks"):
                    got: dict[str, list[float]] = {"lookup": [], "integer": []}
                    for _ in range(alternations):
                        for side, fn in (("lookup", float_fn[qtype]), ("integer", getattr(kernels_int, qtype.lower()))):
                            if path == "direct":
                                got[side].append(_time(lambda: fn(x, data, out, kernels.HALF, 0, n), rounds)[0])
                            else:
                                tbl, total = tables[side][:2]
                                got[side].append(_time(lambda: kernel_pool.run_table_serial(tbl, total), rounds)[0])

                    def g(v: list[float]) -> str:
                        return (f"{n * k * t / statistics.median(v) / 1e9:.2f}"
                                f" [{n * k * t / max(v) / 1e9:.2f}-{n * k * t / min(v) / 1e9:.2f}]")

                    ratio = statistics.median(got["lookup"]) / statistics.median(got["integer"])
                    print(f"| {qtype} | {n}x{k} | {t} | {path} | {g(got['lookup'])} | {g(got['integer'])} |"
                          f" {ratio:.2f}x |")


def decode_int(path: str, alternations: int) -> None:
    """Table 8: a whole planned decode of a GGUF checkpoint, the lookup kernels against the integer ones (the
    kernel threads' Q4_K/Q6_K entries switched, the plan rebuilt), as table 6."""
    from engine import kernel_pool, kernels_int

    if not kernels_int.AVAILABLE:
        print("integer kernels: not available (no AVX-512 VNNI, or MESHD_KERNELS_INT=0)")
        return
    sides = {name: {q: int(getattr(kernel_pool, f"_c_{q.lower()}{'' if suffix == '_lut' and q == 'Q8_0' else suffix}")
                           .address) for q in kernels_int.POOL_TYPES}
             for name, suffix in (("lookup", "_lut"), ("integer", "_int"))}
    m, got = _decode_alternating(path, sides, alternations, "integer")
    lk, it = statistics.median(got["lookup"]), statistics.median(got["integer"])
    print(f"| {Path(path).name} | lookup ms/token | integer ms/token | lookup/integer |")
    print("| --- | --- | --- | --- |")
    print(f"| decode ({type(m._plan).__name__}, {kernels.threads()} kernel threads) | {lk:.3f}"
          f" [{min(got['lookup']):.3f}-{max(got['lookup']):.3f}] | {it:.3f} [{min(got['integer']):.3f}-"
          f"{max(got['integer']):.3f}] | {lk / it:.3f}x |")


def avx2(rounds: int, alternations: int, rng: np.random.Generator) -> None:
    """Table 9: engine/kernels_avx2.py against the generic kernels, one thread, weights in cache."""
    from engine import kernels_avx2

    if not kernels_avx2.AVAILABLE:
        print("AVX2 kernels: not used on this CPU (AVX-512, no AVX2, or MESHD_KERNELS_AVX2=0)")
        return
    generic = {"Q4_K": lambda x, d, o, n: kernels._q45_k(x, d, o, kernels.HALF, 0, n, False),
               "Q6_K": lambda x, d, o, n: kernels._q6_k(x, d, o, kernels.HALF, 0, n),
               "Q8_0": lambda x, d, o, n: kernels._q8_0(x, d, o, kernels.HALF, 0, n)}
    print("| type | shape | rows | generic, 1 thread | AVX2, 1 thread | AVX2/generic |")
    print("| --- | --- | --- | --- | --- | --- |")
    for qtype in ("Q4_K", "Q6_K", "Q8_0"):
        new = getattr(kernels_avx2, qtype.lower())
        for n, k in ((1536, 768), (768, 384) if qtype == "Q8_0" else (1024, 1024)):
            w = rng.standard_normal((n, k)).astype(np.float32)
            data = quant.packed(quantize(w, qtype), qtype, (n, k)).data
            for t in (1, 4):
                x = rng.standard_normal((t, k)).astype(np.float32)
                out = np.empty((t, n), dtype=np.float32)
                got: dict[str, list[float]] = {"generic": [], "avx2": []}
                for _ in range(alternations):
                    got["generic"].append(_time(lambda: generic[qtype](x, data, out, n), rounds)[0])
                    got["avx2"].append(_time(lambda: new(x, data, out, kernels.HALF, 0, n), rounds)[0])

                def g(v: list[float]) -> str:
                    return f"{n * k / statistics.median(v) / 1e9:.2f} [{n * k / max(v) / 1e9:.2f}-{n * k / min(v) / 1e9:.2f}]"

                ratio = statistics.median(got["generic"]) / statistics.median(got["avx2"])
                print(f"| {qtype} | {n}x{k} | {t} | {g(got['generic'])} | {g(got['avx2'])} | {ratio:.2f}x |")


def _greedy_steps(seq: list, n: int) -> tuple[float, float]:
    """``n`` greedy decode steps of ``seq`` ([model, cache, last token], updated) -> median (wall, thread CPU) ms
    per step; the cache is cut back to 100 positions whenever it passes 200."""
    m, cache, tok = seq
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        logits = m.forward([tok], cache)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        tok = int(np.argmax(logits[-1]))
        if cache.length > 200:
            cache.truncate(100)
    seq[2] = tok
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3



def decode_avx2(path: str, fp32: str, alternations: int) -> None:
    """Table 9's decode: the planned decode of ``path`` on the generic and the AVX2 kernels, and of the fp32
    checkpoint ``fp32`` (optional), in one process, rounds alternating; wall and thread CPU ms per token."""
    from engine import kernel_pool, kernels_avx2
    from engine.model import Model

    if not kernels_avx2.AVAILABLE:
        return
    names = ("Q4_K", "Q6_K", "Q8_0")
    addrs = {"generic": {q: int(getattr(kernel_pool, f"_c_{q.lower()}").address) for q in names},
             "avx2": {q: int(getattr(kernel_pool, f"_c_{q.lower()}_avx2").address) for q in names}}
    seqs = {}

    def start(m: Model) -> list:
        cache = m.new_cache(1024)
        tok = int(np.argmax(m.forward(list(range(10, 74)), cache)[-1]))
        return [m, cache, int(np.argmax(m.forward([tok], cache)[-1]))]

    q = Model.load(path)
    plans = {}
    try:
        for side in ("generic", "avx2"):
            kernel_pool._ADDR.update(addrs[side])
            q._plan = True  # rebuilt on the next step, with these kernels in its tables
            seqs[side] = start(q)
            plans[side] = q._plan
    finally:
        kernel_pool._ADDR.update(addrs["avx2"])
    if fp32:
        seqs["fp32"] = start(Model.load(fp32))

    got: dict[str, list[tuple[float, float]]] = {side: [] for side in seqs}
    for _ in range(alternations):
        for side, seq in seqs.items():
            if side in plans:
                q._plan = plans[side]
            _greedy_steps(seq, 5)
            got[side].append(_greedy_steps(seq, 40))
    print(f"| {Path(path).name}, {kernels.threads()} kernel threads | wall ms/token | thread CPU ms/token |")
    print("| --- | --- | --- |")

    def col(side: str, i: int) -> str:
        v = [r[i] for r in got[side]]
        return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"

    for side in got:
        print(f"| {side} | {col(side, 0)} | {col(side, 1)} |")
    for i, what in ((0, "wall"), (1, "CPU")):
        med = {side: statistics.median(r[i] for r in got[side]) for side in got}
        line = f"{what}: AVX2/generic {med['generic'] / med['avx2']:.2f}x"
        if "fp32" in med:
            line += f"; vs our fp32: generic {med['fp32'] / med['generic']:.2f}x, AVX2 {med['fp32'] / med['avx2']:.2f}x"
        print(line)


def _int_base(rev: str) -> ModuleType | None:
    """engine/kernels_int.py as of ``rev``, imported as ``engine._kernels_int_base`` (its numba cache beside it)."""
    got = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:engine/kernels_int.py"], capture_output=True,
                         text=True, check=False)
    if got.returncode != 0:
        print(f"integer kernels at {rev}: not available ({got.stderr.strip()[:100]})")
        return None
    d = Path(tempfile.gettempdir()) / f"meshd-bench-kernels-int-{rev.replace('/', '_')}"
    d.mkdir(exist_ok=True)
    f = d / "_kernels_int_base.py"
    if not f.exists() or f.read_text() != got.stdout:
        f.write_text(got.stdout)
    spec = importlib.util.spec_from_file_location("engine._kernels_int_base", f)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def integer_base(rev: str, rounds: int, alternations: int, path: str, fp32: str, rng: np.random.Generator) -> None:
    """Table 10 (session 10): this tree's integer Q4_K/Q6_K kernels against ``rev``'s (``--int-base``), one
    thread, weights in cache, called directly on one prepared activation buffer (the same bits checked); with
    ``--decode``, a whole planned decode with either pair in the kernel threads' table (and ``--fp32``'s
    checkpoint) in one process, rounds alternating: wall and thread CPU ms per token, ratios paired per round."""
    import numba

    from engine import kernel_pool, kernels_int
    from engine.model import Model

    if not kernels_int.AVAILABLE:
        print("integer kernels: not available (no AVX-512 VNNI, or MESHD_KERNELS_INT=0)")
        return
    base = _int_base(rev)
    if base is None:
        return
    lay = {"Q4_K": kernels_int.LAYOUT_Q4_K, "Q6_K": kernels_int.LAYOUT_Q6_K}
    print(f"| type | shape | rows | {rev}, G weights/s | this tree | this/{rev} (paired) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for qtype in ("Q4_K", "Q6_K"):
        for n, k in ((1536, 768), (384, 768)):
            data = quant.packed(quantize(rng.standard_normal((n, k)).astype(np.float32), qtype), qtype, (n, k)).data
            for t in (1, 4):
                x = rng.standard_normal((t, k)).astype(np.float32)
                buf = np.empty(-(-kernels_int.buffer_bytes(t, k) // 8), dtype=np.float64)
                kernels_int.prepare(lay[qtype], x.ctypes.data, t, k, buf.ctypes.data)
                outs = {side: np.full((t, n), np.nan, dtype=np.float32) for side in ("base", "this")}
                fns = {side: getattr(mod, f"{qtype.lower()}_buf") for side, mod in (("base", base),
                                                                                    ("this", kernels_int))}
                got: dict[str, list[float]] = {"base": [], "this": []}
                for _ in range(alternations):
                    for side, fn in fns.items():
                        o = outs[side]
                        got[side].append(_time(lambda fn=fn, o=o: fn(buf.ctypes.data, t, k, data, o, kernels.HALF,
                                                                     0, n), rounds)[0])
                assert outs["base"].tobytes() == outs["this"].tobytes(), (qtype, n, k, t)
                paired = [a / b for a, b in zip(got["base"], got["this"])]

                def g(v: list[float]) -> str:
                    return (f"{n * k * t / statistics.median(v) / 1e9:.2f}"
                            f" [{n * k * t / max(v) / 1e9:.2f}-{n * k * t / min(v) / 1e9:.2f}]")

                print(f"| {qtype} | {n}x{k} | {t} | {g(got['base'])} | {g(got['this'])} |"
                      f" {statistics.median(paired):.3f}x [{min(paired):.3f}-{max(paired):.3f}] |")
    if not path:
        return
    sig = numba.cfunc(kernel_pool._KERNEL_SIG, cache=False, fastmath=kernels.FASTMATH, boundscheck=False,
                      error_model="numpy")
    u8p, f32p = kernel_pool._u8p, kernel_pool._f32p
    q4b, q6b = base.q4_k_buf, base.q6_k_buf

    @sig
    def c_q4(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
        q4b(xa, t, k, numba.carray(u8p(wa), (n, rb)), numba.carray(f32p(oa), (t, n)),
            numba.carray(f32p(ha), (65536,)), r0, r1)

    @sig
    def c_q6(xa, t, k, wa, n, rb, oa, r0, r1, ha):  # noqa: ANN001, ANN202
        q6b(xa, t, k, numba.carray(u8p(wa), (n, rb)), numba.carray(f32p(oa), (t, n)),
            numba.carray(f32p(ha), (65536,)), r0, r1)

    kernel_pool._INT_LAYOUT[int(c_q4.address)] = kernels_int.LAYOUT_Q4_K
    kernel_pool._INT_LAYOUT[int(c_q6.address)] = kernels_int.LAYOUT_Q6_K
    addrs = {"base": {"Q4_K": int(c_q4.address), "Q6_K": int(c_q6.address)},
             "this": {q: int(getattr(kernel_pool, f"_c_{q.lower()}_int").address) for q in ("Q4_K", "Q6_K")}}
    q = Model.load(path)
    seqs, plans, first = {}, {}, {}
    try:
        for side in ("base", "this"):
            kernel_pool._ADDR.update(addrs[side])
            q._plan = True  # rebuilt on the next step, with these kernels in its tables
            cache = q.new_cache(1024)
            tok = int(np.argmax(q.forward(list(range(10, 74)), cache)[-1]))
            logits = q.forward([tok], cache)  # the first decode step builds the plan with these kernels
            first[side] = logits.tobytes()
            seqs[side] = [q, cache, int(np.argmax(logits[-1]))]
            plans[side] = q._plan
            assert type(plans[side]).__name__ == "DecodePlan", "the model does not take the decode plan"
    finally:
        kernel_pool._ADDR.update(addrs["this"])
    assert first["base"] == first["this"], "the two kernel pairs gave other logits"
    if fp32:
        m = Model.load(fp32)
        cache = m.new_cache(1024)
        seqs["fp32"] = [m, cache, int(np.argmax(m.forward(list(range(10, 74)), cache)[-1]))]

    res: dict[str, list[tuple[float, float]]] = {side: [] for side in seqs}
    for a in range(alternations):
        for side in (list(seqs) if a % 2 == 0 else list(seqs)[::-1]):
            if side in plans:
                q._plan = plans[side]
            _greedy_steps(seqs[side], 5)
            res[side].append(_greedy_steps(seqs[side], 40))
    print()
    print(f"| {Path(path).name}, {kernels.threads()} kernel threads | wall ms/token | thread CPU ms/token |")
    print("| --- | --- | --- |")

    def col(side: str, i: int) -> str:
        v = [r[i] for r in res[side]]
        return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"

    def ratio(num: str, den: str, i: int) -> str:
        v = [a[i] / b[i] for a, b in zip(res[num], res[den])]
        return f"{statistics.median(v):.3f}x [{min(v):.3f}-{max(v):.3f}]"

    for side in res:
        print(f"| {rev if side == 'base' else side} | {col(side, 0)} | {col(side, 1)} |")
    for i, what in ((0, "wall"), (1, "CPU")):
        line = f"{what}: this/{rev} {ratio('base', 'this', i)}"
        if "fp32" in res:
            line += f"; our fp32 over Q4_K_M: {rev} {ratio('fp32', 'base', i)}, this {ratio('fp32', 'this', i)}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="timed calls per side (default 200)")
    ap.add_argument("--baseline", default=BASELINE,
                    help=f"git revision whose engine/kernels.py is the baseline; '' for none (default {BASELINE})")
    ap.add_argument("--main", default=MAIN,
                    help="git revision whose engine/dense.py (fp32 products on its own thread) table 4 compares"
                         f" against; '' for none (default {MAIN})")
    ap.add_argument("--only", default="", help="run only these tables, e.g. '4' or '1,2' (default all)")
    ap.add_argument("--alternations", type=int, default=5,
                    help="tables 5-9: times the two sides alternate (default 5)")
    ap.add_argument("--decode", default="",
                    help="tables 6 and 8: a GGUF checkpoint to decode with either kernels, e.g."
                         " /tmp/compact-bench/model-Q4_K_M.gguf (default none: table 6 left out)")
    ap.add_argument("--int-base", default="main",
                    help="table 10: git revision whose engine/kernels_int.py this tree's is compared with (default"
                         " main)")
    ap.add_argument("--fp32", default="",
                    help="table 9: bench/engine.py's fp32 checkpoint dir, decoded in the same rounds as --decode"
                         " (default none)")
    args = ap.parse_args()
    if not kernels.AVAILABLE:
        sys.exit("numba is not installed (pip install 'meshd[fast]'): nothing to compare")
    kernels.warm()
    only = {int(v) for v in args.only.split(",") if v.strip()} or {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
    base = _baseline(args.baseline) if only & {1, 2} else None
    rng = np.random.default_rng(0)
    print(f"kernel threads {kernels.threads()}; baseline {args.baseline or '-'}; G weights/s, median [min-max] of"
          f" {args.rounds} calls")
    tables = ((products, base), (layer, base), (dequant, None), (f32, None), (lookup, None), (decode, None),
              (integer, None), (decode_int, None), (avx2, None), (integer_base, None))
    for i, (fn, extra) in enumerate(tables, 1):
        if i not in only:
            continue
        print()
        if i == 4:
            f32(args.rounds, _main_dense(args.main), rng)
        elif i == 5:
            lookup(args.rounds, args.alternations, rng)
        elif i == 6:
            if args.decode:
                decode(args.decode, args.alternations)
        elif i == 7:
            integer(args.rounds, args.alternations, rng)
        elif i == 8:
            if args.decode:
                decode_int(args.decode, args.alternations)
        elif i == 10:
            integer_base(args.int_base, args.rounds, args.alternations, args.decode, args.fp32, rng)
        elif i == 9:
            avx2(args.rounds, args.alternations, rng)
            if args.decode:
                print()
                decode_avx2(args.decode, args.fp32, args.alternations)
        elif extra is None:
            fn(args.rounds, rng)
        else:
            fn(args.rounds, extra, rng)


if __name__ == "__main__":
    main()
