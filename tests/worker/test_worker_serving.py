"""One real worker process (tiny random Llama) serving a real Redis: a raw-protocol client, concurrency, bad jobs,
cancellation and a Redis restart mid-run."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from shared import keys
from shared.launcher.redis_server import RedisServer
from shared.queue import JobQueue
from shared.schemas import (
    ChatMessage,
    DoneEvent,
    GenerationParams,
    JobStatus,
)
from tests.queue.queue_helpers import make_job, worker_test_queue
from tests.worker.worker_process import WorkerProcess, client_text, read_all, wait_config, wait_final, wait_tokens

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow
LUA_SUBMIT = Path(__file__).resolve().parents[2] / "shared" / "lua" / "submit.lua"
LONG = GenerationParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_worker(redis_server: RedisServer, tiny_llama: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(redis_server.url, tiny_llama, tmp_path_factory.mktemp("logs"), "tiny-w1")
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture()
async def queue(redis_url: str) -> AsyncIterator[JobQueue]:
    async with worker_test_queue(redis_url) as job_queue:
        yield job_queue


async def test_job_submitted_with_raw_redis_commands_is_completed(tiny_worker: WorkerProcess,
                                                                  redis_url: str) -> None:
    """Another backend: EVAL the shipped submit.lua, poll the record, read result and tokens. No project code."""
    job_id = "rawbackend-job-1"
    body = json.dumps({"id": job_id, "model": "tiny", "prompt": "Once upon a time",
                       "params": {"max_tokens": 12, "temperature": 0}})
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        wait_config(r)  # the test's Redis was just flushed
        reply = r.eval(LUA_SUBMIT.read_text(), 4, f"ts:job:{{0}}:{job_id}", "ts:queue:{0}:tiny",
                       "ts:queue:{0}:tiny:seq", "ts:config:{0}", body)
        assert reply[0] == "created"
        deadline = time.monotonic() + 60
        while r.hget(f"ts:job:{{0}}:{job_id}", "status") not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, tiny_worker.log_tail()
            time.sleep(0.05)
        record = r.hgetall(f"ts:job:{{0}}:{job_id}")
        log = [json.loads(fields["data"]) for _, fields in r.xrange(f"ts:job:{{0}}:{job_id}:log")]

    assert record["status"] == "succeeded", record.get("error")
    result = json.loads(record["result"])
    assert result["usage"]["completion_tokens"] == 12 and result["choices"][0]["finish_reason"] == "length"
    assert "".join(e["text"] for e in log if e["type"] == "token") == result["choices"][0]["text"]
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    assert log[-1] == {"seq": len(log), "type": "done", "status": "succeeded"}
    assert float(record["created_at"]) <= float(record["started_at"]) <= float(record["first_token_at"]) \
        <= float(record["finished_at"])


async def test_jobs_run_concurrently(tiny_worker: WorkerProcess, queue: JobQueue) -> None:
    jobs = [make_job(prompt=f"Story number {i}", params=GenerationParams(max_tokens=150, ignore_eos=True, seed=i))
            for i in range(4)]
    for job in jobs:
        await queue.submit(job)
    records = [await wait_final(queue, job.id) for job in jobs]
    assert all(r.status is JobStatus.SUCCEEDED and r.usage.completion_tokens == 150 for r in records)
    assert max(r.started_at for r in records) < min(r.finished_at for r in records)  # type: ignore[type-var]
    assert {r.worker_id for r in records} == {"tiny-w1"}
    [info] = [w for w in await queue.live_workers() if w.id == "tiny-w1"]  # other modules' workers may be live
    card = await queue.model_card("tiny")
    assert info.id == "tiny-w1" and card is not None and card.max_model_len == 1024 and card.vocab_size == 49152


async def test_new_jobs_wake_the_worker_whether_idle_or_busy(redis_server: RedisServer, tiny_llama: Path,
                                                             queue: JobQueue, tmp_path: Path) -> None:
    """With its unprompted claims a minute apart, only the wake channel can get a job claimed within seconds:
    first by the idle worker, then by the same worker while it decodes another job."""
    worker = WorkerProcess(redis_server.url, tiny_llama, tmp_path, "wake-w1", name="tiny-wake",
                           claim_poll_s=60).start()
    try:
        await asyncio.sleep(0.5)  # past its first claim at start: idle, waiting for a wake message
        running = make_job(model="tiny-wake", params=GenerationParams(max_tokens=1000, ignore_eos=True))
        await queue.submit(running)
        await wait_tokens(queue, running.id, 3, timeout_s=20)
        second = make_job(model="tiny-wake", params=GenerationParams(max_tokens=5))
        await queue.submit(second)
        await wait_tokens(queue, second.id, 1, timeout_s=20)
        records = [await queue.get(job.id) for job in (running, second)]
        assert all(r is not None and r.started_at is not None and r.created_at is not None
                   and r.started_at - r.created_at < 10 for r in records), worker.log_tail()
        assert records[0] is not None and records[0].status is JobStatus.RUNNING  # the second came in busy
        await queue.cancel(running.id)
    finally:
        worker.stop()


async def test_bad_jobs_fail_clearly_and_the_worker_keeps_serving(tiny_worker: WorkerProcess, queue: JobQueue,
                                                                  redis_url: str) -> None:
    too_long = make_job(prompt=None, prompt_token_ids=[5] * 2000)
    bad_token = make_job(prompt=None, prompt_token_ids=[10**6])
    await queue.submit(too_long)
    await queue.submit(bad_token)
    with redis.Redis.from_url(redis_url) as r:  # pushed by hand: a job for another model in this queue
        r.hset(KS.job("wrongmodel-1"), mapping={
            "id": "wrongmodel-1", "model": "tiny", "status": "queued", "score": 0, "attempts": 0, "fence": 0,
            "seq": 0, "submission": json.dumps({"id": "wrongmodel-1", "model": "other", "prompt": "x"})})
        r.zadd(KS.queue("tiny", 0), {"wrongmodel-1": 0})
    chat = make_job(prompt=None, messages=[ChatMessage(role="user", content="Hi!")],
                    params=GenerationParams(max_tokens=5, temperature=0))
    await queue.submit(chat)

    assert "max_model_len" in ((await wait_final(queue, too_long.id)).error or "")
    assert "prompt_token_ids[0]" in ((await wait_final(queue, bad_token.id)).error or "")
    assert "do not match" in ((await wait_final(queue, "wrongmodel-1")).error or "")
    done = await wait_final(queue, chat.id)
    assert done.status is JobStatus.SUCCEEDED and done.usage.completion_tokens == 5
    assert tiny_worker.proc is not None and tiny_worker.proc.poll() is None


async def test_cancel_a_running_job(tiny_worker: WorkerProcess, queue: JobQueue) -> None:
    job = make_job(params=GenerationParams(max_tokens=1000, temperature=0, ignore_eos=True))
    await queue.submit(job)
    await wait_tokens(queue, job.id, 3)
    async with queue.open_stream(job.id) as stream:
        cancelled_at = time.monotonic()
        await queue.cancel(job.id)
        events = [event async for event in stream]
    record = await wait_final(queue, job.id, 5)
    assert time.monotonic() - cancelled_at < 2.0
    assert record.status is JobStatus.CANCELLED and record.finish_reason == "abort"
    assert 0 < record.usage.completion_tokens < 1000
    assert isinstance(events[-1], DoneEvent) and events[-1].job.status is JobStatus.CANCELLED
    assert client_text(events) == record.text


async def test_redis_restart_mid_run_loses_nothing(tiny_worker: WorkerProcess, queue: JobQueue,
                                                   redis_server: RedisServer) -> None:
    jobs = [make_job(prompt=f"Tale {i}", params=LONG) for i in range(3)]
    for job in jobs:
        await queue.submit(job)
    reader = asyncio.create_task(read_all(queue, jobs[0].id))
    await wait_tokens(queue, jobs[0].id, 5)

    await asyncio.to_thread(redis_server.restart)  # SIGTERM: the AOF is flushed, then the same port and data

    records = [await wait_final(queue, job.id, 90) for job in jobs]
    assert [r.status for r in records] == [JobStatus.SUCCEEDED] * 3, tiny_worker.log_tail()
    assert all(r.usage.completion_tokens == 400 for r in records)
    events = await asyncio.wait_for(reader, 30)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert client_text(events) == records[0].text
    assert tiny_worker.proc is not None and tiny_worker.proc.poll() is None


async def test_a_result_redis_refuses_fails_that_job_and_the_worker_keeps_serving(tiny_worker: WorkerProcess,
                                                                                  queue: JobQueue) -> None:
    """complete.lua raising a script error (here: the tenants' clock was made infinite by hand, so settling the
    job's tokens is refused) fails that job with the reason; the worker lives on and serves the next job."""
    params = GenerationParams(max_tokens=4, temperature=0)
    await queue.redis.hset(KS.queue_vtime("tiny", 0), keys.tenant_of(None), "inf")
    refused = make_job(model="tiny", params=params)
    await queue.submit(refused)
    record = await wait_final(queue, refused.id)
    assert record.status is JobStatus.FAILED and "refused" in (record.error or ""), record.error

    await queue.redis.delete(KS.queue_vtime("tiny", 0))
    served = make_job(model="tiny", params=params)
    await queue.submit(served)
    assert (await wait_final(queue, served.id)).status is JobStatus.SUCCEEDED
    assert tiny_worker.proc is not None and tiny_worker.proc.poll() is None
