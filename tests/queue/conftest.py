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
def queue(redis: Redis, settings: Settings) -> JobQueue:
    return JobQueue(redis, settings, poll_interval_s=0.2)
