"""The OpenAI surface that clients probe first (issue 17's small items): ``/health`` as vLLM serves it,
``GET /v1/models/{id}``, and every OpenAI field tokenspool does not honour refused with a 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import ApiServer

from tests.worker.scripted_engine import MODEL, InProcessWorker

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def test_health_answers_like_vllm(api: ApiServer) -> None:
    response = httpx.get(f"{api.base_url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_404(api: ApiServer, worker: InProcessWorker) -> None:
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused")
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
