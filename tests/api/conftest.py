"""API test fixtures: a real uvicorn serving ``create_app`` on a free port, against the session's real Redis,
and the production worker in process over a scripted engine (``tests.worker.scripted_engine``), whose text the
tests predict.

A real server (not httpx's ASGI transport, which buffers whole responses) is what streaming, disconnects and
the official openai client need.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared.config import Settings
from tests.in_process_api import ApiServer, serve_api
from tests.worker.scripted_engine import MODEL, InProcessWorker


def test_settings(redis_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"redis_url": redis_url, "model": MODEL, "lease_ttl_s": 5.0,
                              "heartbeat_interval_s": 1.0}
    values.update(overrides)
    return Settings(**values)


@pytest.fixture()
def start_api(redis_url: str) -> Iterator[Callable[..., ApiServer]]:
    """Start an API (settings overrides as keyword arguments); all are stopped after the test."""
    servers: list[ApiServer] = []

    def start(**overrides: Any) -> ApiServer:
        api = serve_api(test_settings(redis_url, **overrides))
        servers.append(api)
        return api

    yield start
    for api in servers:
        api.stop()


@pytest.fixture()
def api(start_api: Callable[..., ApiServer]) -> ApiServer:
    """An API with default test settings (no auth)."""
    return start_api()


@pytest.fixture()
def start_worker(redis_url: str) -> Iterator[Callable[..., InProcessWorker]]:
    workers: list[InProcessWorker] = []

    def start(**kwargs: Any) -> InProcessWorker:
        worker = InProcessWorker(redis_url, test_settings(redis_url), worker_id=f"scripted-{len(workers)}",
                                 **kwargs).start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture()
def worker(start_worker: Callable[..., InProcessWorker]) -> InProcessWorker:
    return start_worker()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def parse_sse(raw: str) -> list[dict[str, str]]:
    """SSE text as a list of events (``id``, ``event``, ``data``); comments (pings) are dropped."""
    events = []
    for block in raw.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            fields[name] = fields[name] + "\n" + value if name in fields else value
        if fields:
            events.append(fields)
    return events
