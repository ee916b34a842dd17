"""Async scheduling (``overlap.py``): the next decode step is launched before this one's tokens are read back.

On the CPU nothing runs concurrently, but every part of the mechanism runs: steps scheduled behind pending tokens,
their ids fed from the previous step's drawn tensor, the read-back a step late, dropped rows of requests that ended
meanwhile. So each test compares the overlapped engine with the same engine stepping in turn (the static padded
decode path, ``cuda_graphs="padded"``, in both), token for token and event for event.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import Run, drain, poison_token, reference_greedy
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.block_pool import hash_full_blocks
from worker.engine.config import pick_async_scheduling
from worker.engine.draw import NOT_FINITE
from worker.engine.request import PENDING_TOKEN, Request
from worker.engine.sampler import SamplerOutput, SamplingBatch
from worker.engine.scheduler import SchedulerOutput

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
PROMPTS = [[5 + 7 * i for i in range(n)] for n in (5, 19, 30)]


def _engine(model: Path, overlap: bool, **kwargs: object) -> Engine:
    # flex with 16-token blocks (the CPU flex kernel's multiple), float32: transformers' exact forward
    return Engine(EngineConfig(model=str(model), dtype="float32", block_size=16, num_kv_blocks=32, max_num_seqs=4,
                               attention_backend="flex", cuda_graphs="padded",
                               async_scheduling="on" if overlap else "off", **kwargs))  # type: ignore[arg-type]


def _run(engine: Engine, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> Run:
    """Every request to its end; no step computes the K/V of a request's last output (``max_tokens``)."""
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, sp)
    requests = dict(engine._requests)
    schedule = engine.scheduler.schedule

    def checked_schedule() -> SchedulerOutput:
        output = schedule()
        for c in output.chunks:
            r = requests[c.request_id]
            assert c.start_position + len(c.token_ids) < r.num_prompt_tokens + r.max_tokens, c
        return output

    engine.scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    run = Run()
    try:
        while engine.has_unfinished():
            run.record(engine.step())
            run.num_steps += 1
    finally:
        del engine.scheduler.schedule
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    assert engine.runner.graphs is not None and engine.runner.graphs.num_steps > 0
    return run


def _outcome(run: Run) -> dict[str, tuple[list[int], str, str | None, str | None]]:
    return {rid: (run.token_ids[rid], run.text[rid], e.finish_reason, e.error) for rid, e in run.finished.items()}


@pytest.fixture(scope="module")
def overlapped(tiny_llama: Path) -> Engine:
    engine = _engine(tiny_llama, overlap=True)
    assert engine.runner.async_scheduling
    return engine


@pytest.fixture(scope="module")
def in_turn(tiny_llama: Path) -> Engine:
    engine = _engine(tiny_llama, overlap=False)
    assert not engine.runner.async_scheduling
    return engine


def test_greedy_tokens_equal_generate_and_the_engine_in_turn(tiny_llama: Path, overlapped: Engine,
                                                             in_turn: Engine) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 8, 1)]
    run = _run(overlapped, params)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert [run.token_ids[f"r{i}"] for i in range(3)] == [reference_greedy(reference, p, sp)
                                                          for p, sp in zip(PROMPTS, params, strict=True)]
    assert _outcome(run) == _outcome(_run(in_turn, params))
    assert run.num_steps == 12 + 1  # one more call than tokens: the last step's tokens come a call later


def test_a_request_stopped_by_the_pending_token_drops_its_row_of_the_next_step(overlapped: Engine,
                                                                            in_turn: Engine) -> None:
    """r0 stops on its 4th token (a stop token) and r1 on a stop string, while the step behind each was already
    launched with a row for it; the others go on as they would."""
    free = _run(in_turn, [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 3)
    stop_id = free.token_ids["r0"][3]
    stop_text = in_turn.tokenizer.decode(free.token_ids["r1"][:5])[-2:]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=(stop_id,)),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=(stop_text,)),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    run = _run(overlapped, params)
    assert run.finished["r0"].finish_reason == "stop" and len(run.token_ids["r0"]) <= 4
    assert run.finished["r1"].finish_reason == "stop" and len(run.token_ids["r1"]) <= 5
    assert _outcome(run) == _outcome(_run(in_turn, params))


def test_seeded_sampling_draws_the_same_tokens(overlapped: Engine, in_turn: Engine) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=9, ignore_eos=True, seed=s)
              for s in (1, 2, 3)]
    assert _outcome(_run(overlapped, params)) == _outcome(_run(in_turn, params))


