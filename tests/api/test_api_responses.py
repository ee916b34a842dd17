"""``POST /v1/responses`` (basic) with the official openai client over the scripted engine: text in and out,
the streamed event sequence, structured text formats, and the unsupported fields refused with a 400."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import ApiServer

from tests.worker.scripted_engine import MODEL, InProcessWorker, expected_text


def _client(api: ApiServer) -> openai.OpenAI:
    return api.openai_client(timeout=openai.DEFAULT_TIMEOUT)


def test_text_in_text_out(api: ApiServer, worker: InProcessWorker) -> None:
    response = _client(api).responses.create(model=MODEL, input="hello brown fox", instructions="be brief",
                                             max_output_tokens=4)
    assert response.id.startswith("resp_") and response.status == "incomplete"  # max_output_tokens reached
    assert response.output_text == expected_text("be brief hello brown fox", 4)
    assert response.usage is not None and response.usage.output_tokens == 4


def test_streamed_events(api: ApiServer, worker: InProcessWorker) -> None:
    events = list(_client(api).responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "quick fox"}]}],
        max_output_tokens=3, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected_text("quick fox", 3) == events[-4].text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_text_format_json_schema_is_accepted(api: ApiServer, worker: InProcessWorker) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}}
    assert httpx.post(f"{api.base_url}/v1/responses", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize(("field", "value"), [("previous_response_id", "resp_1"), ("tools", []),
                                              ("reasoning", {"effort": "low"}), ("include", []),
                                              ("stream_options", {"include_usage": True}), ("top_logprobs", 2),
                                              ("background", True), ("max_tool_calls", 1)])
def test_unsupported_fields_are_a_400_naming_them(api: ApiServer, field: str, value: object) -> None:
    response = httpx.post(f"{api.base_url}/v1/responses", json={"model": MODEL, "input": "hi", field: value},
                          timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
