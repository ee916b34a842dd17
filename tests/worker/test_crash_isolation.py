"""Isolation after a crash, with real worker processes: a job that kills every worker it runs on is dead-lettered
alone, and every job that shared its batch succeeds. ``max_attempts=1``: before isolation, the first crash used up
every job's single attempt and dead-lettered the whole batch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from shared import keys
from shared.config import Settings
from shared.launcher.redis_server import RedisServer
from shared.queue import JobQueue
from shared.schemas import GenerationParams, JobStatus, JobSubmission
from tests.queue.queue_helpers import dead_letters
from tests.worker.crashing_worker import CRASH_TOKEN_ID
from tests.worker.worker_process import WorkerProcess

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
MAX_WORKER_STARTS = 6


def _job(i: int, prompt: list[int]) -> JobSubmission:
    return JobSubmission(id=f"isolation-{i:04d}", model="tiny", prompt_token_ids=prompt,
                         params=GenerationParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0))


async def _all_final(queue: JobQueue, jobs: list[JobSubmission]) -> bool:
    records = [await queue.get(job.id) for job in jobs]
    return all(r is not None and r.status.is_terminal for r in records)


@pytest.fixture()
def private_redis_url(tmp_path: Path) -> Iterator[str]:
    """A Redis of this test's own: the session's is shared with long-lived API processes of other test modules,
    whose reapers would recover the crashed worker's jobs under their own ``max_attempts``."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server.url
    server.stop()


async def test_a_poison_job_is_dead_lettered_alone(private_redis_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    redis_url = private_redis_url
    settings = {"max_attempts": 1, "max_num_seqs": 8}
    redis = Redis.from_url(redis_url)
    queue = JobQueue(redis, Settings(redis_url=redis_url, **settings))
    good = [_job(i, [5 + i, 6, 7, 8]) for i in range(5)]
    poison = _job(99, [5, 6, CRASH_TOKEN_ID, 8])
    for job in [good[0], good[1], poison, *good[2:]]:
        await queue.submit(job)

    crashes = 0
    for start in range(MAX_WORKER_STARTS):
        worker = WorkerProcess(redis_url, tiny_llama, tmp_path, f"crashy-{start}",
                               module="tests.worker.crashing_worker", **settings).start()
        try:
            deadline = time.monotonic() + 60
            while worker.alive() and not await _all_final(queue, [*good, poison]):
                assert time.monotonic() < deadline, worker.log_tail()
                await asyncio.sleep(0.1)
            crashes += not worker.alive()
        finally:
            worker.stop()
        if await _all_final(queue, [*good, poison]):
            break

    record = await queue.get(poison.id)
    assert record is not None and record.status is JobStatus.FAILED, record
    assert record.error is not None and "gave up after max_attempts=1" in record.error
    assert await dead_letters(queue) == [poison.id]
    for job in good:
        record = await queue.get(job.id)
        assert record is not None and record.status is JobStatus.SUCCEEDED, record
        assert record.usage.completion_tokens == MAX_TOKENS
    # Once with the whole batch (not charged: every job isolated), once alone (charged: dead-lettered).
    assert crashes == 2
    assert await redis.hget(KS.job(poison.id), "crashes") == b"1"
    await redis.aclose()
