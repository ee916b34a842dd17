"""open_stream: replay + live with no gap and no duplicate, after_seq, and no hang on finished jobs."""

from __future__ import annotations

import asyncio

from queue_helpers import MODEL, collect, make_job, publish

from shared.queue import JobQueue
from shared.schemas import Choice, DoneEvent, ErrorEvent, JobResult, JobStatus, TokenEvent, Usage


def _result(text: str) -> JobResult:
    return JobResult(choices=[Choice(index=0, text=text, finish_reason="length")], usage=Usage())


async def _produce(queue: JobQueue, job_id: str, fence: int, pieces: list[str], batch: int, first: int = 0) -> None:
    """A worker publishing ``pieces[first:]`` in batches (several events per step), pausing between steps.
    Events are numbered within the claim: piece i is event i + 1."""
    for start in range(first, len(pieces), batch):
        events = [TokenEvent(seq=i + 1, text=pieces[i]) for i in range(start, min(start + batch, len(pieces)))]
        assert await publish(queue, job_id, fence, events)
        await asyncio.sleep(0.002)
    assert await queue.complete(job_id, fence, _result("".join(pieces)))


async def test_replay_then_live_without_gap_or_duplicate(queue: JobQueue) -> None:
    job = make_job()
    pieces = [f"t{i} " for i in range(300)]
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    # 40 events are already in the log when the readers arrive; the rest race with their replay.
    await publish(queue, job.id, claim.fence, [TokenEvent(seq=i + 1, text=pieces[i]) for i in range(40)])

    async def read(after_seq: int) -> list:
        async with queue.open_stream(job.id, after_seq=after_seq) as stream:
            return await collect(stream)

    readers = [asyncio.create_task(read(after)) for after in (0, 0, 17, 40)]
    await asyncio.sleep(0)
    await _produce(queue, job.id, claim.fence, pieces, batch=3, first=40)
    for after, task in zip((0, 0, 17, 40), readers, strict=True):
        events = await asyncio.wait_for(task, 10)
        assert [e.seq for e in events] == list(range(after + 1, len(pieces) + 2))
        assert [e.text for e in events if isinstance(e, TokenEvent)] == pieces[after:]
        assert isinstance(events[-1], DoneEvent) and events[-1].job.status is JobStatus.SUCCEEDED


async def test_event_text_is_exactly_the_published_text(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    pieces = ["Hé", "llo", " wörld", " 🎉", "\n", '"q"']
    async with queue.open_stream(job.id) as stream:
        await _produce(queue, job.id, claim.fence, pieces, batch=2)
        events = await collect(stream)
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "".join(pieces)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.job.text == "".join(pieces) and done.seq == len(pieces) + 1


async def test_retried_publish_does_not_duplicate(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    first = [TokenEvent(seq=1, text="a"), TokenEvent(seq=2, text="b")]
    assert await publish(queue, job.id, claim.fence, first)
    assert await publish(queue, job.id, claim.fence, first)  # the reply was lost; the worker retries
    assert await publish(queue, job.id, claim.fence, [TokenEvent(seq=3, text="c")])
    await queue.complete(job.id, claim.fence, _result("abc"))
    async with queue.open_stream(job.id) as stream:
        events = await collect(stream)
    assert [(e.seq, getattr(e, "text", None)) for e in events[:-1]] == [(1, "a"), (2, "b"), (3, "c")]


async def test_stream_of_a_finished_job_ends_at_once(queue: JobQueue) -> None:
    job = make_job()
    await queue.submit(job)
    [claim] = await queue.claim(MODEL, "w1", 1)
    await queue.fail(job.id, claim.fence, "boom")
    async with queue.open_stream(job.id) as stream:
        events = await asyncio.wait_for(collect(stream), 2)
    [done] = events
    assert isinstance(done, DoneEvent) and done.job.status is JobStatus.FAILED and done.job.error == "boom"
    async with queue.open_stream(job.id, after_seq=done.seq) as stream:  # resuming after the end
        events = await asyncio.wait_for(collect(stream), 2)
    assert [type(e) for e in events] == [DoneEvent]


async def test_stream_of_an_unknown_job_is_an_error_not_a_hang(queue: JobQueue) -> None:
    async with queue.open_stream("never-submitted") as stream:
        events = await asyncio.wait_for(collect(stream), 2)
    [error] = events
    assert isinstance(error, ErrorEvent) and "not found" in error.message


async def test_a_quiet_stream_backs_off_its_log_reads_and_still_ends(queue: JobQueue) -> None:
    """A stream of a job that waits (nothing published) re-reads the log after 1, 2, 4, ... poll intervals, not
    every interval (10,000 waiting streams), and still sees the job's end at once through its live channel."""
    job = make_job()
    await queue.submit(job)

    async def xranges() -> int:
        stats = await queue.redis.info("commandstats")
        return int(stats.get("cmdstat_xrange", {}).get("calls", 0))

    async with queue.open_stream(job.id) as stream:
        reader = asyncio.create_task(collect(stream))
        await asyncio.sleep(0.1)
        before = await xranges()
        await asyncio.sleep(15 * queue.poll_interval_s)  # 15 intervals: 15 reads without the back-off
        quiet_reads = await xranges() - before
        await queue.cancel(job.id)
        events = await asyncio.wait_for(reader, 5)
    assert 2 <= quiet_reads <= 6, quiet_reads  # after 1, 2, 4 and 8 intervals
    assert isinstance(events[-1], DoneEvent) and events[-1].job.status is JobStatus.CANCELLED
