"""The tokenizer of a GGUF file, built with ``tokenizers`` from its metadata (``tokenizer.ggml.*``) and its
chat template (``tokenizer.chat_template``).

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is rebuilt the way the Hugging Face ``tokenizer.json``
of the same model is: the vocabulary and merges as stored, the pre-tokenizer regex named by
``tokenizer.ggml.pre``, control tokens (type 3) as special added tokens and user-defined ones (type 4)
as added tokens, a BOS prepended when ``tokenizer.ggml.add_bos_token`` says so. So ids equal Hugging
Face's. Other tokenizer models and unknown pre-tokenizers are refused by name.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from .limits import GGUF_MAX_VOCAB
from .tokenizer import Tokenizer, TokenizerError

# tokenizer.ggml.pre -> (split regex or None for GPT-2's own, NFC normalizer)
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "qwen2": (_QWEN2, True),
    "llama-bpe": (_LLAMA3, False),
    "llama3": (_LLAMA3, False),
    "gpt-2": (None, False),
    "gpt2": (None, False),
    "olmo": (None, False),
    "default": (None, False),
}
CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(pattern: str | None) -> Any:
    if pattern is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def build_hf_tokenizer(meta: dict[str, Any]) -> _HFTokenizer:
    """A ``tokenizers.Tokenizer`` from GGUF metadata. Raises TokenizerError naming what is unsupported."""
    kind = meta.get("tokenizer.ggml.model")
    if kind in (None, "none", "no_vocab"):
        raise TokenizerError(f"the file has no tokenizer (tokenizer.ggml.model {kind!r})")
    if kind != "gpt2":
        raise TokenizerError(f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, byte-level BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or len(tokens) > GGUF_MAX_VOCAB:
        raise TokenizerError("tokenizer.ggml.tokens is missing or has a bad length")
    if not isinstance(merges, list):
        raise TokenizerError("tokenizer.ggml.merges is missing")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    pattern, nfc = PRE_TOKENIZERS[pre]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError("tokenizer.ggml.tokens holds duplicate tokens")
    pairs = []
    for m in merges:
        a, sep, b = str(m).partition(" ")
        if not sep:
            raise TokenizerError(f"tokenizer.ggml.merges entry {m!r} is not two tokens")
        pairs.append((a, b))
    bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre == "llama-bpe")
    tok = _HFTokenizer(bpe)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pattern)
    tok.decoder = decoders.ByteLevel()
    added = []
    for i, (text, t) in enumerate(zip(tokens, types)):
        if t in (CONTROL, USER_DEFINED):
            added.append((i, AddedToken(text, special=t == CONTROL, normalized=t != CONTROL)))
    # added tokens keep their ids: they are already in the vocabulary
    tok.add_special_tokens([a for _, a in added if a.special])
    tok.add_tokens([a for _, a in added if not a.special])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and isinstance(bos, int) and 0 <= bos < len(tokens):
        b = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1",
                                                           special_tokens=[(b, bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """The engine's :class:`~engine.tokenizer.Tokenizer` of a GGUF model (ids, chat template, eos ids)."""
    hf = build_hf_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < len(tokens):
            config[name] = tokens[i]
    eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(hf, config, template if isinstance(template, str) else None,
                     [i for i in eos if isinstance(i, int)])
