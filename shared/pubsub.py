"""Redis pub/sub as tokenspool uses it: confirmed subscriptions, closing connections that may be broken, and a
channel listener that survives Redis restarts.

Pub/sub delivers at most once and only to connected subscribers, so every listener here pairs its channel with a
durable source it re-reads after a reconnect or a quiet interval (``resync``); what matters is never in pub/sub
alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ClusterError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 10.0
# Redis errors a stream or channel listener (and a worker's writes) ride out by reconnecting and retrying: a lost
# connection, and on a Redis Cluster the moments of a failover (no master for a slot yet, a slot moving).
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, ClusterError, TryAgainError, SlotNotCoveredError)
# What redis-py (8.1) may raise besides those when two tasks use one pub/sub connection that Redis just cut: a
# failed read drops the connection's writer, so a concurrent command finds it gone (AttributeError: 'NoneType'
# object has no attribute 'writelines'), and a command that reconnects reads the handshake while the listener
# reads too (RuntimeError: readuntil() called while another coroutine is already waiting). The connection is
# being replaced then: a listener reconnects, an unsubscribe or a close has nothing left to do.
BROKEN_CONNECTION_ERRORS = (*TRANSIENT_ERRORS, AttributeError, RuntimeError)


async def subscribe_confirmed(pubsub: PubSub, channels: Sequence[str]) -> None:
    """Subscribe and wait for Redis to confirm each channel, so nothing published afterwards can be missed."""
    await pubsub.subscribe(*channels)
    pending = set(channels)
    deadline = asyncio.get_running_loop().time() + SUBSCRIBE_TIMEOUT_S
    while pending and asyncio.get_running_loop().time() < deadline:
        msg = await pubsub.get_message(timeout=1.0)
        if msg is not None and as_text(msg["type"]) == "subscribe":
            pending.discard(as_text(msg["channel"]))
    if pending:
        raise RedisTimeoutError(f"no confirmation of SUBSCRIBE {', '.join(sorted(pending))} within "
                                f"{SUBSCRIBE_TIMEOUT_S} s")


async def close_quietly(pubsub: PubSub) -> None:
    """Close a pub/sub connection that may already be broken."""
    with suppress(*BROKEN_CONNECTION_ERRORS):
        # Bounded: closing a connection whose reader was just cancelled can wait on a lock forever.
        async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S / 5):
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed in redis 8.2


async def listen(redis: Redis, channels: Sequence[str], resync: Callable[[], Awaitable[list[str]]], name: str,
                 poll_s: float) -> AsyncGenerator[str, None]:
    """Messages of pub/sub channels (decoded), surviving Redis restarts: after each (re)subscription and each
    quiet ``poll_s`` the items of ``resync`` (what messages may have been missed) come too. Plain (not shard)
    channels: on a Redis Cluster a PUBLISH reaches subscribers on every node."""
    pubsub: PubSub | None = None
    try:
        while True:
            try:
                if pubsub is None:
                    pubsub = redis.pubsub()
                    await subscribe_confirmed(pubsub, channels)
                    for item in await resync():
                        yield item
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_s)
                for item in [as_text(msg["data"])] if msg is not None else await resync():
                    yield item
            except TRANSIENT_ERRORS as exc:
                log.warning("%s lost (%s); reconnecting", name, exc)
                if pubsub is not None:
                    await close_quietly(pubsub)
                pubsub = None
                await asyncio.sleep(poll_s / 4)
    finally:
        if pubsub is not None:
            await close_quietly(pubsub)


def as_text(value: Any) -> str:
    """Redis replies as text, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)
