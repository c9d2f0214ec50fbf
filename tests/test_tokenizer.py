"""Tokenizer: ids and decoding as transformers produces them, multi-byte text, incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import processors

from engine.tiny import build_tokenizer, create_tiny
from engine.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello world",
    "The mesh wakes before the sun.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "Grüße aus München, café, naïve façade",
    "こんにちは、世界。你好，世界。안녕하세요",
    "Emoji 🙂🚀 family 👩‍👩‍👧 flag 🇳🇱 crab 🦀 zwj 👩‍💻",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special inside<|endoftext|>text",
    "",
    "x" * 300,
    "numbers 1234567890 3.14159 0x1f",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_dir)


def _hf(path: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


def test_ids_match_transformers(tiny_dir: Path, tok: Tokenizer) -> None:
    hf = _hf(tiny_dir)
    for text in TEXTS:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text


def test_decode_matches_transformers(tiny_dir: Path, tok: Tokenizer) -> None:
    hf = _hf(tiny_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_post_processor_bos_matches_transformers(tmp_path: Path) -> None:
    # A Llama-style post-processor that prepends a BOS: ids must include it exactly as HF does.
    raw = build_tokenizer()
    bos = raw.token_to_id("<|endoftext|>")
    raw.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
        special_tokens=[("<|endoftext|>", bos)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.load(tmp_path)
    hf = _hf(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text)[0] == bos
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "").replace(
        "<|endoftext|>", "")
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def _incremental(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    d = tok.detokenizer(prompt or [])
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces


def test_incremental_never_emits_half_a_character(tok: Tokenizer) -> None:
    text = "crab 🦀 and 👩‍💻 and 你好 and naïve"
    ids = tok.encode(text)
    # The tiny vocab has no merge for the crab: its 4 UTF-8 bytes are 4 ids, so a naive per-id decode
    # would emit U+FFFD pieces.
    crab_ids = tok.encode("🦀")
    assert len(crab_ids) > 1 and "\ufffd" in tok.decode(crab_ids[:1])
    pieces = _incremental(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # The crab arrives whole in one piece, exactly when its last byte arrives.
    assert " 🦀" in pieces


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_incremental_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    pieces = _incremental(tok, ids, prompt=tok.encode("prompt: "))
    assert "".join(pieces) == tok.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces[:-1])


def test_incremental_flush_renders_a_dangling_byte(tok: Tokenizer) -> None:
    crab = tok.encode("🦀")
    d = tok.detokenizer()
    assert [d.add(i) for i in crab[:2]] == ["", ""]
    assert d.flush() == "\ufffd"  # what a full decode of an unfinished character gives


def test_token_bytes(tok: Tokenizer) -> None:
    for text in ("Hello", " world", "🦀", "你好"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(tok.token_to_id("<|im_end|>") or 0) == b"<|im_end|>"
    assert tok.token_bytes(10**6) == b""


def test_eos_ids_from_generation_config_and_config(tmp_path: Path, tiny_dir: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((tiny_dir / f).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.load(tmp_path).eos_ids == {2, 5, 7}
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").unlink()
    # Neither file: the eos_token of tokenizer_config.json.
    assert Tokenizer.load(tmp_path).eos_ids == {Tokenizer.load(tmp_path).token_to_id("<|im_end|>")}


def test_tiny_eos_ids(tok: Tokenizer) -> None:
    assert tok.eos_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}


def test_missing_or_broken_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot load"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text(build_tokenizer().to_str())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize(("flags", "bos_in_json"), [
    ({"add_bos_token": False}, True), ({"add_bos_token": True}, False),
    ({"add_bos_token": True, "add_eos_token": True}, True), ({"add_eos_token": True}, False), ({}, True)])
def test_add_bos_eos_flags_match_autotokenizer(tmp_path: Path, tiny_dir: Path, flags: dict,  # type: ignore[type-arg]
                                               bos_in_json: bool) -> None:
    # transformers 5 loads a checkpoint dir's tokenizer.json post-processor as-is: tokenizer_config's
    # add_bos_token/add_eos_token do not change the ids (checked here against AutoTokenizer).
    transformers = pytest.importorskip("transformers")
    raw = build_tokenizer()
    bos = raw.token_to_id("<|endoftext|>")
    if bos_in_json:
        raw.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", bos)])
    raw.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<|endoftext|>", **flags)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = Tokenizer.load(tmp_path)
    for text in ("hello world", "🙂", ""):
        assert tok.encode(text) == hf.encode(text), (flags, text)
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
