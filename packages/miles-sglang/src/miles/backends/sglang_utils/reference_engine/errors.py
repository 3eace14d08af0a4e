"""Why the reference engine refuses a request, as exceptions every layer below HTTP can raise.

Plain Python on purpose (no FastAPI, no torch): request parsing, sampling and the weight manager
raise them, and `server.py` maps each to its HTTP status (400, 413, 503).
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; the server answers 400 with this message, naming `param`
    (the field's dotted path) when one field is to blame."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLargeError(InvalidRequestError):
    """A body over --max-request-bytes: refused unread (413)."""


class QueueFullError(RuntimeError):
    """More requests wait than --max-queued-requests: refused, to be retried (503)."""
