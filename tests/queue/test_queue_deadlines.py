"""Job deadlines in the queue: a job not started in time ends ``expired`` without reaching a worker; a claimed
job learns how long it has left; a job that stopped at its timeout completes ``expired`` with its text."""

from __future__ import annotations

import asyncio

from queue_helpers import MODEL, collect, make_job, queue_depth
from redis.asyncio import Redis

from shared import keys
from shared.queue import JobQueue
from shared.schemas import Choice, DoneEvent, JobResult, JobStatus, Usage

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with


async def test_a_job_not_started_within_its_queue_timeout_expires(queue: JobQueue, redis: Redis) -> None:
    late = make_job(queue_timeout_s=0.2)
    patient = make_job(queue_timeout_s=60)
    await queue.submit(late)
    await queue.submit(patient)
    await asyncio.sleep(0.3)

    assert await queue.expire(MODEL) == 1

    record = await queue.get(late.id)
    assert record is not None and record.status is JobStatus.EXPIRED and record.attempts == 0
    assert record.error == "expired: not started within its deadline" and record.finished_at is not None
    async with queue.open_stream(late.id) as events:
        [done] = await collect(events)
    assert isinstance(done, DoneEvent) and done.job.status is JobStatus.EXPIRED
    assert await queue_depth(queue, MODEL) == 1  # the patient job still waits
    assert await redis.zrange(KS.queue_deadlines(MODEL, 0), 0, -1) == [patient.id]
    assert await redis.ttl(KS.job(late.id)) > 0  # a terminal job gets the result TTL


async def test_a_claim_expires_overdue_jobs_instead_of_starting_them(queue: JobQueue) -> None:
    late = make_job(timeout_s=0.2)  # the total timeout bounds the start too
    await queue.submit(late)
    await asyncio.sleep(0.3)

    claimed, num_expired = await queue.claim_and_expire(MODEL, "w1", 4)

    assert claimed == [] and num_expired == 1
    record = await queue.get(late.id)
    assert record is not None and record.status is JobStatus.EXPIRED and record.worker_id is None


async def test_a_claimed_job_learns_the_time_left_and_its_timeout_completes_expired(queue: JobQueue) -> None:
    job = make_job(timeout_s=30)
    await queue.submit(job)

    [claim] = await queue.claim(MODEL, "w1", 1)

    assert claim.time_left_s is not None and 29 < claim.time_left_s <= 30
    partial = JobResult(choices=[Choice(index=0, text="Once upon", finish_reason="timeout", token_ids=[1, 2])],
                        usage=Usage(prompt_tokens=1, completion_tokens=2))
    assert await queue.complete(job.id, claim.fence, partial)
    assert await queue.complete(job.id, claim.fence, partial)  # a retried call is harmless
    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.EXPIRED
    assert record.text == "Once upon" and record.finish_reason == "timeout"


async def test_a_job_without_deadlines_never_expires(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    assert claim.time_left_s is None
    assert await queue.expire(MODEL) == 0


async def test_a_restarted_job_must_start_again_before_its_total_deadline(queue: JobQueue, redis: Redis) -> None:
    job = make_job(queue_timeout_s=0.1, timeout_s=0.6)
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    await asyncio.sleep(0.15)  # past the queue timeout: it no longer applies once the job started
    assert await queue.release(job.id, claim.fence, crashed=False) == "queued"
    assert await queue.expire(MODEL) == 0

    await asyncio.sleep(0.5)  # past the total timeout, still queued
    assert await queue.expire(MODEL) == 1

    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.EXPIRED
    assert record.error == "expired: not restarted before its total timeout"
