"""This process's numerics tag: a short canonical string naming exactly the choices that change the bits the
engine computes, so that every node computing part of one result (pipeline stages, expert workers) can be
checked to compute with the same numerics as the node it serves.

``tag()`` -> ``"kernels=<k>;numpy=<version>;blas=<name>-<version>:<core>;engine=<revision>"`` (fixed key order,
ASCII):

- ``kernels``: ``numpy`` (no numba, or ``MESHD_KERNELS=numpy``: numpy tiles and BLAS everywhere) or
  ``numba-<version>`` (the compiled kernels of engine/kernels.py, engine/dense_kernels.py and the compiled
  decode step: other roundings than numpy's), with ``+int`` when the AVX-512 VNNI integer kernels compute Q4_K
  and Q6_K (engine/kernels_int.py: ``kernels_int.AVAILABLE``, i.e. the CPU has them and ``MESHD_KERNELS_INT`` is
  not 0). numba's version is part of it: the kernels are compiled on each machine, and LLVM's contractions are
  numba's.
- ``numpy``: numpy's version (its float32 ``exp``, reductions and ``matmul`` dispatch are the numpy path's
  numerics, and no release promises them bit-stable).
- ``blas``: the BLAS numpy links (name and version) and, for OpenBLAS, the kernel it picked at run time for
  this CPU (``openblas_get_corename``; ``OPENBLAS_CORETYPE`` overrides it). Products of more rows than
  ``KERNEL_MAX_ROWS`` (prefill) run on BLAS with or without numba, and OpenBLAS's kernels for different cores
  block and accumulate differently (measured: ``Haswell`` and ``SkylakeX`` give other bits for a 7x64 @ 64x128
  product). ``:?`` when the core cannot be read (another BLAS, another OS).
- ``engine``: ``REVISION``, the engine's own numerics: the choices in meshd's code that change bits for the
  same inputs and the same libraries (how products are cut into pieces and which way round they run, the
  attention's query blocks, the kernels' accumulation order, the reductions' order, ...). Two meshd versions
  with equal libraries but another revision compute other bits, and without this key their tags were equal
  (session 11's attention blocks changed every CPU's bits and no tag said so). Bump ``REVISION`` with every
  change that alters bits; tests/test_numerics_revision.py holds the tiny models' logits hashes per tag and
  fails when they change while the revision does not.

Not in the tag, because they do not change bits (each tested bit for bit, docs/kernels.md): the kernel
threads' count (``MESHD_KERNEL_THREADS``), ``MESHD_KERNELS_LUT`` (the AVX-512 lookup kernels equal the generic
ones), ``MESHD_KERNELS_AVX2`` (so do engine/kernels_avx2.py's), ``MESHD_DECODE_PLAN`` (the plan equals the general pass), BLAS's thread count
(``OPENBLAS_NUM_THREADS`` and the core count: engine/prefill_threads.py holds OpenBLAS at one thread for the
process, and engine/products.py cuts a big product into pieces by its shape alone; where BLAS cannot be held at one
thread, another BLAS than OpenBLAS, the ``blas`` part ends ``+unpinned-<cores>``, so that such a node matches only
one with the same core count), the prefill threads' count
(``MESHD_PREFILL_THREADS``: engine/prefill_threads.py runs whole pieces per thread), ``MESHD_PIPELINE_BATCH`` and the
other scheduling switches. Nodes with equal tags compute equal bits for equal inputs on the same CPU
architecture; the tag does not name the CPU model beyond OpenBLAS's core, so it is not a proof, it is the
check of every choice the engine itself makes.

The tag is computed once per process, from the same environment and CPU features the kernel modules read at
import (without importing numba: ``kernels_choice``; where llvmlite is not loaded yet, a child interpreter reads
LLVM's view of the CPU: ``int_kernels_usable``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from .limits import NUMERICS_MAX_CHARS

KEYS = ("kernels", "numpy", "blas", "engine")
# The engine's numerics revision (see the module docstring): 1 = the numerics of session 11 (2026-12-02:
# products of 5-64 rows run transposed, attention query blocks of 64, the AVX-512 Q8_0 decode kernel).
REVISION = 1
MALFORMED = "malformed"  # stands for a peer's tag that ``parse`` rejected: equal to no real tag
_TEXT = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces


def kernels_choice() -> str:
    """``numpy``, ``numba-<version>`` or ``numba-<version>+int`` (see the module docstring). Decided the way
    engine/kernels.py and engine/kernels_int.py decide at import, without importing numba (~0.5 s and ~70 MB
    that a process serving a test-sized fp32 model never pays otherwise); tests/test_numerics.py checks that
    it agrees with ``kernels.AVAILABLE`` and ``kernels_int.AVAILABLE``."""
    if os.environ.get("MESHD_KERNELS", "").lower() == "numpy":
        return "numpy"
    try:
        if importlib.util.find_spec("numba") is None:
            return "numpy"
        version = importlib.metadata.version("numba")
    except (ImportError, ValueError):  # not installed (PackageNotFoundError is an ImportError), or hidden
        return "numpy"
    return f"numba-{version}" + ("+int" if int_kernels_usable() else "")


def int_kernels_usable() -> bool:
    """Whether engine/kernels_int.py may compile its integer kernels (given numba, which ``kernels_int``
    checks itself; it decides by this function): VNNI and BW on the host as LLVM sees them, LLVM 22 or later
    (``llvm.x86.avx512.vpdpbusd.512`` with <64 x i8> operands, the form written there), numba compiling for
    the host, and ``MESHD_KERNELS_INT`` not 0."""
    if os.environ.get("MESHD_KERNELS_INT", "1") == "0":
        return False
    if os.environ.get("NUMBA_CPU_NAME", "host") not in ("", "host") or os.environ.get("NUMBA_CPU_FEATURES"):
        return False
    return _llvm_host_allows()


def host_allows(binding: Any) -> bool:
    """LLVM's view of this host (``llvmlite.binding``): AVX-512 VNNI and BW, and LLVM 22 or later."""
    feat = binding.get_host_cpu_features()
    return bool(feat.get("avx512vnni")) and bool(feat.get("avx512bw")) and binding.llvm_version_info[0] >= 22


