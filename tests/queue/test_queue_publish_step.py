"""publish_step.lua: one call per engine step for all its jobs, each job checked and published as publish.lua does."""

from __future__ import annotations

import json

import pytest
from queue_helpers import MODEL, make_job, queue_settings
from redis.asyncio import Redis

from shared import keys
from shared.config import Settings
from shared.queue import ClaimedJob, JobQueue
from shared.queue.base import script_config
from shared.queue.worker import PUBLISH_STEP_MAX_JOBS, publish_groups
from shared.schemas import TokenEvent
from shared.scripts import Scripts

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with


def _token(seq: int, text: str) -> TokenEvent:
    return TokenEvent(seq=seq, index=0, text=text, token_ids=[seq])


async def _claimed(queue: JobQueue, count: int, worker_id: str = "w1") -> list[ClaimedJob]:
    for _ in range(count):
        await queue.submit(make_job())
    claims = await queue.claim(MODEL, worker_id, count)
    assert len(claims) == count
    return claims


async def _script_calls(redis: Redis) -> int:
    """EVALSHA calls that ran since the last CONFIG RESETSTAT (the first call on a fresh Redis fails NOSCRIPT,
    loads the script and is sent again)."""
    stats = (await redis.info("commandstats"))["cmdstat_evalsha"]
    return int(stats["calls"]) - int(stats["failed_calls"])


async def _texts(queue: JobQueue, job_id: str) -> list[tuple[int, str]]:
    return [(int(e["seq"]), e.get("text", e["type"])) for e in await queue.replay(job_id, 0)]


async def test_a_stale_fence_among_live_jobs_rejects_only_that_job(queue: JobQueue, redis: Redis) -> None:
    a, b, c = await _claimed(queue, 3)
    # b is lost: released (a drain) and claimed by another worker, so its fence moved on.
    assert await queue.release(b.submission.id, b.fence, crashed=False) == "queued"
    [b_again] = await queue.claim(MODEL, "w2", 1)
    assert b_again.fence > b.fence
    await redis.config_resetstat()
    step = [(a.submission.id, a.fence, [_token(1, "a1")]), (b.submission.id, b.fence, [_token(1, "stale")]),
            (c.submission.id, c.fence, [_token(1, "c1"), _token(2, "c2")])]
    assert await queue.publish_many(step) == [True, False, True]
    assert await _script_calls(redis) == 1  # the whole step in one script call
    assert await _texts(queue, a.submission.id) == [(1, "a1")]
    assert await _texts(queue, c.submission.id) == [(1, "c1"), (2, "c2")]
    assert await _texts(queue, b.submission.id) == [(1, "restart")]  # nothing of the stale holder
    assert (await queue.get(a.submission.id)).first_token_at is not None  # type: ignore[union-attr]
    assert (await queue.get(b.submission.id)).first_token_at is None  # type: ignore[union-attr]
    # The new holder of b publishes from its own event 1; seq continues after the restart event.
    assert await queue.publish_many([(b.submission.id, b_again.fence, [_token(1, "b1")])]) == [True]
    assert await _texts(queue, b.submission.id) == [(1, "restart"), (2, "b1")]


async def test_a_retried_step_duplicates_nothing(queue: JobQueue) -> None:
    a, b = await _claimed(queue, 2)
    step = [(a.submission.id, a.fence, [_token(1, "a1"), _token(2, "a2")]), (b.submission.id, b.fence,
                                                                                 [_token(1, "b1")])]
    assert await queue.publish_many(step) == [True, True]
    first_token_at = (await queue.get(a.submission.id)).first_token_at  # type: ignore[union-attr]
    assert await queue.publish_many(step) == [True, True]  # the reply was lost; the worker sends it again
    # The next step carries an event already published (b's 1) beside new ones: only the new ones are added.
    retry = [(a.submission.id, a.fence, [_token(3, "a3")]), (b.submission.id, b.fence, [_token(1, "b1"),
                                                                                        _token(2, "b2")])]
    assert await queue.publish_many(retry) == [True, True]
    assert await _texts(queue, a.submission.id) == [(1, "a1"), (2, "a2"), (3, "a3")]
    assert await _texts(queue, b.submission.id) == [(1, "b1"), (2, "b2")]
    assert (await queue.get(a.submission.id)).first_token_at == first_token_at  # type: ignore[union-attr]


