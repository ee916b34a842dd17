"""api/relay.py on a real Redis: a stream that fails with a Redis error its reader does not ride out is reopened
after the last event relayed, so the request sees each event once; any other failure ends it at once.

The Redis error here is WRONGTYPE (the job's log replaced by a string for a while): shared/job_stream.py retries
connection errors itself, so the relay's reopening is for the Redis errors that escape it (the CI failure of
test_stack_restarts: a stream ended with an error event while Redis restarted, and its client stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from api.metrics import ApiMetrics
from api.relay import JobRelay
from api.routes.jobs import _job_event_stream
from api.sse import STREAM_LOST
from shared.config import Settings
from shared.queue import JobQueue
from shared.schemas import Choice, DoneEvent, JobResult, JobSubmission, StreamEvent, TokenEvent, Usage

MODEL = "tiny"


@pytest.fixture()
async def queue(redis_url: str) -> AsyncIterator[JobQueue]:
    client = Redis.from_url(redis_url)
    job_queue = JobQueue(client, Settings(redis_url=redis_url), poll_interval_s=0.1)
    await job_queue.publish_config()
    yield job_queue
    await client.aclose()


async def _running_job(queue: JobQueue) -> tuple[str, int]:
    job = JobSubmission(id=secrets.token_urlsafe(12), model=MODEL, prompt="Hello")
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    return job.id, claim.fence


async def _publish(queue: JobQueue, job_id: str, fence: int, seqs: range) -> None:
    events = [TokenEvent(seq=seq, text=f"t{seq} ") for seq in seqs]
    assert (await queue.publish_many([(job_id, fence, events)]))[0]


@dataclass
class Reading:
    """A running job's stream, read by a task into ``seen``."""

    job_id: str
    fence: int
    relay: JobRelay
    seen: list[StreamEvent]
    reader: asyncio.Task[None]


@contextlib.asynccontextmanager
async def _reading(queue: JobQueue, num_events: int) -> AsyncIterator[Reading]:
    """A claimed job with ``num_events`` events published, its relay's reader past them."""
    job_id, fence = await _running_job(queue)
    await _publish(queue, job_id, fence, range(1, num_events + 1))
    relay = JobRelay(queue, job_id)
    await relay.start()
    seen: list[StreamEvent] = []

    async def read() -> None:
        async for event in relay.events():
            seen.append(event)

    reader = asyncio.create_task(read())
    try:
        await _until(lambda: len(seen) == num_events, "first events")
        yield Reading(job_id, fence, relay, seen, reader)
    finally:
        reader.cancel()
        await relay.close()


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"no {what} within {timeout_s} s"
        await asyncio.sleep(0.02)


async def test_a_redis_error_reopens_the_stream_after_the_last_event(queue: JobQueue,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    async with _reading(queue, 3) as run:
        log_key = queue.keyspace.job_log(run.job_id)
        # The log becomes a string: the reader's next read of it (a quiet poll) fails with WRONGTYPE, and so
        # does every reopened stream's first read, until the log is back.
        with caplog.at_level(logging.WARNING, logger="api.relay"):
            await queue.redis.rename(log_key, f"{log_key}:aside")
            await queue.redis.set(log_key, "not a stream")
            await _until(lambda: sum("reopening it after event 3" in r.getMessage() for r in caplog.records) >= 2,
                         "two reopenings")
        await queue.redis.delete(log_key)
        await queue.redis.rename(f"{log_key}:aside", log_key)
        await _publish(queue, run.job_id, run.fence, range(4, 7))
        result = JobResult(choices=[Choice(index=0, text="", finish_reason="length")], usage=Usage())
        assert await queue.complete(run.job_id, run.fence, result)
        await asyncio.wait_for(run.reader, 10)
    assert [event.seq for event in run.seen] == list(range(1, 8))  # each once, the done event last
    assert isinstance(run.seen[-1], DoneEvent) and run.relay.finished


async def test_a_failure_that_is_not_redis_ends_the_stream_at_once(queue: JobQueue) -> None:
    async with _reading(queue, 2) as run:
        # A foreign producer's entry that is not an event's JSON: read at the next quiet poll, never retried.
        await queue.redis.xadd(queue.keyspace.job_log(run.job_id), {"data": "not json"}, id="3-0")
        with pytest.raises(ValueError):
            await asyncio.wait_for(run.reader, 10)
    assert [event.seq for event in run.seen] == [1, 2]


@pytest.mark.parametrize("break_log", ["wrong type for good", "not json"])
async def test_job_events_end_without_a_final_event_only_when_redis_stays_away(queue: JobQueue,
                                                                                 break_log: str) -> None:
    """``/v1/jobs/{id}/events``: a Redis error past the relay's reopening ends the stream with a comment (the client
    resumes, the job goes on); any other failure ends it with ``event: error``."""
    job_id, fence = await _running_job(queue)
    await _publish(queue, job_id, fence, range(1, 3))
    log_key = queue.keyspace.job_log(job_id)
    if break_log == "not json":
        await queue.redis.xadd(log_key, {"data": "not json"}, id="3-0")
    else:
        await queue.redis.delete(log_key)
        await queue.redis.set(log_key, "not a stream")
    relay = JobRelay(queue, job_id, after_seq=2, resume_s=0.6)
    await relay.start()
    body = b"".join([chunk async for chunk in _job_event_stream(relay, ApiMetrics())])
    if break_log == "not json":
        assert body.startswith(b"event: error\n") and STREAM_LOST not in body
    else:
        assert body == STREAM_LOST
