"""One faulty request fails alone: the rest of its batch, in the same step and after, is untouched.

A request is made faulty for real: the tiny model's embedding row of one token id is NaN, so any request whose
prompt holds that id gets NaN hidden states, K/V and logits. The others must produce exactly what they produce
without it, also when they later reuse the blocks the faulty request left NaN K/V in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import worker.engine.engine as engine_module
from tests.engine.helpers import drain, poison_token
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.block_pool import hash_block
from worker.engine.draw import Draw, draw_tokens
from worker.engine.request import Request
from worker.engine.scheduler import ScheduledChunk

POISON = 77
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [13, 14, 15, 16, 17, 18, 19, 20, 21]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, min_tokens=12, seed=7)


def _engine(model: Path, dtype: str = "float32") -> Engine:
    return Engine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64, max_num_seqs=8, dtype=dtype))


def _run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    run = drain(engine)
    assert {rid: e.finish_reason for rid, e in run.finished.items()} == dict.fromkeys(prompts, "length")
    return run.token_ids


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> str:
    """float32 runs transformers' forward, bfloat16 the engine's own decoder."""
    return str(request.param)


@pytest.fixture(scope="module")
def poisoned(tiny_llama: Path, dtype: str) -> Engine:
    engine = _engine(tiny_llama, dtype)
    poison_token(engine, POISON)
    return engine


@pytest.fixture(params=[False, True], ids=["checked-first", "checked-after"])
def check_after(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs a test with the engine checking the logits before drawing (the CPU's order), then with it drawing first
    and checking after (the GPU's, ``draw_tokens``'s ``defer_check``), forced here on the CPU."""
    if request.param:
        def deferred(*args: object, **kwargs: object) -> list[Draw]:
            return draw_tokens(*args, **{**kwargs, "defer_check": True})  # type: ignore[arg-type]

        monkeypatch.setattr(engine_module, "draw_tokens", deferred)


@pytest.mark.usefixtures("check_after")
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_request_with_nan_logits_fails_alone(tiny_llama: Path, poisoned: Engine, dtype: str,
                                               params: SamplingParams) -> None:
    expected = _run(_engine(tiny_llama, dtype), PROMPTS, params)
    for rid, prompt in PROMPTS.items():
        poisoned.add_request(rid, prompt, params)
    poisoned.add_request("poison", [5, 6, POISON, 8], params)
    run = drain(poisoned)
    bad = run.finished.pop("poison")
    assert bad.finish_reason == "error" and bad.error is not None and "not finite" in bad.error
    assert bad.new_token_ids == () and run.token_ids["poison"] == []
    assert all(e.finish_reason == "length" for e in run.finished.values())
    assert poisoned.stats().num_free_blocks == poisoned.stats().num_total_blocks
    again = _run(poisoned, {f"{rid}2": p for rid, p in PROMPTS.items()}, params)
    if params is SAMPLED:
        # Matmuls are not batch-invariant on every CPU (seen with fp32 and bf16 on AVX2 without AMX): with the
        # poisoned request in the first step's batch, the others' probabilities differ in the last bits, so a
        # sampled draw may too. The greedy case checks exactness (the rerun's prompts also hit cached prefix
        # blocks, computed in another batch); here the others must still run to their full length.
        assert all(len(run.token_ids[rid]) == len(again[f"{rid}2"]) == len(ids) for rid, ids in expected.items())
        return
    assert {rid: run.token_ids[rid] for rid in PROMPTS} == expected
    # The poisoned request's NaN K/V stays in the blocks it freed; requests that get those blocks next are exact.
    assert again == {f"{rid}2": ids for rid, ids in expected.items()}


@pytest.mark.usefixtures("check_after")
def test_a_group_choice_with_nan_logits_fails_its_siblings_too(poisoned: Engine) -> None:
    poisoned.add_request_group(["g#0", "g#1"], [5, POISON], GREEDY)
    poisoned.add_request("ok", PROMPTS["a"], GREEDY)
    run = drain(poisoned)
    assert {rid: e.finish_reason for rid, e in run.finished.items()} == {"g#0": "error", "g#1": "error",
                                                                        "ok": "length"}


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.0, beam_width=2, max_tokens=4)],
                         ids=["request", "beam-group"])
