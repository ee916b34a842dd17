"""Queue fixtures: a JobQueue on the test Redis (flushed per test) with short leases."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from queue_helpers import queue_settings
from redis.asyncio import Redis

from shared.config import Settings
from shared.queue import JobQueue


@pytest.fixture()
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture()
def settings(redis_url: str) -> Settings:
    return queue_settings(redis_url)


@pytest.fixture()
async def queue(redis: Redis, settings: Settings) -> JobQueue:
    """The test's queue, its settings stored as the service's (ts:config), as an API does at start: workers of
    other tests still running on this Redis store theirs only where none are."""
    job_queue = JobQueue(redis, settings, poll_interval_s=0.2)
    await job_queue.publish_config()
    return job_queue
