"""A Llama/Mixtral-style tokenizer (Metaspace-like normalizer, byte fallback, Strip decoder): ids as
transformers produces them and incremental detokenization of byte-fallback characters."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors

from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "llo", "▁he", "▁hello", "or", "▁wor",
              "▁worl", "▁world", "é", "a", "c", "f", "▁c", "af", "▁caf", "▁café"]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo"), ("o", "r"),
              ("▁w", "or"), ("▁wor", "l"), ("▁worl", "d"), ("▁", "c"), ("a", "f"), ("▁c", "af"), ("▁caf", "é")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                 fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("sp")
    tok.save(str(d / "tokenizer.json"))
    return d


TEXTS = ["hello world", "hello café 你好 🦀", "world", " leading space", "héllo wörld"]


def test_ids_match_transformers(sp_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(sp_dir / "tokenizer.json"))
    tok = Tokenizer.load(sp_dir)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text)[0] == 1
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


def test_byte_fallback_incremental(sp_dir: Path) -> None:
    tok = Tokenizer.load(sp_dir)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        d = tok.detokenizer()
        pieces = [d.add(i) for i in ids] + [d.flush()]
        assert "".join(pieces) == tok.decode(ids)
        if not text.startswith(" "):
            assert tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    # 🦀 is four <0x..> byte tokens: it appears once, whole.
    ids = tok.encode("hello 🦀", add_special_tokens=False)
    assert sum(1 for i in ids if tok.token_bytes(i) and len(tok.token_bytes(i)) == 1) >= 4
    d = tok.detokenizer()
    pieces = [d.add(i) for i in ids] + [d.flush()]
    assert "🦀" in "".join(pieces) and any(p.endswith("🦀") for p in pieces)
    assert b"".join(tok.token_bytes(i) for i in ids) == " hello 🦀".encode()


def test_continuation_keeps_the_space_after_a_prompt(sp_dir: Path) -> None:
    tok = Tokenizer.load(sp_dir)
    prompt = tok.encode("hello")
    gen = tok.encode("world", add_special_tokens=False)  # "▁world"
    d = tok.detokenizer(prompt)
    assert "".join([d.add(i) for i in gen] + [d.flush()]) == " world"