# run by a child interpreter: the same function on the same package (the parent's copy, first on sys.path)
_PROBE = ("import sys; sys.path.insert(0, sys.argv[1]); from llvmlite import binding;"
          " from engine.numerics import host_allows; print(int(host_allows(binding)))")


@functools.cache
def _llvm_host_allows() -> bool:
    """``host_allows`` for this host, once per process. Where llvmlite is loaded already (numba imported: the
    kernels run here) it is asked here; else a child interpreter asks it, so that a process that never runs
    the kernels (an idle stage, a serving node of an fp32 test model) does not map LLVM to compute its tag:
    importing ``llvmlite.binding`` costs ~40 MB of resident memory (measured: 41.1 -> 81.1 MB) and is not
    given back. A child that fails (no llvmlite: False) falls back to asking here."""
    if "llvmlite.binding" not in sys.modules:
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE, str(Path(__file__).resolve().parent.parent)],
                                 capture_output=True, text=True, timeout=60, check=False)
            if out.returncode == 0 and out.stdout.strip() in ("0", "1"):
                return out.stdout.strip() == "1"
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        from llvmlite import binding
    except ImportError:
        return False
    return host_allows(binding)


def openblas_libs() -> list[ctypes.CDLL]:
    """The OpenBLAS libraries this process has mapped (numpy's, found in /proc/self/maps; Linux), as handles:
    opening a library already mapped loads nothing new. Empty if none or not Linux."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    out = []
    for path in sorted({line.split()[-1] for line in maps.splitlines() if "openblas" in line.lower() and "/" in line}):
        try:
            out.append(ctypes.CDLL(path))
        except OSError:
            continue
    return out


def _openblas_core() -> str | None:
    """The core OpenBLAS picked at run time, read from the library numpy loaded (Linux), or None."""
    for lib in openblas_libs():
        for name in ("openblas_get_corename", "openblas_get_corename64_", "scipy_openblas_get_corename",
                     "scipy_openblas_get_corename64_"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                core = fn()
                return core.decode("ascii", "replace") if core else None
    return None


def blas_choice() -> str:
    """``<name>-<version>:<core>`` of the BLAS numpy uses (``:?`` when the core is unknown), ``+unpinned-<cores>``
    after it when its thread count could not be held at one (see the module docstring)."""
    import numpy as np

    try:
        info = np.__config__.CONFIG["Build Dependencies"]["blas"]  # type: ignore[attr-defined]
        name = f"{info.get('name', 'unknown')}-{info.get('version', 'unknown')}"
    except (AttributeError, KeyError, TypeError):
        name = "unknown"
    np.ones((2, 2), dtype=np.float32) @ np.ones((2, 2), dtype=np.float32)  # BLAS loaded and initialised
    core = _openblas_core() if "openblas" in name.lower() else None
    from . import prefill_threads  # here: it imports this module

    pinned = "" if prefill_threads.pinned() else f"+unpinned-{os.cpu_count() or 0}"
    return f"{name}:{core or '?'}{pinned}"


@functools.cache
def tag() -> str:
    """This process's numerics tag (see the module docstring); computed once (~0.1-0.2 s: numpy's BLAS, and
    llvmlite's CPU features where numba is installed)."""
    import numpy as np

    parts = {"kernels": kernels_choice(), "numpy": np.__version__, "blas": blas_choice(), "engine": str(REVISION)}
    text = ";".join(f"{k}={_clean(parts[k])}" for k in KEYS)
    return text[:NUMERICS_MAX_CHARS]


def _clean(value: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() and c not in " ;=" else "_" for c in value)


def parse(value: object) -> str | None:
    """A peer's tag (from gossip) if it is well-formed: a string of at most ``NUMERICS_MAX_CHARS`` printable
    ASCII characters without spaces; None otherwise."""
    if isinstance(value, str) and len(value) <= NUMERICS_MAX_CHARS and _TEXT.fullmatch(value):
        return value
    return None


def from_record(value: object) -> str | None:
    """The tag a gossip record's ``numerics`` field says: None when absent (an older meshd: nothing to check),
    ``MALFORMED`` when present but not a tag (never equal to a real one, so refused)."""
    if value is None:
        return None
    return parse(value) or MALFORMED


def _fields(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(";"):
        k, _, v = part.partition("=")
        out[k] = v
    return out


def difference(mine: str, theirs: str | None, mine_as: str = "here", theirs_as: str = "there") -> str:
    """Why ``theirs`` is not ``mine``, in words for a refusal: each component that differs (``kernels numpy
    there, numba-0.68.1+int here``), or that the peer says nothing (an older meshd). Empty when equal."""
    if theirs == mine:
        return ""
    if theirs is None:
        return f"no numerics tag {theirs_as} (an older meshd)"
    if theirs == MALFORMED:
        return f"a malformed numerics tag {theirs_as}"
    a, b = _fields(mine), _fields(theirs)
    return "; ".join(f"{k} {b.get(k, 'none')} {theirs_as}, {a.get(k, 'none')} {mine_as}"
                     for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k))
