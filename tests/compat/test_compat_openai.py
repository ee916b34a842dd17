"""The official openai client against the service: structured outputs and tool calls end to end, on SmolLM2 where
the content matters and on a tiny random-weight model (fast) for the protocol's breadth."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.compat.conftest import Service

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


@pytest.fixture(scope="session")
def client(service: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=service.base_url, api_key="unused", max_retries=0, timeout=120) as opened:
        yield opened


@pytest.fixture(scope="session")
def tiny_client(tiny_service: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny_service.base_url, api_key="unused", max_retries=0, timeout=120) as opened:
        yield opened


def test_json_schema_strict_output_validates(client: openai.OpenAI, service: Service) -> None:
    response = client.chat.completions.create(
        model=service.model, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_object_on_completions_and_guided_choice(tiny_client: openai.OpenAI, tiny_service: Service) -> None:
    completion = tiny_client.completions.create(
        model=tiny_service.model, prompt="A cat:", max_tokens=40, temperature=0,
        extra_body={"guided_json": {"type": "object", "properties": {"legs": {"enum": [3, 4]}}, "required": ["legs"]}})
    assert json.loads(completion.choices[0].text)["legs"] in (3, 4)
    chat = tiny_client.chat.completions.create(model=tiny_service.model, max_tokens=5, messages=ASK,
                                               extra_body={"guided_choice": ["sunny", "rainy"]})
    assert chat.choices[0].message.content in ("sunny", "rainy")


def test_required_tool_call_is_valid_and_parsed(client: openai.OpenAI, service: Service) -> None:
    response = client.chat.completions.create(model=service.model, max_tokens=50, temperature=0, messages=ASK,
                                              tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                                              parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


def test_named_tool_streams_a_tool_call_delta(tiny_client: openai.OpenAI, tiny_service: Service) -> None:
    stream = tiny_client.chat.completions.create(model=tiny_service.model, max_tokens=60, temperature=0, messages=ASK,
                                            tools=[WEATHER_TOOL, TIME_TOOL], stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert reasons == ["tool_calls"]
    assert calls and {c.function.name for c in calls} == {"get_time"} and calls[0].id
    jsonschema.validate(json.loads(calls[0].function.arguments or ""), TIME_TOOL["function"]["parameters"])


def test_tool_history_round_trip(tiny_client: openai.OpenAI, tiny_service: Service) -> None:
    """An assistant turn with tool_calls and null content, then the tool's result: the model answers in text."""
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    response = tiny_client.chat.completions.create(model=tiny_service.model, max_tokens=4, temperature=0,
                                                   messages=messages, tools=[WEATHER_TOOL], tool_choice="none")
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.choices[0].message.content


def test_continuous_usage_stats_on_a_real_engine(tiny_client: openai.OpenAI, tiny_service: Service) -> None:
    """vLLM's ``continuous_usage_stats`` (guidellm sends it): every chunk has the usage so far; the prompt count
    is the worker's (the same in every chunk and in the usage chunk), completion tokens only grow."""
    stream = tiny_client.chat.completions.create(
        model=tiny_service.model, max_tokens=6, n=2, messages=ASK, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    *chunks, final = list(stream)
    assert final.choices == [] and final.usage is not None and final.usage.completion_tokens == 12
    assert all(c.usage is not None and c.usage.prompt_tokens == final.usage.prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 12
    assert chunks[-1].usage == final.usage
