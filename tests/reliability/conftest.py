"""Reliability fixtures: one ``tokenspool api`` process and one standing worker for the whole run, plus worker
processes per test, all on the session's real Redis (flushed before each test by ``redis_url``). The shared
processes are started once because every start costs seconds (torch, the model) on a busy 2-core machine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.launcher.redis_server import RedisServer
from tests.reliability.stack import MODEL, ApiProcess
from tests.worker.worker_process import WorkerProcess


@pytest.fixture(scope="session")
def api_process(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    """One API process; a test may kill and restart it (same port)."""
    if not redis_server.running:
        redis_server.start()
    api = ApiProcess(redis_server.url, tmp_path_factory.mktemp("api-logs")).start()
    yield api
    api.stop()


@pytest.fixture()
def new_worker(redis_url: str, tiny_llama: Path, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Make (not start) tiny-Llama workers on the test Redis; every one is killed after the test."""
    made: list[WorkerProcess] = []

    def make(worker_id: str, **settings: object) -> WorkerProcess:
        worker = WorkerProcess(redis_url, tiny_llama, tmp_path, worker_id, name=MODEL, **settings)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop()


@pytest.fixture(scope="session")
def standing_worker(redis_server: RedisServer, tiny_llama: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A worker that lasts the whole run and outlives each test's faulty ones. Tests may freeze it (SIGSTOP)
    for a while but must leave it running."""
    if not redis_server.running:
        redis_server.start()
    worker = WorkerProcess(redis_server.url, tiny_llama, tmp_path_factory.mktemp("standing"), "standing", name=MODEL)
    worker.start()
    yield worker
    worker.stop()
