"""worker.jobs, the runner's pure logic: a job becomes engine requests, step outputs become events and a result.

Real tokenizer (SmolLM2's), real engine output records; no Redis, no model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shared.queue import ClaimedJob
from shared.schemas import ChatMessage, GenerationParams
from tests.queue.queue_helpers import make_job
from worker.engine import StepOutput
from worker.jobs import ActiveJob, prompt_token_ids, request_id, split_request_id


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2)


def _out(rid: str, text: str, ids: tuple[int, ...], finished: bool = False, reason: str | None = None,
         n_out: int = 1) -> StepOutput:
    return StepOutput(request_id=rid, new_token_ids=ids, text_delta=text, finished=finished,
                      finish_reason=reason, num_prompt_tokens=7, num_output_tokens=n_out, num_cached_tokens=3)


def test_prompt_forms_become_token_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert prompt_token_ids(make_job(prompt="Hello world"), tokenizer) == tokenizer.encode("Hello world")
    assert prompt_token_ids(make_job(prompt=None, prompt_token_ids=[1, 2, 3]), tokenizer) == [1, 2, 3]
    messages = [ChatMessage(role="user", content="What is 2+2?")]
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"]
    assert prompt_token_ids(make_job(prompt=None, messages=messages), tokenizer) == list(expected)


def test_request_ids_round_trip() -> None:
    assert request_id("abc_-123", 2) == "abc_-123#2"
    assert split_request_id("abc_-123#2") == ("abc_-123", 2)


def test_step_outputs_become_numbered_events_and_one_result() -> None:
    job = make_job(n=2, params=GenerationParams(max_tokens=3))
    active = ActiveJob.start(ClaimedJob(job, fence=4, attempt=1))
    a, b = request_id(job.id, 0), request_id(job.id, 1)

    events = [active.apply(_out(a, "He", (10,)), 0, None), active.apply(_out(b, "", (11,)), 1, None),
              active.apply(_out(a, "", (), n_out=1), 0, None),  # nothing new: no event
              active.apply(_out(a, "llo", (12,), True, "stop", 2), 0, None),
              active.apply(_out(b, "Yo", (13, 14), True, "length", 3), 1, None)]

    assert events[2] is None
    assert [(e.seq, e.index, e.text, e.token_ids) for e in events if e is not None] == [
        (1, 0, "He", [10]), (2, 1, "", [11]), (3, 0, "llo", [12]), (4, 1, "Yo", [13, 14])]
    assert active.done
    result = active.result()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in result.choices] == [
        (0, "Hello", [10, 12], "stop"), (1, "Yo", [11, 13, 14], "length")]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens) == (7, 5, 3)


def test_the_first_event_of_an_attempt_carries_the_prompt_length() -> None:
    """Streams that report usage as they go read the prompt's token count from it; later events leave it out."""
    job = make_job(n=2, params=GenerationParams(max_tokens=3))
    for attempt in (1, 2):  # a restarted job is a new ActiveJob: its first event carries the count again
        active = ActiveJob.start(ClaimedJob(job, fence=attempt, attempt=attempt))
        first = active.apply(_out(request_id(job.id, 1), "a", (10,)), 1, None)
        second = active.apply(_out(request_id(job.id, 0), "b", (11,)), 0, None)
        assert first is not None and second is not None
        assert (first.num_prompt_tokens, second.num_prompt_tokens) == (7, None)
        assert "num_prompt_tokens" in first.model_dump_json() and "num_prompt_tokens" not in second.model_dump_json()


def test_abort_ends_only_unfinished_choices() -> None:
    job = make_job(n=2)
    active = ActiveJob.start(ClaimedJob(job, fence=1, attempt=1))
    active.apply(_out(request_id(job.id, 0), "done", (5,), True, "stop"), 0, None)
    active.apply(_out(request_id(job.id, 1), "part", (6,)), 1, None)
    assert active.unfinished_request_ids() == [request_id(job.id, 1)]
    active.abort()
    assert [c.finish_reason for c in active.result().choices] == ["stop", "abort"]
    assert active.result().choices[1].text == "part"
