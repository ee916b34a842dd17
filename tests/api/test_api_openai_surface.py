"""The OpenAI surface that clients probe first (issue 17's small items): ``/health`` as vLLM serves it,
``GET /v1/models/{id}``, and every OpenAI field tokenspool does not honour refused with a 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import ApiServer

from tests.worker.scripted_engine import MODEL, InProcessWorker, expected_text

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def test_health_answers_like_vllm(api: ApiServer) -> None:
    response = httpx.get(f"{api.base_url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_404(api: ApiServer, worker: InProcessWorker) -> None:
    client = api.openai_client(max_retries=openai.DEFAULT_MAX_RETRIES, timeout=openai.DEFAULT_TIMEOUT)
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("tool_choice", "auto"),
    ("parallel_tool_calls", True),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("reasoning_effort", "low"),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("stream_options", {"include_usage": True}),
])
def test_unhonoured_chat_fields_are_a_400_naming_them(api: ApiServer, field: str, value: object) -> None:
    response = httpx.post(f"{api.base_url}/v1/chat/completions", json={**CHAT, field: value}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_stream_options_without_stream_is_refused_on_completions(api: ApiServer) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream_options": {"include_usage": True}}
    response = httpx.post(f"{api.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def test_text_modality_alone_is_accepted(api: ApiServer, worker: InProcessWorker) -> None:
    response = httpx.post(f"{api.base_url}/v1/chat/completions", json={**CHAT, "modalities": ["text"]}, timeout=30)
    assert response.status_code == 200, response.text


def test_a_list_of_prompts_is_one_job_each_answered_together(api: ApiServer, worker: InProcessWorker) -> None:
    """LangChain's ``OpenAI.batch`` and LiteLLM's ``text_completion(prompt=[...])`` send several prompts: choice
    ``i * n + c`` is choice ``c`` of prompt ``i``, usage is summed, and each prompt ran as its own job."""
    client = api.openai_client(max_retries=openai.DEFAULT_MAX_RETRIES, timeout=openai.DEFAULT_TIMEOUT)
    prompts = ["hello world", "the quick fox", "brown"]
    completion = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2)
    assert [c.index for c in completion.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        for c in range(2):
            assert completion.choices[i * 2 + c].text == expected_text(prompt, 3, index=c)
    assert completion.usage is not None and completion.usage.completion_tokens == 3 * 2 * 3
    assert completion.usage.prompt_tokens == 2 + 3 + 1  # the word tokenizer: one token per word
    assert len(worker.claimed) == 3


def test_a_list_of_prompts_is_not_streamed(api: ApiServer) -> None:
    body = {"model": MODEL, "prompt": ["hello", "world"], "max_tokens": 2, "stream": True}
    response = httpx.post(f"{api.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
