"""Pipelines over quantized GGUF checkpoints (Q8_0, Q4_K_M) with real stage processes on loopback: the
serving node and every stage map the same .gguf file, keep the blocks as stored, and the output (text and
logprobs; chat and completions; streamed and not; greedy and seeded) is byte-identical to one node
running the file alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("meshd.membership.service")

from daemon_testlib import Node, start_node
from gguf_helpers import QWEN3_MOE, build
from pipeline_mesh import invite, pipeline_status, same_as_ref, stage, wait_for, wait_plan

from engine import quant
from engine.gguf_export import export_gguf
from engine.model import Model
from engine.tiny import create_tiny

CHAT = (
    "/v1/chat/completions",
    {"model": "q", "messages": [{"role": "user", "content": "layers far away"}], "max_tokens": 16,
     "logprobs": True, "top_logprobs": 2},
)
COMPLETION = ("/v1/completions", {"model": "q", "prompt": "The mesh holds", "max_tokens": 16, "logprobs": 2})


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Qwen3-MoE whose rows are 256 wide (Q4_K's block) with the tiny model's tokenizer."""
    root = tmp_path_factory.mktemp("pipegguf")
    tiny = create_tiny(root / "tiny")
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    out = root / "src"
    build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", out, **{**QWEN3_MOE, "num_hidden_layers": 4,
                                                            "vocab_size": vocab})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, out / f)
    return out


@pytest.mark.parametrize(("mix", "pins", "qtype"), [("Q8_0", ["2-3"], "Q8_0"),
                                                      ("Q4_K_M", ["1-2", "3-3"], "Q4_K")])
def test_quantized_gguf_pipeline_byte_identical(src: Path, tmp_path: Path, mix: str, pins: list[str],
                                                qtype: str) -> None:
    g = tmp_path / f"m-{mix}.gguf"
    export_gguf(src, g, mix)
    m = Model.load(g)  # the file really holds the quantized blocks the stages will multiply with
    assert isinstance(m.layers[3].q, quant.Packed) and m.layers[3].q.qtype == qtype, m.layers[3].q
    del m
    ref = start_node(tmp_path / "ref", "--model", f"q={g}")
    srv = start_node(tmp_path / "s", "--model", f"q={g}", "--pipeline", "on")
    nodes = [ref, srv]
    try:
        token = invite(tmp_path / "s")
        for i, pin in enumerate(pins):
            nodes.append(stage(tmp_path, f"st{i}", token, f"{g}@{pin}"))
        first = int(pins[0].split("-")[0])
        layers = [[0, first - 1], *[[int(x) for x in p.split("-")] for p in pins]]
        wait_plan(srv, layers, timeout_s=60, model="q")
        assert same_as_ref(ref, srv, (CHAT, COMPLETION)) > 0
        st = pipeline_status(srv, "q")
        run = st["runs"][st["run"]]
        assert all(s["calls"] > 0 for s in run["stages"]), run  # every stage process did its part
        wait_for(lambda: all(pipeline_status(srv, "q")["runs"][r]["live_sequences"] == 0
                             for r in pipeline_status(srv, "q")["runs"]), 10, "sequences freed")
    finally:
        for n in reversed(nodes):
            n.stop()


def test_fingerprint_tells_quantizations_of_one_model_apart(src: Path, tmp_path: Path) -> None:
    """A stage holding the Q4_K_M file is another checkpoint than the Q8_0 one (OPEN refuses it by name)."""
    from engine.pipeline.layout import fingerprint

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    export_gguf(src, a, "Q8_0")
    export_gguf(src, b, "Q4_K_M")
    assert fingerprint(a) == fingerprint(a) and len(fingerprint(a)) == 32
    assert fingerprint(a) != fingerprint(b)
