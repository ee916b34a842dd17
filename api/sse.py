"""Server-sent events: framing, and a response that notices a client leaving.

``EventStreamResponse`` differs from Starlette's ``StreamingResponse`` in two ways that the streaming endpoints
rely on: it always listens for ``http.disconnect`` (Starlette stops listening under ASGI spec 2.4 and only
notices at the next failed write, which for a queued job may be minutes away) and then calls ``on_disconnect``
(which cancels the job); and it writes a ``: ping`` comment when nothing was sent for ``ping_interval_s``, so
proxies do not cut a stream that is waiting in the queue.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

PING = b": ping\n\n"
# The last thing a resumable stream sends when it ends without its terminal event (Redis stayed away).
STREAM_LOST = b": the event stream lost Redis; reconnect with Last-Event-ID\n\n"


def format_event(data: str | Mapping[str, Any], *, event: str | None = None, id: int | str | None = None) -> bytes:
    """One SSE event. ``data`` that is not a string is JSON-encoded on one line (JSON never holds raw newlines)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in text.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


async def wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    """Return once the client has gone (ASGI ``http.disconnect``); other messages are ignored."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """A ``text/event-stream`` response fed by an async iterator of ready-framed bytes."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
        ping_interval_s: float = 15.0,
        headers: Mapping[str, str] | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        self.body_iterator = content
        self.on_disconnect = on_disconnect
        self.ping_interval_s = ping_interval_s
        self.status_code = 200
        self.background = background
        # No caching, and tell nginx-style proxies not to buffer the stream.
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        chunks_in, chunks_out = anyio.create_memory_object_stream[bytes](max_buffer_size=64)

        async def pump() -> None:
            async with chunks_in:
                async for chunk in self.body_iterator:
                    await chunks_in.send(chunk)

        async def write() -> None:
            nonlocal disconnected
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async with chunks_out:
                    while True:
                        chunk = PING
                        with anyio.move_on_after(self.ping_interval_s):
                            try:
                                chunk = await chunks_out.receive()
                            except anyio.EndOfStream:
                                break
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the server reports a closed connection on write (ASGI spec 2.4)
                disconnected = True
            task_group.cancel_scope.cancel()

        async def listen() -> None:
            nonlocal disconnected
            await wait_for_disconnect(receive)
            disconnected = True
            task_group.cancel_scope.cancel()

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(pump)
            task_group.start_soon(write)
            task_group.start_soon(listen)

        with anyio.CancelScope(shield=True):
            # The pump may have been cancelled between two chunks, with the generator suspended at a yield:
            # close it so its cleanup (unsubscribing from Redis) runs now, not at garbage collection.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if disconnected and self.on_disconnect is not None:
                await self.on_disconnect()
        if self.background is not None and not disconnected:
            await self.background()
