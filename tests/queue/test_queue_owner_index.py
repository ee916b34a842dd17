"""The per-owner recent-jobs index that submit.lua keeps (docs/protocol.md): one sorted set per owner, newest
first, trimmed to ``keys.OWNER_JOBS_KEEP``, expiring with the results; and the in-flight view of the fleet page."""

from __future__ import annotations

from queue_helpers import MODEL, make_job, queue_settings
from redis.asyncio import Redis

from shared import keys
from shared.config import Settings
from shared.queue import JobQueue
from shared.schemas import JobStatus

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with


async def test_each_owner_sees_its_own_jobs_newest_first(queue: JobQueue, redis: Redis,
                                                          settings: Settings) -> None:
    alice = [make_job(owner="alice", priority=p) for p in (0, 7, -2)]
    bob = make_job(owner="bob")
    anonymous = make_job()
    for job in (*alice, bob, anonymous):
        await queue.submit(job)
    recent = await queue.recent_jobs("alice", 10)
    assert [r.id for r in recent] == [j.id for j in reversed(alice)]
    assert [r.priority for r in recent] == [-2, 7, 0] and {r.status for r in recent} == {JobStatus.QUEUED}
    assert [r.id for r in await queue.recent_jobs("bob", 10)] == [bob.id]
    assert [r.id for r in await queue.recent_jobs(None, 10)] == [anonymous.id]
    assert [r.id for r in await queue.recent_jobs("alice", 2)] == [alice[2].id, alice[1].id]
    assert await queue.recent_jobs("carol", 10) == []
    assert 0 < await redis.ttl(KS.owner_jobs("alice", 0)) <= settings.result_ttl_s


async def test_a_replayed_idempotency_key_adds_no_second_entry(queue: JobQueue, redis: Redis) -> None:
    first = make_job(owner="alice", idempotency_key="k")
    await queue.submit(first)
    _, created = await queue.submit(make_job(owner="alice", idempotency_key="k"))
    assert not created
    assert await redis.zrange(KS.owner_jobs("alice", 0), 0, -1) == [first.id]


async def test_the_index_keeps_the_newest_entries_only(redis: Redis, redis_url: str) -> None:
    queue = JobQueue(redis, queue_settings(redis_url, max_queue_length=keys.OWNER_JOBS_KEEP + 10))
    jobs = [make_job(owner="alice") for _ in range(keys.OWNER_JOBS_KEEP + 3)]
    for job in jobs:
        await queue.submit(job)
    kept = await redis.zrevrange(KS.owner_jobs("alice", 0), 0, -1)
    assert len(kept) == keys.OWNER_JOBS_KEEP
    assert kept[0] == jobs[-1].id and kept[-1] == jobs[3].id


async def test_running_jobs_name_their_worker_and_owner(queue: JobQueue) -> None:
    mine, other = make_job(owner="alice"), make_job()
    await queue.submit(mine)
    await queue.submit(other)
    claimed = await queue.claim(MODEL, "w1", max_jobs=2)
    assert len(claimed) == 2
    assert sorted(await queue.running_jobs()) == sorted([(mine.id, "w1", "alice"), (other.id, "w1", None)])
