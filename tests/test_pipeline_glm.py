"""Pipeline parity on the DeepSeek-V3-style families (issue 17): ``glm4_moe`` (dense layer 0, sigmoid
group-limited routing with a correction bias, an ungated shared expert, q/k/v bias, qk-norm, partial
rotary) and ``deepseek_v3`` (the same MoE with multi-head latent attention, whose per-stage KV cache holds
the latent and the shared rope key, YaRN).

In one process: real stage hosts behind real socket pairs (tests/pipeline_util.py), every 2-stage cut,
greedy and seeded, single sequences and batched decode through the scheduler, byte-identical to local.
With real processes: a serving daemon and a stage daemon on loopback over the OpenAI API
(test_real_stage_process_byte_identical).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.experts.channel import LoopThread
from engine.generate import generate
from engine.mla import MlaModel
from engine.model import Model
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.tiny import create_tiny
from engine.tokenizer import Tokenizer
from tests.pipeline_util import InprocProvider

ARCHES = ("glm4_moe", "deepseek_v3")
PROMPT = "The mesh holds the layers"


@pytest.fixture(scope="module", params=ARCHES)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, seed=5)


@pytest.fixture()
def lt():
    t = LoopThread()
    yield t
    t.stop()


def _run(model, tok, params, ids):  # type: ignore[no-untyped-def]
    evs = list(generate(model, tok, ids, params))
    return [e.token_id for e in evs], [e.logprob for e in evs], [e.top_logprobs for e in evs], "".join(
        e.text for e in evs
    )


def _two_stage_cuts(n: int) -> list[list[tuple[str, int, int]]]:
    """Every 2-stage cut, the serving node first (also holding no layer: it then only embeds)."""
    return [[("local", 0, c - 1), ("s1", c, n - 1)] for c in range(0, n)]


@pytest.mark.parametrize("seed", [None, 7])
def test_every_two_stage_cut_matches_local(ckpt: Path, lt: LoopThread, seed: int | None) -> None:
    model, tok = Model.load(ckpt), Tokenizer.load(ckpt)
    ids = tok.encode(PROMPT)
    params = SamplingParams(
        max_tokens=12, temperature=0.0 if seed is None else 0.9, seed=seed, top_logprobs=3, ignore_eos=True
    )
    ref = _run(model, tok, params, ids)
    cuts = _two_stage_cuts(model.config.num_layers)
    assert len(cuts) == model.config.num_layers == 4
    for plan in cuts:
        prov = InprocProvider(lt, model, ckpt, [plan])
        got = _run(prov.pipelined(), tok, params, ids)
        assert got == ref, plan
        # the stage built the same model class (latent attention stays latent attention) for its range
        part = next(iter(prov.hosts["s1"].parts.values()))
        assert type(part) is type(model)
        assert (part.first_layer, len(part.layers)) == (plan[1][1], plan[1][2] - plan[1][1] + 1)


def test_three_stages_and_batched_decode_match_local(ckpt: Path, lt: LoopThread) -> None:
    """Four sequences in flight through a 3-stage pipeline via the scheduler (batched decode steps):
    each gets what it gets alone on the local model."""
    model, tok = Model.load(ckpt), Tokenizer.load(ckpt)
    prompts = [tok.encode(p) for p in ("one two", "the mesh holds the layers of", "a", "seeded run here")]
    params = [
        SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.8, seed=i, top_logprobs=2, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = [_run(model, tok, p, ids) for p, ids in zip(params, prompts)]
    prov = InprocProvider(lt, model, ckpt, [[("local", 0, 0), ("s1", 1, 2), ("s2", 3, 3)]])
    sched = Scheduler(prov.pipelined(), tok, 8, batching="always")
    try:
        handles = [sched.submit(ids, p) for ids, p in zip(prompts, params)]
        got = []
        for h in handles:
            evs = list(h)
            got.append(([e.token_id for e in evs], [e.logprob for e in evs], [e.top_logprobs for e in evs],
                        "".join(e.text for e in evs)))
        assert got == want
        assert sched.batched_steps > 0
    finally:
        sched.close()


def test_stage_cache_holds_only_its_layers_and_latents(ckpt: Path, lt: LoopThread) -> None:
    """A stage's KV cache covers its own layers only; with latent attention it holds, per layer and
    position, the latent (kv_lora_rank) and the shared rope key (qk_rope_head_dim): nothing expanded."""
    model, tok = Model.load(ckpt), Tokenizer.load(ckpt)
    prov = InprocProvider(lt, model, ckpt, [[("local", 0, 1), ("s1", 2, 3)]])
    pm = prov.pipelined()
    cache = pm.new_cache()
    pm.forward(tok.encode(PROMPT), cache, last_only=True)
    host = prov.hosts["s1"]
    assert host.live() == 1
    live = next(iter(host.seqs.values())).cache
    n = len(tok.encode(PROMPT))
    assert live.first_layer == 2 and len(live.k) == len(live.v) == 2 and live.length == n
    cfg = model.config
    per_position = sum(a.shape[0] * a.shape[2] for a in (live.k[0], live.v[0]))
    if isinstance(model, MlaModel):
        m = cfg.mla
        assert live.k[0].shape[::2] == (1, m.kv_lora_rank) and live.v[0].shape[::2] == (1, m.qk_rope_head_dim)
        expanded = cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        assert per_position == m.kv_lora_rank + m.qk_rope_head_dim < expanded
        # what it holds is what the local model's cache holds for those layers, bit for bit
        ref = model.new_cache()
        model.forward(tok.encode(PROMPT), ref, last_only=True)
        for i in range(2):
            assert np.array_equal(live.k[i][:, :n], ref.k[2 + i][:, :n])
            assert np.array_equal(live.v[i][:, :n], ref.v[2 + i][:, :n])
    else:
        assert per_position == 2 * cfg.num_kv_heads * cfg.head_dim

def test_negative_control_a_changed_bias_is_seen(ckpt: Path, lt: LoopThread) -> None:
    """The parity check can fail: a stage whose router correction bias differs (choice only) routes
    differently and the logprobs change."""
    model, tok = Model.load(ckpt), Tokenizer.load(ckpt)
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.0, top_logprobs=2, ignore_eos=True)
    ref = _run(model, tok, params, ids)
    prov = InprocProvider(lt, model, ckpt, [[("local", 0, 1), ("s1", 2, 3)]])
    pm = prov.pipelined()
    pm.new_cache()
    part = next(iter(prov.hosts["s1"].parts.values()))
    layer = part.layers[0]
    assert layer.router_bias is not None
    layer.router_bias = (layer.router_bias + np.float32(1.0) * (np.arange(layer.router_bias.size) % 2)).astype(
        np.float32)
    got = _run(pm, tok, params, ids)
    assert got[1] != ref[1]



def test_stage_killed_mid_generation_recovers_byte_identical(ckpt: Path, lt: LoopThread) -> None:
    """A stage dies after 5 tokens: the run moves to the other plan, whose new stage rebuilds its (latent)
    cache from the sequence so far, and the output is still the local one."""
    model, tok = Model.load(ckpt), Tokenizer.load(ckpt)
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=14, temperature=0.8, seed=3, top_logprobs=2, ignore_eos=True)
    ref = _run(model, tok, params, ids)
    prov = InprocProvider(
        lt, model, ckpt, [[("local", 0, 0), ("s1", 1, 2), ("s2", 3, 3)], [("local", 0, 1), ("s3", 2, 3)]]
    )
    out = []
    for i, ev in enumerate(generate(prov.pipelined(), tok, ids, params)):
        out.append(ev)
        if i == 5:
            prov.kill("s1")
    got = ([e.token_id for e in out], [e.logprob for e in out], [e.top_logprobs for e in out],
           "".join(e.text for e in out))
    assert got == ref
    assert prov.run is not None and [s.node_id for s in prov.run.plan.stages] == ["local", "s3"]

@pytest.mark.parametrize("cut", [1, 2, 3])
def test_q8_gguf_of_the_family_every_cut_matches_local(ckpt: Path, lt: LoopThread, tmp_path: Path,
                                                       cut: int) -> None:
    """The same on a Q8_0 GGUF (glm4moe / deepseek2 with kv_b split): stages map the file and take their
    layer range (each widens only its own kv_b halves); byte-identical to the file run locally."""
    pytest.importorskip("gguf")
    from engine.gguf_export import export_gguf

    g = tmp_path / "m.gguf"
    export_gguf(ckpt, g, "Q8_0")
    model, tok = Model.load(g), Tokenizer.load(g)
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=4, top_logprobs=2, ignore_eos=True)
    ref = _run(model, tok, params, ids)
    prov = InprocProvider(lt, model, g, [[("local", 0, cut - 1), ("s1", cut, 3)]])
    assert _run(prov.pipelined(), tok, params, ids) == ref

@pytest.mark.parametrize("arch,pin", [("glm4_moe", "1-3"), ("deepseek_v3", "2-3")])
def test_real_stage_process_byte_identical(tmp_path: Path, arch: str, pin: str) -> None:
    """Real daemons on loopback: a serving node (``--pipeline on``) and a stage node (``--stage PATH@pin``)
    answer chat and completions, streamed and not, greedy and seeded, exactly as a node running the model
    alone; the stage did the steps of its layers."""
    pytest.importorskip("meshd.membership.service")
    from daemon_testlib import start_node
    from pipeline_mesh import collect, invite, post, stage, stage_status, stream, wait_plan, whole

    path = create_tiny(tmp_path / arch, arch=arch, seed=5)
    chat = ("/v1/chat/completions", {"model": "tiny", "max_tokens": 20, "logprobs": True, "top_logprobs": 2,
                                     "messages": [{"role": "user", "content": "layers far away"}]})
    completion = ("/v1/completions", {"model": "tiny", "prompt": "The mesh holds", "max_tokens": 20,
                                      "logprobs": 2})
    nodes = [start_node(tmp_path / "ref", "--model", f"tiny={path}")]
    try:
        ref = nodes[0]
        srv = start_node(tmp_path / "s", "--model", f"tiny={path}", "--pipeline", "on")
        nodes.append(srv)
        nodes.append(stage(tmp_path, "a", invite(tmp_path / "s"), f"{path}@{pin}"))
        first, last = (int(x) for x in pin.split("-"))
        wait_plan(srv, [[0, first - 1], [first, last]])
        for url, body in (chat, completion):
            kind = "chat" if "chat" in url else "completion"
            for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):
                b = {**body, **sampling}
                code, want = post(ref.run["api"], url, b)
                assert code == 200, want
                code, got = post(srv.run["api"], url, b)
                assert code == 200, got
                assert whole(got, kind) == whole(want, kind), (url, sampling)
                assert collect(list(stream(srv.run["api"], url, b)), kind) == whole(want, kind), (url, sampling)
        st = stage_status(nodes[2])
        assert st["loaded"] == [[first, last]] and st["steps"] > 0, st
    finally:
        for n in reversed(nodes):
            n.stop()
