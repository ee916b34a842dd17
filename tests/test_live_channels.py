"""shared/live_channels.py on one real Redis whose pub/sub connection is cut while readers come and go.

When Redis cuts the connection, the listener's read fails and redis-py drops the connection's writer; a reader
released at that moment unsubscribes on the dropped connection and redis-py raised AttributeError ('NoneType'
object has no attribute 'writelines'), or reconnected it from the releasing task while the listener read it
(RuntimeError: readuntil() called while another coroutine is already waiting). That once escaped ``release``,
ended a job's SSE stream with an error while Redis restarted, and its client stopped instead of resuming (CI:
test_stack_restarts). A subscription made at that moment could fail the same ways.
"""

from __future__ import annotations

import asyncio
import secrets

from redis.asyncio import Redis

from shared.live_channels import RESYNC, LiveChannels, LiveSubscription


async def _publish_until_heard(redis: Redis, reader: LiveSubscription, timeout_s: float = 10.0) -> None:
    """Publish on the reader's channel until the reader gets the message (after a RESYNC, if one comes first)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        await redis.spublish(reader.channel, "hello")
        item = await reader.get(0.2)
        if item not in (None, RESYNC):
            assert item == b"hello"
            return
    raise AssertionError(f"nothing heard on {reader.channel} within {timeout_s} s")


async def test_readers_released_while_the_connection_is_cut_never_raise(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    killer = Redis.from_url(redis_url)
    live = LiveChannels(redis, idle_s=0.5)
    try:
        for _ in range(30):
            readers = await asyncio.gather(*(live.subscribe(f"test:{secrets.token_hex(4)}") for _ in range(16)))
            await killer.client_kill_filter(_type="pubsub")
            await asyncio.sleep(0)  # the listener sees the cut while the releases below send their SUNSUBSCRIBEs
            await asyncio.gather(*(live.release(reader) for reader in readers))
            assert live.num_channels == 0
        # The listener reconnected and still serves: a new reader hears a message.
        reader = await live.subscribe("test:after")
        await _publish_until_heard(killer, reader)
        await live.release(reader)
    finally:
        await live.aclose()
        await killer.aclose()
        await redis.aclose()
