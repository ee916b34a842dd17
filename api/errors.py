"""Errors in the OpenAI error body, everywhere: ``{"error": {"message", "type", "param", "code"}}``.

Every client of an OpenAI-compatible server already knows how to read this shape (the official SDKs turn it
into typed exceptions), so the job endpoints use it too. Bad input is always a 4xx: FastAPI's 422 for
validation errors becomes a 400, and no exception raised by parsing a request escapes as a 500.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# The ``type`` field by status code, for errors raised without an explicit type.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with the OpenAI error body; raise it anywhere in a request."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status_code, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for input that parsed but is not acceptable (caps, limits, unknown combinations)."""
    return APIError(400, message, param=param, code=code)


def job_not_found(job_id: str) -> APIError:
    """A 404 for a job that does not exist *or belongs to another API key* (the two look the same)."""
    return APIError(404, f"job {job_id!r} not found", param="job_id", code="job_not_found")


def error_body(status_code: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body as a dict (also sent as an SSE ``data:`` when a stream fails)."""
    return {
        "error": {
            "message": message,
            "type": type or _TYPE_BY_STATUS.get(status_code, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(status_code: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, type, param, code), status_code=status_code,
                        headers=headers)


def _describe_validation_error(errors: list[Any]) -> tuple[str, str | None]:
    """One readable message and the offending parameter from pydantic's error list."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    # FastAPI prefixes body fields with "body"; tagged unions add the tag name. Neither helps a client.
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status_code, exc.message, type=exc.type, param=exc.param, code=exc.code,
                          headers=exc.headers)


def invalid_input(exc: ValidationError) -> APIError:
    """A 400 for client input that failed a wire model's validators (GenerationParams, JobSubmission).

    Only for models built from request fields: a ValidationError anywhere else is our bug, and stays a 500.
    """
    message, param = _describe_validation_error(list(exc.errors()))
    return invalid_request(message, param=param, code="invalid_value")


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _describe_validation_error(list(exc.errors()))
    return error_response(400, message, param=param, code="invalid_value")


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    try:
        default = HTTPStatus(exc.status_code).phrase
    except ValueError:
        default = "error"
    message = exc.detail if isinstance(exc.detail, str) else default
    return error_response(exc.status_code, message, headers=dict(exc.headers or {}))


async def _redis_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # Not the client's fault and usually brief (a failover, a restart): a retryable 503, not a 500.
    log.warning("redis error on %s %s: %s", request.method, request.url.path, exc)
    return error_response(503, "the job queue is unavailable; retry shortly", code="queue_unavailable",
                          headers={"Retry-After": "1"})


async def _unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal server error", type="server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to the OpenAI error body."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(RedisError, _redis_error_handler)
    app.add_exception_handler(Exception, _unhandled_error_handler)
