"""One real worker process (tiny Llama) with its metrics endpoint on a free port, shared by the observability
tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from shared.queue import JobQueue
from shared.redis_server import RedisServer
from tests.observability.helpers import WORKER_ID, ObservedWorker
from tests.queue.queue_helpers import queue_settings
from tests.queue.worker_process import WorkerProcess


@pytest.fixture(scope="session")
def observed_worker(redis_server: RedisServer, tiny_llama: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedWorker]:
    worker = WorkerProcess(redis_server.url, tiny_llama, tmp_path_factory.mktemp("obs-logs"), WORKER_ID,
                           metrics_port=0)
    worker.start()
    try:
        port = next(line["metrics_port"] for line in ObservedWorker(worker, "").log_lines() if "metrics_port" in line)
        url = f"http://127.0.0.1:{port}/metrics"
        yield ObservedWorker(worker, url)
    finally:
        worker.stop()


@pytest.fixture()
async def queue(redis_url: str) -> AsyncIterator[JobQueue]:
    client = Redis.from_url(redis_url)
    yield JobQueue(client, queue_settings(redis_url, lease_ttl_s=2), poll_interval_s=0.5)
    await client.aclose()
