"""The OpenAI-compatible endpoints, read by the official ``openai`` client (sync and async, streamed and not)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import ApiServer, parse_sse, wait_until

from tests.worker.scripted_engine import MODEL, InProcessWorker, expected_text


def _client(api: ApiServer, key: str = "unused") -> openai.OpenAI:
    return api.openai_client(key)


def test_completion(api: ApiServer, worker: InProcessWorker) -> None:
    completion = _client(api).completions.create(model=MODEL, prompt="the quick fox", max_tokens=7)
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.choices[0].text == expected_text("the quick fox", 7)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 7
    # Every OpenAI request is also a job.
    job = httpx.get(f"{api.base_url}/v1/jobs/{completion.id.removeprefix('cmpl-')}").json()
    assert job["status"] == "succeeded" and job["text"] == completion.choices[0].text


def test_chat_completion_with_n_stop_and_logprobs(api: ApiServer, worker: InProcessWorker) -> None:
    chat = _client(api).chat.completions.create(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello brown fox"}],
        model=MODEL, max_completion_tokens=6, n=2, stop=["fox-"], logprobs=True, top_logprobs=2, seed=3,
        temperature=0, extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "priority": 2},
    )
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        assert choice.message.role == "assistant"
        assert choice.message.content == expected_text("be brief hello brown fox", 6, choice.index, stop=("fox-",))
        assert choice.finish_reason == "stop"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        first = choice.logprobs.content[0]
        assert first.logprob == -0.25 and len(first.top_logprobs) == 2
    job = httpx.get(f"{api.base_url}/v1/jobs/{chat.id.removeprefix('chatcmpl-')}").json()
    assert job["priority"] == 2


def test_streamed_chat_with_usage(api: ApiServer, worker: InProcessWorker) -> None:
    stream = _client(api).chat.completions.create(
        messages=[{"role": "user", "content": "quick brown"}], model=MODEL, max_tokens=9, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text("quick brown", 9)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion_wire_format(api: ApiServer, worker: InProcessWorker) -> None:
    body = {"prompt": "fox", "max_tokens": 3, "stream": True, "logprobs": 1, "n": 2}
    response = httpx.post(f"{api.base_url}/v1/completions", json=body, timeout=30)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    events = [e["data"] for e in parse_sse(response.text)]
    assert events[-1] == "[DONE]"
    chunks = [httpx.Response(200, content=data).json() for data in events[:-1]]
    for index in (0, 1):
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index)
        assert text == expected_text("fox", 3, index)
    with_logprobs = [c for c in chunks if c["choices"][0]["logprobs"]]
    assert with_logprobs and with_logprobs[0]["choices"][0]["logprobs"]["token_logprobs"] == [-0.25]


def test_non_streamed_completion_logprobs(api: ApiServer, worker: InProcessWorker) -> None:
    completion = _client(api).completions.create(model=MODEL, prompt="fox", max_tokens=2, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["fox-0 ", "fox-1 "]
    assert logprobs.text_offset == [0, 6]
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs[0]) == 2


async def test_async_client_streams_and_waits(api: ApiServer, worker: InProcessWorker) -> None:
    client = openai.AsyncOpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == expected_text("hello", 5)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox"}],
                                                max_tokens=4)
    assert chat.choices[0].message.content == expected_text("fox", 4)
    await client.close()


async def test_150_concurrent_streams_each_get_their_complete_text(api: ApiServer, start_worker: object) -> None:
    """More open streams than redis-py's default connection pool holds (100): each stream holds a pub/sub
    connection while it is open, and ~1 s per job keeps all of them open at once."""
    start_worker(token_delay_s=0.05)  # type: ignore[operator]
    client = openai.AsyncOpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0, timeout=60,
                                http_client=None)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"client{i} says hello"}], max_tokens=20,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(150)))
    await client.close()
    for i, text in enumerate(texts):
        assert text == expected_text(f"client{i} says hello", 20)


def test_models_lists_the_served_model(api: ApiServer, worker: InProcessWorker) -> None:
    models = _client(api).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra == {"max_model_len": 512}


def test_errors_reach_the_client_as_typed_exceptions(api: ApiServer, worker: InProcessWorker) -> None:
    client = _client(api)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="hi")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox " * 600}])
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bad_temperature:
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert bad_temperature.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as empty_prompt:
        client.completions.create(model=MODEL, prompt=["one", ""])
    assert empty_prompt.value.param == "prompt.1"
    with pytest.raises(openai.BadRequestError) as bad_n:
        client.completions.create(model=MODEL, prompt="hi", n=50)
    assert bad_n.value.param == "n"
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(model=MODEL, messages=[])
    assert missing.value.param == "messages"


def test_chat_default_max_tokens_fills_the_context(api: ApiServer, worker: InProcessWorker) -> None:
    # The test template renders 6 tokens for one word: '<|im_start|>', 'user', 'fox', '<|im_end|>', '<|im_start|>',
    # 'assistant' (the markers are special tokens, as in a real chat model); the API and the worker count alike.
    response = httpx.post(f"{api.base_url}/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "fox"}]})
    assert response.status_code == 200
    job_id = response.json()["id"].removeprefix("chatcmpl-")
    wait_until(lambda: httpx.get(f"{api.base_url}/v1/jobs/{job_id}").json()["status"] == "succeeded")
    assert response.json()["usage"]["completion_tokens"] == 512 - 6
