"""A real worker process (tiny Llama) with its metrics endpoint on a free port, one per test module: it must not
outlive its module (it reaps leases and counts as a live worker, which other modules' tests would notice)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shared.launcher.redis_server import RedisServer
from shared.queue import JobQueue
from tests.observability.helpers import ObservedWorker
from tests.queue.queue_helpers import worker_test_queue
from tests.worker.worker_process import WorkerProcess


@pytest.fixture(scope="module")
def observed_worker(redis_server: RedisServer, tiny_llama: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedWorker]:
    # A fresh id per module: WorkerProcess.start waits for the id's registration, which a killed predecessor
    # of the same id would leave behind.
    worker = WorkerProcess(redis_server.url, tiny_llama, tmp_path_factory.mktemp("obs-logs"),
                           f"obs-{secrets.token_hex(3)}", metrics_port=0)
    worker.start()
    try:
        port = next(line["metrics_port"] for line in ObservedWorker(worker, "").log_lines() if "metrics_port" in line)
        url = f"http://127.0.0.1:{port}/metrics"
        yield ObservedWorker(worker, url)
    finally:
        worker.stop()


@pytest.fixture()
async def queue(redis_url: str) -> AsyncIterator[JobQueue]:
    async with worker_test_queue(redis_url) as job_queue:
        yield job_queue
