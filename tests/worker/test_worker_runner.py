"""The runner in process: a real ``Runner`` around a tiny random Llama on its ``EngineThread``, a real Redis.

A step's events are published while the next step computes, except after a job's first token (the queue's
``publish_many`` is slowed down, a subclass, so that steps and deliveries overlap visibly in a timeline); a job
handed back to the same worker runs to the end; a full Redis is waited out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from redis.asyncio import Redis

from shared import keys
from shared.queue import ClaimedJob, JobQueue
from shared.schemas import GenerationParams, JobStatus, RestartEvent, TokenEvent
from tests.engine.helpers import poison_token
from tests.queue.queue_helpers import make_job, queue_settings
from worker.engine import Engine
from worker.engine_thread import EngineThread
from worker.main import engine_config
from worker.runner import Runner

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

PUBLISH_DELAY_S = 0.1
LEASE_S = 5.0
NUM_TOKENS = 6


@dataclass
class Timeline:
    """When each engine step and each publish ran (time.monotonic()), which seqs each publish carried, and
    each claim's (max_jobs, number of jobs claimed)."""

    steps: list[tuple[float, float]] = field(default_factory=list)
    publishes: list[tuple[float, float, list[int]]] = field(default_factory=list)
    claims: list[tuple[int, int]] = field(default_factory=list)


class ObservedQueue(JobQueue):
    """The worker's JobQueue, recording claims, and with publishes ``PUBLISH_DELAY_S`` slower (a slow network)."""

    def __init__(self, redis: Redis, timeline: Timeline, **kwargs: object) -> None:
        super().__init__(redis, **kwargs)  # type: ignore[arg-type]
        self._timeline = timeline

    async def claim_and_expire(self, model: str, worker_id: str, max_jobs: int, idle: bool = True
                               ) -> tuple[list[ClaimedJob], int]:
        jobs, num_expired = await super().claim_and_expire(model, worker_id, max_jobs, idle)
        self._timeline.claims.append((max_jobs, len(jobs)))
        return jobs, num_expired

    async def publish_many(self, batches: Iterable[tuple[str, int, Sequence[TokenEvent | RestartEvent]]]
                           ) -> list[bool]:
        batches = list(batches)
        started = time.monotonic()
        await asyncio.sleep(PUBLISH_DELAY_S)
        accepted = await super().publish_many(batches)
        self._timeline.publishes.append((started, time.monotonic(), [e.seq for _, _, evs in batches for e in evs]))
        return accepted


@dataclass
class Harness:
    """A runner serving ``tiny`` in this process (started by ``start``), a plain client queue, the timeline."""

    runner: Runner
    engine: Engine
    queue: JobQueue
    timeline: Timeline
    task: asyncio.Task[int] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.runner.run())


@pytest.fixture()
async def harness(redis_url: str, tiny_llama: Path) -> AsyncIterator[Harness]:
    async with serving_harness(redis_url, tiny_llama) as harness:
        yield harness


@contextlib.asynccontextmanager
async def serving_harness(redis_url: str, tiny_llama: Path, **engine_overrides: object) -> AsyncIterator[Harness]:
    """A ``Harness``; ``engine_overrides`` replace fields of the engine config the settings give."""
    settings = queue_settings(redis_url, model=str(tiny_llama), model_name="tiny", device="cpu", num_threads=1,
                              lease_ttl_s=LEASE_S, heartbeat_interval_s=0.5, num_kv_blocks=64, max_num_seqs=4)
    config = dataclasses.replace(engine_config(settings), **engine_overrides)  # type: ignore[arg-type]
    timeline = Timeline()
    engine_thread = EngineThread()
    engine = await asyncio.to_thread(engine_thread.build, lambda: Engine(config))
    real_step = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        started = time.monotonic()
        outputs = real_step()
        timeline.steps.append((started, time.monotonic()))
        return outputs

    engine.step = timed_step  # type: ignore[method-assign]
    worker_redis, client_redis = Redis.from_url(redis_url), Redis.from_url(redis_url)
    runner = Runner(engine, engine_thread, ObservedQueue(worker_redis, timeline, settings=settings), settings,
                    "runner-w1")
    harness = Harness(runner, engine, JobQueue(client_redis, settings, poll_interval_s=0.5), timeline)
    try:
        yield harness
    finally:
        runner.request_stop()
        if harness.task is not None:
            assert await asyncio.wait_for(harness.task, 30) == 0
        else:
            engine_thread.shutdown()
        await worker_redis.aclose()
        await client_redis.aclose()


@pytest.fixture()
async def served(harness: Harness) -> tuple[JobQueue, Timeline]:
    """The harness's runner, already serving."""
    harness.start()
    return harness.queue, harness.timeline


