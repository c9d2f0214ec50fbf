"""A stage host over a real socket pair: refusals by name, position checks, every way its state is freed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from engine.experts.channel import socketpair_channels
from engine.model import Model
from engine.pipeline import limits, wire
from engine.pipeline.client import StageFailed, StageLink
from engine.pipeline.layout import fingerprint
from engine.pipeline.stage import StageHost
from engine.tiny import create_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny") / "m")


async def _pair(host: StageHost) -> tuple[StageLink, asyncio.Task[None], object]:
    near, far = await socketpair_channels()
    task = asyncio.ensure_future(host.serve(far, "peer"))
    return StageLink("stage-node-1", near, 2, 3), task, near


def _x(model: Model, ids: list[int]) -> np.ndarray:
    return model.embed(np.asarray(ids))


def test_open_refuses_another_checkpoint_and_a_range_against_the_pin(tiny: Path, tmp_path: Path) -> None:
    other = create_tiny(tmp_path / "other", seed=1)

    async def main() -> None:
        host = StageHost(tiny, fingerprint(tiny), pin=(2, 3))
        link, task, _ = await _pair(host)
        with pytest.raises(StageFailed, match=r"holds checkpoint [0-9a-f]{16} \(m\), not [0-9a-f]{16}") as e:
            await link.open(1, fingerprint(other), 4)
        assert e.value.code == wire.ErrorCode.FINGERPRINT_MISMATCH
        link2, task2, _ = await _pair(host)
        link2.first = 1
        with pytest.raises(StageFailed, match="pinned to layers 2-3, asked for 1-3"):
            await link2.open(1, fingerprint(tiny), 4)
        for t in (task, task2):
            await asyncio.wait_for(t, 5)
        assert host.parts == {} and host.live() == 0

    asyncio.run(main())


def test_positions_are_checked_and_state_freed_by_free_stream_end_and_idle(tiny: Path) -> None:
    model = Model.load(tiny)

    async def main() -> None:
        host = StageHost(tiny, fingerprint(tiny))
        link, task, _ = await _pair(host)
        await link.open(7, fingerprint(tiny), 4)
        assert sorted(host.parts) == [(2, 3)]
        span = (wire.SeqSpan(1, 0, 3),)
        res = await link.call(wire.Forward(7, 0, span, _x(model, [1, 2, 3]), True))
        assert res.logits and res.x.shape == (1, model.config.vocab_size)
        with pytest.raises(StageFailed, match="at position 3, asked from 5") as e:
            await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 5, 1),), _x(model, [4]), True))
        assert e.value.code == wire.ErrorCode.POSITION_MISMATCH
        with pytest.raises(StageFailed, match="no state here"):
            await link.call(wire.Forward(7, 0, (wire.SeqSpan(2, 4, 1),), _x(model, [4]), True))
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(3, 0, 1),), _x(model, [4]), True))
        assert host.live(7) == 2
        link.free(7, [1])
        for _ in range(100):
            if host.live(7) == 1:
                break
            await asyncio.sleep(0.01)
        assert host.live(7) == 1
        # idle: a cache nobody touched for SEQ_IDLE_S goes
        import time

        assert host.sweep(time.monotonic()) == 0
        assert host.sweep(time.monotonic() + limits.SEQ_IDLE_S + 1) == 1
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(4, 0, 1),), _x(model, [4]), True))
        link.close("done")  # the serving node goes away: everything of its runs is freed
        await asyncio.wait_for(task, 5)
        assert host.live() == 0 and host.runs == {}
        assert sorted(host.parts) == [(2, 3)]  # kept: the next plan most likely asks for it again

    asyncio.run(main())


def test_garbage_gets_a_protocol_error_and_the_stream_closes(tiny: Path) -> None:
    async def main() -> None:
        host = StageHost(tiny, fingerprint(tiny))
        near, far = await socketpair_channels()
        task = asyncio.ensure_future(host.serve(far, "peer"))
        await near.send(b"\x10\x00\x00\x00XXgarbage-garbage")
        data = b""
        while chunk := await near.recv():
            data += chunk
        (frame,) = wire.FrameDecoder().feed(data)
        assert (
            isinstance(frame, wire.Error) and frame.code == wire.ErrorCode.PROTOCOL and "magic" in frame.text
        )
        await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_a_silent_stage_fails_the_step_within_the_silence_limit(tiny: Path) -> None:
    async def main() -> None:
        near, _far = await socketpair_channels()  # nobody serves `far`: a stage that died without a word
        link = StageLink("stage-node-1", near, 2, 3)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(StageFailed, match="no answer"):
            await link.open(1, b"x" * 32, 4, silence_s=limits.SILENCE_S)  # a failed stage asked again
        assert asyncio.get_running_loop().time() - t0 < limits.SILENCE_S + 0.5

    asyncio.run(main())


def test_link_measures_the_path_round_trip_with_echoed_keepalives(tiny: Path) -> None:
    """Ahead of a step, with nothing else out, the serving side pings (a KEEPALIVE the stage echoes before
    it computes); the echo's round trip is the path's, recorded beside the step latency."""
    model = Model.load(tiny)

    async def main() -> None:
        host = StageHost(tiny, fingerprint(tiny))
        link, task, _near = await _pair(host)
        await link.open(5, fingerprint(tiny), 4)
        x = _x(model, [1, 2, 3])
        await link.call(wire.Forward(5, 0, (wire.SeqSpan(1, 0, 3),), x, True))
        deadline = asyncio.get_running_loop().time() + 5
        while link.stats.pings == 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        st = link.stats.as_dict()
        assert st["pings"] == 1 and 0 < st["path_rtt_ms_avg"] < 5000, st
        await link.call(wire.Forward(5, 0, (wire.SeqSpan(1, 3, 1),), _x(model, [4]), True))
        assert link.stats.pings == 1  # at most one ping per PING_EVERY_S
        link.close("done")
        await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_decode_steps_answered_in_the_read_callback_and_poll_only_when_asked(tiny: Path) -> None:
    """A decode step is answered inside the stage's read callback, on both paths of the serving side
    (``call`` and the latency path ``call_soon``); with FLAG_POLL the stage then polls its loop for the next
    frame and stops as soon as it comes; without the flag it sleeps. A prefill chunk goes the queued way
    and a decode step behind it still comes back in order."""
    from transport import poll

    model = Model.load(tiny)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        poller = poll.poller(loop)
        host = StageHost(tiny, fingerprint(tiny))
        link, task, _ = await _pair(host)
        await link.open(7, fingerprint(tiny), 4)
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 0, 3),), _x(model, [1, 2, 3]), True))
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 3, 1),), _x(model, [4]), True))
        assert not poller.polling  # no flag: the stage sleeps until the next frame
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 4, 1),), _x(model, [5]), True, poll=True))
        assert poller.polling  # answered with the flag: polling for the next frame
        ticks = poller.ticks
        await asyncio.sleep(0.001)
        assert poller.ticks > ticks
        got: list[object] = []
        assert link.call_soon(wire.Forward(7, 0, (wire.SeqSpan(1, 5, 1),), _x(model, [6]), True), got.append)
        for _ in range(500):
            if got:
                break
            await asyncio.sleep(0.001)
        assert isinstance(got[0], wire.Result) and got[0].logits
        assert not poller.polling  # the next frame came: the hold is gone (and nobody asked again)
        # a prefill chunk (more than INLINE_ROWS rows) is queued; the decode step sent right behind it waits
        # for it and is answered after it, at the right position
        rows = limits.INLINE_ROWS + 1
        ids = list(range(1, rows + 1))
        first = asyncio.ensure_future(
            link.call(wire.Forward(7, 0, (wire.SeqSpan(2, 0, rows),), _x(model, ids), True))
        )
        await asyncio.sleep(0)
        second = await link.call(wire.Forward(7, 0, (wire.SeqSpan(2, rows, 1),), _x(model, [7]), True))
        assert first.done() and second.logits
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(3, 0, rows),), _x(model, ids), True))  # one by one
        want = (await link.call(wire.Forward(7, 0, (wire.SeqSpan(3, rows, 1),), _x(model, [7]), True))).x[-1]
        assert np.array_equal(second.x[-1], want)
        link.close("done")
        await asyncio.wait_for(task, 5)
        assert host.live() == 0

    asyncio.run(main())


def test_a_step_runs_single_threaded_while_another_sequence_stepped_just_before(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """limits.CROWDED_WINDOW_S: a one-token step whose stage saw another sequence's step within the window
    runs its products in ``kernels.single_threaded()``; a lone sequence's steps and prefill chunks do not."""
    from engine.pipeline import stage

    model = Model.load(tiny)
    seen: list[bool] = []
    real = stage.serial_if
    monkeypatch.setattr(stage, "serial_if", lambda crowded: seen.append(crowded) or real(crowded))
    monkeypatch.setattr(stage, "SERIAL", True)

    async def main() -> None:
        host = StageHost(tiny, fingerprint(tiny))
        link, task, _ = await _pair(host)
        await link.open(7, fingerprint(tiny), 4)
        monkeypatch.setattr(limits, "CROWDED_WINDOW_S", 60.0)
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 0, 2),), _x(model, [1, 2]), True))  # a chunk
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 2, 1),), _x(model, [3]), True))  # alone
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(2, 0, 1),), _x(model, [4]), True))  # 1 just stepped
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 3, 1),), _x(model, [5]), True))
        monkeypatch.setattr(limits, "CROWDED_WINDOW_S", 0.0)
        await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 4, 1),), _x(model, [6]), True))  # 2 long ago
        link.close("done")
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert seen == [False, True, True, False]