def test_a_failed_requests_blocks_are_zeroed_and_uncached(tiny_llama: Path, dtype: str,
                                                          params: SamplingParams) -> None:
    """What a failed request leaves is scrubbed: its NaN K/V would poison a later owner's padded attention (0 x
    NaN), and a prefix-cache hit on its blocks must find NaN computed again, not zeros."""
    engine = _engine(tiny_llama, dtype)
    poison_token(engine, POISON)
    prompt = [5, 6, POISON, 8, 9, 10]  # one full block of 4, then two tokens
    for attempt in range(2):
        engine.add_request_group([f"poison{attempt}"], prompt, params)
        run = drain(engine)
        assert "not finite" in (run.finished[f"poison{attempt}"].error or "")
        cache = engine.runner.kv_cache
        assert bool(torch.isfinite(cache.key_pool).all()) and bool(torch.isfinite(cache.value_pool).all())
        assert engine.block_pool.lookup(hash_block(None, prompt[:4])) is None
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def _request(rid: str) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2], params=GREEDY, priority=0, arrival=0, max_tokens=4,
                   generator=None, detokenizer=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("defer_check", [False, True], ids=["cpu", "gpu"])
def test_sampling_that_raises_for_one_request_is_bisected_to_it(defer_check: bool) -> None:
    requests = [_request(f"r{i}") for i in range(5)]
    chunks = [ScheduledChunk(r.request_id, (2,), 1, (0,), needs_logits=True) for r in requests]
    logits = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    calls: list[list[str]] = []

    def draw(batch: list[Request], _chunks: list[ScheduledChunk], rows: torch.Tensor) -> list[Draw]:
        calls.append([r.request_id for r in batch])
        if any(r.request_id == "r3" for r in batch):
            raise RuntimeError("boom")
        return [Draw([int(row.argmax()) + (7 if r.request_id == "r1" else 0)], [None])
                for r, row in zip(batch, rows, strict=True)]

    draws = draw_tokens(requests, chunks, logits, draw, defer_check)
    assert [d.error for d in draws] == [None, "sampled token id 9 is outside the vocabulary [0, 3)", None,
                                        "sampling failed: RuntimeError: boom", None]
    assert [d.token_ids for d in draws] == [[2], [], [2], [], [2]]
    assert calls[0] == ["r0", "r1", "r2", "r3", "r4"] and ["r3"] in calls


def test_non_finite_rows_fail_before_drawing() -> None:
    requests, chunks, logits = _poisoned_rows()
    seen: list[str] = []

    def draw(batch: list[Request], _chunks: list[ScheduledChunk], rows: torch.Tensor) -> list[Draw]:
        seen.extend(r.request_id for r in batch)
        return [Draw([0], [None]) for _ in batch]

    draws = draw_tokens(requests, chunks, logits, draw)
    assert seen == ["r1"]
    assert [d.error is None for d in draws] == [False, True, False]


def test_deferred_checks_draw_every_row_but_only_finite_values() -> None:
    """On a GPU every request draws in one go: its rows that are not finite arrive as zeros, and it still fails."""
    requests, chunks, logits = _poisoned_rows()
    seen: list[torch.Tensor] = []

    def draw(batch: list[Request], _chunks: list[ScheduledChunk], rows: torch.Tensor) -> list[Draw]:
        seen.append(rows.clone())
        return [Draw([int(row.argmax())], [None]) for row in rows]

    draws = draw_tokens(requests, chunks, logits, draw, defer_check=True)
    assert len(seen) == 1 and torch.equal(seen[0], torch.stack([torch.zeros(4), logits[1], torch.zeros(4)]))
    assert [d.error is not None and "not finite" in d.error for d in draws] == [True, False, True]
    assert draws[1].token_ids == [3]


def _poisoned_rows() -> tuple[list[Request], list[ScheduledChunk], torch.Tensor]:
    """Three requests' logit rows: a NaN in the first, the second healthy, the third all -inf."""
    requests = [_request(f"r{i}") for i in range(3)]
    chunks = [ScheduledChunk(r.request_id, (2,), 1, (0,), needs_logits=True) for r in requests]
    logits = torch.zeros(3, 4)
    logits[0, 1] = float("nan")
    logits[1, 3] = 1.0
    logits[2] = float("-inf")
    return requests, chunks, logits
