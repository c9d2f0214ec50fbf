"""The engine's numerics revision (engine/numerics.py ``REVISION``, the ``engine=`` part of the numerics tag)
moves with the engine's bits.

Pipeline stages and expert workers are accepted by their numerics tag; two meshd versions whose code computes
other bits must therefore carry other tags, or a mesh mixing them is no longer byte-identical to a local run
and nothing says so. The libraries' part of the tag changes by itself (numba, numpy, OpenBLAS and its core);
the engine's own part is ``REVISION``, bumped by hand. This test is what makes forgetting it fail: it holds
the logits hashes of the tiny models (a prefill long enough for several attention query blocks and few-row
expert products, then greedy decode steps) for each tag they were recorded under, and fails when this tree
computes other bits under the same tag. After a change that alters bits on purpose: bump ``REVISION`` and
record the new hashes (run this file with ``MESHD_RECORD_NUMERICS=1``, it prints them).

A tag not in the table (another CPU's OpenBLAS core, another numpy, numba on or off where nobody recorded it)
skips: there is nothing to compare with.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from engine import numerics
from engine.model import Model
from engine.tiny import create_tiny

# tag -> {form: logits sha256[:16]}; forms: tiny arch, "+q8" for its Q8_0 GGUF (keyed by the file's hash as
# well: another gguf release could quantize other bytes, which is not the engine's numerics).
GOLDEN: dict[str, dict[str, str]] = {
    # Zen 4 VM, 2026-12-02 (CI's install: no numba)
    "kernels=numpy;numpy=2.4.6;blas=scipy-openblas-0.3.31.188.0:SkylakeX;engine=1": {
        "qwen3_moe": "ba3e222324db3080", "deepseek_v3": "fe4ade690fffa890",
        "qwen3_moe+q8:5189f5379360f482": "8f9b9c1bb183105d"},
    # the same with the `fast` extra
    "kernels=numba-0.68.1+int;numpy=2.4.6;blas=scipy-openblas-0.3.31.188.0:SkylakeX;engine=1": {
        "qwen3_moe": "ba3e222324db3080", "deepseek_v3": "fe4ade690fffa890",
        "qwen3_moe+q8:5189f5379360f482": "7d713fd3aa5db8dd"},
}

PROMPT_TOKENS = 150  # three attention query blocks of 64 (engine/limits.py ATTENTION_QUERY_BLOCK)
DECODE_STEPS = 4


def _logits_hash(path: Path) -> str:
    model = Model.load(path)
    cache = model.new_cache(PROMPT_TOKENS + DECODE_STEPS + 1)
    ids = np.random.default_rng(7).integers(3, 700, PROMPT_TOKENS)
    h = hashlib.sha256()
    logits = model.forward(ids, cache)
    h.update(np.ascontiguousarray(logits).tobytes())
    for _ in range(DECODE_STEPS):
        logits = model.forward([int(logits[-1].argmax())], cache)
        h.update(np.ascontiguousarray(logits).tobytes())
    return h.hexdigest()[:16]


def _forms(tmp: Path) -> dict[str, str]:
    out = {}
    for arch in ("qwen3_moe", "deepseek_v3"):
        out[arch] = _logits_hash(create_tiny(tmp / arch, arch=arch))
    from engine.gguf_export import export_gguf

    q8 = tmp / "qwen3_moe-Q8_0.gguf"
    export_gguf(tmp / "qwen3_moe", q8, "Q8_0")
    file_hash = hashlib.sha256(q8.read_bytes()).hexdigest()[:16]
    out[f"qwen3_moe+q8:{file_hash}"] = _logits_hash(q8)
    return out


def test_the_tiny_models_bits_are_those_recorded_for_this_tag(tmp_path: Path) -> None:
    tag = numerics.tag()
    got = _forms(tmp_path)
    if os.environ.get("MESHD_RECORD_NUMERICS") == "1":
        print(f"\n    {tag!r}: {got!r},")
    want = GOLDEN.get(tag)
    if want is None:
        pytest.skip(f"no hashes recorded for this numerics tag ({tag})")
    compared = 0
    for form, value in got.items():
        if form in want:
            assert value == want[form], (
                f"{form}: the logits' bits changed under the same numerics tag ({tag}): bump "
                f"engine/numerics.py REVISION (now {numerics.REVISION}) and record the new hashes "
                "(MESHD_RECORD_NUMERICS=1), or undo the change")
            compared += 1
    assert compared >= 2, (got, want)  # the fp32 forms at least; the Q8_0 file may be another gguf's


def test_a_peer_of_another_engine_revision_is_named_as_such() -> None:
    mine = numerics.tag()
    theirs = mine.replace(f";engine={numerics.REVISION}", f";engine={numerics.REVISION + 1}")
    assert theirs != mine
    assert numerics.difference(mine, theirs, "here", "there") == (
        f"engine {numerics.REVISION + 1} there, {numerics.REVISION} here")
    older = mine.rsplit(";engine=", 1)[0]  # a meshd from before the key: its tag no longer equals ours
    assert numerics.difference(mine, older, "here", "there") == f"engine none there, {numerics.REVISION} here"
