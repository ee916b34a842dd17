"""The job resource: submit, read, SSE events (framing, resume), cancel, batches, idempotency."""

from __future__ import annotations

import json

import httpx
from conftest import ApiServer, parse_sse, wait_until

from tests.worker.scripted_engine import MODEL, InProcessWorker, expected_text


def _submit(client: httpx.Client, **body: object) -> str:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    data = response.json()
    assert data["status"] == "queued"
    assert data["links"] == {"self": f"/v1/jobs/{data['id']}", "events": f"/v1/jobs/{data['id']}/events"}
    return str(data["id"])


def test_job_runs_and_its_record_holds_the_result(api: ApiServer, worker: InProcessWorker) -> None:
    with api.client() as client:
        job_id = _submit(client, prompt="hello world", max_tokens=6, priority=5)
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", what="job done")
        record = client.get(f"/v1/jobs/{job_id}").json()
    assert record["text"] == expected_text("hello world", 6)
    assert record["finish_reason"] == "length"
    assert record["model"] == MODEL
    assert record["priority"] == 5
    assert record["usage"]["completion_tokens"] == 6


def test_events_are_framed_with_seq_ids_and_end_with_done(api: ApiServer, worker: InProcessWorker) -> None:
    # Non-ASCII and a newline inside a token must survive the framing (JSON on one data: line).
    prompt = "héllo\n世界 fox"
    with api.client() as client:
        job_id = _submit(client, prompt=prompt, max_tokens=5)
        response = client.get(f"/v1/jobs/{job_id}/events")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert [e["event"] for e in events] == ["token"] * 5 + ["done"]
    assert [int(e["id"]) for e in events] == [1, 2, 3, 4, 5, 6]
    tokens = [json.loads(e["data"]) for e in events[:-1]]
    assert [t["index"] for t in tokens] == [0] * 5
    assert "".join(t["text"] for t in tokens) == expected_text(prompt, 5)
    done = json.loads(events[-1]["data"])
    assert done["id"] == job_id and done["status"] == "succeeded"
    assert done["text"] == expected_text(prompt, 5)


def test_last_event_id_resumes_without_gap_or_duplicate(api: ApiServer, start_worker: object) -> None:
    start_worker(token_delay_s=0.02)  # type: ignore[operator]
    with api.client() as client:
        job_id = _submit(client, prompt="the quick brown fox", max_tokens=30)
        received: list[dict[str, str]] = []
        # Read part of the stream, drop the connection, resume from the last id seen; repeat.
        for attempt in range(3):
            headers = {"Last-Event-ID": received[-1]["id"]} if received else {}
            with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
                buffer = ""
                for chunk in response.iter_text():
                    buffer += chunk
                    complete, _, buffer = buffer.rpartition("\n\n")
                    received += parse_sse(complete)
                    if len(received) >= 8 * (attempt + 1):
                        break
        headers = {"Last-Event-ID": received[-1]["id"]}
        received += parse_sse(client.get(f"/v1/jobs/{job_id}/events", headers=headers).text)
    assert [int(e["id"]) for e in received] == list(range(1, 32))
    text = "".join(json.loads(e["data"])["text"] for e in received if e["event"] == "token")
    assert text == expected_text("the quick brown fox", 30)
    assert received[-1]["event"] == "done"


def test_events_after_the_job_finished_replay_everything(api: ApiServer, worker: InProcessWorker) -> None:
    with api.client() as client:
        job_id = _submit(client, prompt="fox", max_tokens=3)
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded")
        events = parse_sse(client.get(f"/v1/jobs/{job_id}/events").text)
        resumed = parse_sse(client.get(f"/v1/jobs/{job_id}/events?after=2").text)
    assert [e["event"] for e in events] == ["token", "token", "token", "done"]
    assert [e["id"] for e in resumed] == ["3", "4"]


def test_bad_last_event_id_is_a_400(api: ApiServer, worker: InProcessWorker) -> None:
    with api.client() as client:
        job_id = _submit(client, prompt="fox", max_tokens=1)
        response = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "abc"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "Last-Event-ID"


def test_cancel_a_queued_job(api: ApiServer) -> None:
    with api.client() as client:  # no worker: the job stays queued
        job_id = _submit(client, prompt="hello", max_tokens=3)
        response = client.delete(f"/v1/jobs/{job_id}")
        assert response.status_code == 200
        assert response.json()["status"] == "cancelled"
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
        events = parse_sse(client.get(f"/v1/jobs/{job_id}/events").text)
    assert events[-1]["event"] == "done"
    assert json.loads(events[-1]["data"])["status"] == "cancelled"


