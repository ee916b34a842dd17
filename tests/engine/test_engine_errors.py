"""Bad input is refused with a ValueError naming the field and its range; the engine keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.helpers import drain
from worker.engine import Engine, EngineConfig, SamplingParams

GOOD = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=16,
                               max_model_len=64))


@pytest.mark.parametrize(("request_id", "prompt", "params", "priority", "message"), [
    ("", [1, 2], GOOD, 0, "request_id must be a non-empty string"),
    ("x", [], GOOD, 0, "prompt_token_ids must be a non-empty list"),
    ("x", "hello", GOOD, 0, "prompt_token_ids must be a non-empty list"),
    ("x", list(range(3, 67)), GOOD, 0, r"prompt_token_ids must have at most 63 tokens"),
    ("x", [1, 49152], GOOD, 0, r"prompt_token_ids\[1\] must be a token id in \[0, 49152\)"),
    ("x", [1, -1], GOOD, 0, r"prompt_token_ids\[1\] must be a token id in \[0, 49152\)"),
    ("x", [1, 2.0], GOOD, 0, r"prompt_token_ids\[1\] must be a token id"),
    ("x", [1, 2], {"max_tokens": 3}, 0, "params must be a SamplingParams"),
    ("x", [1, 2], SamplingParams(stop_token_ids=(10**6,)), 0, r"stop_token_ids must be token ids in \[0, 49152\)"),
    ("x", [1, 2], GOOD, "high", "priority must be an int"),
])
def test_bad_request_is_refused_and_nothing_changes(engine: Engine, request_id: object, prompt: object,
                                                    params: object, priority: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_id, prompt, params, priority=priority)  # type: ignore[arg-type]
    assert not engine.has_unfinished()
    engine.add_request("ok", [5, 6, 7], GOOD)
    run = drain(engine)
    assert len(run.token_ids["ok"]) == 3


def test_duplicate_request_id_is_refused(engine: Engine) -> None:
    engine.add_request("dup", [5, 6], GOOD)
    with pytest.raises(ValueError, match="request_id must be unique"):
        engine.add_request("dup", [5, 6], GOOD)
    run = drain(engine)
    assert list(run.finished) == ["dup"]


@pytest.mark.parametrize(("field", "kwargs"), [
    ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": -1.0}),
    ("top_p", {"top_p": 0.0}),
    ("logprobs", {"logprobs": 21}),
    ("min_tokens", {"max_tokens": 4, "min_tokens": 5}),
])
def test_bad_sampling_params(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "kwargs"), [
    ("block_size", {"block_size": 0}),
    ("num_kv_blocks", {"num_kv_blocks": 0}),
    ("max_num_seqs", {"max_num_seqs": 0}),
    ("max_num_batched_tokens", {"max_num_batched_tokens": 0}),
    ("max_model_len", {"max_model_len": 1}),
    ("device", {"device": "tpu"}),
    ("dtype", {"dtype": "int8"}),
    ("kv_cache_bytes", {"kv_cache_bytes": 0}),
])
def test_bad_engine_config(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.{field} must be"):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_max_model_len_beyond_the_model_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="EngineConfig.max_model_len must be <= the model's 1024 positions"):
        Engine(EngineConfig(dtype="float32", model=str(tiny_llama), max_model_len=4096))


def test_generate_rejects_all_or_nothing(engine: Engine) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.generate([[5, 6], []], GOOD)
    assert not engine.has_unfinished()
