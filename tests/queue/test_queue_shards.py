"""Queue shards (docs/protocol.md, "Shards and Redis Cluster"): three shards on one Redis node and on a real
3-master Redis Cluster, through the same JobQueue code: placement, claim order across shards, per-step publishing,
renewals, reaping, cancels, rollbacks, reads that merge the shards, and the refusal of a mixed layout."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from queue_helpers import MODEL, make_job, queue_settings
from redis.asyncio import Redis

from shared import keys
from shared.queue import JobQueue, RateLimitedError
from shared.queue.base import ShardLayoutError
from shared.redis_client import open_client
from shared.schemas import JobStatus, TokenEvent
from shared.tenants import KeyPolicy, owner_of

SHARDS = 3


@pytest.fixture(params=["node", "cluster"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[Redis]:
    url = request.getfixturevalue("redis_url" if request.param == "node" else "redis_cluster_url")
    client = await open_client(url, decode_responses=True)
    yield client
    await client.aclose()


def _queue(redis: Redis, **overrides: object) -> JobQueue:
    return JobQueue(redis, queue_settings("redis://unused", queue_shards=SHARDS, **overrides), poll_interval_s=0.2)


@pytest.fixture()
async def queue(redis: Redis) -> JobQueue:
    job_queue = _queue(redis)
    await job_queue.publish_config()
    return job_queue


def _token(seq: int) -> TokenEvent:
    return TokenEvent(seq=seq, index=0, text="x", token_ids=[1])


async def test_jobs_spread_over_the_shards_and_keep_priority_order_across_them(queue: JobQueue) -> None:
    # Fixed ids, each priority's jobs in every shard (random ones left a shard empty 0.2% of the time)
    jobs = [make_job(id=f"spread-{i}", priority=p) for i, p in enumerate([0] * 12 + [7] * 6)]
    for job in jobs:
        await queue.submit(job)
    for priority in (0, 7):
        assert {queue.keyspace.shard_of(job.id) for job in jobs if job.priority == priority} == set(range(SHARDS))
    claimed = await queue.claim(MODEL, "w", 6)
    assert {c.submission.priority for c in claimed} == {7}  # every high-priority job first, wherever it was
    rest = await queue.claim(MODEL, "w", 20)
    assert len(rest) == 12 and {c.submission.priority for c in rest} == {0}


async def test_claims_of_one_job_each_rotate_over_the_shards(queue: JobQueue) -> None:
    """Equal priorities in every shard: one-job claims take from every shard in turn, none starves."""
    per_shard: dict[int, int] = Counter()
    while sum(per_shard.values()) < 9 or min(per_shard.values(), default=0) < 3:
        job = make_job()
        if per_shard[queue.keyspace.shard_of(job.id)] < 3:
            await queue.submit(job)
            per_shard[queue.keyspace.shard_of(job.id)] += 1
    order = [queue.keyspace.shard_of((await queue.claim(MODEL, "w", 1))[0].submission.id) for _ in range(6)]
    assert set(order[:3]) == set(range(SHARDS)) and set(order[3:]) == set(range(SHARDS))


async def test_idempotency_and_rate_limits_place_jobs_in_one_shard(redis: Redis) -> None:
    owner = owner_of("key-with-limits")
    queue = _queue(redis, api_key_policies={"key-with-limits": KeyPolicy(rpm=1000, max_jobs=2)})
    await queue.publish_config()
    first = make_job(id=queue.job_id_for(None, "key-1"), idempotency_key="key-1")
    assert (await queue.submit(first))[1] is True
    record, created = await queue.submit(make_job(id=queue.job_id_for(None, "key-1"), idempotency_key="key-1"))
    assert not created and record.id == first.id  # the retry found the first job, whatever its new id
    wrong = next(i for i in (f"job-{n:04d}" for n in range(100))
                 if queue.keyspace.shard_of(i) != queue.keyspace.shard_of(first.id))
    with pytest.raises(ValueError, match="maps to queue shard"):
        await queue.submit(make_job(id=wrong, idempotency_key="key-1"))
    # A tenant with limits: every job in its one shard, and its jobs limit counts them all.
    limited = [make_job(id=queue.job_id_for(owner), owner=owner) for _ in range(2)]
    for job in limited:
        await queue.submit(job)
    assert {queue.keyspace.shard_of(job.id) for job in limited} == {queue.keyspace.shard_of(owner)}
    with pytest.raises(RateLimitedError, match="jobs"):
        await queue.submit(make_job(id=queue.job_id_for(owner), owner=owner))


async def test_a_step_publishes_across_shards_and_renewals_and_reaping_follow_each_shard(queue: JobQueue) -> None:
    jobs = [make_job(params={"max_tokens": 4}) for _ in range(9)]
    for job in jobs:
        await queue.submit(job)
    claimed = await queue.claim(MODEL, "w", 9)
    assert len({queue.keyspace.shard_of(c.submission.id) for c in claimed}) > 1
    stale = claimed[0]
    await queue.redis.hincrby(queue.keyspace.job(stale.submission.id), "fence", 1)  # another holder took it
    published = await queue.publish_many([(c.submission.id, c.fence, [_token(1)]) for c in claimed])
    assert published == [c is not stale for c in claimed]  # in the step's order, whatever the shards
    lost = await queue.renew("w", {c.submission.id: c.fence for c in claimed})
    assert lost == [stale.submission.id]
    await asyncio.sleep(0.6)  # past the 0.5 s lease
    recovered = await queue.reap()
    assert {r.job_id for r in recovered} == {c.submission.id for c in claimed}  # every shard reaped
    assert {r.status for r in recovered} == {"queued"}


async def test_cancel_rollback_and_the_merged_reads(queue: JobQueue) -> None:
    jobs = [make_job(owner="alice") for _ in range(8)]
    for job in jobs:
        await queue.submit(job)
    assert sum((await queue.queue_depth_by_priority(MODEL)).values()) == 8
    recent = await queue.recent_jobs("alice", 5)
    assert [r.id for r in recent] == [j.id for j in jobs[::-1][:5]]  # newest first across the shards
    cancelled = await queue.cancel(jobs[0].id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
    assert await queue.rollback([j.id for j in jobs[1:]], "refused") == 7
    assert sum((await queue.queue_depth_by_priority(MODEL)).values()) == 0
    [running] = await queue.claim(MODEL, "w", 1) or [None]
    assert running is None and await queue.running_jobs() == []


async def test_a_process_with_another_shard_count_is_refused(queue: JobQueue, redis: Redis) -> None:
    other = JobQueue(redis, queue_settings("redis://unused", queue_shards=2))
    with pytest.raises(ShardLayoutError, match="queue_shards"):
        await other.publish_config()
    assert await redis.get(keys.SHARDS) == ",".join(queue.keyspace.tags)
