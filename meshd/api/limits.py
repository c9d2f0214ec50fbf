"""Limits of the API's request schema (structured outputs, tools, sampling extensions)."""

from __future__ import annotations

API_MAX_TOOLS = 128  # functions in one request's ``tools`` (OpenAI's limit)
API_MAX_LOGIT_BIAS = 1024  # entries in ``logit_bias``: each is a scatter into the [V] logits every step
API_MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| (OpenAI: -100..100; +-100 bans or forces a token)
API_MAX_REPETITION_PENALTY = 10.0  # above this every seen token is effectively banned
API_MAX_FUNCTION_NAME = 64  # characters of a function or response_format name (OpenAI: a-zA-Z0-9_-, 64)
