"""Helpers shared by the queue tests (a distinct module name: tests/ is not a package)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio import Redis

from shared import keys
from shared.config import Settings
from shared.queue import JobQueue
from shared.schemas import JobSubmission, RestartEvent, StreamEvent, TokenEvent

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

MODEL = "tiny"


def make_job(**fields: Any) -> JobSubmission:
    """A valid submission with a random id (as the API makes them) for the test model."""
    values: dict[str, Any] = {"id": secrets.token_urlsafe(12), "model": MODEL, "prompt": "Hello"}
    values.update(fields)
    return JobSubmission(**values)


def queue_settings(redis_url: str, **overrides: Any) -> Settings:
    """Short leases so expiry tests take a fraction of a second."""
    values: dict[str, Any] = {"redis_url": redis_url, "lease_ttl_s": 0.5, "heartbeat_interval_s": 0.1,
                              "max_attempts": 3, "result_ttl_s": 600, "max_queue_length": 100}
    values.update(overrides)
    return Settings(**values)


@contextlib.asynccontextmanager
async def worker_test_queue(redis_url: str) -> AsyncIterator[JobQueue]:
    """The client side of tests that run real worker processes: 2 s leases (a loaded machine's heartbeats stay
    well inside them) on a bytes client."""
    client = Redis.from_url(redis_url)
    try:
        job_queue = JobQueue(client, queue_settings(redis_url, lease_ttl_s=2), poll_interval_s=0.5)
        await job_queue.publish_config()
        yield job_queue
    finally:
        await client.aclose()


async def collect(stream: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [event async for event in stream]


async def publish(queue: JobQueue, job_id: str, fence: int, events: Sequence[TokenEvent | RestartEvent]) -> bool:
    """One job's events, as a worker's step publishes them (``publish_many`` of one job)."""
    return (await queue.publish_many([(job_id, fence, events)]))[0]


async def queue_depth(queue: JobQueue, model: str) -> int:
    return int(await queue.redis.zcard(KS.queue(model, 0)))


async def dead_letters(queue: JobQueue) -> list[str]:
    """Ids in the dead-letter set, oldest first."""
    return [x.decode() if isinstance(x, bytes) else x for x in await queue.redis.zrange(KS.dead_letter(0), 0, -1)]
