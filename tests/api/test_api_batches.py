"""The Files and Batch APIs read by the official ``openai`` client, over the real worker and a scripted engine:
upload, create, poll, list, cancel, download; validation; expiry; tenant isolation; an API restart mid-batch."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis
from conftest import ApiServer, wait_until

from shared import keys
from tests.worker.scripted_engine import MODEL, InProcessWorker, expected_text


def _client(api: ApiServer, key: str = "unused") -> openai.OpenAI:
    return api.openai_client(key)


def _chat_line(custom_id: str, content: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     **body}}


def _jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def _upload(client: openai.OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch").id


def _wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch}"
        time.sleep(0.1)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_files_round_trip(api: ApiServer) -> None:
    client = _client(api)
    content = _jsonl([_chat_line("a", "hello")])
    created = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert created.id.startswith("file-") and created.bytes == len(content) and created.purpose == "batch"
    assert created.expires_at == created.created_at + api.settings.file_retention_s
    assert client.files.retrieve(created.id).filename == "in.jsonl"
    assert client.files.content(created.id).content == content
    assert [f.id for f in client.files.list()] == [created.id]
    assert client.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", content), purpose="fine-tune")


def test_file_size_cap(start_api: Callable[..., ApiServer]) -> None:
    api = start_api(file_max_bytes=2048)
    with pytest.raises(openai.APIStatusError) as caught:
        _client(api).files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert caught.value.status_code == 413


def test_batch_runs_every_line_once(start_api: Callable[..., ApiServer], worker: InProcessWorker) -> None:
    api = start_api(batch_poll_s=0.1, batch_max_queued=2)
    client = _client(api)
    prompts = ["hello world", "quick brown fox", "the fox", "brown hello", "world world"]
    file_id = _upload(client, [_chat_line(f"req-{i}", p, max_tokens=3 + i) for i, p in enumerate(prompts)])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"team": "a"})
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == 5 and batch.metadata == {"team": "a"}
    done = _wait_status(client, batch.id, ("completed",))
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
    assert done.completed_at is not None and done.finalizing_at is not None and done.error_file_id is None
    output = _lines(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(5)]
    for i, line in enumerate(output):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == expected_text(prompts[i], 3 + i)
    # Every line ran as an ordinary job, at the batch priority, exactly once.
    job_ids = [line["response"]["request_id"] for line in output]
    assert sorted(worker.claimed) == sorted(job_ids)
    job = client.get(f"/jobs/{job_ids[0]}", cast_to=dict)  # type: ignore[type-var]
    assert job["priority"] == api.settings.batch_priority
    listed = client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]


def test_completions_batch_and_listing_pages(api: ApiServer, worker: InProcessWorker) -> None:
    client = _client(api)
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "the quick fox", "max_tokens": 5}}]
    ids = [client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/completions",
                                 completion_window="24h").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == ids[:1] and not second.has_more
    done = _wait_status(client, ids[0], ("completed",))
    [line] = _lines(client, done.output_file_id)
    assert line["response"]["body"]["choices"][0]["text"] == expected_text("the quick fox", 5)


def test_validation_fails_the_batch_before_anything_runs(api: ApiServer, worker: InProcessWorker) -> None:
    client = _client(api)
    lines = [
        _chat_line("ok", "hello"),
        "{not json",
        {**_chat_line("wrong-url", "hello"), "url": "/v1/embeddings"},
        {**_chat_line("wrong-method", "hello"), "method": "GET"},
        _chat_line("ok", "duplicate id"),
        _chat_line("too-long", "hello", max_tokens=api.settings.max_tokens_cap + 1),
        _chat_line("bad-temp", "hello", temperature=-3),
        _chat_line("stream", "hello", stream=True),
    ]
    batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.errors is not None
    errors = {e.line: (e.code, e.param) for e in batch.errors.data or []}
    assert errors[2][0] == "invalid_json_line"
    assert errors[3] == ("invalid_url", "url")
    assert errors[4][1] == "method"
    assert errors[5] == ("duplicate_custom_id", "custom_id")
    assert errors[6] == ("max_tokens_too_large", "max_tokens")  # the chat endpoint's own check and code
    assert errors[7][1] == "temperature"
    assert errors[8][1] == "body.stream"
    assert 1 not in errors
    assert worker.claimed == []
    assert client.batches.retrieve(batch.id).status == "failed"


def test_too_many_lines(start_api: Callable[..., ApiServer]) -> None:
    api = start_api(batch_max_lines=2)
    client = _client(api)
    lines = [_chat_line(str(i), "hello") for i in range(3)]
    batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    assert [e.code for e in batch.errors.data or []] == ["too_many_requests"]


def test_cancel_stops_queued_and_running_lines(start_api: Callable[..., ApiServer],
                                               start_worker: Callable[..., InProcessWorker]) -> None:
    api = start_api(batch_poll_s=0.1, batch_max_queued=3)
    worker = start_worker(token_delay_s=0.05)
    client = _client(api)
    lines = [_chat_line(f"r{i}", "hello world", max_tokens=1 if i == 0 else 400) for i in range(8)]
    batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_until(lambda: len(worker.claimed) >= 2, what="lines running")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = _wait_status(client, batch.id, ("cancelled",))
    counts = done.request_counts
    assert counts is not None and counts.completed + counts.failed == counts.total == 8
    results = _lines(client, done.output_file_id) + _lines(client, done.error_file_id)
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(8))
    cancelled = [r for r in results if r["error"] is not None]
    assert len(cancelled) == counts.failed and {r["error"]["code"] for r in cancelled} == {"batch_cancelled"}
    assert len(worker.claimed) < 8  # lines never submitted never ran
    with pytest.raises(openai.APIStatusError):
        client.batches.cancel(_wait_status(client, client.batches.create(
            input_file_id=_upload(client, [_chat_line("x", "hello")]), endpoint="/v1/chat/completions",
            completion_window="24h").id, ("completed",)).id)


def test_expired_window_ends_unfinished_lines(start_api: Callable[..., ApiServer],
                                              start_worker: Callable[..., InProcessWorker]) -> None:
    api = start_api(batch_poll_s=0.1, batch_window_s=2, batch_max_queued=2)
    start_worker(token_delay_s=0.05)
    client = _client(api)
    lines = [_chat_line("quick", "hello", max_tokens=1)] + [_chat_line(f"slow{i}", "hello", 400) for i in range(4)]
    batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = _wait_status(client, batch.id, ("expired",), timeout_s=30)
    assert done.expired_at is not None and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed, done.request_counts.total) == (1, 4, 5)
    assert [r["custom_id"] for r in _lines(client, done.output_file_id)] == ["quick"]
    errors = _lines(client, done.error_file_id)
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [(f"slow{i}", "batch_expired") for i in range(4)]


def test_tenants_see_only_their_files_and_batches(start_api: Callable[..., ApiServer]) -> None:
    api = start_api(api_keys=["key-a", "key-b"])
    a, b = _client(api, "key-a"), _client(api, "key-b")
    file_id = _upload(a, [_chat_line("x", "hello")])
    batch = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert list(b.files.list()) == [] and b.batches.list().data == []
    assert a.batches.retrieve(batch.id).id == batch.id


def test_api_restart_mid_batch_loses_and_repeats_nothing(start_api: Callable[..., ApiServer],
                                                         start_worker: Callable[..., InProcessWorker],
                                                         redis_url: str) -> None:
    first = start_api(batch_poll_s=0.1, batch_max_queued=2)
    worker = start_worker(token_delay_s=0.02)
    client = _client(first)
    prompts = [f"hello {'fox ' * i}" for i in range(8)]
    batch = client.batches.create(input_file_id=_upload(client, [_chat_line(f"r{i}", p, 10)
                                                                 for i, p in enumerate(prompts)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: len(worker.claimed) >= 3, what="some lines done")
    first.stop()
    # A line's job submitted by the stopped API stays the line's job: nothing resubmits it.
    with redis.Redis.from_url(redis_url) as r:
        assert r.hget(keys.batch(batch.id), "status") == b"in_progress"
    second = start_api(batch_poll_s=0.1, batch_max_queued=2)
    done = _wait_status(_client(second), batch.id, ("completed",))
    output = _lines(_client(second), done.output_file_id)
    assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(8)]
    assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in output] == \
        [expected_text(p, 10) for p in prompts]
    assert len(worker.claimed) == len(set(worker.claimed)) == 8
