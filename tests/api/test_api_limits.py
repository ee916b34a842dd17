"""Limits and isolation: API keys and job ownership, body size, queue full, disconnects, health and metrics."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from conftest import ApiServer, wait_until

from tests.worker.scripted_engine import MODEL, InProcessWorker, expected_text


@pytest.fixture()
def keyed_api(start_api: Callable[..., ApiServer]) -> ApiServer:
    return start_api(api_keys=["key-alice", "key-bob"])


def test_api_keys_are_required_when_configured(keyed_api: ApiServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-alice"}):
        response = httpx.post(f"{keyed_api.base_url}/v1/jobs", json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        keyed_api.openai_client("wrong").models.list()
    # Health endpoints stay open for orchestrators.
    assert httpx.get(f"{keyed_api.base_url}/healthz").status_code == 200


def test_a_job_is_visible_only_to_the_key_that_created_it(keyed_api: ApiServer, worker: InProcessWorker) -> None:
    with keyed_api.client("key-alice") as alice, keyed_api.client("key-bob") as bob:
        job_id = alice.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2}).json()["id"]
        wait_until(lambda: alice.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded")
        assert alice.get(f"/v1/jobs/{job_id}/events").status_code == 200
        for method, path in [("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/events"),
                             ("DELETE", f"/v1/jobs/{job_id}")]:
            response = bob.request(method, path)
            assert response.status_code == 404, (method, path)
            assert response.json()["error"]["code"] == "job_not_found"
        # The same idempotency key in two tenants names two different jobs.
        a = alice.post("/v1/jobs", json={"prompt": "hello", "idempotency_key": "k1"}).json()["id"]
        b = bob.post("/v1/jobs", json={"prompt": "hello", "idempotency_key": "k1"}).json()["id"]
        assert a != b


def test_body_over_the_limit_is_413(start_api: Callable[..., ApiServer]) -> None:
    api = start_api(max_body_bytes=2048)
    big = {"prompt": "x" * 4096}
    response = httpx.post(f"{api.base_url}/v1/jobs", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunked() -> object:  # no Content-Length: the limit is enforced while reading
        body = json.dumps(big).encode()
        for i in range(0, len(body), 512):
            yield body[i:i + 512]

    response = httpx.post(f"{api.base_url}/v1/jobs", content=chunked(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_full_queue_is_429_with_retry_after(start_api: Callable[..., ApiServer]) -> None:
    api = start_api(max_queue_length=2)
    with api.client() as client:  # no worker: jobs stay queued
        assert client.post("/v1/jobs", json={"prompt": "a"}).status_code == 202
        assert client.post("/v1/jobs", json={"prompt": "b"}).status_code == 202
        for path, body in [("/v1/jobs", {"prompt": "c"}), ("/v1/completions", {"prompt": "c"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "c"}], "stream": True}),
                           ("/v1/jobs/batch", {"prompts": ["c"]})]:
            response = client.post(path, json=body)
            assert response.status_code == 429, path
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        api.openai_client("x").completions.create(
            model=MODEL, prompt="d")


def _read_some_then_disconnect(api: ApiServer, body: dict[str, object], path: str = "/v1/chat/completions") -> str:
    """Open a stream over a raw socket, read the first data line, and drop the connection."""
    payload = json.dumps(body).encode()
    host, port = api.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(4096)
    return received.decode()


def _job_id_from(raw: str) -> str:
    first = raw[raw.index("data: ") + 6:]
    return str(json.loads(first[: first.index("\n")])["id"]).removeprefix("chatcmpl-")


def test_disconnecting_a_stream_cancels_its_job(api: ApiServer, start_worker: Callable[..., InProcessWorker]) -> None:
    worker = start_worker(token_delay_s=0.05)
    raw = _read_some_then_disconnect(api, {"messages": [{"role": "user", "content": "fox"}], "max_tokens": 400,
                                           "stream": True})
    job_id = _job_id_from(raw)
    with api.client() as client:
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled", what="cancel")
    assert job_id in worker.cancelled


def test_background_stream_survives_its_client(api: ApiServer, start_worker: Callable[..., InProcessWorker]) -> None:
    worker = start_worker(token_delay_s=0.01)
    raw = _read_some_then_disconnect(api, {"messages": [{"role": "user", "content": "fox"}], "max_tokens": 60,
                                           "stream": True, "background": True})
    job_id = _job_id_from(raw)
    with api.client() as client:
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", what="success")
        assert client.get(f"/v1/jobs/{job_id}").json()["text"] == expected_text("fox", 60)
    assert job_id not in worker.cancelled


def test_disconnecting_a_non_streamed_request_cancels_its_job(api: ApiServer,
                                                              start_worker: Callable[..., InProcessWorker]) -> None:
    worker = start_worker(token_delay_s=0.05)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.base_url}/v1/completions", json={"prompt": "fox", "max_tokens": 400}, timeout=0.5)
    wait_until(lambda: len(worker.cancelled) == 1, what="the worker told to cancel")
    job_id = next(iter(worker.cancelled))
    wait_until(lambda: httpx.get(f"{api.base_url}/v1/jobs/{job_id}").json()["status"] == "cancelled")


def test_health_readiness_and_metrics(api: ApiServer, start_worker: Callable[..., InProcessWorker]) -> None:
    with api.client() as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        not_ready = client.get("/readyz")
        assert not_ready.status_code == 503 and not_ready.json()["error"]["code"] == "no_workers"
        start_worker()
        assert client.get("/readyz").json() == {"status": "ready", "workers": 1}
        client.post("/v1/completions", json={"prompt": "fox", "max_tokens": 2})
        client.get("/v1/jobs/0123456789abcdef")
        time.sleep(0.1)  # the metrics middleware records after the last byte is sent
        metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'tokenspool_api_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text
    assert 'tokenspool_api_requests_total{method="GET",route="/v1/jobs/{job_id}",status="404"} 1.0' in text
    assert f'tokenspool_api_jobs_submitted_total{{endpoint="completions",model="{MODEL}"}} 1.0' in text
    assert "tokenspool_api_request_duration_seconds_bucket" in text


def test_unknown_routes_and_methods_use_the_error_body(api: ApiServer) -> None:
    with api.client() as client:
        missing = client.get("/v2/nothing")
        wrong_method = client.put("/v1/jobs")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]
