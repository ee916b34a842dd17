"""One definition of the sampling fields and their ranges: the job schema, the engine's ``SamplingParams`` and the
OpenAI request bodies all follow ``shared.sampling`` (checked here, so a field added in one place fails until it is
added everywhere)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from pydantic import ValidationError

from api.openai_models import ChatCompletionRequest, CompletionRequest, SamplingRequest
from shared.sampling import GREEDY_BELOW_TEMPERATURE, SAMPLING_RANGES, Range, is_greedy
from shared.schemas import GenerationParams
from worker.engine import SamplingParams

# OpenAI request fields that are not sampling parameters, or are renamed/reshaped on the way into a job.
NOT_SAMPLING = {"model", "n", "stream", "stream_options", "logit_bias", "user", "priority", "background", "prompt",
                "echo", "suffix", "best_of", "messages", "max_completion_tokens", "top_logprobs", "tools",
                "response_format", "tool_choice", "parallel_tool_calls", "functions", "function_call", "modalities",
                "audio", "reasoning_effort", "prediction", "web_search_options", "use_beam_search",
                # structured outputs: they become the job's ``grammar`` (api/structured_output.py)
                "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                # deadlines: job fields of the submission, not sampling parameters
                "queue_timeout_s", "timeout_s"}
FLOAT_FIELDS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}


def test_the_job_schema_and_the_engine_have_the_same_fields() -> None:
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(GenerationParams.model_fields)
    assert set(SAMPLING_RANGES) <= set(GenerationParams.model_fields)


def test_openai_requests_carry_only_job_fields() -> None:
    for model in (SamplingRequest, CompletionRequest, ChatCompletionRequest):
        assert set(model.model_fields) - NOT_SAMPLING <= set(GenerationParams.model_fields), model


@pytest.mark.parametrize("name", sorted(SAMPLING_RANGES))
def test_both_sides_refuse_just_outside_each_range_and_accept_its_ends(name: str) -> None:
    allowed = SAMPLING_RANGES[name]
    step = 1e-9 if name in FLOAT_FIELDS else 1
    outside = [allowed.high + step, allowed.low if allowed.low_open else allowed.low - step]
    inside = [allowed.high] + ([] if allowed.low_open else [allowed.low])
    wrap = (lambda v: (v,)) if name == "stop_token_ids" else (lambda v: v)
    extra = {"max_tokens": SAMPLING_RANGES["max_tokens"].high} if name == "min_tokens" else {}
    extra = {"temperature": 0.0} if name == "beam_width" else extra  # beam search is greedy
    for value in outside:
        with pytest.raises(ValidationError, match=name):
            GenerationParams(**{name: wrap(value)})
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: wrap(value)})
    for value in inside:
        GenerationParams(**{**extra, name: wrap(value)})
        SamplingParams(**{**extra, name: wrap(value)})


def test_nan_is_outside_every_range() -> None:
    assert not Range(0.0, 1.0).contains(math.nan)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=math.nan)


def test_tiny_temperatures_are_greedy() -> None:
    assert is_greedy(0.0) and is_greedy(1e-46) and is_greedy(GREEDY_BELOW_TEMPERATURE / 2)
    assert not is_greedy(GREEDY_BELOW_TEMPERATURE) and SamplingParams(temperature=1e-40).is_greedy
