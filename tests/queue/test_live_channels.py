"""LiveChannels: every open stream of a process over one pub/sub connection, against a real Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.asyncio import Redis

from shared.live_channels import TRANSIENT_ERRORS, LiveChannels
from shared.redis_server import RedisServer


async def pubsub_clients(redis: Redis) -> int:
    """Connections of this Redis that hold at least one subscription."""
    return sum(1 for client in await redis.client_list() if int(client.get("sub", 0)) > 0)


async def test_many_streams_share_one_connection_and_each_gets_its_own_messages(redis: Redis) -> None:
    hub = LiveChannels(redis)
    listeners = [await hub.listen(f"chan-{i}") for i in range(20)]
    assert await pubsub_clients(redis) == 1
    for i in range(20):
        assert await redis.publish(f"chan-{i}", f"m{i}") == 1  # one subscriber connection per channel
    assert [await listener.get(timeout=2.0) for listener in listeners] == [f"m{i}" for i in range(20)]
    assert await listeners[0].get(timeout=0.05) is None  # nothing else arrived
    for listener in listeners:
        await listener.close()
    assert await pubsub_clients(redis) == 0  # closed with the last listener


async def test_two_listeners_of_one_channel_and_unsubscribing_the_last(redis: Redis) -> None:
    hub = LiveChannels(redis)
    first, second = await hub.listen("shared"), await hub.listen("shared")
    other = await hub.listen("other")
    await redis.publish("shared", "both")
    assert (await first.get(2.0), await second.get(2.0)) == ("both", "both")
    await first.close()
    await redis.publish("shared", "still")
    assert await second.get(2.0) == "still"
    await second.close()  # the channel's last listener: unsubscribed, while "other" keeps the connection
    assert (await redis.pubsub_numsub("shared"))[0][1] == 0
    assert await redis.publish("other", "x") == 1 and await other.get(2.0) == "x"
    await other.close()


async def test_a_listener_sees_everything_published_after_listen_returned(redis: Redis) -> None:
    hub = LiveChannels(redis)
    listeners = await asyncio.gather(*(hub.listen("burst") for _ in range(5)))
    for n in range(50):
        await redis.publish("burst", str(n))
    for listener in listeners:
        assert [await listener.get(2.0) for _ in range(50)] == [str(n) for n in range(50)]
        await listener.close()


async def test_a_redis_restart_fails_every_listener_once_and_listening_again_works(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        redis = Redis.from_url(server.url, decode_responses=True)
        try:
            hub = LiveChannels(redis)
            listeners = [await hub.listen(f"c{i}") for i in range(3)]
            server.restart(kill=True)
            for listener in listeners:
                with pytest.raises(TRANSIENT_ERRORS):
                    await listener.get(timeout=10.0)
                await listener.close()
            again = await hub.listen("c0")
            await redis.publish("c0", "back")
            assert await again.get(2.0) == "back"
            await again.close()
        finally:
            await redis.aclose()
