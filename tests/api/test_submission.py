"""Prompt token ids are range-checked before they are queued: against the model's vocabulary once a worker has
published its card, and against the bound no vocabulary reaches before that (an id past it could only overflow
the worker's int64 tensors); the submission schema holds raw producers to the same bound."""

from __future__ import annotations

import pydantic
import pytest

from api.errors import APIError
from api.submission import count_prompt_tokens
from api.tokenization import ServedModel
from shared.sampling import MAX_INT
from shared.schemas import JobSubmission, ModelCard


async def test_token_ids_are_checked_against_the_vocabulary_once_the_card_is_known() -> None:
    card = ModelCard(name="m", max_model_len=64, eos_token_ids=[0], vocab_size=100)
    model = ServedModel("m", card, None, None)
    assert await count_prompt_tokens(model, prompt_token_ids=[0, 99]) == 2
    with pytest.raises(APIError, match="below the vocabulary size 100") as refused:
        await count_prompt_tokens(model, prompt_token_ids=[5, 100])
    assert refused.value.status_code == 400


async def test_without_a_card_only_ids_past_any_vocabulary_are_refused() -> None:
    model = ServedModel("m", None, None, None)  # no worker has published the model yet
    assert await count_prompt_tokens(model, prompt_token_ids=[MAX_INT]) == 1
    for huge in (MAX_INT + 1, 10**30):
        with pytest.raises(APIError, match="no vocabulary is larger") as refused:
            await count_prompt_tokens(model, prompt_token_ids=[1, huge])
        assert refused.value.status_code == 400


def test_the_submission_schema_refuses_ids_past_any_vocabulary() -> None:
    JobSubmission(id="job-0001", model="m", prompt_token_ids=[MAX_INT])
    with pytest.raises(pydantic.ValidationError, match="prompt_token_ids"):
        JobSubmission(id="job-0001", model="m", prompt_token_ids=[10**30])
