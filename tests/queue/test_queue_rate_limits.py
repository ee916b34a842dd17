"""Per-key rate limits enforced in submit.lua: requests and tokens per minute (GCRA) and unfinished jobs, one
budget shared by every client of the Redis (two JobQueue instances stand for two API processes here; the API
tests run two apps), and the token reservation settled when a job ends."""

from __future__ import annotations

import pytest
from queue_helpers import MODEL, make_job
from redis.asyncio import Redis

from shared import keys
from shared.config import Settings
from shared.queue import JobQueue, RateLimitedError
from shared.schemas import Choice, JobResult, JobSubmission, Usage
from shared.tenants import KeyPolicy, owner_of

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

OWNER = owner_of("key-a")


def limited_queue(redis: Redis, settings: Settings, policy: KeyPolicy) -> JobQueue:
    update = {"api_key_policies": {"key-a": policy}, "lease_ttl_s": 30.0}
    return JobQueue(redis, settings.model_copy(update=update), poll_interval_s=0.2)


def job(max_tokens: int = 9) -> JobSubmission:
    return make_job(owner=OWNER, prompt=None, prompt_token_ids=[1], params={"max_tokens": max_tokens})


async def test_requests_per_minute_are_shared_by_every_client(redis: Redis, settings: Settings) -> None:
    one, two = (limited_queue(redis, settings, KeyPolicy(rpm=4)) for _ in range(2))
    for queue in (one, two, one, two):
        await queue.submit(job())

    with pytest.raises(RateLimitedError) as refused:
        await two.submit(job())

    assert refused.value.limit == "requests" and refused.value.tenant == f"key-{OWNER[:8]}"  # never the key
    assert refused.value.retry_after_s is not None and 10 < refused.value.retry_after_s <= 15  # one request a 15 s
    state = refused.value.state
    assert state is not None and state.limit_requests == 4 and state.remaining_requests == 0
    assert 45 < state.reset_requests_s <= 60


async def test_tokens_per_minute_reserve_max_tokens_and_are_settled_at_the_end(redis: Redis, settings: Settings
                                                                               ) -> None:
    queue = limited_queue(redis, settings, KeyPolicy(tpm=100))
    first = job(max_tokens=49)  # 1 + 49 = 50 tokens reserved
    _, _, rate = await queue.submit_with_rate(first)
    assert rate is not None and rate.limit_tokens == 100 and rate.remaining_tokens == 50
    await queue.submit(job(max_tokens=49))
    with pytest.raises(RateLimitedError) as refused:
        await queue.submit(job(max_tokens=9))
    assert refused.value.limit == "tokens"

    # The first job used 1 + 4 tokens of its 50: the other 45 come back to the budget when it ends.
    [claim] = await queue.claim(MODEL, "w1", 1)
    result = JobResult(choices=[Choice(index=0, text="x", finish_reason="stop")],
                       usage=Usage(prompt_tokens=1, completion_tokens=4))
    assert await queue.complete(claim.submission.id, claim.fence, result)
    _, _, rate = await queue.submit_with_rate(job(max_tokens=9))
    assert rate is not None and 34 <= rate.remaining_tokens <= 36  # 100 - 5 - 50 - 10, plus a little refill


async def test_a_request_larger_than_the_token_limit_can_never_pass(redis: Redis, settings: Settings) -> None:
    queue = limited_queue(redis, settings, KeyPolicy(tpm=50))
    with pytest.raises(RateLimitedError) as refused:
        await queue.submit(job(max_tokens=60))
    assert refused.value.limit == "tokens" and refused.value.retry_after_s is None


async def test_unfinished_jobs_are_capped_and_freed_by_any_end(redis: Redis, settings: Settings) -> None:
    queue = limited_queue(redis, settings, KeyPolicy(max_jobs=2))
    first, second = job(), job()
    await queue.submit(first)
    await queue.submit(second)
    with pytest.raises(RateLimitedError) as refused:
        await queue.submit(job())
    assert refused.value.limit == "jobs"

    await queue.cancel(first.id)  # a queued job cancelled: its slot is free at once
    await queue.submit(job())
    [claim] = await queue.claim(MODEL, "w1", 1)
    assert await queue.fail(claim.submission.id, claim.fence, "boom")  # a failure frees its slot too
    await queue.submit(job())
    assert int(await redis.hget(KS.queue_rate(MODEL, OWNER, 0), "jobs")) == 2


async def test_keys_without_limits_are_not_counted(queue: JobQueue, redis: Redis) -> None:
    _, _, rate = await queue.submit_with_rate(job())
    assert rate is None
    assert await redis.exists(KS.queue_rate(MODEL, OWNER, 0)) == 0
