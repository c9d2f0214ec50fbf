"""A pipeline stage's decode hop over a direct channel (engine.pipeline.direct, transport.lane_direct).

In one process, over a real QUIC connection with a data lane and a real direct channel (TLS on loopback): lone
decode steps go over the channel (counted on both ends) with output byte-identical to a local run, greedy and
seeded; the serving node's socket shut down mid-decode: the next step goes on the stream, output identical;
the stage's end closed after it computed a step (its reply lost): the step is sent again on the stream, the
stage rewinds it, output identical; a run some other node opened is refused on the channel.

With real daemons: the stage link's direct channel comes up by itself, steps go over it, every request equal
to a local node's, and a stage killed with SIGKILL mid-stream is recovered from byte-identically;
``MESHD_PIPELINE_DIRECT=0`` on the serving node dials none (the lane still carries the stream).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_transport_lane import pair, wait_for

from engine.generate import generate
from engine.model import Model
from engine.pipeline import direct, wire
from engine.pipeline.client import PipelinedModel, PipelineUnavailable, Run, StageFailed, StageLink
from engine.pipeline.layout import fingerprint
from engine.pipeline.planner import Plan, Stage
from engine.pipeline.stage import StageHost
from engine.sampling import SamplingParams
from engine.tiny import create_tiny
from engine.tokenizer import Tokenizer
from transport.lane_direct import SERVICE_PIPELINE
from transport.quic import StreamType

PROMPT = "The mesh holds the layers"
TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny") / "m")


class _Provider:
    """One run, no spare capacity: a step that cannot be answered fails the generation (no silent re-plan)."""

    def __init__(self, run: Run, loop: asyncio.AbstractEventLoop) -> None:
        self.run, self.loop = run, loop

    def current(self) -> Run:
        return self.run

    def recover(self, failed: Run, error: StageFailed) -> Run:
        raise PipelineUnavailable(f"no spare stage: {error}")

    def run_on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def release(self, run: Run, seq: int) -> None:
        self.loop.call_soon_threadsafe(lambda: [lk.free(run.id, [seq]) for lk in run.links])


def _generate(model: Any, tok: Tokenizer, seed: int | None, on_event: Callable[[int], None] | None = None
              ) -> tuple[list[int], list[float], str]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0 if seed is None else 0.9, seed=seed,
                            top_logprobs=2, ignore_eos=True)
    ids, lps, text = [], [], ""
    for i, e in enumerate(generate(model, tok, tok.encode(PROMPT), params)):
        ids.append(e.token_id)
        lps.append(e.logprob)
        text += e.text
        if on_event is not None:
            on_event(i)
    return ids, lps, text


def _inproc(tiny: Path, body: Callable[..., Any], cut: int = 2) -> None:
    """A serving node (layers 0..cut-1) and a stage (the rest + head) on two real transports with a lane between them,
    the stage link's direct channel dialled; ``body(model, tok, host, run, link, hop, stage_channels)`` runs
    on a thread (the scheduler's role) while the loop serves both ends."""
    model, tok = Model.load(tiny), Tokenizer.load(tiny)
    fp = fingerprint(tiny)

    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            host = StageHost(tiny, fp)
            p.b.on_stream(StreamType.PIPELINE, lambda peer, s: host.serve(s, peer.node_id))
            stage_channels: list[Any] = []

            def handler(peer: Any, ch: Any) -> None:
                stage_channels.append(ch)
                direct.serve([host], peer.node_id, ch)

            p.lb.direct_handlers[SERVICE_PIPELINE] = handler
            b_id = p.b.identity.node_id
            stream = await p.peer_of_b.open_stream(StreamType.PIPELINE)
            assert stream.path == "lane"
            last = model.config.num_layers - 1
            link = StageLink(b_id, stream, cut, last)
            run_id = 0x5EED
            await link.open(run_id, fp, model.config.num_layers)
            run = Run(run_id, Plan((Stage(p.a.identity.node_id, 0, cut - 1), Stage(b_id, cut, last))),
                      model.part(0, cut - 1), [link])
            hop = direct.DirectHop(await p.la.dial_direct(p.peer_of_b, SERVICE_PIPELINE))
            link.direct = hop
            pm = PipelinedModel(model, _Provider(run, asyncio.get_running_loop()))
            await asyncio.to_thread(body, model, pm, tok, host, link, hop, stage_channels)
            hop.close("test over")
            link.close("test over")

    asyncio.run(main())


@pytest.mark.parametrize("seed", [None, 5])
def test_lone_steps_over_the_direct_channel_byte_identical(tiny: Path, seed: int | None) -> None:
    def body(model: Any, pm: Any, tok: Any, host: Any, link: Any, hop: Any, chans: Any) -> None:
        ref = _generate(model, tok, seed)
        assert _generate(pm, tok, seed) == ref
        # the first token comes from the prompt's chunk (the stream); every later one from a lone step
        assert hop.calls == link.stats.direct_calls == host.direct_steps == TOKENS - 1, link.stats.as_dict()
        assert link.stats.calls == TOKENS and link.stats.pings >= 1 and not hop.closed
        assert host.rewound == 0 and hop.fallbacks == 0
        # the channel only serves runs its own node opened on its stream
        x = np.zeros((1, model.config.hidden_size), np.float32)
        f = wire.Forward(next(iter(host.runs)), 9, (wire.SeqSpan(1, 0, 1),), x)
        got = host.direct_step(f, "another-node")
        assert isinstance(got, wire.Error) and got.code == wire.ErrorCode.UNKNOWN_RUN, got

    _inproc(tiny, body)


def test_serving_side_socket_shut_down_mid_decode_falls_back_byte_identical(tiny: Path) -> None:
    def body(model: Any, pm: Any, tok: Any, host: Any, link: Any, hop: Any, chans: Any) -> None:
        ref = _generate(model, tok, 3)

        def cut(i: int) -> None:
            if i == 4:
                hop.channel._sock.shutdown(socket.SHUT_RDWR)  # the socket dies under the scheduler thread

        assert _generate(pm, tok, 3, cut) == ref
        assert hop.closed and 0 < link.stats.direct_calls < TOKENS - 1, link.stats.as_dict()
        assert link.stats.calls == TOKENS and hop.fallbacks == 1  # every step answered, one way or the other

    _inproc(tiny, body)


def test_reply_lost_after_the_stage_computed_is_taken_again_on_the_stream(tiny: Path) -> None:
    def body(model: Any, pm: Any, tok: Any, host: Any, link: Any, hop: Any, chans: Any) -> None:
        ref = _generate(model, tok, None)
        real = host.direct_step

        def lose_the_fifth_reply(f: Any, peer_id: str) -> Any:
            reply = real(f, peer_id)
            if host.direct_steps == 5:
                chans[0].close("test: the connection dies before the reply is out")
            return reply

        host.direct_step = lose_the_fifth_reply
        assert _generate(pm, tok, None) == ref
        assert host.rewound == 1 and hop.closed, host.status()  # the stage had that step in its cache
        assert host.direct_steps == 5 and link.stats.direct_calls == 4

    _inproc(tiny, body)


def test_a_direct_reply_of_the_wrong_shape_fails_the_stage_by_name(tiny: Path) -> None:
    """As on the stream (tests/test_pipeline_hostile.py): logits wider than the vocabulary over the channel
    are not sampled; the stage is failed by name (here no spare stage is left, so the generation ends)."""
    def body(model: Any, pm: Any, tok: Any, host: Any, link: Any, hop: Any, chans: Any) -> None:
        real = host.direct_step

        def wider_logits(f: Any, peer_id: str) -> Any:
            reply = real(f, peer_id)
            if isinstance(reply, wire.Result) and reply.logits:
                x = np.zeros((reply.x.shape[0], reply.x.shape[1] * 4), np.float32)
                x[:, -1] = 50.0  # the largest logit past the vocabulary
                return wire.Result(reply.run, reply.step, reply.compute_us, x, True)
            return reply

        host.direct_step = wider_logits
        with pytest.raises(PipelineUnavailable, match="expected float32") as e:
            _generate(pm, tok, None)
        assert host.direct_steps >= 1 and link.closed, (e.value, host.status())

    _inproc(tiny, body)


@pytest.fixture(scope="module")
def batchable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint the compiled batched step covers (as tests/test_pipeline_batch.py's), tiny's tokenizer."""
    import json
    import shutil

    from experts_util import make_moe_checkpoint

    tiny = create_tiny(tmp_path_factory.mktemp("direct") / "tiny")
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    path = make_moe_checkpoint(tmp_path_factory.mktemp("direct") / "src", family="qwen3_moe", layers=3,
                               experts=8, hidden=512, inter=512, top_k=4, vocab=vocab, seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, path / name)
    return path


def test_batched_group_step_over_the_direct_channel_and_a_lost_reply_rewinds_every_row(batchable: Path) -> None:
    """With one group (the machine's pipeline processes share its cores), a batched decode step goes over the
    direct channel too; each row equals the sequence's lone local step; a lost reply rewinds every row."""
    pytest.importorskip("numba")

    def body(model: Any, pm: Any, tok: Any, host: Any, link: Any, hop: Any, chans: Any) -> None:
        pm.provider.run.groups = 1  # as on a 2-core machine whatever this one has
        prompts = [tok.encode(t) for t in ("The mesh holds", "layers far away", "a direct hop")]
        caches = [pm.new_cache() for _ in prompts]
        local = [model.new_cache() for _ in prompts]
        if pm.decode_groups(caches) != 1:
            pytest.skip("no batched pipeline step here (the compiled kernels do not cover this checkpoint)")
        toks = []
        for ids, c, lc in zip(prompts, caches, local):
            want = model.forward(ids, lc, last_only=True)[-1]
            assert np.array_equal(pm.forward(ids, c, last_only=True)[-1], want)
            toks.append(int(np.argmax(want)))
        real = host.direct_step

        def lose_the_third_reply(f: Any, peer_id: str) -> Any:
            reply = real(f, peer_id)
            if host.direct_steps == 3:
                chans[0].close("test: the connection dies before the reply is out")
            return reply

        host.direct_step = lose_the_third_reply
        for _ in range(5):
            got = [pm.finish_one(p) for p in pm.start_many(toks, caches)]
            want = [model.forward([t], lc, last_only=True)[-1] for t, lc in zip(toks, local)]
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
            toks = [int(np.argmax(w)) for w in want]
        assert host.direct_steps == 3 and link.stats.direct_calls == 2, link.stats.as_dict()
        assert host.rewound == len(prompts) and hop.closed, host.status()
        # one call per prompt and per batched step: the lost step was taken again as one batched step
        assert link.stats.calls == len(prompts) + 5, link.stats.as_dict()

    _inproc(batchable, body, cut=1)


# --- real daemons -----------------------------------------------------------------------------------------

pytest.importorskip("meshd.membership.service")


def test_a_run_on_quic_is_opened_again_once_a_lane_to_its_stage_is_up() -> None:
    """``Serving._off_lane``: a run whose stage link went over QUIC (opened before the lane to that stage
    was up: a run planned right after the stage joined, seen under load in
    test_switched_off_no_direct_channel) is found off the lane once the lane is up, so the next re-plan
    opens the plan again over it; a link on the lane, on QUIC to a stage with no lane, or on QUIC while the
    lane was already up when the run was opened (the lane was full: opening again would find it full again,
    once per re-plan) is left alone. Real transports and streams."""
    from types import SimpleNamespace

    from meshd.pipeline_service import Serving

    async def main() -> list[bool]:
        got = []
        for lane_b in (True, False):
            async with pair(lane_b=lane_b) as p:
                if lane_b:
                    await wait_for(lambda: p.peer_of_b.path == "lane")
                svc: Any = SimpleNamespace(transport=p.a)
                need: Any = None
                serving = Serving(svc, "tiny", None, b"", need, "on", asyncio.get_running_loop())
                b_id = p.b.identity.node_id
                for lane in (False, True):
                    stream = await p.peer_of_b.open_stream(StreamType.PIPELINE, lane=lane)
                    assert stream.path == ("lane" if lane and lane_b else "quic")
                    run: Any = SimpleNamespace(links=[StageLink(b_id, stream, 2, 3)])
                    got.append(serving._off_lane(run))
                    run.lane_was_up = frozenset({b_id})  # opened while the lane was up: it was full then
                    got.append(serving._off_lane(run))
                    stream.reset(0)
        return got

    # with a lane: a QUIC link is off it (unless the lane was up, hence full, when the run was opened), a
    # lane link is not; without a lane: both on QUIC, as they must be
    assert asyncio.run(main()) == [True, False, False, False, False, False, False, False]


from conftest import meshd_env
from daemon_testlib import Node, start_node
from pipeline_mesh import (
    collect,
    invite,
    pipeline_status,
    post,
    same_as_ref,
    stage,
    stage_status,
    stream,
    wait_plan,
    whole,
)
from pipeline_mesh import wait_for as wait_until

CHAT = ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a direct hop"}],
                                 "max_tokens": 16, "logprobs": True, "top_logprobs": 2})
COMPLETION = ("/v1/completions", {"model": "tiny", "prompt": "The mesh holds", "max_tokens": 16, "logprobs": 2})
LONG = ("/v1/completions", {"model": "tiny", "prompt": "The mesh holds", "max_tokens": 2000, "logprobs": 1,
                            "temperature": 0.7, "seed": 6})


@pytest.fixture()
def ref(tmp_path: Path):
    node = start_node(tmp_path / "ref", "--model", "tiny")
    yield node
    node.stop()


def _link(srv: Node) -> dict[str, Any]:
    st = pipeline_status(srv)
    return st["runs"][st["run"]]["stages"][0]  # type: ignore[no-any-return]


def test_daemons_step_over_the_direct_channel_and_recover_from_kill9(tmp_path: Path, ref: Node) -> None:
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--pipeline-memory", "0.7")
    nodes = [srv]
    try:
        token = invite(tmp_path / "s")
        nodes.append(stage(tmp_path, "a", token, "tiny@2-3"))
        wait_plan(srv, [[0, 1], [2, 3]])
        wait_until(lambda: _link(srv)["direct"], 20, "the stage's direct channel")
        same_as_ref(ref, srv, (CHAT, COMPLETION))
        lk = _link(srv)
        assert lk["path"] == "lane" and lk["direct_calls"] > 0, lk
        assert stage_status(nodes[1])["direct_steps"] == lk["direct_calls"], stage_status(nodes[1])
        # a spare stage, then the planned one killed mid-stream: recovered on the spare, byte-identical
        nodes.append(stage(tmp_path, "d", token, "tiny", "--pipeline-memory", "0.7"))
        wait_until(lambda: len(srv.status()["peers"]) >= 2, 20, "the spare joined")
        code, want = post(ref.run["api"], *LONG)
        assert code == 200
        events: list[dict[str, Any]] = []
        before = _link(srv)["direct_calls"]
        for ev in stream(srv.run["api"], *LONG):
            events.append(ev)
            if len(events) == 20:
                assert _link(srv)["direct_calls"] > before  # this stream's steps went direct
                nodes[1].proc.send_signal(signal.SIGKILL)
        assert "error" not in events[-1], events[-1]
        assert collect(events, "completion") == whole(want, "completion")
        st = pipeline_status(srv)
        assert st["recoveries"] == 1 and st["plan"][1]["node_id"] == nodes[2].run["node_id"], st
    finally:
        for n in reversed(nodes):
            n.stop()


def test_switched_off_no_direct_channel(tmp_path: Path, ref: Node) -> None:
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--pipeline-memory", "0.7",
                     env=meshd_env(MESHD_PIPELINE_DIRECT="0"))
    nodes = [srv]
    try:
        nodes.append(stage(tmp_path, "a", invite(tmp_path / "s"), "tiny@2-3"))
        wait_plan(srv, [[0, 1], [2, 3]])
        wait_until(lambda: _link(srv)["path"] == "lane", 20, "the stage stream on the lane")
        same_as_ref(ref, srv, (CHAT, COMPLETION))
        lk = _link(srv)
        assert lk["calls"] > 0 and lk["direct_calls"] == 0 and not lk["direct"], lk
        assert stage_status(nodes[1])["direct_steps"] == 0
        assert srv.status()["services"]["lane"]["direct_channels"] == 0
    finally:
        for n in reversed(nodes):
            n.stop()


