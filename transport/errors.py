"""Exceptions raised by the transport's public API (``transport.quic``)."""

from __future__ import annotations


class TransportError(Exception):
    """A connection or stream failed (unreachable, closed, timed out). ``str(e)`` is the reason."""


class HandshakeRefused(TransportError):
    """The peer (or we) refused the handshake: not a member, banned, pinned key mismatch, timeout."""

    def __init__(self, reason: str, code: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class JoinRefused(TransportError):
    """Raised by a join handler to refuse a joiner; ``redeem()`` raises it on the joiner with the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StreamReset(TransportError):
    """The peer reset the stream (cancelled a request, or its handler failed). ``code`` says why."""

    def __init__(self, code: int, reason: str = "stream reset by peer") -> None:
        super().__init__(f"{reason} (code {code})")
        self.code = code


class RemoteError(TransportError):
    """An RPC handler on the peer answered with an error (``RpcError`` there, or a failure)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class RpcError(Exception):
    """Raise in an ``on_rpc`` handler to answer with this code and reason (sent to the requester)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
