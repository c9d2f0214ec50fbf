"""Tokenizer and prompts for a Hugging Face checkpoint directory.

``Tokenizer.load(dir)`` reads ``tokenizer.json`` with the ``tokenizers`` library (so ids, added/special tokens
and the post-processor are exactly Hugging Face's), ``tokenizer_config.json`` for the special-token strings
and the chat template (or ``chat_template.jinja``), and the eos ids from ``generation_config.json`` plus
``config.json``.

Chat templates render with jinja2 the way transformers' ``apply_chat_template`` does: a sandboxed
environment with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, a
``tojson`` filter that does not HTML-escape, and the globals ``raise_exception`` and ``strftime_now``; the
named special tokens (``bos_token``, ``eos_token``...) are template variables; messages drop keys whose value
is None. The rendered text is encoded without adding special tokens (the template writes them).

``IncrementalDetokenizer`` turns a growing list of ids into text pieces and never emits a piece ending in
an incomplete UTF-8 sequence (the decoders render those as U+FFFD; we wait for the next id instead).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as _HFTokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
_REPLACEMENT = "\ufffd"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(Exception):
    """A tokenizer file is missing or malformed; the message names the file."""


class ChatTemplateError(Exception):
    """The chat template failed to render (including its own ``raise_exception``), or there is none."""


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores special tokens as a string or an AddedToken dict {"content": ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# --- chat templates ------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses it for masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses. Raises ``ChatTemplateError``."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def _plain(value: Any) -> Any:
    # Only plain JSON data reaches the sandbox.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


# --- tokenizer -----------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[str, int]:
    # GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to 256+n. char -> byte.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _bytes_to_unicode()


class Tokenizer:
    """A checkpoint's tokenizer: ids as Hugging Face produces them, chat template, eos ids."""

    def __init__(self, hf: _HFTokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, eos_ids: Iterable[int] = ()) -> None:
        self._hf = hf
        self.config: dict[str, Any] = dict(config or {})
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(self.config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.chat_template_source = chat_template
        self._template: jinja2.Template | None = None
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        added = hf.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_ids = frozenset(added)
        dec = json.loads(hf.to_str()).get("decoder") or {}
        self._byte_level = _mentions(dec, "ByteLevel")
        self._byte_fallback = _mentions(dec, "ByteFallback")

    # -- loading --

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load from a checkpoint dir (or a ``.gguf`` file: its metadata). Raises ``TokenizerError`` naming
        the missing or bad file."""
        d = Path(directory)
        if d.suffix == ".gguf" and d.is_file():
            from .checkpoint import CheckpointError
            from .gguf_file import _reader, read_metadata
            from .gguf_tokenizer import tokenizer_from_gguf

            try:
                meta = read_metadata(_reader(d))
                return tokenizer_from_gguf(meta)
            except (CheckpointError, TokenizerError) as e:
                raise TokenizerError(f"{d}: {e}" if str(d) not in str(e) else str(e)) from None
        tok_path = d / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: missing (a checkpoint needs tokenizer.json)")
        try:
            hf = _HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{tok_path}: cannot load ({first})") from None
        config = _read_json(d / "tokenizer_config.json") or {}
        template = None
        jinja_path = d / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        else:
            raw = config.get("chat_template")
            if isinstance(raw, str):
                template = raw
            elif isinstance(raw, list):  # [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
                chosen = named.get("default")
                template = chosen if isinstance(chosen, str) else None
        eos: list[int] = []
        gen = _read_json(d / "generation_config.json") or {}
        eos += _ids(gen.get("eos_token_id"))
        model_cfg = _read_json(d / "config.json") or {}
        eos += _ids(model_cfg.get("eos_token_id"))
        text_cfg = model_cfg.get("text_config")
        if isinstance(text_cfg, Mapping):
            eos += _ids(text_cfg.get("eos_token_id"))
        if not eos:
            eos_text = _token_content(config.get("eos_token"))
            if eos_text is not None and hf.token_to_id(eos_text) is not None:
                eos.append(int(hf.token_to_id(eos_text)))
        return cls(hf, config, template, eos)

    # -- ids --

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (base vocab plus added tokens)."""
        return int(self._hf.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True, *, release_gil: bool = False) -> list[int]:
        """Text -> ids, as ``PreTrainedTokenizerFast.encode`` (post-processor runs if add_special_tokens).

        ``release_gil=True`` gives the same ids through ``encode_batch`` of one text, which lets other
        Python threads run while the Rust tokenizer works (``encode`` holds the GIL throughout: seconds for
        megabytes of text). For callers on a worker thread of an event loop (the API's prompts).
        """
        if release_gil:
            return list(self._hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text. Ids outside the vocabulary (padded model vocab) decode to nothing."""
        return str(self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def to_json(self) -> str:
        """The ``tokenizer.json`` document (for libraries that build their own view, e.g. llguidance)."""
        return str(self._hf.to_str())

    def token_to_id(self, token: str) -> int | None:
        tid = self._hf.token_to_id(token)
        return None if tid is None else int(tid)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one id stands for (for logprob displays); b"" for unknown ids."""
        piece = self._hf.id_to_token(int(token_id))
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    # -- chat --

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template_source is not None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                            release_gil: bool = False, **kwargs: Any) -> list[int] | str:
        """Render ``messages`` as transformers' ``apply_chat_template`` does; ids (default) or text.

        Extra keyword arguments become template variables (e.g. ``enable_thinking=False``), overriding the
        special tokens of the same name. Messages drop keys whose value is None, and a message's reasoning
        (``reasoning_content``, ``thinking`` or ``reasoning``) is visible under the first two names.
        ``release_gil`` is ``encode``'s. Raises ``ChatTemplateError`` (no template, or it raised).
        """
        if self.chat_template_source is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json chat_template)")
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template_source)
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ChatTemplateError("chat messages must be objects")
            msg = {k: v for k, v in m.items() if v is not None}
            # A message's reasoning under any of its common names is visible under all of them (as
            # transformers does): templates read reasoning_content, gpt-oss style ones read thinking.
            reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
            if reasoning is not None:
                msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
            chat.append(msg)
        variables = _plain({**self.special_tokens, **kwargs})
        try:
            text = self._template.render(messages=_plain(chat), tools=_plain(list(tools)) if tools else None,
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False, release_gil=release_gil)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids)


