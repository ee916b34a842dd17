"""Restarting the shared parts under load: Redis (AOF on) and the API process, while clients stream and poll.
Jobs must all finish, and streaming clients must resume (Last-Event-ID) without a gap or a duplicate."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from shared import keys
from shared.launcher.redis_server import RedisServer
from tests.reliability.stack import ApiProcess, Stream, assert_clean_stream, follow, poll, submit
from tests.worker.worker_process import WorkerProcess

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow


async def _wait_events(redis: Redis, job_id: str, count: int, timeout_s: float = 60) -> None:
    """Until the job's log holds ``count`` events, or the job ended (a quiet machine may finish it first)."""
    deadline = time.monotonic() + timeout_s
    while int(await redis.hget(KS.job(job_id), "seq") or 0) < count:
        if await redis.hget(KS.job(job_id), "status") in (b"succeeded", b"failed", b"cancelled"):
            return
        assert time.monotonic() < deadline, f"job {job_id} produced no tokens"
        await asyncio.sleep(0.02)


Polled = asyncio.Task[tuple[dict[str, Any], int]]  # a poll() task: the final job record and the polls it took


async def _start_clients(client: httpx.AsyncClient, title: str, num_jobs: int, body: dict[str, Any]
                         ) -> tuple[list[str], list[asyncio.Task[Stream]], list[Polled]]:
    """Submit ``num_jobs`` jobs; the first half are followed over SSE, the second half polled by id."""
    job_ids = [await submit(client, f"{title} {i}", **body) for i in range(num_jobs)]
    half = num_jobs // 2
    streamed = [asyncio.create_task(follow(client, job_id)) for job_id in job_ids[:half]]
    polled = [asyncio.create_task(poll(client, job_id)) for job_id in job_ids[half:]]
    return job_ids, streamed, polled


def _check_streams(streams: list[Stream], max_tokens: int) -> None:
    for stream in streams:
        assert_clean_stream(stream)
        assert stream.ids[0] == 1
        assert stream.final["usage"]["completion_tokens"] == max_tokens


async def test_redis_restart_mid_run_api_and_workers_reconnect_and_nothing_is_lost(
        api_process: ApiProcess, standing_worker: WorkerProcess, redis_server: RedisServer, redis_url: str) -> None:
    body = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=api_process.base_url, timeout=30) as client:
        # 12 jobs for a worker that runs 8 at a time: some are running and some queued when Redis goes away.
        job_ids, streamed, polled = await _start_clients(client, "Chapter", 12, body)
        async with Redis.from_url(redis_url) as redis:
            await _wait_events(redis, job_ids[0], 5)
        await asyncio.to_thread(redis_server.restart)  # SIGTERM: the AOF is flushed; same port, same data

        streams = await asyncio.wait_for(asyncio.gather(*streamed), 120)
        finals = [job for job, _ in await asyncio.wait_for(asyncio.gather(*polled), 120)]
        after = await submit(client, "After the outage", max_tokens=4)  # the API serves new work
        finals.append((await poll(client, after))[0])

    _check_streams(streams, 200)
    assert [job["status"] for job in finals] == ["succeeded"] * 7
    async with Redis.from_url(redis_url) as redis:
        assert await redis.zcard(KS.inflight(0)) == 0 and await redis.zcard(KS.queue("tiny-rel", 0)) == 0
    assert standing_worker.proc is not None and standing_worker.proc.poll() is None
    assert api_process.process is not None and api_process.process.proc.poll() is None


async def test_api_restart_clients_resume_with_last_event_id(api_process: ApiProcess, standing_worker: WorkerProcess,
                                                             redis_url: str) -> None:
    """A crash (SIGKILL) and then a graceful restart (SIGTERM) of the only API process, mid-stream."""
    body = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=api_process.base_url, timeout=30) as client:
        job_ids, streamed, polled = await _start_clients(client, "Volume", 8, body)
        async with Redis.from_url(redis_url) as redis:
            await _wait_events(redis, job_ids[0], 5)
            for sig in (signal.SIGKILL, signal.SIGTERM):
                await asyncio.to_thread(api_process.kill, sig)  # in a thread: the clients keep trying meanwhile
                await asyncio.to_thread(api_process.start)
                await _wait_events(redis, job_ids[0], int(await redis.hget(KS.job(job_ids[0]), "seq")) + 5)

        streams = await asyncio.wait_for(asyncio.gather(*streamed), 120)
        polls = await asyncio.wait_for(asyncio.gather(*polled), 120)

    _check_streams(streams, 900)
    assert max(s.connections for s in streams) >= 2, [s.connections for s in streams]  # resumed mid-stream
    assert [job["status"] for job, _ in polls] == ["succeeded"] * 4
    assert max(failures for _, failures in polls) >= 1  # the pollers did see the API gone
