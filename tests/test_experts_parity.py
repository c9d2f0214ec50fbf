"""The parity gate over real QUIC on loopback with real worker processes.

Local engine vs the remote executor with 1, 2 and 3 workers, for Qwen3-MoE and Mixtral checkpoints the
test writes (safetensors fp32/bf16, and GGUF Q8_0 and Q4_K_M): teacher-forced prefill logits for every prompt prefix of length 1..8 and greedy decode
logits, every position equal byte for byte, same greedy tokens. A worker perturbing one output by 1e-6
must make the gate fail (negative control).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from experts_mesh import Coordinator, MeshFixture, WorkerProc, spawn_worker
from experts_util import make_moe_checkpoint

from engine.experts.coordinator import RemoteExecutor
from engine.model import Model
from engine.tiny import create_tiny
from engine.moe import ExpertExecutor

PROMPT = [5, 17, 3, 42, 9, 28, 61, 11]
DECODE_STEPS = 8


def gate(model: Model, remote: ExpertExecutor, prompt: list[int] = PROMPT) -> list[str]:
    """Every mismatch between local and remote runs (empty = bit-exact)."""
    bad: list[str] = []
    for n in range(1, len(prompt) + 1):
        a = model.forward(prompt[:n], model.new_cache())
        b = model.forward(prompt[:n], model.new_cache(), executor=remote)
        for pos in range(n):
            if a[pos].tobytes() != b[pos].tobytes():
                bad.append(f"prefix {n} position {pos}: max diff {float(np.abs(a[pos] - b[pos]).max()):.3g}")
    ca, cb = model.new_cache(), model.new_cache()
    la = model.forward(prompt, ca)[-1]
    lb = model.forward(prompt, cb, executor=remote)[-1]
    for step in range(DECODE_STEPS):
        if la.tobytes() != lb.tobytes():
            bad.append(f"decode step {step}: logits differ")
        ta, tb = int(np.argmax(la)), int(np.argmax(lb))
        if ta != tb:
            bad.append(f"decode step {step}: token {ta} != {tb}")
            break
        la = model.forward([ta], ca)[-1]
        lb = model.forward([tb], cb, executor=remote)[-1]
    return bad


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mesh = MeshFixture()
        self.ckpts = {
            # engine/tiny.py's checkpoints, as `meshd model create-tiny --arch ...` writes them
            "tiny-qwen3_moe": create_tiny(tmp / "tiny-q3", arch="qwen3_moe", seed=1),
            "tiny-mixtral": create_tiny(tmp / "tiny-mx", arch="mixtral", seed=2),
            # a Qwen3-MoE with a dense layer in the middle, bf16 storage
            "qwen3_moe-dense1-bf16": make_moe_checkpoint(tmp / "q3", family="qwen3_moe", layers=3, experts=8,
                                                         top_k=2, hidden=32, inter=16, dense_layers=(1,), seed=1,
                                                         dtype="BF16"),
        }
        # GGUF checkpoints, quantized: workers hold the blocks as stored and run the same tiled kernels
        from engine.gguf_export import export_gguf

        q8 = make_moe_checkpoint(tmp / "q8src", family="mixtral", layers=2, experts=4, hidden=64, inter=32, seed=4)
        self.ckpts["gguf-mixtral-Q8_0"] = tmp / "mx-q8.gguf"
        export_gguf(q8, self.ckpts["gguf-mixtral-Q8_0"], "Q8_0")
        qk = make_moe_checkpoint(tmp / "qksrc", family="qwen3_moe", layers=2, experts=4, hidden=256, inter=256,
                                 seed=5)
        self.ckpts["gguf-qwen3_moe-Q4_K_M"] = tmp / "q3-q4km.gguf"
        export_gguf(qk, self.ckpts["gguf-qwen3_moe-Q4_K_M"], "Q4_K_M")
        specs = [str(p) for p in self.ckpts.values()]
        self.workers: list[WorkerProc] = [spawn_worker(self.mesh, tmp, specs) for _ in range(3)]
        self.models = {k: Model.load(p) for k, p in self.ckpts.items()}

    def close(self) -> None:
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("parity"))
    yield s
    s.close()


class ExpertFfnCounter:
    """Counts routed-expert computations in this process (the local executor and the prefer fallback)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import engine.experts.general as general_mod
        import engine.moe as moe_mod

        self.calls = 0
        orig = moe_mod.expert_ffn

        def counted(*args: np.ndarray) -> np.ndarray:
            self.calls += 1
            return orig(*args)

        orig_many = moe_mod.expert_ffn_many

        def counted_many(items: list) -> list[np.ndarray]:  # the local executor's batched form
            self.calls += len(items)
            return orig_many(items)

        monkeypatch.setattr(moe_mod, "expert_ffn", counted)
        monkeypatch.setattr(moe_mod, "expert_ffn_many", counted_many)
        monkeypatch.setattr(general_mod, "expert_ffn_many", counted_many)  # the local fallback


