"""shared/live_channels.py on a real 3-master cluster: channels on every master subscribed and released at once.

The listener reads the node pub/subs of redis-py's ClusterPubSub while a subscribe adds a node's PubSub whose
connection is not set yet (or a release closes one): ``get_message`` then raises RuntimeError('pubsub connection
not set'). That once killed the listener task, and the subscriptions waiting on it timed out (the API answered
503); the listener now reads again.
"""

from __future__ import annotations

import asyncio
import secrets

from shared import keys
from shared.live_channels import LiveChannels
from shared.redis_client import open_client


async def test_concurrent_subscribes_over_every_master_all_confirm(redis_cluster_url: str) -> None:
    redis = await open_client(redis_cluster_url)
    live = LiveChannels(redis, idle_s=1.0)
    space = keys.Keyspace(3)
    failures: list[str] = []

    async def subscribe_and_release(shard: int) -> None:
        channel = space.job_live(space.fit_id(secrets.token_hex(12), shard))
        try:
            reader = await live.subscribe(channel)
        except Exception as exc:  # noqa: BLE001  # every failure is the finding
            failures.append(f"{type(exc).__name__}: {exc}")
            return
        await asyncio.sleep(secrets.randbelow(50) / 1000)
        await live.release(reader)

    try:
        for _ in range(10):
            await asyncio.gather(*(subscribe_and_release(k % 3) for k in range(9)))
            if failures:
                break
    finally:
        await live.aclose()
        await redis.aclose()
    assert failures == []


async def test_a_message_on_one_master_is_not_held_behind_quiet_others(redis_cluster_url: str) -> None:
    """One reader per master's shard channel; a message published on any one of them arrives in well under the
    listener's idle timeout, while the other masters stay quiet (redis-py reads the nodes in turn: a blocking
    read of a quiet node would hold the message back for its whole timeout)."""
    redis = await open_client(redis_cluster_url)
    live = LiveChannels(redis, idle_s=3.0)
    space = keys.Keyspace(3)
    channels = [space.job_live(space.fit_id(secrets.token_hex(12), shard)) for shard in space.shards]
    try:
        readers = [await live.subscribe(channel) for channel in channels]
        for _ in range(2):
            for channel, reader in zip(channels, readers, strict=True):
                await asyncio.sleep(0.2)
                sent = asyncio.get_running_loop().time()
                await redis.spublish(channel, "hello")
                assert await reader.get(3.0) in (b"hello", "hello")
                assert asyncio.get_running_loop().time() - sent < 0.5
    finally:
        await live.aclose()
        await redis.aclose()