async def test_replies_keep_job_order_across_calls(redis: Redis, redis_url: str) -> None:
    """A step of more than PUBLISH_STEP_MAX_JOBS jobs goes out in several script calls, one pipeline."""
    queue = JobQueue(redis, queue_settings(redis_url, max_queue_length=1000))
    await queue.publish_config()
    claims = await _claimed(queue, PUBLISH_STEP_MAX_JOBS + 4)
    stale = {0, PUBLISH_STEP_MAX_JOBS + 1}
    await redis.config_resetstat()
    step = [(c.submission.id, c.fence - 1 if i in stale else c.fence, [_token(1, f"j{i}")])
            for i, c in enumerate(claims)]
    assert await queue.publish_many(step) == [i not in stale for i in range(len(claims))]
    assert await _script_calls(redis) == 2
    for i in (1, PUBLISH_STEP_MAX_JOBS, PUBLISH_STEP_MAX_JOBS + 3):
        assert await _texts(queue, claims[i].submission.id) == [(1, f"j{i}")]
    assert await _texts(queue, claims[0].submission.id) == []


async def test_an_empty_step_sends_nothing(queue: JobQueue, redis: Redis) -> None:
    await redis.config_resetstat()
    assert await queue.publish_many([]) == []
    assert "cmdstat_evalsha" not in await redis.info("commandstats")


async def test_publish_lua_is_the_same_for_one_job(queue: JobQueue, redis: Redis, settings: Settings) -> None:
    """The one-job script other backends call: seq numbering, skipped duplicates, stale fences refused."""
    [a] = await _claimed(queue, 1)
    job_id, publish = a.submission.id, Scripts.load(redis).publish

    async def publish_one(fence: int, events: list[TokenEvent]) -> int:
        args: list[str | int] = [json.dumps(script_config(settings, KS, 0)), job_id, fence, 1]
        for event in events:
            args += [event.seq, event.model_dump_json(exclude={"seq"})]
        return int(await publish(keys=[KS.job(job_id)], args=args))

    assert await publish_one(a.fence, [_token(1, "x"), _token(2, "y")]) == 1
    assert await publish_one(a.fence, [_token(2, "y"), _token(3, "z")]) == 1
    assert await publish_one(a.fence + 1, [_token(4, "stale")]) == 0
    assert await _texts(queue, job_id) == [(1, "x"), (2, "y"), (3, "z")]
    assert (await queue.get(job_id)).first_token_at is not None  # type: ignore[union-attr]


def test_publish_groups_split_a_step_by_shard_in_order() -> None:
    one = keys.Keyspace(1)
    assert publish_groups(["a", "b", "c", "d", "e"], one, max_jobs=2) == [(0, [0, 1]), (0, [2, 3]), (0, [4])]
    assert publish_groups(["a"], one) == [(0, [0])]
    assert publish_groups([], one) == []
    with pytest.raises(ValueError, match="max_jobs"):
        publish_groups(["a"], one, max_jobs=0)
    three = keys.Keyspace(3)
    job_ids = [f"job-{i:04d}" for i in range(12)]
    groups = publish_groups(job_ids, three, max_jobs=3)
    assert sorted(i for _, group in groups for i in group) == list(range(12))  # every job once
    for shard, group in groups:
        assert 1 <= len(group) <= 3 and group == sorted(group)
        assert {three.shard_of(job_ids[i]) for i in group} == {shard}  # one shard (one hash slot) per call
