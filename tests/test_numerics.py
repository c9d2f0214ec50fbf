"""The numerics tag (engine/numerics.py) and its checks: a pipeline stage or an expert worker computing with
other numerics than the node it serves is refused by name with the reason, and the rest are used.

The choice that changes bits on the numpy path (no numba needed) is OpenBLAS's kernel: ``OPENBLAS_CORETYPE``
picks another core's kernels, whose products of several rows have other bits (checked here in the same run,
next to the tags). Tests that need it skip where the BLAS is not a run-time-dispatching OpenBLAS.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import numerics
from engine.experts import rpc
from engine.pipeline import wire
from engine.pipeline.planner import Need, Offer, make_plan

PROBE = """
import hashlib, json, numpy as np
from engine import numerics
r = np.random.default_rng(0)
x = r.standard_normal((7, 64), dtype=np.float32); w = r.standard_normal((128, 64), dtype=np.float32)
print(json.dumps({"tag": numerics.tag(), "bits": hashlib.sha256((x @ w.T).tobytes()).hexdigest()}))
"""


def _probe(**env: str) -> dict[str, str]:
    """This tag and a 7x64 @ 64x128 product's hash in a fresh process with ``env`` added."""
    from conftest import meshd_env

    out = subprocess.run([sys.executable, "-c", PROBE], env=meshd_env(**env), capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _skip_when_numba_is_switched_off() -> None:
    """numba against numpy needs numba on here: a run under ``MESHD_KERNELS=numpy`` (which its daemons inherit,
    conftest.KERNEL_SWITCHES) has no numba side."""
    if os.environ.get("MESHD_KERNELS", "").lower() == "numpy":
        pytest.skip("this run switches the compiled kernels off (MESHD_KERNELS=numpy)")


def _other_core() -> tuple[str, dict[str, str], dict[str, str]]:
    """An ``OPENBLAS_CORETYPE`` that gives another tag than the default here, and both probes; skips when
    the BLAS core cannot be read or chosen."""
    found = _find_other_core()
    if found is None:
        pytest.skip(f"no OpenBLAS core to choose here ({numerics.tag()})")
    return found


@functools.cache
def _find_other_core() -> tuple[str, dict[str, str], dict[str, str]] | None:
    base = _probe()
    if not numerics._fields(base["tag"])["blas"].endswith("?") and "openblas" in base["tag"].lower():
        for core in ("Haswell", "Sandybridge"):
            other = _probe(OPENBLAS_CORETYPE=core)
            if other["tag"] != base["tag"]:
                return core, base, other
    return None


# --- the tag --------------------------------------------------------------------------------------


def test_tag_is_canonical_and_parses() -> None:
    tag = numerics.tag()
    keys = [part.split("=", 1)[0] for part in tag.split(";")]
    assert keys == list(numerics.KEYS), tag
    assert numerics.parse(tag) == tag and tag.isascii() and " " not in tag
    assert tag == numerics.tag()  # computed once
    assert f"numpy={np.__version__}" in tag
    for bad in (None, 3, "", "a b", "x" * 201, "caf\u00e9", "tab\there"):
        assert numerics.parse(bad) is None, bad


def test_difference_names_each_component() -> None:
    a = "kernels=numba-0.68.1+int;numpy=2.4.6;blas=scipy-openblas-0.3.31:SkylakeX"
    b = "kernels=numpy;numpy=2.4.6;blas=scipy-openblas-0.3.31:Haswell"
    assert numerics.difference(a, a) == ""
    text = numerics.difference(a, b, "here", "there")
    assert text == ("kernels numpy there, numba-0.68.1+int here; "
                    "blas scipy-openblas-0.3.31:Haswell there, scipy-openblas-0.3.31:SkylakeX here"), text
    assert "older meshd" in numerics.difference(a, None)
    assert numerics.from_record(None) is None and numerics.from_record(a) == a
    for bad in (3, ["x"], "a b", "x" * 201):  # a record's field that is not a tag is never equal to one
        assert numerics.from_record(bad) == numerics.MALFORMED
    assert numerics.difference(a, numerics.MALFORMED, "here", "there") == "a malformed numerics tag there"


def test_openblas_core_changes_the_tag_and_the_bits() -> None:
    """The BLAS core is in the tag because it changes bits: two cores, two tags, two product hashes; and
    what is left out of the tag (thread counts, the lookup kernels, the decode plan) changes neither."""
    core, base, other = _other_core()
    assert numerics._fields(other["tag"])["blas"].endswith(f":{core}"), other
    assert other["bits"] != base["bits"], (base, other)
    same = _probe(OPENBLAS_NUM_THREADS="1", MESHD_KERNEL_THREADS="1", MESHD_KERNELS_LUT="0", MESHD_DECODE_PLAN="0")
    assert same == base, (same, base)


def test_a_blas_whose_thread_count_is_not_held_at_one_says_so_in_the_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """With OpenBLAS held at one thread (engine/prefill_threads.py) the thread counts are not in the tag; where
    it could not be held (another BLAS), the products' bits may follow the BLAS's threads, so the ``blas`` part
    names the core count: such a node matches only a node with as many cores."""
    from engine import prefill_threads

    if not prefill_threads.pinned():
        pytest.skip("numpy's BLAS is not an OpenBLAS this process could hold at one thread")
    assert "unpinned" not in numerics.blas_choice()
    monkeypatch.setattr(prefill_threads, "_blas", None)
    assert numerics.blas_choice().endswith(f"+unpinned-{__import__('os').cpu_count()}")
    assert numerics.parse(numerics.blas_choice()) is not None


def test_kernels_switch_is_in_the_tag() -> None:
    off = _probe(MESHD_KERNELS="numpy")
    assert ";".join(off["tag"].split(";")[:1]) == "kernels=numpy", off
    try:
        import numba
    except ImportError:
        assert numerics.tag().startswith("kernels=numpy;")
        return
    _skip_when_numba_is_switched_off()
    on = _probe()
    assert on["tag"].startswith(f"kernels=numba-{numba.__version__}"), on
    assert numerics.difference(on["tag"], off["tag"]).startswith("kernels numpy there"), (on, off)


# --- pipeline: the planner (gossip) and the stage (OPEN) --------------------------------------------


def test_planner_refuses_a_stage_with_other_numerics_by_name_and_uses_the_rest() -> None:
    need = Need("fp", (100,) * 4, 50, 32)
    mine, theirs = "kernels=numpy;numpy=2;blas=x:A", "kernels=numpy;numpy=2;blas=x:B"
    local = Offer("me" * 8, "fp", 150, numerics=mine)
    bad = Offer("bad" * 6, "fp", 10_000, numerics=theirs)
    good = Offer("good" * 4, "fp", 10_000, numerics=mine)
    old = Offer("old" * 6, "fp", 10_000)  # an older meshd: no tag, used as before
    plan = make_plan(need, local, [bad, good])
    assert [s.node_id for s in plan.stages] == [local.node_id, good.node_id]
    why = f"stage {bad.node_id[:12]} computes with other numerics: blas x:B on the stage, x:A on this node"
    assert plan.refused == ((bad.node_id, why),)
    assert [s.node_id for s in make_plan(need, local, [old]).stages] == [local.node_id, old.node_id]


def test_open_carries_the_numerics_tag_and_rejects_a_bad_one() -> None:
    tag = numerics.tag()
    for frame in (wire.Open(1, 0, 1, 4, b"f" * 32, tag), wire.Open(1, 0, 1, 4, b"f" * 32)):
        dec = wire.FrameDecoder()
        data = wire.encode(frame)
        got = [f for i in range(len(data)) for f in dec.feed(data[i:i + 1])]
        assert got == [frame]
    good = wire.encode(wire.Open(1, 0, 1, 4, b"f" * 32, "ab"))
    for body_tail, why in ((b"\x00", "0 bytes"), (b"\x02a ", "printable"), (b"\x03ab", "truncated")):
        bad = bytearray(good[:-3] + body_tail)
        bad[0:4] = (len(bad) - 4).to_bytes(4, "little")
        with pytest.raises(wire.RemoteProtocolError, match=why):
            wire.FrameDecoder().feed(bytes(bad))


def test_stage_refuses_an_open_with_other_numerics(tmp_path: Path) -> None:
    import asyncio

    from engine.pipeline.stage import StageError, StageHost

    host = StageHost(tmp_path, b"f" * 32, numerics_tag="kernels=numpy;numpy=2;blas=x:A",
                     load=lambda *_: pytest.fail("a refused OPEN loads nothing"))
    with pytest.raises(StageError) as e:
        asyncio.run(host._open(wire.Open(1, 0, 1, 4, b"f" * 32, "kernels=numpy;numpy=2;blas=x:B")))
    assert e.value.code == wire.ErrorCode.NUMERICS_MISMATCH
    assert str(e.value) == ("this stage computes with other numerics than the serving node: "
                            "blas x:B on the serving node, x:A on this stage")


# --- experts: the v4 hello ack ----------------------------------------------------------------------


def test_hello_ack_v4_carries_the_tag_and_v3_has_none() -> None:
    ack = rpc.HelloAck(version=4, fingerprint=b"f" * 32, capacity=1.0, ranges=(rpc.ShardRange(0, 1, 0, 3),),
                       numerics=numerics.tag())
    assert rpc.decode(rpc.encode(ack, 5)).message == ack  # type: ignore[attr-defined]
    old = rpc.HelloAck(version=3, fingerprint=b"f" * 32, capacity=1.0, ranges=(), numerics="ignored")
    assert rpc.decode(rpc.encode(old, 5)).message.numerics == ""  # type: ignore[attr-defined]


def test_coordinator_refuses_a_worker_with_other_numerics_and_keeps_the_rest(tmp_path: Path) -> None:
    from experts_util import make_moe_checkpoint
    from test_experts_inproc import Fixture, _connect, _equal, _inputs, _worker

    from engine.experts.channel import LoopThread
    from engine.experts.coordinator import RemoteExecutor, WorkerRefused

    lt = LoopThread()
    try:
        fx = Fixture(make_moe_checkpoint(tmp_path / "m", experts=8, top_k=2), "qwen3_moe")
        ex = RemoteExecutor(lt.loop, fx.fp, fx.layout)
        other = numerics.tag().replace("numpy=", "numpy=0.")
        with pytest.raises(WorkerRefused) as e:
            _connect(lt, ex, _worker(fx, numerics_tag=other), "w-other")
        assert e.value.code == rpc.ErrorCode.NUMERICS_MISMATCH and "w-other" in str(e.value)
        assert f"numpy 0.{np.__version__} on the worker, {np.__version__} on the coordinator" in str(e.value)
        assert "w-other" not in ex.links
        _connect(lt, ex, _worker(fx, protocol_max=3), "w-old")  # an older worker says nothing: used
        _connect(lt, ex, _worker(fx), "w-same")
        assert set(ex.links) == {"w-old", "w-same"}
        x = _inputs(fx.layout.hidden_size)[0]
        from engine.moe import local_executor

        assert _equal(fx.forward(x, ex), fx.forward(x, local_executor(fx.full.weights)))
    finally:
        lt.stop()


# --- end to end: real daemons on loopback -----------------------------------------------------------


def test_pipeline_refuses_a_stage_with_other_numerics_by_name_and_uses_the_rest(tmp_path: Path) -> None:
    pytest.importorskip("meshd.membership.service")
    from conftest import meshd_env
    from daemon_testlib import start_node
    from pipeline_mesh import invite, pipeline_status, same_as_ref, stage, wait_for

    core, _, other = _other_core()
    ref = start_node(tmp_path / "ref", "--model", "tiny")
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--pipeline-memory", "0.7")
    nodes: list[Any] = [ref, srv]
    try:
        token = invite(tmp_path / "s")
        odd = start_node(tmp_path / "odd", "--stage", "tiny", "--join", token, "--pipeline-memory", "0.7",
                         env=meshd_env(OPENBLAS_CORETYPE=core))
        nodes.append(odd)
        good = stage(tmp_path, "a", token, "tiny", "--pipeline-memory", "0.7")
        nodes.append(good)

        def planned() -> Any:
            st = pipeline_status(srv)
            ok = st["plan"] and [s["node_id"] for s in st["plan"]] == [srv.run["node_id"], good.run["node_id"]]
            return st if ok and st["refused"] else None

        st = wait_for(planned, 60, "a plan without the odd stage")
        assert [r["node_id"] for r in st["refused"]] == [odd.run["node_id"]], st
        reason = st["refused"][0]["reason"]
        assert "other numerics" in reason and f":{core} on the stage" in reason, reason
        assert other["tag"] == odd.status()["services"]["pipeline"]["pipeline"]["numerics"]
        same_as_ref(ref, srv, (("/v1/completions", {"model": "tiny", "prompt": "same bits", "max_tokens": 8, "logprobs": 2}),))
    finally:
        for n in reversed(nodes):
            n.stop()



@pytest.mark.parametrize("choice", ["blas", "kernels"])
def test_expert_worker_with_other_numerics_is_refused_by_name_and_the_other_serves(tmp_path: Path,
                                                                                  choice: str) -> None:
    """One worker daemon under another OpenBLAS core (any machine with OpenBLAS), or with ``MESHD_KERNELS=numpy``
    where this process has numba: refused by name with the component that differs; the other one is used."""
    pytest.importorskip("meshd.membership.service")
    from conftest import meshd_env
    from daemon_testlib import start_node
    from experts_mesh import Coordinator, MeshFixture
    from experts_util import make_moe_checkpoint
    from test_experts_daemon import _provision
    from test_experts_parity import gate

    from engine.model import Model

    if choice == "blas":
        core, _, other = _other_core()
        env, says = {"OPENBLAS_CORETYPE": core}, f":{core} on the worker"
    else:
        pytest.importorskip("numba")
        _skip_when_numba_is_switched_off()
        env, says = {"MESHD_KERNELS": "numpy"}, "kernels numpy on the worker"
        other = _probe(**env)
    mesh = MeshFixture()
    ck = make_moe_checkpoint(tmp_path / "q3", family="qwen3_moe", layers=2, experts=8, seed=4)
    odd_id, good_id = _provision(mesh, tmp_path / "odd"), _provision(mesh, tmp_path / "good")
    odd = start_node(tmp_path / "odd", "--experts", str(ck), env=meshd_env(**env))
    nodes = [odd]
    coord = Coordinator(mesh)
    try:
        nodes.append(start_node(tmp_path / "good", "--experts", str(ck)))
        for node, nid in zip(nodes, (odd_id, good_id)):
            host, _, port = node.run["quic"].rpartition(":")
            coord.lt.run(coord.transport.connect((host, int(port)), nid), timeout=15)
        ex = coord.executor(ck, "on")
        assert list(ex.links) == [good_id]
        reason = coord.service.status()["coordinators"][0]["refused"][odd_id]
        assert odd_id in reason and "other numerics" in reason and says in reason, reason
        assert odd.status()["services"]["experts"]["numerics"] == other["tag"]
        assert gate(Model.load(ck), ex, [3, 1, 4, 1, 5]) == []  # the one kept computes the local bits
    finally:
        coord.close()
        for n in reversed(nodes):
            n.stop()


AGREE = """
import json, os
from engine import numerics
k = numerics.kernels_choice()
from engine import kernels, kernels_int
v = kernels.numba.__version__ if kernels.AVAILABLE else None
print(json.dumps([k, kernels.AVAILABLE, kernels_int.AVAILABLE, v]))
"""


@pytest.mark.parametrize("env", [{}, {"MESHD_KERNELS_INT": "0"}, {"MESHD_KERNELS": "numpy"},
                                 {"NUMBA_CPU_NAME": "generic"}])
def test_kernels_choice_agrees_with_what_the_kernels_decide(env: dict[str, str]) -> None:
    """The tag decides without importing numba; it must say what engine/kernels.py and kernels_int.py do."""
    from conftest import meshd_env

    out = subprocess.run([sys.executable, "-c", AGREE], env=meshd_env(**env), capture_output=True, text=True,
                         timeout=60, check=True).stdout
    choice, on, int_on, version = json.loads(out.strip().splitlines()[-1])
    assert choice == (f"numba-{version}" + ("+int" if int_on else "") if on else "numpy"), (env, choice, on, int_on)
    assert choice.startswith("numba-") == on


LEAN = """
import json, sys
from engine import numerics
tag = numerics.tag()
mapped = "libllvmlite" in open("/proc/self/maps").read()
loaded = sorted(m for m in ("llvmlite.binding", "numba") if m in sys.modules)
child = numerics._llvm_host_allows()
from llvmlite import binding
print(json.dumps([tag, mapped, loaded, child, numerics.host_allows(binding)]))
"""


@pytest.mark.skipif(importlib.util.find_spec("llvmlite") is None or not sys.platform.startswith("linux"),
                    reason="llvmlite not installed, or no /proc/self/maps")
def test_tag_does_not_map_llvm_and_its_child_agrees_with_llvm_here() -> None:
    """Computing the tag in a process that has not imported numba leaves LLVM unmapped (importing
    llvmlite.binding keeps ~40 MB resident: an idle daemon's tag cost that much), and the child interpreter
    that asked LLVM about the CPU answered what LLVM answers in this process."""
    from conftest import meshd_env

    out = subprocess.run([sys.executable, "-c", LEAN], env=meshd_env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    tag, mapped, loaded, child, here = json.loads(out.strip().splitlines()[-1])
    assert tag.startswith("kernels=")
    assert not mapped and loaded == [], (mapped, loaded)
    assert child == here