def test_the_timeline_traces_each_step_over_the_direct_channel(tmp_path: Path) -> None:
    """bench/pipeline_timeline.py reads the direct path: every decode step of a stream over the channel leaves its
    marks in both processes, in order, and each node's scheduler marks its lone steps (X.tok, X.fwd)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import pipeline_timeline as timeline

    tdir = tmp_path / "trace"
    tdir.mkdir()
    env = meshd_env(MESHD_PIPELINE_TRACE=str(tdir))
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--pipeline-memory", "0.7", env=env)
    nodes = [srv]
    try:
        nodes.append(start_node(tmp_path / "a", "--stage", "tiny@2-3", "--join", invite(tmp_path / "s"), env=env))
        wait_plan(srv, [[0, 1], [2, 3]])
        wait_until(lambda: _link(srv)["direct"], 20, "the stage's direct channel")
        # all 16 tokens: tiny's random weights often draw (or pick) the end token after a few steps, and a short
        # stream leaves too few steps to read (CI saw 3 of 16)
        events = list(stream(srv.run["api"], COMPLETION[0], {**COMPLETION[1], "ignore_eos": True}))
        assert "error" not in events[-1], events[-1]
        assert [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")] \
            == ["length"], events[-2:]
        assert _link(srv)["direct_calls"] > 0
    finally:
        for n in reversed(nodes):
            n.stop()
    roles = {srv.proc.pid: "S", nodes[1].proc.pid: "T"}
    got = timeline.steps(tdir, roles, timeline.DIRECT_ORDER)
    assert len(got) >= TOKENS - 3, f"{len(got)} complete decode steps traced"
    for s in got:
        times = [s[tag] for tag in timeline.DIRECT_CHAIN]
        assert times == sorted(times) and s["next"] > s["S.back"], s
        assert all(s[tag] >= s["S.dsend" if tag[0] == "S" else "T.dsend"]
                   for tag in timeline.OFF_CHAIN if tag in s), s
    period, fwd = timeline.tokens(tdir, roles, "S")
    assert len(period) >= TOKENS - 3 and all(0 < f < p for p, f in zip(period, fwd)), (period, fwd)
