"""OpenAI-shaped error bodies, and which status each formcast error answers with.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``
with the status the ``openai`` client maps to its exception classes (400
BadRequestError, 401 AuthenticationError, 404 NotFoundError, 422
UnprocessableEntityError, 429 RateLimitError, 500 InternalServerError).
"""

from __future__ import annotations

from typing import Any

from formcast.errors import (ConstraintError, FormcastError, OutputValidationError,
                             QueueFullError, RequestError)


class ApiError(Exception):
    """An error answered as an OpenAI error body.

    Parameters
    ----------
    status : int
        HTTP status.
    message : str
    type : str
        OpenAI's error type ("invalid_request_error", "authentication_error", ...).
    param, code : str | None
        The offending request field; a machine-readable code.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# The engine's message for a request whose constraint left no token to sample.
_DEAD_END = "(dead end)"


def aborted_error(reason: str | None) -> ApiError:
    """The :class:`ApiError` of a request the engine ended on its own.

    Parameters
    ----------
    reason : str or None
        The engine's ``RequestOutput.error``.

    Returns
    -------
    ApiError
        422 ``constraint_dead_end`` when the constraint allowed no token to go on
        with (the schema admits nothing the model could finish; a 4xx, so that
        clients do not retry it), else 500 ``generation_failed``.
    """
    if reason and _DEAD_END in reason:
        return ApiError(422, f"the constraint reached a dead end: {reason}",
                        param="response_format", code="constraint_dead_end")
    return ApiError(500, f"generation failed: {reason or 'aborted'}", type="server_error",
                    code="generation_failed")


def api_error(exc: BaseException) -> ApiError:
    """The :class:`ApiError` a formcast (or other) exception answers with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ConstraintError):
        return ApiError(400, str(exc), param="response_format", code="invalid_constraint")
    if isinstance(exc, RequestError):
        code = "context_length_exceeded" if "context" in str(exc) else None
        return ApiError(400, str(exc), code=code)
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, OutputValidationError):
        return ApiError(500, str(exc), type="server_error", code="output_validation_failed")
    if isinstance(exc, (ValueError, TypeError)):  # arguments formcast's layers refused
        return ApiError(400, str(exc))
    if isinstance(exc, FormcastError):
        return ApiError(500, str(exc), type="server_error", code="generation_failed")
    return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
