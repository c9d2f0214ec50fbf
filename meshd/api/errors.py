"""OpenAI-shaped API errors: ``{"error": {"message", "type", "param", "code"}}`` with the SPEC's status codes."""

from __future__ import annotations

import json
from typing import Any

# status -> (OpenAI error type, default code)
_DEFAULTS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    408: ("invalid_request_error", "request_timeout"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "overloaded"),
    500: ("api_error", "internal_error"),
    502: ("api_error", "upstream_failed"),
    503: ("api_error", "model_unavailable"),
    504: ("api_error", "upstream_timeout"),
}


class ApiError(Exception):
    """A request that ends with an OpenAI-shaped error. ``retry_after_s`` adds a Retry-After header."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        type_: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        default_type, default_code = _DEFAULTS.get(status, ("api_error", "error"))
        self.status = status
        self.message = message
        self.type = type_ or default_type
        self.code = code or default_code
        self.param = param
        self.retry_after_s = retry_after_s

    def payload(self) -> dict[str, Any]:
        # OpenAI's shape: "param" is always present, null when no single field is at fault.
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": err}

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.retry_after_s is not None:
            h["Retry-After"] = str(self.retry_after_s)
        return h

    def sse_event(self) -> bytes:
        """The error as one SSE event, sent when a stream fails after it started."""
        return b"data: " + self.body() + b"\n\n"

    @classmethod
    def from_payload(cls, status: int, payload: Any) -> ApiError:
        """Rebuild an error from an OpenAI-shaped body (from a tunnel peer or an external server)."""
        err = payload.get("error") if isinstance(payload, dict) else None
        if not isinstance(err, dict):
            return cls(status, f"upstream answered {status}")
        message = err.get("message")
        code = err.get("code")
        type_ = err.get("type")
        param = err.get("param")
        return cls(
            status,
            message if isinstance(message, str) else f"upstream answered {status}",
            code=code if isinstance(code, str) else None,
            type_=type_ if isinstance(type_, str) else None,
            param=param if isinstance(param, str) else None,
        )
