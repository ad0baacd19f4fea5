"""Errors → HTTP: one table keyed by class, resolved along the MRO, and OpenAI's error body.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

| error                                        | status | type                  | code                    |
|----------------------------------------------|--------|-----------------------|-------------------------|
| PromptTooLongError                           | 400    | invalid_request_error | context_length_exceeded |
| InvalidArgumentError (ChatTemplateError ...) | 400    | invalid_request_error |                         |
| InvalidSpecError, InvalidConfigError         | 400    | invalid_request_error |                         |
| TokenizerError, TraceFormatError             | 400    | invalid_request_error |                         |
| PoolTooSmallError (at admission)             | 400    | invalid_request_error | pool_too_small          |
| ModelNotFoundError                           | 404    | invalid_request_error | model_not_found         |
| UnknownRequestError                          | 404    | invalid_request_error |                         |
| DuplicateRequestError                        | 409    | invalid_request_error |                         |
| other RequestError                           | 400    | invalid_request_error |                         |
| ServiceUnavailableError                      | 503    | server_overloaded     | (and ``Retry-After``)   |
| RateLimitError                               | 429    | requests / tokens     | rate_limit_exceeded     |
| EngineFailedError, InvariantViolation, other | 500    | server_error          | (logged, no detail)     |

A full pool is not an error (requests wait). Config and weight errors end start-up
(exit 2); they reach this table only if raised per request. A 500 never carries the
exception's text or a traceback.
"""

from __future__ import annotations

import logging

from hybridkv import errors as E

__all__ = ["ERROR_TABLE", "ErrorResponse", "error_body", "to_response"]

log = logging.getLogger("hybridkv.server")

#: class -> (HTTP status, OpenAI error type, code)
ERROR_TABLE: dict[type[BaseException], tuple[int, str, str | None]] = {
    E.PromptTooLongError: (400, "invalid_request_error", "context_length_exceeded"),
    E.InvalidArgumentError: (400, "invalid_request_error", None),
    E.InvalidSpecError: (400, "invalid_request_error", None),
    E.InvalidConfigError: (400, "invalid_request_error", None),
    E.TokenizerError: (400, "invalid_request_error", None),
    E.TraceFormatError: (400, "invalid_request_error", None),
    E.WeightLoadError: (400, "invalid_request_error", None),
    E.PoolTooSmallError: (400, "invalid_request_error", "pool_too_small"),
    E.ModelNotFoundError: (404, "invalid_request_error", "model_not_found"),
    E.UnknownRequestError: (404, "invalid_request_error", None),
    E.DuplicateRequestError: (409, "invalid_request_error", None),
    E.RequestFreedError: (409, "invalid_request_error", None),
    E.StaleHitError: (409, "invalid_request_error", None),
    E.RequestError: (400, "invalid_request_error", None),
    E.ServiceUnavailableError: (503, "server_overloaded", None),
    E.RateLimitError: (429, "requests", "rate_limit_exceeded"),  # type: the error's ``limit``
    E.InvariantViolation: (500, "server_error", None),
    E.EngineFailedError: (500, "server_error", None),
}


class ErrorResponse:
    """A status, OpenAI's error body and extra headers (``Retry-After``), framework-free."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def to_response(exc: BaseException) -> ErrorResponse:
    """The response for ``exc`` (see the module docstring)."""
    for cls in type(exc).__mro__:
        hit = ERROR_TABLE.get(cls)
        if hit is not None:
            status, type_, code = hit
            break
    else:
        status, type_, code = 500, "server_error", None
    if status >= 500 and not isinstance(exc, E.ServiceUnavailableError):
        log.error("internal error answering a request", exc_info=exc)
        return ErrorResponse(status, error_body("internal server error", type_, None, code))
    headers = {}
    if isinstance(exc, (E.ServiceUnavailableError, E.RateLimitError)):
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, E.RateLimitError):
        type_ = exc.limit
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return ErrorResponse(status, error_body(message, type_, getattr(exc, "param", None), code), headers)
