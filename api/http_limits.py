"""Limits on reading a request's head (request line and headers) that uvicorn's httptools protocol lacks.

uvicorn bounds neither the size of a request head under httptools (its ``h11_max_incomplete_event_size`` applies
to the slower pure-Python h11 protocol only) nor the time a client may take to send it (``timeout_keep_alive``
starts after a response, so a new connection that trickles one header line a second is held forever; a 64 MB
``Authorization`` header is read in full). ``limited_http_protocol`` is httptools' protocol with both limits:

* a head larger than ``max_header_bytes`` is answered ``431`` and the connection closed, as soon as that many
  bytes arrived without the end of the head (one socket read past the limit at most: asyncio reads up to
  256 KiB at a time);
* a head not complete ``header_timeout_s`` after the connection opened (or, on a kept-alive connection, after
  the next request's first byte) is answered ``408`` and the connection closed.

Bodies are not covered: the app reads them (``BodySizeLimitMiddleware``) without blocking the event loop.
uvicorn takes the class through its ``http`` option, its documented way to plug in a protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.config import Settings


class HeadLimitedProtocol(HttpToolsProtocol):
    """httptools' HTTP/1.1 protocol, refusing request heads that are too large or too slow.

    The limits are class attributes: ``limited_http_protocol`` makes a subclass per server with its settings.
    """

    max_header_bytes = 65_536
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Counted after parsing: a read that completes the head (and carries a body) is not held against it.
        if self._reading_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large",
                             f"request line and headers larger than {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._reading_head:  # the next request on a kept-alive connection
            self._start_head()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def _start_head(self) -> None:
        self._reading_head = True
        self._head_bytes = 0
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._reading_head and not self.transport.is_closing():
            self._refuse(408, "Request Timeout", f"request headers not received within {self.header_timeout_s:g} s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer with a plain-text error and close: nothing of the request reached the app."""
        self.logger.warning("refused a request from %s: %s", self.client, message)
        body = message.encode("ascii")
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self._stop_head_timer()
        self._reading_head = False
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()


def limited_http_protocol(settings: Settings) -> type[HeadLimitedProtocol]:
    """``HeadLimitedProtocol`` with the limits of ``settings`` (for uvicorn's ``http`` option)."""
    return type("HeadLimitedProtocol", (HeadLimitedProtocol,), {
        "max_header_bytes": settings.max_header_bytes, "header_timeout_s": settings.header_timeout_s,
    })


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn options every tokenspool API server runs with (``run_api`` and the tests' servers)."""
    return {"http": limited_http_protocol(settings)}