def test_requests_that_need_the_host_between_steps_step_in_turn(overlapped: Engine, in_turn: Engine) -> None:
    """Logprobs, a penalty and min_tokens beside plain requests: the overlapped engine steps those batches in turn
    (and overlaps again once min_tokens is reached), with the same outcome."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4)]
    for subset in ([0, 2], [1, 2], [2]):
        chosen = [params[i] for i in subset]
        prompts = [PROMPTS[i] for i in subset]
        run = _run(overlapped, chosen, prompts)
        assert _outcome(run) == _outcome(_run(in_turn, chosen, prompts))
        if 0 in subset:
            assert all(e.logprobs for e in [run.finished["r0"]])


def test_an_abort_while_a_token_is_pending_drops_it(overlapped: Engine) -> None:
    for i, prompt in enumerate(PROMPTS):
        overlapped.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    run = Run()
    while len(run.token_ids.get("r1", ())) < 3:
        run.record(overlapped.step())
    assert overlapped._pending is not None and any(r.num_pending_tokens for r in overlapped.scheduler.running)
    assert overlapped.abort("r1")
    drain(overlapped, run)
    assert "r1" not in run.finished and len(run.token_ids["r1"]) == 3  # nothing came after the abort
    assert {rid: len(ids) for rid, ids in run.token_ids.items() if rid != "r1"} == {"r0": 10, "r2": 10}
    assert overlapped.stats().num_free_blocks == overlapped.stats().num_total_blocks


def test_a_request_whose_logits_turn_nan_mid_decode_fails_alone(tiny_llama: Path, in_turn: Engine) -> None:
    """The token r0 generates third gets a NaN embedding: r0's next step has NaN logits and fails when read back;
    the others finish as they would."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3
    free = _run(in_turn, params)
    others = {t for rid in ("r1", "r2") for t in free.token_ids[rid]} | {t for p in PROMPTS for t in p}
    position, poison = next((i, t) for i, t in enumerate(free.token_ids["r0"]) if t not in others and i > 1)
    engine = _engine(tiny_llama, overlap=True)
    poison_token(engine, poison)
    run = _run(engine, params)
    assert run.finished["r0"].error == NOT_FINITE and run.token_ids["r0"] == free.token_ids["r0"][:position + 1]
    assert {rid: run.token_ids[rid] for rid in ("r1", "r2")} == {rid: free.token_ids[rid] for rid in ("r1", "r2")}


def test_blocks_are_cached_once_their_pending_tokens_are_known(overlapped: Engine, in_turn: Engine) -> None:
    """r0 decodes across a block boundary with its tokens pending; the block hashes it publishes are those of its
    real tokens, so a request whose prompt is r0's prompt and output hits the cache as far as in turn."""
    prompt = [9 + i for i in range(14)]  # 14 + 20 tokens: blocks 0 and 1 fill during decoding
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    hits = []
    for engine in (overlapped, in_turn):
        output = _run(engine, [params], [prompt]).token_ids["r0"]
        before = engine.stats().prefix_cache_hits
        _run(engine, [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)], [prompt + output])
        hits.append(engine.stats().prefix_cache_hits - before)
    assert hits[0] == hits[1] == 32


def test_pending_tokens_count_toward_a_request_but_have_no_id_yet() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), priority=0, arrival=0, max_tokens=8)
    request.output_token_ids = [4, 5]
    request.num_pending_tokens = 1
    assert request.num_tokens == 6 and request.num_known_tokens == 5 and request.num_uncomputed_tokens == 6
    assert request.token_ids_slice(0, 6) == [1, 2, 3, 4, 5, PENDING_TOKEN]
    assert request.token_ids_slice(5, 6) == [PENDING_TOKEN] and request.token_ids_slice(2, 4) == [3, 4]
    assert len(hash_full_blocks(request.token_ids_slice(0, 4), 2, 2)) == 2


def test_async_scheduling_is_on_where_graphs_replay(tiny_llama: Path) -> None:
    assert pick_async_scheduling(EngineConfig(), "on") and not pick_async_scheduling(EngineConfig(), "padded")
    assert not pick_async_scheduling(EngineConfig(async_scheduling="off"), "on")
    assert pick_async_scheduling(EngineConfig(async_scheduling="on", cuda_graphs="padded"), "padded")
    with pytest.raises(ValueError, match="async_scheduling"):
        pick_async_scheduling(EngineConfig(async_scheduling="on"), "off")
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="on", cuda_graphs="off")
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32"))  # CPU defaults: kernel/sdpa, no graphs
    assert engine.runner.graphs is None and not engine.runner.async_scheduling


