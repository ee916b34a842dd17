"""Signed webhooks, received by a real HTTP server on a local port that fails the first attempts of every message:
every job and batch event arrives, with the same webhook-id on every attempt, and every signature verifies with
the ``standardwebhooks`` package. Also: the callback allow-list, dead-lettering, and an API restart."""

from __future__ import annotations

import base64
import json
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
import redis
from conftest import ApiServer, wait_until
from standardwebhooks.webhooks import Webhook

from shared import keys
from shared.launcher.redis_server import free_port
from tests.worker.scripted_engine import MODEL, InProcessWorker

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


@dataclass
class Attempt:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """An HTTP server answering 500 to the first ``fail_first`` attempts of each webhook-id, then 204."""

    port: int
    fail_first: int = 2
    attempts: list[Attempt] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str = "/hooks") -> str:
        return f"http://localhost:{self.port}{path}"

    def by_id(self) -> dict[str, list[Attempt]]:
        with self.lock:
            grouped: dict[str, list[Attempt]] = defaultdict(list)
            for attempt in self.attempts:
                grouped[attempt.headers["webhook-id"]].append(attempt)
            return dict(grouped)

    def delivered(self) -> list[tuple[str, dict[str, Any]]]:
        """(path, verified payload) of each message's successful attempt."""
        out = []
        for attempts in self.by_id().values():
            if len(attempts) > self.fail_first:
                last = attempts[self.fail_first]
                out.append((last.path, Webhook(SECRET).verify(last.body, last.headers)))
        return out


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    state = Receiver(free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["content-length"]))
            with state.lock:
                state.attempts.append(Attempt(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                seen = sum(a.headers["webhook-id"] == self.headers["webhook-id"] for a in state.attempts)
            self.send_response(500 if seen <= state.fail_first else 204)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", state.port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def _webhook_api(start_api: Callable[..., ApiServer], receiver: Receiver, **overrides: Any) -> ApiServer:
    return start_api(webhook_urls=[receiver.url()], webhook_signing_key=SECRET, webhook_allowed_hosts=["localhost"],
                     webhook_backoff_s=0.1, batch_poll_s=0.1, **overrides)


def _events(receiver: Receiver) -> list[tuple[str, str, str]]:
    """(path, event type, subject id) of every delivered message, sorted."""
    return sorted((path, p["type"], p["data"]["id"]) for path, p in receiver.delivered())


def test_every_event_arrives_signed_after_failed_attempts(start_api: Callable[..., ApiServer], receiver: Receiver,
                                                          start_worker: Callable[..., InProcessWorker],
                                                          request: pytest.FixtureRequest) -> None:
    api = _webhook_api(start_api, receiver)
    http = api.client()
    request.addfinalizer(http.close)
    queued_id = http.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2}).json()["id"]
    assert http.delete(f"/v1/jobs/{queued_id}").status_code == 200  # no worker yet: cancelled while queued
    start_worker()
    job_id = http.post("/v1/jobs", json={"prompt": "the fox", "max_tokens": 3,
                                         "webhook_url": receiver.url("/job-callback")}).json()["id"]
    client = api.openai_client("x", timeout=openai.DEFAULT_TIMEOUT)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "hello", "max_tokens": 2}}
    file_id = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h",
                                  extra_body={"webhook_url": receiver.url("/batch-callback")})
    bad_file = client.files.create(file=("bad.jsonl", b"{oops\n"), purpose="batch").id
    failed = client.batches.create(input_file_id=bad_file, endpoint="/v1/completions", completion_window="24h")
    expected = sorted([
        ("/hooks", "job.cancelled", queued_id),
        ("/hooks", "job.succeeded", job_id), ("/job-callback", "job.succeeded", job_id),
        ("/hooks", "batch.completed", batch.id), ("/batch-callback", "batch.completed", batch.id),
        ("/hooks", "batch.failed", failed.id),
    ])
    wait_until(lambda: len(receiver.delivered()) >= len(expected), timeout_s=30, what="every event delivered")
    time.sleep(0.5)  # nothing more arrives
    assert _events(receiver) == expected
    for attempts in receiver.by_id().values():
        # Three attempts, one message: same id and body each time, each signed (and verified) on its own.
        assert len(attempts) == 3 and len({a.body for a in attempts}) == 1
        for attempt in attempts[:2]:
            Webhook(SECRET).verify(attempt.body, attempt.headers)
    done = [p for path, p in receiver.delivered() if p["type"] == "job.succeeded"][0]
    assert done["data"]["status"] == "succeeded" and done["data"]["text"]
    with redis.Redis.from_url(api.settings.redis_url or "") as r:
        assert r.zcard(keys.WEBHOOKS_DUE) == 0


def test_callback_hosts_must_be_allowed(start_api: Callable[..., ApiServer], receiver: Receiver) -> None:
    api = _webhook_api(start_api, receiver)
    with api.client() as http:
        answer = http.post("/v1/jobs", json={"prompt": "hi", "webhook_url": "http://10.0.0.1/admin"})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "webhook_url_not_allowed"
        answer = http.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions",
                                              "completion_window": "24h",
                                              "webhook_url": "http://metadata.internal/"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "webhook_url"


def test_gives_up_into_the_dead_letter_set(start_api: Callable[..., ApiServer], receiver: Receiver,
                                           worker: InProcessWorker, caplog: pytest.LogCaptureFixture,
                                           request: pytest.FixtureRequest) -> None:
    receiver.fail_first = 10**6
    api = _webhook_api(start_api, receiver, webhook_retry_s=1.0)
    with api.client() as http:
        http.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 1})
    client = redis.Redis.from_url(api.settings.redis_url or "")
    request.addfinalizer(client.close)
    wait_until(lambda: client.zcard(keys.WEBHOOKS_DEAD) == 1, timeout_s=20, what="dead-lettered")
    [message_id] = [x.decode() for x in client.zrange(keys.WEBHOOKS_DEAD, 0, -1)]
    record = client.hgetall(keys.webhook(message_id))
    assert record[b"state"] == b"dead" and record[b"last_error"] == b"HTTP 500" and int(record[b"attempts"]) >= 2
    assert len(receiver.by_id()[message_id]) == int(record[b"attempts"])
    wait_until(lambda: "tokenspool_webhooks_dead_lettered 1.0" in httpx.get(f"{api.base_url}/metrics").text,
               what="dead letters in the metrics")
    assert 'tokenspool_webhook_attempts_total{outcome="dead_lettered"} 1.0' in httpx.get(f"{api.base_url}/metrics").text
    assert any("dead-lettered" in r.getMessage() for r in caplog.records)


def test_events_survive_an_api_restart(start_api: Callable[..., ApiServer], receiver: Receiver,
                                       start_worker: Callable[..., InProcessWorker],
                                       request: pytest.FixtureRequest) -> None:
    first = _webhook_api(start_api, receiver)
    client = redis.Redis.from_url(first.settings.redis_url or "")
    request.addfinalizer(client.close)
    wait_until(lambda: bool(client.exists(KS.job_events(0))), what="the job-event group")
    start_worker(token_delay_s=0.05)
    with first.client() as http:
        job_id = http.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 20}).json()["id"]
    first.stop()  # no API runs when the job ends: its event waits in the stream
    wait_until(lambda: client.hget(KS.job(job_id), "status") == b"succeeded", what="the job")
    _webhook_api(start_api, receiver)
    wait_until(lambda: len(receiver.delivered()) == 1, timeout_s=20, what="the event after the restart")
    assert _events(receiver) == [("/hooks", "job.succeeded", job_id)]
