"""LangChain (langchain-openai) and LiteLLM against the service: tools, structured output (all three methods of
``with_structured_output``), text completions with a list of prompts. A tiny random-weight model serves them,
fast, except ``json_mode``, where only the prompt (not a grammar) says which keys to write: SmolLM2 there."""

from __future__ import annotations

import os

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.compat.conftest import Service

pytestmark = pytest.mark.slow


class Weather(BaseModel):
    """Look up the weather in a city."""

    city: str = Field(max_length=12)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def _chat(service: Service, **kwargs: object) -> ChatOpenAI:
    return ChatOpenAI(model=service.model, base_url=service.base_url, api_key="unused",  # type: ignore[arg-type]
                      max_retries=0, timeout=120, temperature=0, **kwargs)


def test_bind_tools_gives_tool_calls_and_takes_their_history(tiny_service: Service) -> None:
    llm = _chat(tiny_service, max_tokens=60).bind_tools([Weather], tool_choice="Weather")
    reply = llm.invoke("What is the weather in Oslo?")
    assert isinstance(reply, AIMessage) and len(reply.tool_calls) >= 1
    call = reply.tool_calls[0]
    assert call["name"] == "Weather" and call["id"]
    Weather.model_validate(call["args"])
    follow_up = [HumanMessage("What is the weather in Oslo?"), reply,
                 ToolMessage('{"temperature": 3}', tool_call_id=call["id"])]
    answer = _chat(tiny_service, max_tokens=4).bind_tools([Weather]).invoke(follow_up)
    assert isinstance(answer, AIMessage)


def test_bind_tools_streams(tiny_service: Service) -> None:
    llm = _chat(tiny_service, max_tokens=60, streaming=True).bind_tools([Weather], tool_choice="required")
    chunks = list(llm.stream("Weather in Rome?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk  # type: ignore[assignment]
    assert isinstance(merged, AIMessage) and merged.tool_calls
    Weather.model_validate(merged.tool_calls[0]["args"])


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_by_grammar(tiny_service: Service, method: str) -> None:
    llm = _chat(tiny_service, max_tokens=60).with_structured_output(Weather, method=method)  # type: ignore[arg-type]
    result = llm.invoke("Weather in Lima, in celsius.")
    assert isinstance(result, Weather)


def test_with_structured_output_json_mode(service: Service) -> None:
    schema = {"title": "City", "description": "A city", "type": "object",
              "properties": {"city": {"type": "string"}}, "required": ["city"]}
    llm = _chat(service, max_tokens=30).with_structured_output(schema, method="json_mode")
    result = llm.invoke("Return a JSON object with one key, city, naming the capital of France.")
    assert isinstance(result, dict)


def test_text_completions_batch(tiny_service: Service) -> None:
    llm = OpenAI(model=tiny_service.model, base_url=tiny_service.base_url, api_key="unused",  # type: ignore[arg-type]
                 max_tokens=3, max_retries=0)
    result = llm.generate(["one", "two", "three"])
    assert len(result.generations) == 3 and all(g[0].text is not None for g in result.generations)


def test_litellm_tools_and_text_completion_batch(tiny_service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network look-up of its price list
    import litellm

    common = {"model": f"openai/{tiny_service.model}", "api_base": tiny_service.base_url, "api_key": "unused",
              "max_tokens": 60, "temperature": 0}
    schema = Weather.model_json_schema()
    called = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Bern?"}], **common,
        tools=[{"type": "function", "function": {"name": "weather", "parameters": schema}}], tool_choice="required")
    call = called.choices[0].message.tool_calls[0]
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    Weather.model_validate_json(call.function.arguments)
    texts = litellm.text_completion(prompt=["a", "b"], **{**common, "max_tokens": 2})
    assert len(texts.choices) == 2
    assert os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"


def test_responses_api(tiny_service: Service) -> None:
    reply = _chat(tiny_service, max_tokens=3, use_responses_api=True).invoke("Say hi.")
    assert isinstance(reply, AIMessage) and reply.text
