"""n > 1 choices of one prompt (``Engine.add_request_group``): the prompt is prefilled once, its blocks are shared,
the last partial block is copied on write, and each choice's tokens equal those of a lone request."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.helpers import Run, drain
from worker.engine import Engine, EngineConfig, SamplingParams

PROMPT = [5 + 7 * i for i in range(10)]  # 10 tokens: with block_size 4, blocks 0-1 are full and 2 is partial


def make_engine(model: Path, **overrides: object) -> Engine:
    settings: dict = dict(dtype="float32", model=str(model), block_size=4, num_kv_blocks=40, max_num_seqs=8,
                          max_num_batched_tokens=64)
    return Engine(EngineConfig(**(settings | overrides)))


def test_choices_share_the_prompt_blocks_and_copy_the_partial_one(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request_group(["j#0", "j#1", "j#2"], PROMPT, params)
    first = engine.step()  # the prompt, once: 10 tokens in 3 blocks
    assert [e.request_id for e in first] == ["j#0"]
    assert engine.stats().num_total_blocks - engine.stats().num_free_blocks == 3
    parent_blocks = engine.scheduler.running[0].block_ids[:2]
    second = engine.step()  # the two others start from those blocks and compute only position 9 themselves
    assert sorted(e.request_id for e in second) == ["j#0", "j#1", "j#2"]
    assert [engine.block_pool.ref_count(b) for b in parent_blocks] == [3, 3]
    # 3 prompt blocks + one private copy of the partial block for two of the three (the last writer keeps it);
    # three independent requests would hold 9.
    assert engine.stats().num_total_blocks - engine.stats().num_free_blocks == 5
    run = Run()
    run.record(first + second)
    drain(engine, run)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert [engine.block_pool.ref_count(b) for b in range(stats.num_total_blocks)] == [0] * stats.num_total_blocks
    assert run.token_ids["j#0"] == run.token_ids["j#1"] == run.token_ids["j#2"]  # greedy: the same three choices
    assert len(run.token_ids["j#0"]) == 6


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_seeded_choices_equal_lone_requests_with_seed_plus_index(tiny_llama: Path, prefix_caching: bool) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=41, ignore_eos=True)
    engine = make_engine(tiny_llama, enable_prefix_caching=prefix_caching)
    engine.add_request_group([f"job#{i}" for i in range(4)], PROMPT, params)
    engine.add_request("other", [9, 8, 7, 6, 5], SamplingParams(max_tokens=8, temperature=1.0))
    grouped = drain(engine).token_ids

    lone = make_engine(tiny_llama, enable_prefix_caching=False)
    for i in range(4):
        lone.add_request(f"lone{i}", PROMPT, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=41 + i,
                                                            ignore_eos=True))
    expected = drain(lone).token_ids
    assert [grouped[f"job#{i}"] for i in range(4)] == [expected[f"lone{i}"] for i in range(4)]
    assert len({tuple(t) for t in expected.values()}) > 1  # the seeds differ, so the choices do


def test_aborts_before_the_fork_leave_the_rest_running_and_free_every_block(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request_group(["a#0", "a#1", "a#2"], PROMPT, params)
    engine.add_request_group(["b#0", "b#1"], PROMPT[:8], params)
    assert engine.abort("a#0")  # the parent, before its prompt ran: the others go on alone
    assert engine.abort("b#1")  # a child that never started
    run = drain(engine)
    assert sorted(run.finished) == ["a#1", "a#2", "b#0"]
    assert all(len(run.token_ids[rid]) == 5 for rid in run.finished)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_group_is_all_or_none(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="request_ids"):
        engine.add_request_group(["x#0", "x#0"], PROMPT, SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request_group(["x#0", "x#1"], [], SamplingParams())
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request_group([f"x#{i}" for i in range(9)], PROMPT, SamplingParams())
    assert not engine.has_unfinished()
