"""engine's glibc heap thresholds (engine/__init__.py): what a layer frees serves the next layer's arrays instead
of going back to the kernel and faulting in again as fresh pages; an environment that tunes malloc itself is
left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# a prefill's pattern: a layer's activations (9 MiB in 0.75 MiB arrays and their products) allocated, then freed
LAYERS = r"""
import resource
import engine
import numpy as np

def layer():
    xs = [np.ones((256, 768), np.float32) for _ in range(12)]
    ys = [x * 2 for x in xs]
    del xs, ys

for _ in range(3):
    layer()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(engine.HEAP_HELD, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 10)
"""


def _faults_per_layer(**env: str) -> tuple[str, int]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "MESHD_HEAP")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", LAYERS], env=e, capture_output=True, text=True, timeout=60, check=True)
    held, faults = out.stdout.split()
    return held, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's page faults")
def test_freed_activations_are_reused_without_page_faults_unless_the_environment_tunes_malloc() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        pytest.skip("not glibc")
    held, faults = _faults_per_layer()
    # 9 MiB of fresh pages would be ~2,300 faults; a few stray ones (Python's own arenas) are fine
    assert held == "True" and faults < 200, faults
    # MALLOC_PERTURB_=0 changes nothing in malloc but is one of its variables: engine leaves the heap alone, and
    # the same layers fault their pages in again every time (the test's check that it can tell the two apart)
    held, faults = _faults_per_layer(MALLOC_PERTURB_="0")
    assert held == "False" and faults > 1000, faults
    held, faults = _faults_per_layer(MESHD_HEAP="glibc")  # the switch back to glibc's own thresholds
    assert held == "False" and faults > 1000, faults