def test_a_sampler_that_raises_mid_decode_fails_that_request_alone(tiny_llama: Path) -> None:
    """From r1's fourth token on, drawing raises for any batch holding r1 (top_k 7): the overlapped engine draws
    that step again in turn, where the batch is bisected down to r1, with the outcome of the engine in turn."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.5, top_k=7, max_tokens=8, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=4)]
    outcomes = []
    for overlap in (True, False):
        engine = _engine(tiny_llama, overlap)
        draw = engine.sampler.__call__

        def faulty(logits: torch.Tensor, batch: SamplingBatch, engine: Engine = engine,
                   draw: Callable[..., SamplerOutput] = draw) -> SamplerOutput:
            r1 = engine._requests.get("r1")
            if r1 is not None and r1.num_output_tokens + r1.num_pending_tokens >= 3 and batch.top_k is not None \
                    and bool((batch.top_k == 7).any()):
                raise RuntimeError("no draw for r1")
            return draw(logits, batch)

        engine.sampler = faulty  # type: ignore[assignment]
        outcomes.append(_outcome(_run(engine, params)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0]["r1"][2:] == ("error", "sampling failed: RuntimeError: no draw for r1")
    assert len(outcomes[0]["r1"][0]) == 3 and [len(outcomes[0][r][0]) for r in ("r0", "r2")] == [8, 8]


def test_turning_overlap_off_mid_run_settles_the_pending_step(overlapped: Engine, in_turn: Engine) -> None:
    """The GPU check times one engine both ways: the first step in turn returns the pending step's tokens too."""
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)] * 3
    for i, prompt in enumerate(PROMPTS):
        overlapped.add_request(f"r{i}", prompt, params[i])
    run = Run()
    while len(run.token_ids.get("r0", ())) < 4:
        run.record(overlapped.step())
    assert overlapped._pending is not None
    overlapped.runner.async_scheduling = False
    try:
        drain(overlapped, run)
    finally:
        overlapped.runner.async_scheduling = True
    assert overlapped._pending is None
    assert _outcome(run) == _outcome(_run(in_turn, params))


def test_a_mixed_workload_under_preemption_ends_as_in_turn(tiny_llama: Path) -> None:
    """Seven requests (one an n=2 group) outgrow a pool of 10 blocks while decoding overlapped, so requests are
    preempted with a token pending; greedy and seeded, some stopped by a stop token mid-way, one with logprobs that
    ends early: each ends with the tokens and reason it gets in turn."""
    rng = random.Random(5)
    jobs = []
    for i in range(6):
        params = SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i if i % 3 == 0 else None,
                                max_tokens=4 if i == 5 else rng.randint(25, 40), ignore_eos=True,
                                logprobs=1 if i == 5 else None)
        jobs.append(([f"j{i}a", f"j{i}b"] if i == 4 else [f"j{i}"], [rng.randrange(3, 500) for _ in range(
            rng.randint(1, 20))], params))

    def run(overlap: bool, stops: dict[int, int]) -> tuple[dict[str, tuple], int, int]:
        engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", block_size=16, num_kv_blocks=10,
                                     max_num_seqs=8, attention_backend="flex", cuda_graphs="padded",
                                     async_scheduling="on" if overlap else "off"))
        for i, (ids, prompt, params) in enumerate(jobs):
            stop = (stops[i],) if i in stops else ()
            engine.add_request_group(ids, prompt, dataclasses.replace(params, stop_token_ids=stop))
        overlapped, counted = engine._overlapped_step, []
        engine._overlapped_step = lambda pending: counted.append(1) or overlapped(pending)  # type: ignore[method-assign]
        outcome = _outcome(drain(engine))
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
        return outcome, engine.stats().num_preemptions, len(counted)

    free, _, _ = run(False, {})
    stops = {i: free[f"j{i}"][0][12] for i in (1, 2)}  # their 13th token ends them
    outcome, preempted, num_overlapped = run(True, stops)
    assert outcome == run(False, stops)[0] and len(outcome) == 7
    assert preempted > 0 and num_overlapped > 20  # (the blocks run out a step earlier than in turn)
    assert [outcome[f"j{i}"][2] for i in (1, 2, 3)] == ["stop", "stop", "length"]
