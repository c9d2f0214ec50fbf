"""engine: numpy MoE inference, checkpoints, tokenizer, experts."""

from __future__ import annotations

import os

# OpenBLAS (numpy's BLAS) keeps an idle thread spinning for 2**28 cycles (about 0.1 s) after each call. After a
# prefill's products those threads spin on into the decode that follows, on the cores the compiled kernels'
# threads need: the first 16 decode steps after a 256-token prefill took 1.3-1.4x as long as the rest (Q4_K_M
# 3.4-4.9 against 2.7-3.2 ms; fp32 6.7-8.1 against 4.4-6.0). 2**20 cycles (~0.3 ms) keeps them awake between
# a prefill's back-to-back products and lets them sleep before decode (then 2.4-2.6 ms for every Q4_K_M step).
# It takes effect only when set before numpy loads OpenBLAS (meshd's package imports this module first);
# a value already in the environment wins.
BLAS_THREAD_TIMEOUT = "20"
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)

# glibc's malloc returns the top of its heap to the kernel whenever more than M_TRIM_THRESHOLD bytes are free
# there, and that threshold only follows the largest freed mmap'd chunk (twice it, starting from 128 KiB). A
# prefill frees and reallocates its activations layer after layer (a few MiB each), so its heap shrank and grew
# again all the time: ~10,000 page faults per 256-token prefill of the bench model (fp32 and Q4_K_M alike), each
# a fresh zeroed page, ~10% of a two-thread prefill's wall time (the helper thread's arena gave its pages back
# with madvise too). Held at the ceiling glibc's own rule reaches (mmap threshold 32 MiB, trim threshold twice
# that), the heap keeps what a prefill frees for the next layer's arrays: ~1,000 faults per prefill; the peak
# is the same (a prefill's live set), what stays resident between requests is at most what the last one freed.
# Process-wide, set once at import (mallopt works at any time); skipped where the environment already tunes
# malloc (MALLOC_*_ variables, GLIBC_TUNABLES), with MESHD_HEAP=glibc (glibc's own dynamic thresholds: a few MiB
# less resident between requests, docs/engine-model.md "Session 12 (prefill4)"), or where the C library is not glibc.
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 2 * MALLOC_MMAP_THRESHOLD


def _hold_heap() -> bool:
    """Set glibc's mmap and trim thresholds (above); -> whether they were set."""
    if (os.environ.get("MESHD_HEAP") == "glibc" or any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ)
            or "malloc" in os.environ.get("GLIBC_TUNABLES", "")):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl's mallopt does nothing useful)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


HEAP_HELD = _hold_heap()
