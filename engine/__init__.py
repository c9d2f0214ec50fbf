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
