"""Fair share between tenants within one priority (claim.lua): interleaving by tokens and weights, against a real
Redis, claiming one job at a time as a worker with one free seat does."""

from __future__ import annotations

import json
from collections import Counter

from queue_helpers import MODEL, make_job, queue_depth
from redis.asyncio import Redis

from shared import keys
from shared.config import Settings
from shared.queue import JobQueue
from shared.schemas import Choice, JobResult, JobSubmission, Usage
from shared.scripts import lua_source
from shared.tenants import KeyPolicy, owner_of

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

OWNER_A, OWNER_B = owner_of("key-a"), owner_of("key-b")


def tenant_queue(redis: Redis, settings: Settings, **policies: KeyPolicy) -> JobQueue:
    """A queue whose keys have ``policies``, room for 1000 jobs, and leases that outlive the test."""
    update = {"api_key_policies": policies, "max_queue_length": 1000, "lease_ttl_s": 30.0}
    return JobQueue(redis, settings.model_copy(update=update), poll_interval_s=0.2)


def job_of(owner: str | None, max_tokens: int = 8, priority: int = 0) -> JobSubmission:
    # One prompt token: the job's estimated tokens are exactly 1 + max_tokens.
    return make_job(owner=owner, prompt=None, prompt_token_ids=[1], params={"max_tokens": max_tokens},
                    priority=priority)


async def run_one(queue: JobQueue) -> JobSubmission | None:
    """Claim the next job and complete it with all its tokens used, as a worker with one seat would."""
    claimed = await queue.claim(MODEL, "w1", 1)
    if not claimed:
        return None
    [claim] = claimed
    sub = claim.submission
    result = JobResult(choices=[Choice(index=0, text="x", finish_reason="length")],
                       usage=Usage(prompt_tokens=1, completion_tokens=sub.params.max_tokens))
    assert await queue.complete(sub.id, claim.fence, result)
    return sub


async def test_a_backlog_delays_another_keys_new_jobs_by_about_one_job_each(redis: Redis, settings: Settings
                                                                            ) -> None:
    queue = tenant_queue(redis, settings)
    for _ in range(200):
        await queue.submit(job_of(OWNER_A))
    for _ in range(3):  # A is served for a while first
        assert (await run_one(queue)).owner == OWNER_A  # type: ignore[union-attr]
    b_jobs = [job_of(OWNER_B) for _ in range(5)]
    for job in b_jobs:
        await queue.submit(job)

    order = [(await run_one(queue)).owner for _ in range(10)]  # type: ignore[union-attr]

    assert order.index(OWNER_B) <= 1, order  # B's first job starts within the next two claims
    assert order.count(OWNER_B) == 5, order  # and all five within ten: A and B alternate
    assert all(a != b for a, b in zip(order, order[1:], strict=False)), order
    assert await queue_depth(queue, MODEL) == 200 - 3 - 5


async def test_weights_share_tokens_two_to_one_whatever_the_job_sizes(redis: Redis, settings: Settings) -> None:
    queue = tenant_queue(redis, settings, **{"key-a": KeyPolicy(weight=2), "key-b": KeyPolicy(weight=1)})
    # A's jobs are small (1 + 10 tokens), B's large (1 + 40): by job count A would get far more than 2:1.
    for _ in range(300):
        await queue.submit(job_of(OWNER_A, max_tokens=10))
    for _ in range(80):
        await queue.submit(job_of(OWNER_B, max_tokens=40))

    tokens: Counter[str | None] = Counter()
    while tokens.total() < 3000:  # both stay backlogged all along (A holds 3300 tokens, B 3280)
        sub = await run_one(queue)
        assert sub is not None
        tokens[sub.owner] += 1 + sub.params.max_tokens

    ratio = tokens[OWNER_A] / tokens[OWNER_B]
    assert abs(ratio - 2.0) <= 0.2, tokens  # 2:1 within 10%


