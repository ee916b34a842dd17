"""Every accepted request is computable: the real engine, over the whole accepted parameter space (hypothesis).

Parameters are drawn as the API accepts them (``GenerationParams``, whose ranges come from ``shared.sampling``),
extremes included, and converted as the worker converts them. On every dtype the engine runs on CPU, no exception
escapes ``step()`` and no request ends with an error: the ranges only admit values the engine can honour.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.sampling import GREEDY_BELOW_TEMPERATURE, SAMPLING_RANGES, Range
from shared.schemas import GenerationParams
from tests.engine.helpers import drain
from worker.engine import Engine, EngineConfig, SamplingParams

VOCAB = 49152


def _values(allowed: Range, integer: bool, extra: tuple[float, ...] = ()) -> st.SearchStrategy[float]:
    """Both ends, values just inside them, a few listed ones, and anything in between."""
    low = allowed.low + (1 if integer else 1e-300) if allowed.low_open else allowed.low
    ends = [v for v in (low, allowed.high, *extra) if allowed.contains(v)]
    inner = (st.integers(int(low), int(allowed.high)) if integer
             else st.floats(low, allowed.high, allow_nan=False, allow_infinity=False))
    return st.one_of(st.sampled_from(ends), inner)


def _field(name: str, integer: bool = False, extra: tuple[float, ...] = ()) -> st.SearchStrategy[float]:
    return _values(SAMPLING_RANGES[name], integer, extra)


PARAMS = st.builds(
    lambda max_tokens, min_tokens, **kw: GenerationParams(max_tokens=max_tokens,
                                                          min_tokens=min(min_tokens, max_tokens), **kw),
    max_tokens=st.integers(1, 4) | st.just(SAMPLING_RANGES["max_tokens"].high),
    min_tokens=st.integers(0, 4),
    temperature=_field("temperature", extra=(1e-46, 1e-40, 1e-30, GREEDY_BELOW_TEMPERATURE, 1e-3 * 1.0001, 0.01)),
    top_p=_field("top_p", extra=(1e-300, 1e-9, 0.5)),
    top_k=_field("top_k", integer=True, extra=(-1, 0, 1, VOCAB - 1, VOCAB, VOCAB + 1)),
    min_p=_field("min_p", extra=(1e-300, 0.999999)),
    repetition_penalty=_field("repetition_penalty", extra=(1.0,)),
    presence_penalty=_field("presence_penalty"),
    frequency_penalty=_field("frequency_penalty"),
    seed=st.none() | _field("seed", integer=True),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.none() | _field("logprobs", integer=True),
)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request: pytest.FixtureRequest, tiny_llama: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=128, max_num_seqs=8,
                               max_model_len=24, dtype=request.param))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(PARAMS, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                                st.integers(1, 3)), min_size=1, max_size=5))
def test_any_accepted_request_runs_to_an_ordinary_end(engine: Engine, batch: list[tuple[GenerationParams,
                                                                                       list[int], int]]) -> None:
    for i, (wire, prompt, n) in enumerate(batch):
        params = SamplingParams(**wire.model_dump())  # as the worker converts a job
        engine.add_request_group([f"r{i}#{c}" for c in range(n)], prompt, params)
    run = drain(engine)  # no exception escapes step()
    assert len(run.finished) == sum(n for _, _, n in batch)
    assert {e.finish_reason for e in run.finished.values()} <= {"stop", "length"}, [
        (rid, e.error) for rid, e in run.finished.items() if e.error]
    assert all(0 <= t < VOCAB for ids in run.token_ids.values() for t in ids)
