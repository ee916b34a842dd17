"""``stream_options.continuous_usage_stats`` (vLLM's extension, which guidellm always sends): every chunk of a
stream carries the usage so far, the prompt's tokens as the worker counted them and the completion tokens of all
choices; the finish chunks carry the final usage, the same as the usage chunk's."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from conftest import ApiServer, parse_sse

from tests.worker.scripted_engine import MODEL, InProcessWorker

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 5}
COMPLETION = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 5}


def _client(api: ApiServer) -> openai.OpenAI:
    return api.openai_client()


def _check_running_usage(chunks: list[dict[str, Any]], n: int, max_tokens: int) -> None:
    """Every chunk carries usage; it only grows, by at least a token per content chunk; the last chunk is the
    usage chunk, and the chunks before it end at its usage."""
    *streamed, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == n * max_tokens
    assert all(chunk["usage"] is not None for chunk in chunks)
    prompt_tokens = final["usage"]["prompt_tokens"]
    assert prompt_tokens > 0
    completion_tokens = [chunk["usage"]["completion_tokens"] for chunk in streamed]
    assert completion_tokens == sorted(completion_tokens)
    for chunk in streamed:
        assert chunk["usage"]["prompt_tokens"] == prompt_tokens
        assert chunk["usage"]["total_tokens"] == prompt_tokens + chunk["usage"]["completion_tokens"]
    contents = [c["usage"]["completion_tokens"] for c in streamed
                if any(choice.get("text") or (choice.get("delta") or {}).get("content") for choice in c["choices"])]
    assert len(contents) >= n and contents == sorted(set(contents))  # each content chunk brings new tokens
    finishes = [c for c in streamed if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == n and all(c["usage"] == final["usage"] for c in finishes)
    assert streamed[-1]["usage"] == final["usage"]


def _raw_stream(api: ApiServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(f"{api.base_url}/v1/{path}", json={**body, "stream": True}, timeout=30)
    assert response.status_code == 200, response.text
    events = [e["data"] for e in parse_sse(response.text)]
    assert events[-1] == "[DONE]"
    return [json.loads(data) for data in events[:-1]]


@pytest.mark.parametrize("n", [1, 2])
def test_openai_client_chat_stream_carries_usage_in_every_chunk(api: ApiServer, worker: InProcessWorker,
                                                                n: int) -> None:
    stream = _client(api).chat.completions.create(**CHAT, n=n, stream=True, stream_options=CONTINUOUS)
    chunks = [chunk.model_dump() for chunk in stream]
    _check_running_usage(chunks, n, max_tokens=5)
    openings = chunks[:n]  # the role chunks: sent once the prompt's count is known, before any token
    assert [c["choices"][0]["delta"]["role"] for c in openings] == ["assistant"] * n
    assert all(c["usage"]["completion_tokens"] == 0 for c in openings)
    job = httpx.get(f"{api.base_url}/v1/jobs/{chunks[0]['id'].removeprefix('chatcmpl-')}").json()
    assert chunks[-1]["usage"]["prompt_tokens"] == job["usage"]["prompt_tokens"]


@pytest.mark.parametrize("n", [1, 2])
def test_openai_client_completion_stream_via_extra_body(api: ApiServer, worker: InProcessWorker, n: int) -> None:
    stream = _client(api).completions.create(**COMPLETION, n=n, stream=True, extra_body={"stream_options": CONTINUOUS})
    chunks = [chunk.model_dump() for chunk in stream]
    _check_running_usage(chunks, n, max_tokens=5)
    assert chunks[-1]["usage"]["prompt_tokens"] == 4  # the scripted tokenizer: one token per word


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", COMPLETION)])
def test_raw_stream_every_chunk_has_usage(api: ApiServer, worker: InProcessWorker, path: str,
                                          body: dict[str, Any], n: int) -> None:
    chunks = _raw_stream(api, path, {**body, "n": n, "stream_options": CONTINUOUS})
    _check_running_usage(chunks, n, max_tokens=5)


def test_without_continuous_usage_only_the_last_chunk_has_usage(api: ApiServer, worker: InProcessWorker) -> None:
    chunks = _raw_stream(api, "chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(chunk["usage"] is None for chunk in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", COMPLETION)])
def test_continuous_usage_stats_is_refused_where_it_cannot_be_honoured(api: ApiServer, path: str,
                                                                       body: dict[str, Any]) -> None:
    url = f"{api.base_url}/v1/{path}"
    not_streamed = httpx.post(url, json={**body, "stream_options": CONTINUOUS}, timeout=30)
    assert not_streamed.status_code == 400 and not_streamed.json()["error"]["param"] == "stream_options"
    alone = {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    without_usage = httpx.post(url, json=alone, timeout=30)
    assert without_usage.status_code == 400
    assert without_usage.json()["error"]["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", COMPLETION)])
def test_include_obfuscation_true_is_refused_false_is_honoured(api: ApiServer, worker: InProcessWorker, path: str,
                                                               body: dict[str, Any]) -> None:
    url = f"{api.base_url}/v1/{path}"
    refused = httpx.post(url, json={**body, "stream": True, "stream_options": {"include_obfuscation": True}},
                         timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "stream_options.include_obfuscation"
    chunks = _raw_stream(api, path, {**body, "stream_options": {"include_obfuscation": False}})
    assert chunks and all("obfuscation" not in chunk for chunk in chunks)