async def test_the_tokens_a_job_used_correct_its_tenants_charge(redis: Redis, settings: Settings) -> None:
    """A's jobs reserve 1 + 40 tokens but stop after 4; B's use all of their 1 + 10. Charged by the reservation
    alone, B would get 3.7 jobs per job of A and eight times A's tokens; settled by the tokens used, equal
    weights get equal tokens."""
    queue = tenant_queue(redis, settings)
    for _ in range(120):
        await queue.submit(job_of(OWNER_A, max_tokens=40))
    for _ in range(60):
        await queue.submit(job_of(OWNER_B, max_tokens=10))

    tokens: Counter[str | None] = Counter()
    while tokens.total() < 500:
        claimed = await queue.claim(MODEL, "w1", 1)
        sub = claimed[0].submission
        generated = 4 if sub.owner == OWNER_A else 10
        result = JobResult(choices=[Choice(index=0, text="x", finish_reason="stop")],
                           usage=Usage(prompt_tokens=1, completion_tokens=generated))
        assert await queue.complete(sub.id, claimed[0].fence, result)
        tokens[sub.owner] += 1 + generated

    assert abs(tokens[OWNER_A] / tokens[OWNER_B] - 1.0) <= 0.1, tokens


async def test_priority_wins_over_fairness(queue: JobQueue) -> None:
    for _ in range(20):
        await queue.submit(job_of(OWNER_A))
    await run_one(queue)  # A is now behind on nothing; B has never run
    urgent = job_of(OWNER_A, priority=5)
    await queue.submit(urgent)
    await queue.submit(job_of(OWNER_B))

    first = await run_one(queue)
    second = await run_one(queue)

    assert first is not None and first.id == urgent.id
    assert second is not None and second.owner == OWNER_B


async def test_jobs_without_an_owner_form_their_own_tenant(queue: JobQueue) -> None:
    for _ in range(30):
        await queue.submit(job_of(OWNER_A))
    anonymous = job_of(None)
    await queue.submit(anonymous)

    order = [(await run_one(queue)).id for _ in range(2)]  # type: ignore[union-attr]

    assert anonymous.id in order


async def test_a_job_pushed_with_only_the_required_keys_runs(queue: JobQueue, redis: Redis) -> None:
    """A backend that EVALs submit.lua with only the record, queue, counter and config keys (docs/protocol.md)
    still gets its job run: it joins its tenant's sub-queue when it reaches the head of the queue."""
    raw = job_of(None)
    await queue.publish_config()
    await redis.eval(lua_source("submit"), 4, KS.job(raw.id), KS.queue(MODEL, 0), KS.queue_seq(MODEL, 0),
                     KS.config(0), raw.model_dump_json())
    await queue.submit(job_of(OWNER_A))

    ran = [await run_one(queue), await run_one(queue)]

    assert [s.id for s in ran if s is not None][0] == raw.id
    assert await redis.zcard(KS.queue_tenants(MODEL, 0)) == 0  # every tenant's sub-queue is empty again


async def test_cancel_takes_a_job_out_of_its_tenants_sub_queue(queue: JobQueue, redis: Redis) -> None:
    job = job_of(OWNER_B)
    await queue.submit(job)
    assert await redis.zcard(KS.queue_tenant(MODEL, OWNER_B, 0)) == 1

    await queue.cancel(job.id)

    assert await redis.exists(KS.queue_tenant(MODEL, OWNER_B, 0)) == 0
    assert await redis.zscore(KS.queue_tenants(MODEL, 0), OWNER_B) is None
    assert await queue.claim(MODEL, "w1", 1) == []


async def test_a_hostile_token_estimate_leaves_the_tenants_clock_finite(queue: JobQueue, redis: Redis) -> None:
    """A raw job with n = 1e308 and max_tokens = inf is charged at its claim (then failed as malformed); that
    charge once made the tenant's virtual time infinite, so the next job's settlement asked HINCRBYFLOAT for inf
    and the worker died on the refused complete.lua. The estimate is bounded: the clock stays finite."""
    hostile = job_of(None).model_dump(mode="json")
    hostile.update(n=1e308, params={"max_tokens": 1e999})  # json.dumps writes 1e999 as Infinity, cjson reads it
    await queue.publish_config()
    await redis.eval(lua_source("submit"), 4, KS.job(hostile["id"]), KS.queue(MODEL, 0), KS.queue_seq(MODEL, 0),
                     KS.config(0), json.dumps(hostile))
    await queue.submit(job_of(None))

    ran = [await run_one(queue) for _ in range(2)]  # the hostile job is failed at its claim, the valid one runs
    assert [sub is not None for sub in ran] == [False, True]

    assert (await redis.hget(KS.job(hostile["id"]), "status")) == "failed"
    assert 0 < float(await redis.hget(KS.queue_vtime(MODEL, 0), "-")) <= 1e7 + 100