def test_decode_steps_poll_only_where_every_process_has_the_cores_it_computes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run polls (serving node for a result, stages via FLAG_POLL) only when the pipeline processes on this
    machine times the threads a step computes on fit the cores: not with 2-thread kernel pools on 2 cores."""
    from types import SimpleNamespace

    from engine.pipeline import client

    links = [SimpleNamespace(channel=SimpleNamespace(on_loopback=True))]

    def polling(cores: int, threads: int, force: str | None = None) -> bool:
        monkeypatch.setattr(client, "_cores", lambda: cores)
        monkeypatch.setattr(client, "_compute_threads", lambda: threads)
        if force is None:
            monkeypatch.delenv("MESHD_PIPELINE_POLL", raising=False)
        else:
            monkeypatch.setenv("MESHD_PIPELINE_POLL", force)

        async def make() -> bool:
            return client.Run(1, None, None, links).polling  # type: ignore[arg-type]

        return asyncio.run(make())

    assert polling(2, 1) and polling(4, 2)
    assert not polling(2, 2) and not polling(3, 2) and not polling(1, 1)
    assert polling(2, 2, "1") and not polling(2, 1, "0")
    assert not client.Run(1, None, None, links).polling  # type: ignore[arg-type]  # no loop: never


def test_open_refuses_other_numerics_and_takes_none_from_an_older_node(tiny: Path) -> None:
    """The stage's own check (engine/numerics.py): another tag in OPEN is refused by name before anything is
    loaded; an OPEN without one (an older serving node) and one with the stage's own tag are served."""

    async def main() -> None:
        host = StageHost(tiny, fingerprint(tiny), numerics_tag="kernels=numpy;numpy=2;blas=x:A")
        link, task, _ = await _pair(host)
        with pytest.raises(StageFailed, match="other numerics than the serving node: blas x:B on the serving "
                                              "node, x:A on this stage") as e:
            await link.open(1, fingerprint(tiny), 4, numerics_tag="kernels=numpy;numpy=2;blas=x:B")
        assert e.value.code == wire.ErrorCode.NUMERICS_MISMATCH and host.parts == {}
        for n, tag in enumerate(("", "kernels=numpy;numpy=2;blas=x:A"), start=2):
            ok, _, _ = await _pair(host)
            ready = await ok.open(n, fingerprint(tiny), 4, numerics_tag=tag)
            assert (ready.first, ready.last) == (2, 3)
            ok.close("done")
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
