"""Pure ASGI middleware: the request body size limit and request metrics.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched and a client disconnect
reaches the endpoint as it would without middleware.
"""

from __future__ import annotations

import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from api.metrics import ApiMetrics


class BodySizeLimitMiddleware:
    """Answer 413 for a body larger than ``max_body_bytes``.

    A declared ``Content-Length`` over the limit is refused before the body is read. A chunked body is counted
    as it arrives and refused when it crosses the limit (raised inside the endpoint's body read, which the app's
    HTTPException handler turns into the OpenAI error body), so the server never buffers more than the limit.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.path_limits = path_limits or {}  # exact path -> its own limit (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_body_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            response = error_response(413, self._message(limit), code="request_too_large")
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, self._message(limit))
            return message

        await self.app(scope, limited_receive, send)

    def _message(self, limit: int) -> str:
        return f"request body larger than the limit of {limit} bytes"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class MetricsMiddleware:
    """Count requests and time them to the last byte, labelled by route template (not raw path)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            # Unmatched paths share one label so random URLs cannot blow up the metric's cardinality.
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(scope["method"], template, status, time.perf_counter() - start)
