"""Wake messages (a job entered a model's queue) and the per-step publish pipeline, against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import suppress

from queue_helpers import MODEL, make_job, queue_depth
from redis.asyncio import Redis

from shared import keys
from shared.queue import JobQueue
from shared.schemas import TokenEvent
from shared.scripts import lua_source

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with


async def listening(queue: JobQueue, model: str = MODEL) -> AsyncGenerator[str, None]:
    """A wakeups listener past its first (re)connect item, so what it yields next is a message."""
    listener = queue.wakeups(model)
    assert await asyncio.wait_for(anext(listener), 2.0) == ""  # subscribed: anything missed before is possible
    return listener


async def test_a_submission_wakes_the_models_listeners_only(queue: JobQueue) -> None:
    mine, other = await listening(queue), await listening(queue, "another-model")
    job = make_job()
    await queue.submit(job)
    assert await asyncio.wait_for(anext(mine), 1.0) == job.id
    quiet = asyncio.ensure_future(anext(other))
    await asyncio.sleep(0.1)  # shorter than the listener's quiet poll (0.2 s): only a message could end it
    assert not quiet.done()
    quiet.cancel()
    with suppress(asyncio.CancelledError):
        await quiet
    await mine.aclose()
    await other.aclose()


async def test_a_requeued_job_wakes_the_listeners(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    listener = await listening(queue)
    assert await queue.release(job.id, claim.fence, crashed=False)
    assert await asyncio.wait_for(anext(listener), 1.0) == job.id
    await listener.aclose()


async def test_a_quiet_channel_still_yields_every_poll_interval(queue: JobQueue) -> None:
    """Messages published while a listener reconnects are lost, so quiet polls tell the worker to look anyway."""
    listener = await listening(queue)
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(anext(listener), 2.0) == ""
    assert asyncio.get_running_loop().time() - started >= queue.poll_interval_s * 0.9
    await listener.aclose()


async def test_submit_lua_as_shipped_wakes_the_models_workers(queue: JobQueue, redis: Redis) -> None:
    """Other backends EVAL submit.lua with the job's own data only: it announces the job on the model's wake
    channel, named from the layout the service stored in ts:config."""
    await queue.publish_config()
    listener = await listening(queue)
    job = make_job()
    await redis.eval(lua_source("submit"), 4, KS.job(job.id), KS.queue(MODEL, 0), KS.queue_seq(MODEL, 0),
                     KS.config(0), job.model_dump_json())
    assert await asyncio.wait_for(anext(listener), 1.0) == job.id
    assert await queue_depth(queue, MODEL) == 1
    await listener.aclose()


async def test_publish_many_survives_a_flushed_script_cache(queue: JobQueue, redis: Redis) -> None:
    """The pipeline calls EVALSHA directly; after a Redis restart (empty script cache) it loads and resends."""
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    event = TokenEvent(seq=1, index=0, text="hi", token_ids=[5])
    assert await queue.publish_many([(job.id, claim.fence, [event])]) == [True]
    await redis.script_flush()
    again = TokenEvent(seq=2, index=0, text=" there", token_ids=[6])
    assert await queue.publish_many([(job.id, claim.fence, [event, again])]) == [True]  # seq 1 is not repeated
    assert [e["text"] for e in await queue.replay(job.id, 0)] == ["hi", " there"]


async def test_publish_many_is_one_round_trip_without_script_exists(queue: JobQueue, redis: Redis) -> None:
    """redis-py's registered scripts would ask SCRIPT EXISTS before every pipeline: a second round trip per step."""
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    await redis.config_resetstat()
    for seq in (1, 2, 3):
        event = TokenEvent(seq=seq, index=0, text=f"t{seq}", token_ids=[seq])
        assert await queue.publish_many([(job.id, claim.fence, [event])]) == [True]
    stats = await redis.info("commandstats")
    assert "cmdstat_script|exists" not in stats and stats["cmdstat_evalsha"]["calls"] == 3
