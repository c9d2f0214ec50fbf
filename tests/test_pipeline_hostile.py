"""A hostile member on the pipeline, both ways: real stage hosts behind real socket pairs.

- a stage that answers with results of the wrong shape or type (logits wider than the vocabulary, rows
  more or fewer than asked, fp16 bits) is failed by name and the step recovers onto an honest stage, so
  the output stays byte-identical to a local run (before: wider logits were sampled, giving token ids
  outside the vocabulary);
- a serving node that sends a stage activations of the wrong width, positions past the model's context, or
  one sequence twice in a batched step gets a named refusal, and the stage keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.experts.channel import LoopThread, socketpair_channels
from engine.generate import generate
from engine.model import Model
from engine.pipeline import wire
from engine.pipeline.client import StageFailed, StageLink
from engine.pipeline.layout import fingerprint
from engine.pipeline.stage import StageHost
from engine.sampling import SamplingParams
from engine.tiny import create_tiny
from engine.tokenizer import Tokenizer
from tests.pipeline_util import InprocProvider

PROMPT = "The mesh holds the layers"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture()
def lt():  # type: ignore[no-untyped-def]
    t = LoopThread()
    yield t
    t.stop()


def _lie(x: np.ndarray, how: str) -> np.ndarray:
    if how == "wider":  # the largest logit past the vocabulary
        out = np.zeros((x.shape[0], x.shape[1] * 4), dtype=np.float32)
        out[:, -1] = 50.0
        return out
    if how == "more_rows":
        return np.concatenate([x, x])
    if how == "no_rows":
        return x[:0]
    assert how == "fp16"
    return x.astype(np.float16)


@pytest.mark.parametrize("how", ["wider", "more_rows", "no_rows", "fp16"])
@pytest.mark.parametrize("liar", ["s1", "s2"])  # the middle stage (hidden states) or the last (logits)
def test_a_stage_answering_with_the_wrong_shape_is_failed_and_the_output_stays_local(
    tiny: Path, lt: LoopThread, how: str, liar: str
) -> None:
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=5, temperature=0.0, top_logprobs=2, ignore_eos=True)
    ref = [(e.token_id, e.logprob) for e in generate(model, tok, ids, params)]
    prov = InprocProvider(
        lt, model, tiny, [[("local", 0, 0), ("s1", 1, 2), ("s2", 3, 3)], [("local", 0, 1), ("s3", 2, 3)]]
    )
    bad = prov.hosts[liar]
    honest = bad._compute

    def lying(part: Any, executor: Any, f: wire.Forward) -> tuple[np.ndarray, bool, int]:
        x, logits, us = honest(part, executor, f)
        return _lie(x, how), logits, us

    bad._compute = lying  # type: ignore[method-assign]
    got = [(e.token_id, e.logprob) for e in generate(prov.pipelined(), tok, ids, params)]
    assert got == ref
    assert liar in prov.dead and prov.run is not None
    assert [s.node_id for s in prov.run.plan.stages] == ["local", "s3"]


_SERVING: list[Any] = []  # the stage hosts' serve tasks (the loop keeps only weak references)


async def _open(path: Path) -> tuple[StageHost, StageLink]:
    host = StageHost(path, fingerprint(path))
    near, far = await socketpair_channels()
    _SERVING.append(asyncio.ensure_future(host.serve(far, "peer")))
    link = StageLink("s", near, 2, 3)
    await link.open(7, fingerprint(path), 4)
    return host, link


def test_a_stage_refuses_activations_of_another_width_by_name(tiny: Path) -> None:
    cfg = Model.load(tiny).config
    d = cfg.hidden_size

    async def main() -> None:
        host, link = await _open(tiny)
        for rows, width in ((1, d * 64), (1, 3), (12, d + 1)):
            span = (wire.SeqSpan(1, 0, rows),)
            with pytest.raises(StageFailed, match=f"activations of width {width}, the model's is {d}") as e:
                await link.call(wire.Forward(7, 0, span, np.ones((rows, width), np.float32), True))
            assert e.value.code == wire.ErrorCode.PROTOCOL
        batch = tuple(wire.SeqSpan(s, 0, 1) for s in range(3))
        with pytest.raises(StageFailed, match=f"activations of width 5, the model's is {d}"):
            await link.call(wire.Forward(7, 0, batch, np.ones((3, 5), np.float32), True))
        res = await link.call(wire.Forward(7, 0, (wire.SeqSpan(9, 0, 1),), np.ones((1, d), np.float32), True))
        assert res.x.shape == (1, cfg.vocab_size)
        assert host.live(7) == 1  # the refused frames made no sequence

    asyncio.run(main())


def test_a_stage_refuses_positions_past_the_models_context(tiny: Path) -> None:
    cfg = Model.load(tiny).config
    ctx, d = cfg.max_position_embeddings, cfg.hidden_size

    async def main() -> None:
        host, link = await _open(tiny)
        rows = ctx + 1  # before: accepted, a KV cache past the context (any length, frame after frame)
        with pytest.raises(StageFailed, match=f"positions 0-{ctx} of sequence 1 are past the model's context"):
            await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 0, rows),), np.ones((rows, d), np.float32), True))
        assert host.live(7) == 0
        res = await link.call(wire.Forward(7, 0, (wire.SeqSpan(1, 0, 2),), np.ones((2, d), np.float32), True))
        assert res.x.shape[0] == 1

    asyncio.run(main())


def test_a_stage_refuses_one_sequence_twice_in_a_batched_step(tiny: Path) -> None:
    d = Model.load(tiny).config.hidden_size

    async def main() -> None:
        host, link = await _open(tiny)
        twice = (wire.SeqSpan(4, 0, 1), wire.SeqSpan(4, 0, 1))  # before: one cache advanced by two positions
        with pytest.raises(StageFailed, match="sequence 4 appears twice"):
            await link.call(wire.Forward(7, 0, twice, np.ones((2, d), np.float32), True))
        assert host.live(7) == 0

    asyncio.run(main())


def test_frames_left_unfinished_on_many_streams_are_bounded_over_the_stage(tiny: Path) -> None:
    """Each stream may announce a frame of up to MAX_FRAME_BYTES and never finish it; the stage holds at most
    ``max_buffered_bytes`` of such partial frames over all its streams (here lowered to 3 MiB; 512 MiB by
    default): the stream that would go over gets a PROTOCOL error and is closed, the others are served."""
    d = Model.load(tiny).config.hidden_size

    async def main() -> None:
        host = StageHost(tiny, fingerprint(tiny))
        host.max_buffered_bytes = 3 << 20
        rows = (2 << 20) // (4 * d)
        frame = wire.encode(wire.Forward(7, 0, (wire.SeqSpan(1, 0, rows),), np.ones((rows, d), np.float32)))
        part = frame[: 1_600_000]  # 1.6 MB of a 2 MiB frame, the rest never sent
        pairs = []
        for _ in range(2):
            near, far = await socketpair_channels()
            _SERVING.append(asyncio.ensure_future(host.serve(far, "peer")))
            pairs.append(near)
            await near.send(part)
        # the second stream went over: an error, then its end
        data = b""
        while chunk := await asyncio.wait_for(pairs[1].recv(), 5):
            data += chunk
        (err,) = wire.FrameDecoder().feed(data)
        assert isinstance(err, wire.Error) and err.code == wire.ErrorCode.PROTOCOL
        assert "frames being received hold over 3145728 bytes" in err.text
        assert sum(host._buffered.values()) < host.max_buffered_bytes
        # the first is still served: the rest of its frame gets its answer (this run is not open there)
        await pairs[0].send(frame[len(part) :])
        (reply,) = wire.FrameDecoder().feed(await asyncio.wait_for(pairs[0].recv(), 10))
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.UNKNOWN_RUN
        assert host._buffered == {}

    asyncio.run(main())


def test_a_stage_that_only_keeps_alive_is_failed_and_the_step_recovers(
    tiny: Path, lt: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage that answers a prefill chunk with KEEPALIVE for ever (its link is never silent): after
    ``STEP_TIMEOUT_S`` (60 s; 1.5 s here) the serving node fails it by name and recovers onto another stage,
    byte-identical. Before, the request ended after 60 s with a bare TimeoutError and no recovery."""
    from engine.pipeline import limits

    monkeypatch.setattr(limits, "STEP_TIMEOUT_S", 1.5)
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    ids = tok.encode(PROMPT * 3)
    assert len(ids) > limits.INLINE_ROWS  # a chunk computed on a thread, KEEPALIVE sent meanwhile
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    ref = [(e.token_id, e.logprob) for e in generate(model, tok, ids, params)]
    prov = InprocProvider(lt, model, tiny, [[("local", 0, 1), ("s1", 2, 3)], [("local", 0, 1), ("s2", 2, 3)]])
    release = threading.Event()

    def stuck(part: Any, executor: Any, f: wire.Forward) -> Any:
        release.wait(30)
        raise RuntimeError("released")

    prov.hosts["s1"]._compute = stuck  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        got = [(e.token_id, e.logprob) for e in generate(prov.pipelined(), tok, ids, params)]
    finally:
        release.set()
    assert got == ref
    assert "s1" in prov.dead and time.monotonic() - t0 < 20
