"""``engine.kernels.warm`` loads the specializations a model uses, and no others: after it, multiplying and
dequantizing read-only weights (every checkpoint's: views of a read-only file mapping), and dequantizing
gathered (writable) embedding rows, loads no further kernel. Before, warm used writable arrays, so the first
prefill loaded a second, read-only specialization of each kernel (memory counted after the model's load).
Runs in a fresh interpreter (a test earlier in the same worker may have loaded any specialization already).
Skipped without numba (the [fast] extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import kernels

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba not installed (the [fast] extra)")
ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = """
import json, sys
import numpy as np
from engine import kernel_pool, kernels
from engine.quant import row_bytes

def counts():
    fns = {"fill": kernel_pool._fill, "dq_q8_0": kernels._dq_q8_0, "dq_q4_0": kernels._dq_q4_0,
           "dq_q45_k": kernels._dq_q45_k, "dq_q6_k": kernels._dq_q6_k}
    return {k: len(f.overloads) for k, f in fns.items()}

kernels.warm()
before = counts()
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 256)).astype(np.float32)
for qtype in kernels.ROW_TYPES:
    if qtype in ("BF16", "F32"):
        data = rng.integers(0, 2**14, (4, 256), dtype=np.uint16)
        data = data if qtype == "BF16" else rng.standard_normal((4, 256)).astype(np.float32)
    else:
        data = rng.integers(0, 256, (4, row_bytes(qtype, 256)), dtype=np.uint8)
    data.setflags(write=False)  # as a checkpoint's mapping gives it
    out = np.empty((3, 4), dtype=np.float32)
    kernels.run(x, qtype, data, out, 0, 4)
    if qtype in kernels.DEQUANT_TYPES:
        blocks = data.reshape(-1, kernels.BLOCK_BYTES[qtype])
        a = kernels.dequantize_blocks(blocks, qtype)
        b = kernels.dequantize_blocks(blocks[np.arange(blocks.shape[0])], qtype)  # gathered rows: writable
        assert b.tobytes() == a.tobytes(), qtype
print(json.dumps({"before": before, "after": counts()}))
"""


def test_warm_loads_the_read_only_specializations_models_use() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after"] == got["before"], f"kernels loaded after warm: {got}"
