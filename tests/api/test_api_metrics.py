"""The API's /metrics shows the whole service: queue depth per priority, live workers and their heartbeat gauges,
submissions, and what its lease reaper recovered; its lifecycle log lines are JSON with the job fields."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from shared.logging_setup import JsonFormatter
from shared.queue import JobQueue
from shared.schemas import JobStatus, WorkerInfo
from tests.api.conftest import ApiServer, wait_until
from tests.deploy.test_k8s_manifests import contract_metrics
from tests.observability.helpers import Samples, exported_types, scrape, value
from tests.queue.queue_helpers import make_job
from tests.worker.scripted_engine import MODEL, model_card


@pytest.fixture()
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def metrics_eventually(api: ApiServer, check: Callable[[Samples], bool], what: str) -> Samples:
    """The API refreshes its view of Redis every heartbeat interval: poll until ``check`` holds."""
    seen: list[Samples] = []

    def ok() -> bool:
        seen[:] = [scrape(f"{api.base_url}/metrics")]
        return check(seen[0])

    wait_until(ok, timeout_s=10, what=what)
    return seen[0]


async def test_metrics_show_queue_depth_per_priority_and_worker_heartbeats(
        api: ApiServer, redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    # A worker's heartbeat (no claiming: the jobs stay queued), with engine gauges the test can recognise.
    queue = JobQueue(redis, api.settings)
    now = time.time()
    await queue.register_worker(WorkerInfo(id="gpu-7", model=MODEL, max_num_seqs=64, num_running=3, num_waiting=2,
                                           kv_cache_usage=0.25, heartbeat_at=now, started_at=now), model_card())
    caplog.set_level(logging.INFO, logger="api.submission")
    with api.client() as client:
        for priority in (0, 0, 5):
            r = client.post("/v1/jobs", json={"prompt": "hello world", "max_tokens": 4, "priority": priority})
            assert r.status_code == 202, r.text

    samples = metrics_eventually(api, lambda s: value(s, "tokenspool_queue_depth", model=MODEL, priority="5") == 1,
                                 "queue depth of priority 5")
    assert value(samples, "tokenspool_queue_depth", model=MODEL, priority="0") == 2
    assert value(samples, "tokenspool_live_workers", model=MODEL) == 1
    assert value(samples, "tokenspool_worker_running_requests", worker="gpu-7", model=MODEL) == 3
    assert value(samples, "tokenspool_worker_waiting_requests", worker="gpu-7", model=MODEL) == 2
    assert value(samples, "tokenspool_worker_kv_cache_usage_ratio", worker="gpu-7", model=MODEL) == 0.25
    assert value(samples, "tokenspool_dead_letter_jobs") == 0
    assert value(samples, "tokenspool_api_jobs_submitted_total", model=MODEL, endpoint="jobs") == 3
    assert value(samples, "tokenspool_jobs_total", model=MODEL, event="submitted") == 3

    # One JSON line per submission, with the job fields and without the prompt.
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if getattr(r, "event", None)]
    assert [line["event"] for line in lines] == ["submitted"] * 3
    assert all(line["model"] == MODEL and len(line["job_id"]) == 32 and line["worker_id"] is None for line in lines)
    assert not any("hello world" in json.dumps(line) for line in lines)


async def test_reaped_jobs_are_counted_as_retried_then_dead_lettered(
        start_api: Callable[..., ApiServer], redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """A worker that claims and dies, three times: the API's reaper requeues the job twice, then gives up on it."""
    api = start_api(lease_ttl_s=0.5, heartbeat_interval_s=0.2, max_attempts=2)
    queue = JobQueue(redis, api.settings)
    caplog.set_level(logging.INFO, logger="shared.queue")
    job = make_job(model=MODEL)
    await queue.submit(job)
    for attempt in (1, 2, 3):  # the first crash isolates the job (uncharged); two more alone dead-letter it
        worker_id = f"doomed-{attempt}"
        assert [c.attempt for c in await queue.claim(MODEL, worker_id, 1)] == [attempt]
        wait_until(lambda w=worker_id: any(getattr(r, "worker_id", None) == w for r in caplog.records),
                   what=f"the reaper recovering attempt {attempt}")
    assert (await queue.get(job.id)).status == JobStatus.FAILED  # type: ignore[union-attr]

    samples = metrics_eventually(api, lambda s: value(s, "tokenspool_dead_letter_jobs") == 1, "dead-letter gauge")
    assert value(samples, "tokenspool_jobs_total", model=MODEL, event="retried") == 2
    assert value(samples, "tokenspool_jobs_total", model=MODEL, event="dead_lettered") == 1
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if getattr(r, "job_id", None) == job.id]
    assert [(line["event"], line["worker_id"], line["model"]) for line in lines] == [
        ("requeued", "doomed-1", MODEL), ("requeued", "doomed-2", MODEL), ("dead_lettered", "doomed-3", MODEL)]


def test_the_api_exports_only_contract_metrics(api: ApiServer) -> None:
    with api.client() as client:
        client.get("/healthz")
        text = client.get("/metrics").text
    exported = exported_types(text)
    assert {"tokenspool_api_requests_total", "tokenspool_jobs_total", "tokenspool_queue_depth",
            "tokenspool_live_workers"} <= set(exported)
    contract = contract_metrics()
    assert exported == {name: kind for name, kind in contract.items() if name in exported}

