"""Worker process lifecycle on a real Redis: SIGTERM drain (finish, or release after the timeout) and kill -9
recovery by another worker. Tiny random Llama for speed; SmolLM2 where the greedy text must be true."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared import keys
from shared.queue import JobQueue
from shared.schemas import (
    ChatMessage,
    GenerationParams,
    JobStatus,
    RestartEvent,
)
from tests.queue.queue_helpers import make_job, worker_test_queue
from tests.worker.worker_process import WorkerProcess, client_text, read_all, read_first, wait_final, wait_tokens

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow
LONG = GenerationParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture()
async def queue(redis_url: str) -> AsyncIterator[JobQueue]:
    async with worker_test_queue(redis_url) as job_queue:
        yield job_queue


async def test_sigterm_lets_running_jobs_finish_then_exits_0(tiny_llama: Path, queue: JobQueue, redis_url: str,
                                                              tmp_path: Path) -> None:
    worker = WorkerProcess(redis_url, tiny_llama, tmp_path, "drain-w1", drain_timeout_s=60).start()
    try:
        job = make_job(params=LONG)
        await queue.submit(job)
        await wait_tokens(queue, job.id, 3)
        worker.signal(signal.SIGTERM)
        while "draining" not in worker.log_tail():  # the signal is handled between two engine steps
            await asyncio.sleep(0.02)
        queued = make_job(params=LONG)
        await queue.submit(queued)  # a draining worker claims nothing new
        assert await asyncio.to_thread(worker.wait, 60) == 0, worker.log_tail()
        record = await queue.get(job.id)
        assert record is not None and record.status is JobStatus.SUCCEEDED and record.usage.completion_tokens == 400
        assert (await queue.get(queued.id)).status is JobStatus.QUEUED  # type: ignore[union-attr]
        assert worker.worker_id not in {w.id for w in await queue.live_workers()}  # deregistered
    finally:
        worker.stop()


async def test_kill_9_mid_generation_another_worker_finishes_with_the_same_greedy_text(
        smollm2: Path, queue: JobQueue, redis_url: str, tmp_path: Path) -> None:
    """Then SIGTERM on the second worker, whose drain timeout is short: the job it runs goes back, uncharged.
    (One test for both, as every SmolLM2 worker start costs tens of seconds on a busy 2-core machine.)"""
    params = GenerationParams(max_tokens=40, temperature=0)
    job = make_job(model="smollm2", messages=[ChatMessage(role="user", content="Tell me about the sea.")],
                   prompt=None, params=params)
    first = WorkerProcess(redis_url, smollm2, tmp_path, "smol-w1", name="smollm2").start()
    second = WorkerProcess(redis_url, smollm2, tmp_path, "smol-w2", name="smollm2", drain_timeout_s=0.1)
    try:
        await queue.submit(job)
        reader = asyncio.create_task(read_all(queue, job.id))
        await wait_tokens(queue, job.id, 3)
        first.signal(signal.SIGKILL)
        first.wait(10)
        second.start()  # its reaper requeues the job once the dead worker's 2 s lease expires

        record = await wait_final(queue, job.id, 120)
        assert record.status is JobStatus.SUCCEEDED and record.worker_id == "smol-w2", second.log_tail()
        assert record.attempts == 2
        events = await asyncio.wait_for(reader, 30)
        assert any(isinstance(e, RestartEvent) for e in events)
        assert client_text(events) == record.text

        fresh = job.model_copy(update={"id": job.id + "x2"})  # the same greedy job, uninterrupted
        await queue.submit(fresh)
        assert (await wait_final(queue, fresh.id, 120)).text == record.text

        long_job = make_job(model="smollm2", params=GenerationParams(max_tokens=2000, ignore_eos=True))
        await queue.submit(long_job)
        await wait_tokens(queue, long_job.id, 3)
        second.signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 30) == 0, second.log_tail()
        released = await queue.get(long_job.id)
        # attempts counts claims (1 so far); the restart names the next one; a drain charges no crash.
        assert released is not None and (released.status, released.attempts) == (JobStatus.QUEUED, 1)
        restart = await read_first(queue, long_job.id)
        assert isinstance(restart, RestartEvent) and restart.attempt == 2
        assert await queue.redis.hmget(KS.job(long_job.id), "crashes", "isolate") == [None, None]
        assert not {first.worker_id, second.worker_id} & {w.id for w in await queue.live_workers()}
    finally:
        first.stop()
        second.stop()