@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_parity_gate_over_quic(setup: Setup, n_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.experts.passes as passes_mod

    # decode passes go to the loop by their rows, not by the wall clock (LOOP_STEP_MAX_COMPUTE_S, 5 ms, is
    # exceeded on a loaded machine): the passes_on_loop count below is then exact
    monkeypatch.setattr(passes_mod, "LOOP_STEP_MAX_COMPUTE_S", 3600.0)
    coord = Coordinator(setup.mesh)
    try:
        coord.connect(setup.workers[:n_workers])
        for family, path in setup.ckpts.items():
            model = setup.models[family]
            ex: RemoteExecutor = coord.executor(path, "on")
            assert sorted(ex.links) == sorted(w.node_id for w in setup.workers[:n_workers])
            bad = gate(model, ex)
            assert bad == [], f"{family} with {n_workers} workers: {bad[:5]}"
            st = ex.status()
            assert st["items_local"] == 0 and st["layers_delegated"] == st["layers"] > 0, st
            # decode steps (and these short prompts) ran on the executor's loop, none handed back
            assert st["passes_on_loop"] >= DECODE_STEPS and st["passes_handed_back"] == 0, st
            workers = st["workers"]
            assert isinstance(workers, dict)
            used = set(ex.stats.expert_rows)
            for w in setup.workers[:n_workers]:  # every worker owning a routed-to expert was called
                owns_used = any(ex.current_map.owner(*k) == w.node_id for k in used)
                assert (workers[w.node_id]["calls"] > 0) == owns_used, st  # type: ignore[index]
            # Delegation acted: a remote forward computes no routed expert here; a local one does.
            with pytest.MonkeyPatch.context() as mp:
                counter = ExpertFfnCounter(mp)
                model.forward(PROMPT, model.new_cache(), executor=ex)
                assert counter.calls == 0
                model.forward(PROMPT, model.new_cache())
                assert counter.calls > 0
    finally:
        coord.close()


def test_negative_control_perturbed_worker_fails_the_gate(setup: Setup) -> None:
    bad_worker = spawn_worker(setup.mesh, setup.tmp, [str(setup.ckpts["tiny-qwen3_moe"])], perturb=1e-6)
    coord = Coordinator(setup.mesh)
    try:
        coord.connect([bad_worker])
        ex = coord.executor(setup.ckpts["tiny-qwen3_moe"], "on")
        bad = gate(setup.models["tiny-qwen3_moe"], ex)
        assert bad, "a 1e-6 perturbation of one output must be caught"
    finally:
        coord.close()
        bad_worker.stop()


@pytest.mark.parametrize("batching", ["always", "never"])
def test_scheduler_batched_generation_is_identical_with_workers(setup: Setup, batching: str) -> None:
    """The engine's Scheduler (its own thread, forward_batch for concurrent requests) with the remote
    executor produces the same tokens and logprobs as without it.

    Both runs must take the same steps: a batched step is not bit-identical to single steps (BLAS on
    more rows), so the batching mode is fixed (``auto`` decides from timings) and all requests are
    admitted before the scheduler thread looks (else it may start one before the others arrive)."""
    from engine.sampling import SamplingParams
    from engine.scheduler import Scheduler
    from engine.tokenizer import Tokenizer

    path = setup.ckpts["tiny-qwen3_moe"]
    model, tok = setup.models["tiny-qwen3_moe"], Tokenizer.load(path)
    prompts = [tok.encode("the quick brown fox"), tok.encode("hello mesh"), tok.encode("a")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, top_logprobs=2)

    batched: list[int] = []

    def run(executor: ExpertExecutor | None) -> list[list[tuple[int | None, float | None]]]:
        sched = Scheduler(model, tok, 4, executor=executor, name="t", batching=batching)
        try:
            with sched._lock:  # the scheduler thread sees all three at once
                handles = [sched.submit(p, params, loop=None) for p in prompts]
            return [[(ev.token_id, ev.logprob) for ev in h] for h in handles]
        finally:
            sched.close()
            batched.append(sched.batched_steps)

    coord = Coordinator(setup.mesh)
    try:
        coord.connect(setup.workers[:2])
        ex = coord.executor(path, "on")
        local = run(None)
        remote = run(ex)
        assert remote == local and all(len(r) == 12 for r in local)
        assert ex.status()["items_local"] == 0 and ex.status()["layers_delegated"] > 0
        assert batched[0] == batched[1] and (batched[0] > 0) == (batching == "always"), batched
    finally:
        coord.close()


@pytest.mark.parametrize("n_workers", [1, 2])
def test_parity_gate_over_quic_with_workers_combining_every_whole_row(setup: Setup, n_workers: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On loopback a decode-sized reply fits one packet raw, so workers do not combine it (it would not pay);
    forced to, over real QUIC, the gate still holds byte for byte."""
    monkeypatch.setattr(RemoteExecutor, "_combining_pays", staticmethod(lambda *a: True))
    coord = Coordinator(setup.mesh)
    try:
        coord.connect(setup.workers[:n_workers])
        for family, path in setup.ckpts.items():
            ex: RemoteExecutor = coord.executor(path, "on")
            bad = gate(setup.models[family], ex)
            assert bad == [], f"{family} with {n_workers} workers combining: {bad[:5]}"
            assert ex.status()["rows_combined"] > 0
    finally:
        coord.close()


def test_workers_combine_only_when_it_saves_a_packet(setup: Setup) -> None:
    """The policy, against real links: 16 KiB loopback packets hold a top-2 hidden-32 decode reply raw."""
    coord = Coordinator(setup.mesh)
    try:
        coord.connect(setup.workers[:1])
        path = next(iter(setup.ckpts.values()))
        ex: RemoteExecutor = coord.executor(path, "on")
        link = next(iter(ex.links.values()))
        assert link.channel.max_datagram_bytes == 16384  # type: ignore[attr-defined]
        assert not ex._combining_pays(link, 1, 2, 32)  # 128 bytes saved
        assert ex._combining_pays(link, 128, 2, 32)  # 16 KiB saved
        model = setup.models[next(iter(setup.ckpts))]
        model.forward(PROMPT[:1], model.new_cache(), executor=ex)
        assert ex.status()["rows_combined"] == 0
    finally:
        coord.close()
