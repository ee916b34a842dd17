"""JobQueue state transitions against a real Redis: order, leases, fencing, recovery, cancel, limits."""

from __future__ import annotations

import asyncio
import json

import pytest
from queue_helpers import MODEL, collect, dead_letters, make_job, publish, queue_depth, queue_settings
from redis.asyncio import Redis

from shared import keys
from shared.queue import JobQueue, QueueFullError
from shared.schemas import (
    Choice,
    DoneEvent,
    JobResult,
    JobStatus,
    RestartEvent,
    TokenEvent,
    Usage,
)

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

RESULT = JobResult(choices=[Choice(index=0, text="hi there", finish_reason="stop", token_ids=[5, 6])],
                   usage=Usage(prompt_tokens=2, completion_tokens=2))


async def test_priority_order_and_fifo_within_a_priority(queue: JobQueue) -> None:
    priorities = [0, 5, 0, -3, 5, 0, 1000, -1000]
    jobs = [make_job(priority=p) for p in priorities]
    for job in jobs:
        await queue.submit(job)
    assert await queue_depth(queue, MODEL) == len(jobs)

    claimed = [c.submission.id for _ in jobs for c in await queue.claim(MODEL, "w1", 1)]

    expected = [j.id for j in sorted(jobs, key=lambda j: -j.priority)]  # sorted() is stable: FIFO per priority
    assert claimed == expected
    assert await queue_depth(queue, MODEL) == 0


async def test_claim_sets_running_with_fence_and_renew_keeps_the_lease(queue: JobQueue, redis: Redis) -> None:
    job = make_job()
    record, created = await queue.submit(job)
    assert created and record.status is JobStatus.QUEUED and record.created_at is not None

    [claim] = await queue.claim(MODEL, "w1", 5)
    assert claim.submission == job and claim.attempt == 1 and claim.fence >= 1
    running = await queue.get(job.id)
    assert running is not None and running.status is JobStatus.RUNNING and running.worker_id == "w1"
    assert running.started_at is not None and running.started_at >= running.created_at

    for _ in range(4):  # 4 x 0.2 s > the 0.5 s lease: only renewals keep it
        await asyncio.sleep(0.2)
        assert await queue.renew("w1", {job.id: claim.fence}) == []
        assert len(await queue.reap()) == 0
    assert await queue.renew("w2", {job.id: claim.fence}) == [job.id]  # another worker cannot renew it
    assert await queue.complete(job.id, claim.fence, RESULT)
    done = await queue.get(job.id)
    assert done is not None and done.status is JobStatus.SUCCEEDED and done.text == "hi there"
    assert done.finished_at is not None and done.finished_at >= done.started_at
    assert await redis.zscore(KS.inflight(0), job.id) is None


