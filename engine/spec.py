"""Model SPEC parsing (SPEC.md): ``PATH``, ``tiny``, or ``openai:URL``, with an optional ``NAME=`` prefix.

``parse_model_spec(text) -> ModelSpec`` raises ``ValueError`` with a one-line reason. It only parses: it
does not touch the file system or the network (``PATH`` existence is checked when loading; the
``openai:`` backend lives in the API layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from engine.limits import MAX_MODEL_SPEC_CHARS

MAX_SPEC_CHARS = MAX_MODEL_SPEC_CHARS
# Served names: what OpenAI clients put in "model". No leading '/', '.', '~' so a path is never a name.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")

Kind = Literal["path", "tiny", "openai"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A parsed model SPEC. ``name`` is the served name (None for ``openai:``: discovered later)."""

    kind: Kind
    name: str | None
    path: Path | None = None
    url: str | None = None
    explicit_name: bool = False


def _split_name(text: str) -> tuple[str | None, str]:
    if "=" not in text or text.startswith("openai:"):
        return None, text
    head, rest = text.split("=", 1)
    if _NAME_RE.fullmatch(head):
        return head, rest
    return None, text


def parse_model_spec(text: str) -> ModelSpec:
    """Parse one ``--model`` SPEC. Raises ``ValueError`` for an empty/oversized spec or a bad URL/name."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("model spec is empty (expected PATH, tiny, or openai:URL, optionally NAME=...)")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"model spec is longer than {MAX_SPEC_CHARS} characters")
    if "\x00" in text or "\n" in text:
        raise ValueError("model spec contains control characters")
    name, body = _split_name(text.strip())
    if not body:
        raise ValueError(f"model spec {text!r} names a model but gives no PATH, tiny or openai:URL")
    if body == "tiny":
        return ModelSpec("tiny", name or "tiny", explicit_name=name is not None)
    if body.startswith("openai:"):
        url = body[len("openai:"):].rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"openai: spec needs an http(s) URL such as openai:http://127.0.0.1:8080/v1, "
                             f"got {url!r}")
        try:
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            raise ValueError(f"openai: URL {url!r} has an invalid port") from None
        if parts.username or parts.password:
            raise ValueError("openai: URL must not carry credentials (use the API key file)")
        return ModelSpec("openai", name, url=url, explicit_name=name is not None)
    path = Path(body).expanduser()
    default = path.resolve().name if str(path) not in ("", ".") else Path.cwd().name
    if default.endswith(".gguf"):  # served name of a GGUF: its file name without the split suffix and .gguf
        default = re.sub(r"-\d{5}-of-\d{5}$", "", default[: -len(".gguf")])
    return ModelSpec("path", name or default or "model", path=path, explicit_name=name is not None)


def resolve_checkpoint(spec: ModelSpec, state_dir: str | Path) -> Path:
    """The checkpoint directory (or ``.gguf`` file) for a ``path`` or ``tiny`` spec (creating tiny under
    ``state_dir``).

    Raises ``ValueError`` if the path is neither a directory nor a ``.gguf`` file, or the spec is ``openai:``.
    """
    if spec.kind == "tiny":
        from engine.tiny import ensure_tiny

        return ensure_tiny(state_dir)
    if spec.kind == "openai" or spec.path is None:
        raise ValueError("an openai: model is served by its own server, not loaded in this process")
    if not spec.path.exists():
        raise ValueError(f"model path {spec.path} does not exist")
    if spec.path.is_file() and spec.path.suffix == ".gguf":
        return spec.path
    if not spec.path.is_dir():
        raise ValueError(f"model path {spec.path} is not a directory or a .gguf file (expected a checkpoint "
                         f"directory or a GGUF)")
    return spec.path
