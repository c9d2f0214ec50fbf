"""Bits independent of BLAS's thread count and of the prefill threads' count: the same prefill (full logits and
the cache) and decode steps in fresh processes with ``OPENBLAS_NUM_THREADS`` 1 and 2 and ``MESHD_PREFILL_THREADS``
1, 2 and 3 give the same bytes. Run on the BLAS kernels OpenBLAS picks for this CPU and, where the CPU has AVX2,
on its ``Haswell`` kernels too (``OPENBLAS_CORETYPE``): with those, one and two OpenBLAS threads give other
last bits for most prefill-sized products (an AMD EPYC VM, and this Zen 4 one with ``Haswell`` forced), so a
2-core node and an 8-core node would disagree where any engine product ran on BLAS's own threads."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from experts_util import make_moe_checkpoint

_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
import hashlib
from pathlib import Path
import numpy as np
from engine.model import Model
model = Model.load(Path(sys.argv[2]))
h = hashlib.sha256()
cache = model.new_cache(8)
prompt = [(7 * i + 3) % 96 for i in range(40)]
h.update(model.forward(prompt, cache).tobytes())          # full logits: the output head on 40 rows
for layer in range(len(model.layers)):
    h.update(cache.k[layer][:, :40].tobytes() + cache.v[layer][:, :40].tobytes())
tok = 5
for _ in range(3):
    logits = model.forward([tok], cache)
    h.update(logits.tobytes())
    tok = int(np.argmax(logits[-1]))
caches = [model.new_cache(8) for _ in range(6)]
for i, c in enumerate(caches):
    model.forward(prompt[: 6 + i], c, last_only=True)
h.update(model.forward_batch([1, 2, 3, 4, 5, 6], caches).tobytes())  # a batched step of 6 rows
print(h.hexdigest())
"""

SETTINGS = (("1", "1"), ("2", "2"), ("2", "1"), ("1", "3"))  # (OPENBLAS_NUM_THREADS, MESHD_PREFILL_THREADS)


def _avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def _digest(ck: Path, blas: str, prefill: str, core: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHD_", "OPENBLAS_"))}
    env.update(OPENBLAS_NUM_THREADS=blas, MESHD_PREFILL_THREADS=prefill)
    if core is not None:
        env["OPENBLAS_CORETYPE"] = core
    if os.environ.get("MESHD_KERNELS"):
        env["MESHD_KERNELS"] = os.environ["MESHD_KERNELS"]
    tests = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", _RUN, tests, str(ck)], capture_output=True, text=True, timeout=300,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()[-1]


@pytest.mark.parametrize("core", [None, "Haswell"])
def test_prefill_and_decode_bits_do_not_follow_the_blas_or_prefill_thread_count(tmp_path: Path,
                                                                                core: str | None) -> None:
    if core == "Haswell" and not (_avx2() and sys.platform == "linux"):
        pytest.skip("OpenBLAS's Haswell kernels need AVX2")
    ck = make_moe_checkpoint(tmp_path / "m", family="qwen3_moe", layers=3, experts=8, hidden=256, inter=256,
                             top_k=2, vocab=96, seed=11, dense_layers=(0,))
    with ThreadPoolExecutor(2) as ex:
        digests = list(ex.map(lambda s: _digest(ck, s[0], s[1], core), SETTINGS))
    assert len(set(digests)) == 1, dict(zip(SETTINGS, digests))
