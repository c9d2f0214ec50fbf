"""Chat templates render exactly as transformers' apply_chat_template (text and ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tiny import create_tiny
from engine.tokenizer import ChatTemplateError, Tokenizer

# An original template that exercises what Hub templates use: bos_token, namespace, loop controls,
# tojson with options, raise_exception, strftime_now, {% generation %}, tools, extra kwargs, whitespace
# control (trim_blocks / lstrip_blocks).
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='', count=0) %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
{%- endfor %}
{%- if ns.system %}<|im_start|>system
{{ ns.system }}{% if tools %}

Tools: {{ tools | tojson(indent=2, sort_keys=True) }}{% endif %}<|im_end|>
{% endif %}
{%- for m in messages if m['role'] != 'system' %}
    {%- if m['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role: ' + m['role']) }}
    {%- endif %}
<|im_start|>{{ m['role'] }}
    {%- if m['role'] == 'assistant' %}
{% generation %}{{ m['content'] | trim }}{% endgeneration %}
    {%- else %}
{{ m['content'] }}
    {%- endif %}
    {%- if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}
<|im_end|>
    {%- if loop.last and ns.count > 1 %}{# {{ count }} #}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
{%- if strftime_now('%Y') | length != 4 %}{{ raise_exception('bad year') }}{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "  4  "}, {"role": "user", "content": "ünïcödé 🙂 你好"}],
    [{"role": "user", "content": "call", "tool_calls": None},
     {"role": "assistant", "content": "ok", "tool_calls": [{"name": "f", "arguments": {"x": "<&>"}}]}],
]
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.thinking is defined %}[{{ m.thinking }}]{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
REASONING_CHATS = [
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "because"}],
    [{"role": "assistant", "content": "a", "thinking": "t1"}],
    [{"role": "assistant", "content": "a", "reasoning_content": "r", "thinking": None}],
]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"b": 1, "a": "é"}}}]


def _write(tmp: Path, template: str, bos: str | None) -> Path:
    tiny = create_tiny(tmp / "src")
    d = tmp / "ck"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    cfg["bos_token"] = bos
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _hf(d: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("template", ["tiny", "rich"])
def test_matches_transformers(tmp_path: Path, template: str) -> None:
    if template == "tiny":
        d = create_tiny(tmp_path / "tiny")
    else:
        d = _write(tmp_path, RICH_TEMPLATE, "<|endoftext|>")
    hf = _hf(d)
    tok = Tokenizer.load(d)
    for conv in CONVERSATIONS:
        for gen in (True, False):
            for extra in ({}, {"enable_thinking": False}, {"tools": TOOLS}):
                want_text = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False, **extra)
                got_text = tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False, **extra)
                assert got_text == want_text
                want_ids = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True,
                                                  return_dict=False, **extra)
                assert tok.apply_chat_template(conv, add_generation_prompt=gen, **extra) == list(want_ids)


def test_generation_prompt_and_special_tokens_are_single_ids(tmp_path: Path) -> None:
    tok = Tokenizer.load(create_tiny(tmp_path))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(ids, list)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids.count(tok.token_to_id("<|im_end|>")) == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert not str(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False,
                                           tokenize=False)).endswith("assistant\n")


def test_raise_exception_is_a_chat_template_error(tmp_path: Path) -> None:
    tok = Tokenizer.load(_write(tmp_path, RICH_TEMPLATE, None))
    with pytest.raises(ChatTemplateError, match="unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_no_template_empty_chat_and_sandbox(tmp_path: Path) -> None:
    d = _write(tmp_path, "{{ ''.__class__.__mro__ }}", None)
    tok = Tokenizer.load(d)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.load(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_and_named_templates(tmp_path: Path) -> None:
    d = _write(tmp_path, "unused", None)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"},
                            {"name": "default", "template": "D{{ 1 }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.load(d).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "D1"
    (d / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert Tokenizer.load(d).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "Jx"


def test_reasoning_fields_match_transformers(tmp_path: Path) -> None:
    d = _write(tmp_path, REASONING_TEMPLATE, None)
    hf = _hf(d)
    tok = Tokenizer.load(d)
    for conv in REASONING_CHATS:
        want = hf.apply_chat_template(conv, tokenize=False)
        assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False) == want