async def test_stale_fence_is_rejected_after_the_job_moved_on(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [first] = await queue.claim(MODEL, "w1", 1)
    await asyncio.sleep(0.6)
    assert len(await queue.reap()) == 1
    [second] = await queue.claim(MODEL, "w2", 1)
    assert second.fence > first.fence and second.attempt == 2

    assert not await publish(queue, job.id, first.fence, [TokenEvent(seq=1, text="late")])
    assert not await queue.complete(job.id, first.fence, RESULT)
    assert not await queue.fail(job.id, first.fence, "late")
    assert not await queue.release(job.id, first.fence, crashed=False)
    assert await queue.renew("w1", {job.id: first.fence}) == [job.id]

    assert await queue.complete(job.id, second.fence, RESULT)
    assert await queue.complete(job.id, second.fence, RESULT)  # a retried call is idempotent
    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED and record.worker_id == "w2"


async def test_expired_lease_requeues_at_its_priority_with_a_restart_event(queue: JobQueue) -> None:
    job = make_job(priority=3)
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    assert await publish(queue, job.id, claim.fence, [TokenEvent(seq=1, text="a"), TokenEvent(seq=2, text="b")])
    later = make_job(priority=3)
    await queue.submit(later)

    await asyncio.sleep(0.6)
    assert len(await queue.reap()) == 1
    record = await queue.get(job.id)
    assert record is not None
    assert (record.status, record.attempts, record.worker_id) == (JobStatus.QUEUED, 1, None)

    # The restarted job keeps its place: ahead of a job of the same priority submitted after it.
    [again] = await queue.claim(MODEL, "w2", 1)
    assert again.submission.id == job.id and again.attempt == 2
    assert await publish(queue, job.id, again.fence, [TokenEvent(seq=1, text="c")])
    assert await queue.complete(job.id, again.fence, RESULT)

    async with queue.open_stream(job.id) as stream:
        events = await collect(stream)
    # The failed attempt's tokens were trimmed from the log; seq continues across attempts.
    assert [type(e) for e in events] == [RestartEvent, TokenEvent, DoneEvent]
    assert [e.seq for e in events] == [3, 4, 5]
    assert isinstance(events[0], RestartEvent) and events[0].attempt == 2
    assert isinstance(events[1], TokenEvent) and events[1].text == "c"


async def test_max_attempts_fails_the_job_into_the_dead_letter_set(redis: Redis, redis_url: str) -> None:
    """The first crash (beside others, as far as the queue knows) isolates the job without charging it; then
    max_attempts crashes while running alone dead-letter it."""
    queue = JobQueue(redis, queue_settings(redis_url, lease_ttl_s=0.2, max_attempts=2), poll_interval_s=0.2)
    job = make_job()
    await queue.submit(job)
    for attempt in (1, 2, 3):
        [claim] = await queue.claim(MODEL, f"w{attempt}", 1)
        assert (claim.attempt, claim.alone) == (attempt, attempt > 1)
        await asyncio.sleep(0.3)
        assert len(await queue.reap()) == 1

    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.FAILED and record.attempts == 3
    assert record.error is not None and "max_attempts=2" in record.error and "lease expired" in record.error
    assert "2 times running alone" in record.error
    assert await dead_letters(queue) == [job.id]
    assert await queue.claim(MODEL, "w4", 1) == []
    assert 0 < await redis.ttl(KS.job(job.id)) <= 600


async def test_release_without_charge_keeps_the_attempt_count(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    assert await queue.release(job.id, claim.fence, crashed=False)
    record = await queue.get(job.id)
    assert record is not None and (record.status, record.attempts) == (JobStatus.QUEUED, 1)
    [restart] = await queue.replay(job.id, 0)
    assert restart == {"seq": 1, "type": "restart", "attempt": 2}  # attempts count claims; the next is 2
    [claim] = await queue.claim(MODEL, "w2", 1)
    assert (claim.attempt, claim.alone) == (2, False)  # a drain is no crash: the job is not isolated
    assert await queue.redis.hmget(KS.job(job.id), "isolate", "crashes") == [None, None]


async def test_cancel_a_queued_job_removes_and_finalises_it(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    async with queue.open_stream(job.id) as stream:
        record = await queue.cancel(job.id)
        assert record is not None and record.status is JobStatus.CANCELLED
        events = await collect(stream)
    assert await queue_depth(queue, MODEL) == 0
    assert await queue.claim(MODEL, "w1", 1) == []
    [done] = events
    assert isinstance(done, DoneEvent) and done.job.status is JobStatus.CANCELLED
    assert await queue.cancel("no-such-job-id") is None


async def test_cancel_a_running_job_reaches_its_worker_which_finalises_it(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    listener = queue.cancellations("w1")
    first = asyncio.ensure_future(anext(listener))
    await asyncio.sleep(0.1)  # let it subscribe

    record = await queue.cancel(job.id)
    assert record is not None and record.status is JobStatus.RUNNING  # the worker finalises it
    assert await asyncio.wait_for(first, 2.0) == job.id

    aborted = JobResult(choices=[Choice(index=0, text="par", finish_reason="abort")], usage=Usage())
    assert await queue.complete(job.id, claim.fence, aborted)
    final = await queue.get(job.id)
    assert final is not None and final.status is JobStatus.CANCELLED and final.finish_reason == "abort"
    await listener.aclose()


async def test_cancel_is_durable_for_a_worker_that_missed_the_message(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    await queue.claim(MODEL, "w1", 1)
    await queue.cancel(job.id)  # nobody listens yet
    listener = queue.cancellations("w1")
    assert await asyncio.wait_for(anext(listener), 2.0) == job.id
    await listener.aclose()


async def test_cancelled_job_whose_worker_died_is_finalised_by_the_reaper(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    await queue.claim(MODEL, "w1", 1)
    await queue.cancel(job.id)
    await asyncio.sleep(0.6)
    assert len(await queue.reap()) == 1
    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.CANCELLED


async def test_idempotency_key_returns_the_existing_job_per_owner(queue: JobQueue) -> None:
    first, created = await queue.submit(make_job(idempotency_key="k1", owner="alice"))
    again, created_again = await queue.submit(make_job(idempotency_key="k1", owner="alice"))
    other, created_other = await queue.submit(make_job(idempotency_key="k1", owner="bob"))
    assert created and not created_again and created_other
    assert again.id == first.id and other.id != first.id
    assert await queue_depth(queue, MODEL) == 2


async def test_taken_id_is_refused(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    with pytest.raises(ValueError, match="already exists"):
        await queue.submit(job)


async def test_result_ttl_applies_to_every_key_of_the_job_at_the_end(queue: JobQueue, redis: Redis) -> None:
    job = make_job(idempotency_key="ttl", owner="o")
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    await publish(queue, job.id, claim.fence, [TokenEvent(seq=1, text="x")])
    job_keys = [KS.job(job.id), KS.job_log(job.id), KS.idempotency("o", "ttl", 0)]
    assert [await redis.ttl(k) for k in job_keys] == [-1, -1, -1]  # nothing expires while it runs

    await queue.complete(job.id, claim.fence, RESULT)
    ttls = [await redis.ttl(k) for k in job_keys]
    assert all(590 < ttl <= 600 for ttl in ttls), ttls


async def test_queue_cap_raises_queue_full_with_retry_after(redis: Redis, redis_url: str) -> None:
    queue = JobQueue(redis, queue_settings(redis_url, max_queue_length=3), poll_interval_s=0.2)
    for _ in range(3):
        await queue.submit(make_job())
    with pytest.raises(QueueFullError) as info:
        await queue.submit(make_job())
    assert info.value.retry_after_s >= 1 and info.value.depth == 3
    await queue.claim(MODEL, "w1", 1)
    _, created = await queue.submit(make_job())
    assert created


@pytest.mark.parametrize("submission", [
    "this is not json",
    json.dumps({"id": "raw-bad-job-1", "model": MODEL, "prompt": "x", "unknown_field": 1}),
    json.dumps({"id": "raw-bad-job-1", "model": MODEL, "prompt": "x", "params": {"temperature": -1}}),
    json.dumps({"id": "raw-bad-job-1", "model": MODEL}),
])
async def test_malformed_job_pushed_raw_fails_cleanly(queue: JobQueue, redis: Redis, submission: str) -> None:
    job_id = "raw-bad-job-1"
    await redis.hset(KS.job(job_id), mapping={"id": job_id, "model": MODEL, "submission": submission,
                                                "status": "queued", "priority": 0, "score": 1, "attempts": 0,
                                                "fence": 0, "seq": 0})
    await redis.zadd(KS.queue(MODEL, 0), {job_id: 1, "ghost-without-record": 2})
    good = make_job()
    await queue.submit(good)

    claimed = await queue.claim(MODEL, "w1", 10)

    assert [c.submission.id for c in claimed] == [good.id]
    record = await queue.get(job_id)
    assert record is not None and record.status is JobStatus.FAILED
    assert record.error is not None and record.error.startswith("invalid job")
    assert await queue.get_submission(job_id) is None
    assert await queue_depth(queue, MODEL) == 0


async def test_worker_registry_and_model_cards(queue: JobQueue) -> None:
    from shared.schemas import ModelCard, WorkerInfo

    card = ModelCard(name=MODEL, max_model_len=1024, eos_token_ids=[2], vocab_size=49152, tokenizer_json="{}")
    info = WorkerInfo(id="w1", model=MODEL, max_num_seqs=8, heartbeat_at=1.0, started_at=1.0)
    await queue.register_worker(info, card)
    await queue.register_worker(info, card)  # a heartbeat: the card is not resent but stays
    assert [w.id for w in await queue.live_workers()] == ["w1"]
    assert await queue.model_cards() == [card]
    assert await queue.model_card(MODEL) == card and await queue.model_card("other") is None
    await queue.deregister_worker("w1")
    assert await queue.live_workers() == [] and await queue.model_cards() == []
    assert await queue.model_card(MODEL) == card  # still known: jobs may queue while workers restart
    # A worker whose heartbeats stopped a week ago leaves the workers set at the next worker's heartbeat.
    seconds, _ = await queue.redis.time()
    await queue.redis.zadd(keys.WORKERS, {"long-gone": seconds - keys.DEAD_LETTER_KEEP_S - 60, "recent": seconds - 60})
    await queue.register_worker(info, card)
    assert set(await queue.redis.zrange(keys.WORKERS, 0, -1)) == {"w1", "recent"}


async def test_a_crash_isolates_the_jobs_it_took_down_without_charging_them(queue: JobQueue) -> None:
    """Three jobs ran together when their worker died: none is charged, each runs alone next, and only an idle
    worker is handed one. A busy worker claims nothing behind an isolated job at the head of the queue."""
    jobs = [make_job() for _ in range(3)]
    for job in jobs:
        await queue.submit(job)
    assert len(await queue.claim(MODEL, "w1", 5)) == 3
    await asyncio.sleep(0.6)
    assert len(await queue.reap()) == 3
    for job in jobs:
        assert await queue.redis.hmget(KS.job(job.id), "isolate", "crashes", "attempts") == ["1", None, "1"]
    late = make_job()
    await queue.submit(late)

    assert await queue.claim(MODEL, "busy", 5, idle=False) == []  # drains instead of jumping the queue
    [solo] = await queue.claim(MODEL, "w2", 5, idle=True)  # alone, though five seats were offered
    assert (solo.submission.id, solo.attempt, solo.alone) == (jobs[0].id, 2, True)

    # Crashing again while alone is charged; a crash is charged by a release after an engine failure too.
    assert await queue.release(solo.submission.id, solo.fence, crashed=True)
    assert await queue.redis.hget(KS.job(jobs[0].id), "crashes") == "1"
    assert [c.submission.id for c in await queue.claim(MODEL, "w3", 1)] == [jobs[0].id]
