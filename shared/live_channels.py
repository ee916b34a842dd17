"""Live event channels of many jobs over one pub/sub connection per process (per node on a Redis Cluster).

Every open stream of a job needs that job's live channel. One connection per stream would cost a Redis connection
(and a file descriptor on both sides) per SSE client: 10,000 streams, 10,000 connections. Here one listener task
owns one ``PubSub`` connection, subscribes each channel once however many readers want it, and hands each
message to every reader of its channel through a small bounded buffer.

Pub/sub stays a fast path only: a reader whose buffer is full loses live messages (it sees a gap and reads the
job's log), and after a reconnect every reader gets ``RESYNC`` once its channel is subscribed again, so it
re-reads the log. A subscription is confirmed by Redis before ``subscribe`` returns, so a reader that replays the
log afterwards cannot miss an event published in between.

The channels are shard channels (SPUBLISH / SSUBSCRIBE): on a Redis Cluster a message stays on the nodes of its
channel's slot instead of being broadcast to every node; on a single node they behave as plain channels.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterPubSub
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.pubsub import BROKEN_CONNECTION_ERRORS, SUBSCRIBE_TIMEOUT_S, as_text, close_quietly
from shared.tasks import stop_tasks

log = logging.getLogger(__name__)

# Live messages buffered per reader; a reader further behind than this reads the log instead.
READER_BUFFER = 256
# On a Redis Cluster the listener polls the nodes' shard-channel connections this often when all are quiet.
CLUSTER_POLL_S = 0.005


class Resync:
    """The connection was re-established: live messages may have been lost, read the log."""


RESYNC: Final = Resync()


class LiveSubscription:
    """One reader's view of one channel: its messages (raw data) in order, ``RESYNC`` after a reconnect."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self._items: asyncio.Queue[Any] = asyncio.Queue(READER_BUFFER)

    def deliver(self, item: Any) -> None:
        """Buffer one item; a full buffer drops it (the reader finds the gap and reads the log)."""
        with suppress(asyncio.QueueFull):
            self._items.put_nowait(item)

    async def get(self, timeout_s: float) -> Any:
        """The next message's data, ``RESYNC``, or None after ``timeout_s`` without either."""
        try:
            return await asyncio.wait_for(self._items.get(), timeout_s)
        except TimeoutError:
            return None


@dataclass
class _Channel:
    """A subscribed channel: its readers, whether Redis confirmed the subscription, and whether its readers
    must be told to resync once it does (a resubscription after a reconnect)."""

    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    readers: set[LiveSubscription] = field(default_factory=set)
    resync: bool = False