def test_cancel_a_running_job_stops_its_worker(api: ApiServer, start_worker: object) -> None:
    worker: InProcessWorker = start_worker(token_delay_s=0.05)  # type: ignore[operator]
    with api.client() as client:
        job_id = _submit(client, prompt="hello", max_tokens=400)
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "running")
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled", what="cancelled")
        record = client.get(f"/v1/jobs/{job_id}").json()
    assert job_id in worker.cancelled
    assert record["finish_reason"] == "abort"
    assert len(record["choices"][0]["token_ids"]) < 400


def test_unknown_job_is_404_in_openai_format(api: ApiServer) -> None:
    with api.client() as client:
        for method, path in [("GET", "/v1/jobs/0123456789abcdef"), ("DELETE", "/v1/jobs/0123456789abcdef"),
                             ("GET", "/v1/jobs/0123456789abcdef/events"), ("GET", "/v1/jobs/no!such..id")]:
            response = client.request(method, path)
            assert response.status_code == 404, (method, path)
            error = response.json()["error"]
            assert error["code"] == "job_not_found" and error["type"] == "not_found_error"


def test_idempotency_key_returns_the_first_job(api: ApiServer) -> None:
    with api.client() as client:
        first = client.post("/v1/jobs", json={"prompt": "hello", "idempotency_key": "order-17"})
        again = client.post("/v1/jobs", json={"prompt": "hello", "idempotency_key": "order-17"})
        other = client.post("/v1/jobs", json={"prompt": "hello", "idempotency_key": "order-18"})
    assert first.status_code == 202
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert other.json()["id"] != first.json()["id"]


def test_batch_gives_one_job_per_prompt(api: ApiServer, worker: InProcessWorker) -> None:
    prompts = ["hello", "the fox", [3, 4, 5]]
    with api.client() as client:
        response = client.post("/v1/jobs/batch", json={"prompts": prompts, "max_tokens": 4})
        assert response.status_code == 202, response.text
        ids = [job["id"] for job in response.json()["data"]]
        assert len(set(ids)) == 3
        for job_id in ids:
            wait_until(lambda job_id=job_id: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded")
        texts = [client.get(f"/v1/jobs/{job_id}").json()["text"] for job_id in ids]
    assert texts == [expected_text("hello", 4), expected_text("the fox", 4), expected_text([3, 4, 5], 4)]


def test_batch_size_is_capped(start_api: object) -> None:
    api: ApiServer = start_api(max_batch_size=2)  # type: ignore[operator]
    with api.client() as client:
        response = client.post("/v1/jobs/batch", json={"prompts": ["a", "b", "c"]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompts"


def test_messages_and_token_ids_are_accepted(api: ApiServer, worker: InProcessWorker) -> None:
    with api.client() as client:
        chat_id = _submit(client, messages=[{"role": "user", "content": "brown fox"}], max_tokens=3)
        ids_id = _submit(client, prompt_token_ids=[1, 2], max_tokens=3)
        wait_until(lambda: client.get(f"/v1/jobs/{ids_id}").json()["status"] == "succeeded")
        wait_until(lambda: client.get(f"/v1/jobs/{chat_id}").json()["status"] == "succeeded")
        assert client.get(f"/v1/jobs/{chat_id}").json()["text"] == expected_text("brown fox", 3)
        assert client.get(f"/v1/jobs/{ids_id}").json()["text"] == expected_text([1, 2], 3)


def test_invalid_job_bodies_are_400s_naming_the_field(api: ApiServer, worker: InProcessWorker) -> None:
    cases = [
        ({}, None),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 100_000}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "a", "n": 9}, "n"),
        ({"prompt": "a", "tempurature": 0.5}, "tempurature"),
        ({"prompt": "a", "priority": 5000}, "priority"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids.0"),
        ({"prompt_token_ids": [10**9]}, "prompt_token_ids"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ]
    with api.client() as client:
        for body, param in cases:
            response = client.post("/v1/jobs", json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
            if param is not None:
                assert error["param"] == param, (body, error)
        for raw in (b"{not json", b"[1, 2]", b"null"):
            response = client.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, raw


def test_prompt_too_long_for_the_model_names_the_limit(api: ApiServer, worker: InProcessWorker) -> None:
    # The test card says max_model_len 512 and its tokenizer makes one token per word.
    with api.client() as client:
        response = client.post("/v1/jobs", json={"prompt": "hello " * 505, "max_tokens": 10})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "512" in error["message"] and "515" in error["message"]
