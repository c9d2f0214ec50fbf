"""The tiny checkpoint: deterministic bytes, HF layout and config, created once under the state dir."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from engine.tiny import FILES, create_tiny, ensure_tiny
from engine.tokenizer import Tokenizer


def _digests(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


def test_same_seed_byte_identical_across_processes(tmp_path: Path) -> None:
    a = create_tiny(tmp_path / "a")
    # A separate interpreter (different hash seeds, fresh tokenizers state) must write the same bytes.
    code = "import sys; from engine.tiny import create_tiny; create_tiny(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, cwd=REPO_ROOT,
                   env={"PYTHONPATH": str(REPO_ROOT), "PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"})
    assert _digests(a) == _digests(tmp_path / "b")
    c = create_tiny(tmp_path / "c", seed=1)
    dc = _digests(c)
    assert dc["model.safetensors"] != _digests(a)["model.safetensors"]
    assert dc["tokenizer.json"] == _digests(a)["tokenizer.json"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_layout_and_config(tmp_path: Path, arch: str) -> None:
    from safetensors import safe_open

    d = create_tiny(tmp_path, arch=arch)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["max_position_embeddings"] == 4096
    tok = Tokenizer.load(d)
    assert cfg["vocab_size"] >= tok.vocab_size and cfg["vocab_size"] % 64 == 0
    assert tok.has_chat_template
    with safe_open(str(d / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (cfg["vocab_size"], cfg["hidden_size"])
        assert str(f.get_tensor("lm_head.weight").dtype) == "float32"
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    expert_keys = [k for k in keys if ".experts." in k]
    assert len(expert_keys) == cfg["num_hidden_layers"] * n_exp * 3


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_transformers_loads_it(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    d = create_tiny(tmp_path, arch=arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    tok = Tokenizer.load(d)
    ids = torch.tensor([tok.encode("The mesh wakes before the sun.")])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.shape[-1] == json.loads((d / "config.json").read_text())["vocab_size"]
    assert float(logits.std()) > 1.0  # spread logits: greedy decoding is not a string of near-ties


def test_ensure_tiny_once(tmp_path: Path) -> None:
    p = ensure_tiny(tmp_path)
    assert p.parent == tmp_path / "models" and all((p / f).is_file() for f in FILES)
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(tmp_path) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    assert [x.name for x in (tmp_path / "models").iterdir()] == [p.name]  # no temp dirs left behind


def test_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qwen3_moe, mixtral"):
        create_tiny(tmp_path, arch="llama")


def test_ensure_tiny_concurrent_first_use(tmp_path: Path) -> None:
    # Several processes starting at once (e.g. a test mesh) all get the same complete checkpoint.
    code = "import sys; from engine.tiny import ensure_tiny; print(ensure_tiny(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
             for _ in range(3)]
    outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1
    path = Path(outs.pop())
    ref = create_tiny(tmp_path / "ref")
    assert _digests(path) == _digests(ref)
    assert [x.name for x in (tmp_path / "models").iterdir()] == [path.name]
