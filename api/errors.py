"""Errors in the OpenAI error body, everywhere: ``{"error": {"message", "type", "param", "code"}}``.

Every client of an OpenAI-compatible server already knows how to read this shape (the official SDKs turn it
into typed exceptions), so the job endpoints use it too. Bad input is always a 4xx: FastAPI's 422 for
validation errors becomes a 400, and no exception raised by parsing a request escapes as a 500.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
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


# With curl: what a client must add to send JSON (named in the messages about the body itself).
_JSON_HINT = "send a JSON object with the header 'content-type: application/json' (curl: -H 'content-type: " \
             "application/json' -d '{\"prompt\": \"Hello\", \"max_tokens\": 16}')"
_SCALARS = (int, float, bool)


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: ``an array``, ``null``, ..."""
    if value is None:
        return "null"
    kinds = ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _param_of(error: Mapping[str, Any]) -> str | None:
    """The offending parameter: the error's location without FastAPI's prefixes."""
    loc = [str(part) for part in error.get("loc", ()) if part not in ("body", "query", "path", "header")]
    return ".".join(loc) or None


def _got(value: Any) -> str:
    """`` (got 5)`` for a short scalar input; nothing for text, lists and objects (a prompt is not echoed)."""
    if isinstance(value, _SCALARS) or (isinstance(value, str) and len(value) <= 40 and "\n" not in value):
        return f" (got {json.dumps(value)})"  # as the client wrote it: true, "text", 1.5
    return ""


def _describe_one(error: Mapping[str, Any], content_type: str | None) -> tuple[str, str | None, str]:
    """(message, param, code) for one pydantic error, worded as OpenAI's errors are: what is wrong, where,
    and how to fix it."""
    kind = str(error.get("type", ""))
    param = _param_of(error)
    msg = str(error.get("msg", "invalid value"))
    ctx = error.get("ctx") or {}
    if param is None and ctx.get("param"):  # a check across fields names its parameter (and code) in ctx
        return msg, str(ctx["param"]), str(ctx.get("code", "invalid_value"))
    if kind == "json_invalid":
        # loc is ("body", <character offset>): an offset, not a parameter.
        detail = ctx.get("error", "JSON decode error")
        where = error["loc"][-1] if len(error.get("loc", ())) > 1 else "?"
        return f"The request body is not valid JSON ({detail} at character {where}); {_JSON_HINT}.", None, \
            "invalid_json"
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        if content_type is None or "json" not in content_type.lower():
            got = f"content-type {content_type!r}" if content_type else "no content-type"
            return f"The request body must be JSON, but the request has {got}; {_JSON_HINT}.", None, \
                "invalid_content_type"
        return f"The request body must be a JSON object, got {_json_kind(error.get('input'))}; {_JSON_HINT}.", \
            None, "invalid_json"
    if kind == "missing" and param is None:
        return f"The request has no body; {_JSON_HINT}.", None, "missing_body"
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: '{param}'; remove it or check its spelling.", param, \
            "unknown_parameter"
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if param is None:
        return msg[:1].upper() + msg[1:], None, "invalid_value"
    return f"Invalid value for '{param}': {msg}{_got(error.get('input'))}.", param, "invalid_value"


def _describe_validation_error(errors: Sequence[Mapping[str, Any]], content_type: str | None = None
                               ) -> tuple[str, str | None, str]:
    """One readable message, the offending parameter and a code from pydantic's error list (the first
    error; the count of the others is appended)."""
    if not errors:
        return "Invalid request.", None, "invalid_value"
    message, param, code = _describe_one(errors[0], content_type)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param, code


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status_code, exc.message, type=exc.type, param=exc.param, code=exc.code,
                          headers=exc.headers)


def invalid_input(exc: ValidationError) -> APIError:
    """A 400 for client input that failed a wire model's validators (GenerationParams, JobSubmission).

    Only for models built from request fields: a ValidationError anywhere else is our bug, and stays a 500.
    """
    message, param, code = _describe_validation_error(exc.errors())
    return invalid_request(message, param=param, code=code)


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param, code = _describe_validation_error(exc.errors(), request.headers.get("content-type"))
    return error_response(400, message, param=param, code=code)


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