class LiveChannels:
    """The process's one pub/sub connection for job live channels, and the task that reads it. The task starts
    with the first subscription and ends (closing the connection) once no channel has been wanted for
    ``idle_s``."""

    def __init__(self, redis: Redis, idle_s: float) -> None:
        self._redis = redis
        self._idle_s = idle_s
        self._channels: dict[str, _Channel] = {}
        self._pubsub: PubSub | None = None
        self._listener: asyncio.Task[None] | None = None
        self._wanted = asyncio.Event()  # set while the connection has channels to read
        # One command at a time: concurrent first commands would each open a connection (redis-py's PubSub
        # connects lazily), and an UNSUBSCRIBE must reach Redis before a later SUBSCRIBE of the same channel.
        self._send = asyncio.Lock()

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    async def aclose(self) -> None:
        """Stop the listener and close the connection (process shutdown); readers left fall back to the log."""
        if self._listener is not None:
            await stop_tasks([self._listener], SUBSCRIBE_TIMEOUT_S)

    async def subscribe(self, channel: str) -> LiveSubscription:
        """A new reader of ``channel``, returned once Redis has confirmed the subscription."""
        reader = LiveSubscription(channel)
        state = self._channels.get(channel)
        if state is None:
            state = self._channels[channel] = _Channel()
            try:
                async with self._send:
                    await self._send_subscribe(channel)
            except BaseException:
                self._forget(channel, state)
                raise
            self._wanted.set()
        state.readers.add(reader)
        try:
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await state.confirmed.wait()
        except TimeoutError:
            await self.release(reader)
            raise RedisTimeoutError(f"no confirmation of SSUBSCRIBE {channel} within {SUBSCRIBE_TIMEOUT_S} s") from None
        except BaseException:
            await self.release(reader)
            raise
        return reader

    async def release(self, reader: LiveSubscription) -> None:
        """The reader is done; the channel is unsubscribed when it was the last one."""
        state = self._channels.get(reader.channel)
        if state is None or reader not in state.readers:
            return
        state.readers.discard(reader)
        if state.readers:
            return
        self._forget(reader.channel, state)
        async with self._send:
            pubsub = self._pubsub
            # A connection Redis cut is being replaced by the listener with one subscribed to the wanted channels
            # only: unsubscribing on it would reconnect it from here, racing the listener's read.
            if pubsub is not None and not _dropped(pubsub) and reader.channel not in self._channels:
                with suppress(*BROKEN_CONNECTION_ERRORS):
                    await pubsub.sunsubscribe(reader.channel)

    async def _send_subscribe(self, channel: str) -> None:
        """SSUBSCRIBE ``channel`` (the caller holds ``_send``). Not on a connection Redis cut, nor again when it was
        cut during the command: that would reconnect it from here while the listener reads it; the listener's
        reconnect subscribes every wanted channel, this one too, and confirms it."""
        pubsub = self._connection()
        if not _dropped(pubsub):
            connected = pubsub.connection is not None
            try:
                await pubsub.ssubscribe(channel)
                return
            except BROKEN_CONNECTION_ERRORS:
                if not connected:  # a first connection that failed: Redis is down, say so now
                    raise
        self._wanted.set()  # an idle listener wakes, finds the connection dropped and reconnects

    def _forget(self, channel: str, state: _Channel) -> None:
        if self._channels.get(channel) is state and not state.readers:
            del self._channels[channel]

    def _connection(self) -> PubSub:
        """The pub/sub connection, and its listener task, started on first use."""
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub()
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen(), name="live-channels")
        return self._pubsub

    async def _listen(self) -> None:
        """Read the connection and dispatch; reconnect after an error; end after ``idle_s`` without channels."""
        try:
            while True:
                if not self._channels:
                    self._wanted.clear()
                    with suppress(TimeoutError):
                        async with asyncio.timeout(self._idle_s):
                            await self._wanted.wait()
                    if not self._channels:
                        return
                try:
                    await self._wanted.wait()
                    assert self._pubsub is not None
                    if _dropped(self._pubsub):  # cut under a command of another task: reconnect here, not there
                        raise RedisConnectionError("the live channels' connection was dropped")
                    message = await self._next_message(self._pubsub)
                    if message is not None:
                        self._dispatch(message)
                except BROKEN_CONNECTION_ERRORS as exc:
                    log.warning("live channels lost Redis (%s); resubscribing %d channels", exc, len(self._channels))
                    await self._reconnect()
        finally:
            pubsub, self._pubsub, self._listener = self._pubsub, None, None
            if pubsub is not None:
                await close_quietly(pubsub)

    async def _reconnect(self) -> None:
        """A new connection subscribed to every wanted channel; their readers resync once it is confirmed."""
        # Replaced before the old one is closed, so no other task sends on the old one meanwhile.
        broken, self._pubsub = self._pubsub, self._redis.pubsub()
        self._wanted.clear()
        for state in self._channels.values():
            state.confirmed.clear()
            state.resync = True
        if broken is not None:
            await close_quietly(broken)
        while self._channels:
            try:
                async with self._send:
                    await self._pubsub.ssubscribe(*self._channels)
                self._wanted.set()
                return
            except BROKEN_CONNECTION_ERRORS:
                await asyncio.sleep(self._idle_s / 4)

    async def _next_message(self, pubsub: PubSub) -> dict[str, Any] | None:
        """The next message or confirmation, from whichever node has one (a cluster's shard channels live on the
        nodes of their slots: one connection per node, read through ``get_sharded_message``)."""
        if isinstance(pubsub, ClusterPubSub):
            if not pubsub.node_pubsub_mapping:  # nothing subscribed yet on any node
                await asyncio.sleep(min(0.05, self._idle_s))
                return None
            # Non-blocking, then a short sleep: redis-py reads the nodes in turn, each for the whole timeout, so a
            # blocking read of a quiet node would hold back every other node's messages (seconds of lag).
            try:
                message: dict[str, Any] | None = await pubsub.get_sharded_message(timeout=0.0)
            except RuntimeError:
                # redis-py 8.1: a node's PubSub that a concurrent SSUBSCRIBE just added (or a SUNSUBSCRIBE just
                # closed) has no connection yet; nothing was read from it, so read again.
                message = None
            if message is None:
                await asyncio.sleep(CLUSTER_POLL_S)
        else:
            message = await pubsub.get_message(timeout=self._idle_s)
        return message

    def _dispatch(self, message: dict[str, Any]) -> None:
        state = self._channels.get(as_text(message["channel"]))
        if state is None:
            return
        kind = as_text(message["type"])
        if kind == "smessage":
            for reader in state.readers:
                reader.deliver(message["data"])
        elif kind == "ssubscribe":
            state.confirmed.set()
            if state.resync:
                state.resync = False
                for reader in state.readers:
                    reader.deliver(RESYNC)


def _dropped(pubsub: PubSub) -> bool:
    """A single node's pub/sub connection that was made and has since been dropped (redis-py reconnects it on the
    next command). A cluster's shard channels live on per-node connections, which redis-py manages itself."""
    connection: Connection | None = pubsub.connection  # typed None in redis-py 8.1
    return not isinstance(pubsub, ClusterPubSub) and connection is not None and not connection.is_connected
