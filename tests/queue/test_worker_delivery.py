"""The runner publishes a step's events while the next step computes, except after a job's first token.

In process: a real ``Runner`` around a tiny random Llama on its ``EngineThread`` and a real Redis. The queue's
``publish_many`` is slowed down (a subclass) so that steps and deliveries overlap visibly in a timeline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from queue_helpers import make_job, queue_settings
from redis.asyncio import Redis

from shared.queue import JobQueue
from shared.schemas import GenerationParams, JobStatus, RestartEvent, TokenEvent
from worker.engine import Engine
from worker.engine_thread import EngineThread
from worker.main import engine_config
from worker.runner import Runner

PUBLISH_DELAY_S = 0.1
NUM_TOKENS = 6


@dataclass
class Timeline:
    """When each engine step and each publish ran (time.monotonic()), and which seqs each publish carried."""

    steps: list[tuple[float, float]] = field(default_factory=list)
    publishes: list[tuple[float, float, list[int]]] = field(default_factory=list)


class SlowPublishQueue(JobQueue):
    """A JobQueue whose publishes take ``PUBLISH_DELAY_S`` longer, as on a slow network."""

    def __init__(self, redis: Redis, timeline: Timeline, **kwargs: object) -> None:
        super().__init__(redis, **kwargs)  # type: ignore[arg-type]
        self._timeline = timeline

    async def publish_many(self, batches: Iterable[tuple[str, int, Sequence[TokenEvent | RestartEvent]]]
                           ) -> list[bool]:
        batches = list(batches)
        started = time.monotonic()
        await asyncio.sleep(PUBLISH_DELAY_S)
        accepted = await super().publish_many(batches)
        self._timeline.publishes.append((started, time.monotonic(), [e.seq for _, _, evs in batches for e in evs]))
        return accepted


@pytest.fixture()
async def served(redis_url: str, tiny_llama: Path) -> AsyncIterator[tuple[JobQueue, Timeline]]:
    """A runner serving ``tiny`` in this process; yields a plain client queue and the runner's timeline."""
    settings = queue_settings(redis_url, model=str(tiny_llama), model_name="tiny", device="cpu", num_threads=1,
                              lease_ttl_s=5, heartbeat_interval_s=0.5, num_kv_blocks=64, max_num_seqs=4)
    timeline = Timeline()
    engine_thread = EngineThread()
    engine = await asyncio.to_thread(engine_thread.build, lambda: Engine(engine_config(settings)))
    real_step = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        started = time.monotonic()
        outputs = real_step()
        timeline.steps.append((started, time.monotonic()))
        return outputs

    engine.step = timed_step  # type: ignore[method-assign]
    worker_redis, client_redis = Redis.from_url(redis_url), Redis.from_url(redis_url)
    runner = Runner(engine, engine_thread, SlowPublishQueue(worker_redis, timeline, settings=settings), settings,
                    "delivery-w1")
    task = asyncio.create_task(runner.run())
    try:
        yield JobQueue(client_redis, settings, poll_interval_s=0.5), timeline
    finally:
        runner.request_stop()
        assert await asyncio.wait_for(task, 30) == 0
        await worker_redis.aclose()
        await client_redis.aclose()


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

    first_published_at = timeline.publishes[0][1]
    first_token_step = next(i for i, (_, end) in enumerate(timeline.steps) if end <= timeline.publishes[0][0])
    later_steps = timeline.steps[first_token_step + 1:]
    # The first token was published before the next step began ...
    assert later_steps and later_steps[0][0] >= first_published_at
    # ... while every later token's publish overlapped the step after it: a step ran while it was in flight.
    for started, ended, _ in timeline.publishes[1:-1]:
        assert any(s < ended and e > started for s, e in later_steps), (started, ended, later_steps)