async def _wait_final(queue: JobQueue, job_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (record := await queue.get(job_id)) is None or not record.status.is_terminal:
        assert time.monotonic() < deadline, f"job {job_id} did not finish"
        await asyncio.sleep(0.02)


async def test_steps_do_not_wait_for_publishing_but_first_tokens_go_out_first(
        served: tuple[JobQueue, Timeline]) -> None:
    queue, timeline = served
    job = make_job(prompt="Once upon a time", params=GenerationParams(max_tokens=NUM_TOKENS, temperature=0,
                                                                       ignore_eos=True))
    await queue.submit(job)
    await _wait_final(queue, job.id)

    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED
    assert record.usage.completion_tokens == NUM_TOKENS
    # Every token went out, in seq order, one publish per step, each finished before the result was written.
    assert [seq for _, _, seqs in timeline.publishes for seq in seqs] == list(range(1, NUM_TOKENS + 1))
    log = await queue.replay(job.id, 0)
    assert [e["type"] for e in log] == ["token"] * NUM_TOKENS + ["done"]
    assert "".join(e["text"] for e in log[:-1]) == record.choices[0].text

    # The tiny model yields one token per step from the first on: seq j comes from step first + j - 1. (A
    # publish's recorded start can lag its step on a busy machine, so steps are matched by seq, not by time.)
    first = max(i for i, (_, end) in enumerate(timeline.steps) if end <= timeline.publishes[0][0])
    assert len(timeline.steps) >= first + NUM_TOKENS
    # The first token was published before the next step began ...
    assert timeline.steps[first + 1][0] >= timeline.publishes[0][1]
    # ... while each later step began before the previous step's tokens were out: nothing waited for them.
    for j in range(2, NUM_TOKENS):
        published_at = timeline.publishes[j - 1][1]  # the publish carrying seq j
        assert timeline.steps[first + j][0] < published_at, (j, timeline.steps, timeline.publishes)


async def test_a_job_handed_back_to_the_same_worker_runs_to_the_end(served: tuple[JobQueue, Timeline],
                                                                     redis_url: str) -> None:
    """The lease of a running job expires and the queue gives the job straight back to the same worker (it is
    the only one, and woken). The old attempt's publishes are refused while the new attempt runs: that must
    drop the old attempt only (matched by fence), not the new one, which finishes as attempt 2."""
    queue, timeline = served
    job = make_job(prompt="Once upon a time", params=GenerationParams(max_tokens=60, temperature=0, ignore_eos=True))
    await queue.submit(job)
    while len(timeline.publishes) < 3:  # running, with deliveries in flight behind the steps
        await asyncio.sleep(0.01)
    recovered: list[str] = []
    for _ in range(50):  # the worker's heartbeat may renew the lease between these two calls: expire it again
        await queue.redis.zadd(KS.inflight(0), {job.id: 0})  # the lease expired ...
        recovered = [r.job_id for r in await queue.reap()]
        if recovered:
            break
    assert recovered == [job.id]  # ... and the job is queued again (attempt 2)

    await _wait_final(queue, job.id, timeout_s=20)
    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED, record
    assert record.attempts == 2 and record.usage.completion_tokens == 60


async def test_a_full_redis_is_waited_out(served: tuple[JobQueue, Timeline]) -> None:
    """maxmemory reached with noeviction: Redis refuses every write (OOM). The worker retries, as through an
    outage, instead of exiting; once memory is available the job finishes as its first attempt."""
    queue, timeline = served
    job = make_job(prompt="Once upon a time", params=GenerationParams(max_tokens=40, temperature=0, ignore_eos=True))
    await queue.submit(job)
    while len(timeline.publishes) < 2:
        await asyncio.sleep(0.01)
    await queue.redis.config_set("maxmemory", 1)  # any write now fails: OOM command not allowed
    try:
        await asyncio.sleep(0.3)  # a publish already past Redis when the limit fell may still be recorded
        published = len(timeline.publishes)
        await asyncio.sleep(1.2)
        assert len(timeline.publishes) == published  # nothing got through meanwhile
    finally:
        await queue.redis.config_set("maxmemory", 0)

    await _wait_final(queue, job.id, timeout_s=20)
    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED, record
    assert record.attempts == 1 and record.usage.completion_tokens == 40


async def test_waiting_jobs_are_claimed_together(harness: Harness) -> None:
    """Jobs already queued when the worker looks are claimed in one call, as many as the engine has seats for
    (``max_num_seqs`` = 4): one round trip for a burst, not one per job and step."""
    jobs = [make_job(prompt=f"Story {i}", params=GenerationParams(max_tokens=4, temperature=0, ignore_eos=True))
            for i in range(6)]
    for job in jobs:
        await harness.queue.submit(job)
    harness.start()
    for job in jobs:
        await _wait_final(harness.queue, job.id)

    assert harness.timeline.claims[0] == (4, 4)  # the first look: four seats, four jobs, one call
    assert sum(n for _, n in harness.timeline.claims) == 6
    records = [await harness.queue.get(job.id) for job in jobs]
    assert all(r is not None and r.status is JobStatus.SUCCEEDED for r in records)


async def test_a_cancelled_jobs_result_comes_after_its_last_events(served: tuple[JobQueue, Timeline]) -> None:
    """Cancelled while a delivery is in flight: the result (the log's done marker) waits for it, so the log
    never holds a token after its end."""
    queue, timeline = served
    job = make_job(prompt="Once upon a time", params=GenerationParams(max_tokens=200, temperature=0, ignore_eos=True))
    await queue.submit(job)
    while len(timeline.publishes) < 3:
        await asyncio.sleep(0.01)
    await queue.cancel(job.id)

    await _wait_final(queue, job.id)
    record = await queue.get(job.id)
    assert record is not None and record.status is JobStatus.CANCELLED
    log = await queue.replay(job.id, 0)
    assert [e["type"] for e in log] == ["token"] * (len(log) - 1) + ["done"]
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    assert "".join(e["text"] for e in log[:-1]) == record.choices[0].text


async def test_a_job_the_engine_fails_ends_failed_alone_and_the_worker_keeps_serving(harness: Harness) -> None:
    """One choice of a job gets NaN logits (its prompt holds a token whose embedding is NaN): that job fails
    with the engine's reason, its sibling choice is aborted, and the jobs beside it in the batch succeed."""
    poison = 77
    poison_token(harness.engine, poison)
    params = GenerationParams(max_tokens=8, temperature=0, ignore_eos=True)
    good = [make_job(prompt=f"Story {i}", params=params) for i in range(2)]
    bad = make_job(prompt=None, prompt_token_ids=[5, 6, poison, 8], params=params, n=2)
    for job in [good[0], bad, good[1]]:
        await harness.queue.submit(job)
    harness.start()
    for job in [*good, bad]:
        await _wait_final(harness.queue, job.id)

    record = await harness.queue.get(bad.id)
    assert record is not None and record.status is JobStatus.FAILED and record.attempts == 1
    assert record.error is not None and record.error.startswith("generation failed: ") and "not finite" in record.error
    for job in good:
        record = await harness.queue.get(job.id)
        assert record is not None and record.status is JobStatus.SUCCEEDED and record.usage.completion_tokens == 8
    assert harness.task is not None and not harness.task.done()  # still serving
    assert harness.engine.stats().num_free_blocks == harness.engine.stats().num_total_blocks  # siblings freed


async def test_a_step_longer_than_the_lease_keeps_the_lease(harness: Harness) -> None:
    """A step that outlasts the lease (a long prefill on a busy machine) does not stop lease renewal: the job
    is not reaped meanwhile and finishes as its first attempt."""
    lease_s = LEASE_S
    inner, slow = harness.engine.step, [True]

    def slow_step():  # type: ignore[no-untyped-def]
        if slow:
            slow.pop()
            time.sleep(lease_s + 1.0)  # the engine thread is busy for longer than a lease
        return inner()

    harness.engine.step = slow_step  # type: ignore[method-assign]
    job = make_job(prompt="Once upon a time", params=GenerationParams(max_tokens=4, temperature=0, ignore_eos=True))
    await harness.queue.submit(job)
    harness.start()
    await asyncio.sleep(lease_s + 0.5)
    assert slow == []  # the slow step is running now, past the lease
    assert await harness.queue.reap() == []
    await _wait_final(harness.queue, job.id)
    record = await harness.queue.get(job.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED and record.attempts == 1


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
async def test_an_engine_with_async_scheduling_serves_jobs_as_in_turn(redis_url: str, tiny_llama: Path) -> None:
    """The runner around an engine whose decode steps overlap (``overlap.py``: a step's tokens come back a step
    later, and the first overlapped step returns none): greedy and n=2 seeded jobs, a stop string and a cancel
    end as with the same engine stepping in turn."""
    static = {"dtype": "float32", "attention_backend": "flex", "cuda_graphs": "padded", "block_size": 16,
              "num_kv_blocks": 32}
    params = [GenerationParams(max_tokens=12, temperature=0, ignore_eos=True),
              GenerationParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True),
              GenerationParams(max_tokens=30, temperature=0, ignore_eos=True, stop=["sell"])]
    texts = []
    for overlap in ("on", "off"):
        async with serving_harness(redis_url, tiny_llama, async_scheduling=overlap, **static) as harness:
            assert harness.engine.runner.async_scheduling == (overlap == "on")
            jobs = [make_job(prompt=f"Story {i}", params=p, n=2 if i == 1 else 1) for i, p in enumerate(params)]
            long = make_job(prompt="Once upon a time", params=GenerationParams(max_tokens=500, temperature=0,
                                                                               ignore_eos=True))
            for job in [*jobs, long]:
                await harness.queue.submit(job)
            harness.start()
            for job in jobs:
                await _wait_final(harness.queue, job.id)
            await harness.queue.cancel(long.id)
            await _wait_final(harness.queue, long.id)
            records = [await harness.queue.get(job.id) for job in jobs]
            assert all(r is not None and r.status is JobStatus.SUCCEEDED for r in records)
            assert records[2] is not None and records[2].choices[0].finish_reason == "stop"  # mid-way, on "sell"
            texts.append([[c.text for c in r.choices] for r in records if r is not None])
            cancelled = await harness.queue.get(long.id)
            assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
            log = await harness.queue.replay(long.id, 0)
            assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
            assert "".join(e["text"] for e in log[:-1]) == cancelled.choices[0].text
            assert harness.engine.stats().num_free_blocks == harness.engine.stats().num_total_blocks
    assert texts[0] == texts[1] and len(texts[0][1]) == 2