def _mentions(node: Any, type_name: str) -> bool:
    if isinstance(node, Mapping):
        if node.get("type") == type_name:
            return True
        return any(_mentions(v, type_name) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, type_name) for v in node)
    return False


# How many ids of context the detokenizer re-decodes before the new ones: enough for decoders that
# treat the first token specially (Metaspace strips a leading space) to see a stable prefix.
_CONTEXT_IDS = 5


class IncrementalDetokenizer:
    """Feeds ids one by one and returns the new text each adds, never half a character.

    ``add(id) -> str`` returns the text that became final (possibly ""); ``flush() -> str`` returns what
    is still held (an incomplete sequence at the very end renders as U+FFFD, as a full decode would).
    Concatenating every piece equals ``tokenizer.decode(ids)`` for the ids added (special tokens skipped).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_IDS:])
        self._prefix = 0  # start of the window that is re-decoded
        self._read = len(self._ids)  # ids before this are already emitted
        self._prefix_text: str | None = None  # decode of ids[prefix:read], cached while text is held

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        if self._prefix_text is None:
            self._prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        prefix_text = self._prefix_text
        full = self._tok.decode(self._ids[self._prefix:])
        if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
            new = full[len(prefix_text):]
            self._prefix = self._read
            self._read = len(self._ids)
            self._prefix_text = None
            self._compact()
            return new
        return ""

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        self._prefix_text = None
        return full[len(prefix_text):]

    def _compact(self) -> None:
        # Keep the list short: drop ids before the window.
        if self._prefix > 64:
            self._ids = self._ids[self._prefix:]
            self._read -= self._prefix
            self._prefix = 0
