"""Model SPEC parsing and the load progress bar."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from engine.spec import parse_model_spec, resolve_checkpoint
from meshd.progress import ProgressBar, render


@pytest.mark.parametrize(("text", "kind", "name", "target"), [
    ("tiny", "tiny", "tiny", None),
    ("small=tiny", "tiny", "small", None),
    ("/models/Qwen3-30B-A3B", "path", "Qwen3-30B-A3B", "/models/Qwen3-30B-A3B"),
    ("/models/q3/", "path", "q3", "/models/q3"),
    ("qwen3:30b=/models/q3", "path", "qwen3:30b", "/models/q3"),
    ("org/model=/m", "path", "org/model", "/m"),
    ("/weird/a=b", "path", "a=b", "/weird/a=b"),
    ("openai:http://127.0.0.1:8080/v1/", "openai", None, "http://127.0.0.1:8080/v1"),
    ("llama=openai:http://127.0.0.1:8080/v1", "openai", "llama", "http://127.0.0.1:8080/v1"),
    ("openai:https://host/v1?key=x", "openai", None, "https://host/v1?key=x"),
])
def test_parse(text: str, kind: str, name: str | None, target: str | None) -> None:
    spec = parse_model_spec(text)
    assert spec.kind == kind and spec.name == name
    if kind == "path":
        assert str(spec.path) == target
    if kind == "openai":
        assert spec.url == target


@pytest.mark.parametrize(("text", "msg"), [
    ("", "empty"), ("   ", "empty"), ("name=", "gives no PATH"), ("openai:", "http"),
    ("openai:ftp://x", "http"), ("openai:http://", "http"), ("openai:http://h:99999", "port"),
    ("openai:http://u:p@h/v1", "credentials"), ("x" * 5000, "longer"), ("a\x00b", "control"),
])
def test_parse_rejects(text: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_model_spec(text)


def test_resolve(tmp_path: Path) -> None:
    assert resolve_checkpoint(parse_model_spec(str(tmp_path)), tmp_path) == tmp_path
    with pytest.raises(ValueError, match="does not exist"):
        resolve_checkpoint(parse_model_spec(str(tmp_path / "nope")), tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_checkpoint(parse_model_spec(str(tmp_path / "file")), tmp_path)
    with pytest.raises(ValueError, match="openai"):
        resolve_checkpoint(parse_model_spec("openai:http://127.0.0.1/v1"), tmp_path)


def test_progress_render_and_throttle() -> None:
    assert render("loading m", 0, 2_000_000_000, 0.0) == (
        "loading m [..............................]   0%  0 B/2.0 GB  0.0s")
    assert render("x", 1_000_000_000, 2_000_000_000, 1.25, width=10) == (
        "x [#####.....]  50%  1.0/2.0 GB  1.2s")
    now = [0.0]
    out = io.StringIO()
    bar = ProgressBar("l", out, total=100, clock=lambda: now[0])
    bar(10)
    bar(20)  # same instant: throttled
    assert out.getvalue().count("\r") == 1
    now[0] = 0.5
    bar(100)
    bar.close()
    assert out.getvalue().count("\r") == 3 and out.getvalue().endswith("100%  100/100 B  0.5s\n")


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_load_shows_progress_on_a_terminal_only(tmp_path: Path) -> None:
    from engine.tiny import create_tiny
    from meshd.commands.generate import load_model

    d = create_tiny(tmp_path)
    term = _FakeTerminal()
    model = load_model(d, "tiny", stream=term, min_bytes=0)
    assert model.config.vocab_size == 768
    out = term.getvalue()
    assert out.startswith("\rloading tiny [") and out.endswith("\n") and "100%" in out
    pipe = io.StringIO()  # not a terminal: nothing drawn
    load_model(d, "tiny", stream=pipe, min_bytes=0)
    assert pipe.getvalue() == ""
    big = _FakeTerminal()  # a terminal, but a small checkpoint under the default threshold
    load_model(d, "tiny", stream=big)
    assert big.getvalue() == ""
