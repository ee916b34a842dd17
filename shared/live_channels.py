"""Every live job stream of a process over one Redis pub/sub connection.

A connection per open stream costs a Redis connection and, on a busy machine, a wake-up of the API per stream
per engine step (the worker publishes one message per job per step). One connection per process turns that
into one socket read per step, whose messages are handed to the streams' queues. It opens with the first
listener and closes with the last, so nothing outlives the streams that use it.

Delivery is best effort, as pub/sub is: a message published while the connection reconnects is lost, and
readers find such gaps through the events' sequence numbers and the job's replay log (``shared/queue.py``). When
the connection fails, every listener's ``get`` raises the error once; the reader listens again.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 10.0
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Connection:
    """One pub/sub connection, its reader task, and who listens to which channel."""

    def __init__(self, pubsub: PubSub) -> None:
        self.pubsub = pubsub
        self.listeners: dict[str, set[asyncio.Queue[Any]]] = {}
        self.confirmations: dict[str, asyncio.Future[None]] = {}
        self.reader: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    async def read(self) -> None:
        """Hand every message to its channel's listeners; confirm subscriptions; on failure, tell everyone."""
        try:
            while True:
                msg = await self.pubsub.get_message(timeout=None)
                if msg is None:
                    continue
                kind, channel = _text(msg["type"]), _text(msg["channel"])
                if kind == "message":
                    for queue in self.listeners.get(channel, ()):
                        queue.put_nowait(msg["data"])
                elif kind == "subscribe":
                    confirmed = self.confirmations.pop(channel, None)
                    if confirmed is not None and not confirmed.done():
                        confirmed.set_result(None)
        except TRANSIENT_ERRORS as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        for confirmed in self.confirmations.values():
            if not confirmed.done():
                confirmed.set_exception(exc)
                confirmed.exception()  # retrieved here: a subscriber that gave up must not leave it unlogged
        for queues in self.listeners.values():
            for queue in queues:
                queue.put_nowait(exc)


class Listener:
    """One stream's view of a channel: messages published after ``LiveChannels.listen`` returned."""

    def __init__(self, hub: LiveChannels, connection: _Connection, channel: str) -> None:
        self._hub = hub
        self._connection = connection
        self.channel = channel
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    async def get(self, timeout: float) -> Any | None:
        """The next message's data, or None after ``timeout`` seconds without one; raises the connection's error
        (a Redis outage) once it failed."""
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        await self._hub.unlisten(self._connection, self)


class LiveChannels:
    """The process's shared subscriber. ``listen`` returns once Redis confirmed the subscription, so nothing
    published afterwards is missed (while the connection holds)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._connection: _Connection | None = None
        self._lock = asyncio.Lock()  # subscribe, unsubscribe, open and close happen one at a time

    async def listen(self, channel: str) -> Listener:
        async with self._lock:
            connection = self._connection
            if connection is None or connection.error is not None:
                connection = self._connection = _Connection(self._redis.pubsub())
            listener = Listener(self, connection, channel)
            queues = connection.listeners.setdefault(channel, set())
            queues.add(listener.queue)
            confirmed = connection.confirmations.get(channel)
            try:
                if len(queues) == 1:
                    confirmed = connection.confirmations[channel] = asyncio.get_running_loop().create_future()
                    await connection.pubsub.subscribe(channel)
                    if connection.reader is None:
                        connection.reader = asyncio.create_task(connection.read(), name="live-channels")
            except BaseException as exc:
                if isinstance(exc, TRANSIENT_ERRORS):
                    connection.fail(exc)
                await self._drop(connection, listener)
                raise
        try:
            if confirmed is not None:
                await asyncio.wait_for(asyncio.shield(confirmed), SUBSCRIBE_TIMEOUT_S)
        except BaseException:
            await self.unlisten(connection, listener)
            raise
        if connection.error is not None:
            await self.unlisten(connection, listener)
            raise connection.error
        return listener

    async def unlisten(self, connection: _Connection, listener: Listener) -> None:
        async with self._lock:
            await self._drop(connection, listener)

    async def _drop(self, connection: _Connection, listener: Listener) -> None:
        """Remove a listener (lock held): unsubscribe its channel if it was the last, close the connection if
        nobody listens any more or it failed."""
        queues = connection.listeners.get(listener.channel)
        if queues is not None and listener.queue in queues:
            queues.discard(listener.queue)
            if not queues:
                del connection.listeners[listener.channel]
                if connection.error is None and connection.listeners:
                    with suppress(*TRANSIENT_ERRORS):
                        await connection.pubsub.unsubscribe(listener.channel)
        if connection.listeners and connection.error is None:
            return
        if connection is self._connection and not connection.listeners:
            self._connection = None
        if not connection.listeners:
            await self._close(connection)

    @staticmethod
    async def _close(connection: _Connection) -> None:
        if connection.reader is not None:
            connection.reader.cancel()
            with suppress(asyncio.CancelledError, *TRANSIENT_ERRORS):
                await connection.reader
            connection.reader = None
        with suppress(*TRANSIENT_ERRORS):
            # Bounded: closing a connection whose reader was just cancelled can wait on a lock forever.
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S / 5):
                await connection.pubsub.aclose()  # type: ignore[no-untyped-call]
