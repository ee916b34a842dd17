"""Scheduler behaviour without a model: admission order, token budget, chunked prefill and preemption."""

from __future__ import annotations

import itertools

from worker.engine.block_pool import BlockPool
from worker.engine.request import Request, RequestStatus
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerOutput

_arrivals = itertools.count()


def make_request(request_id: str, prompt_len: int, priority: int = 0, max_tokens: int = 100) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(range(10, 10 + prompt_len)),
                   params=SamplingParams(max_tokens=max_tokens), priority=priority, arrival=next(_arrivals),
                   max_tokens=max_tokens)


def fake_model_step(scheduler: Scheduler, output: SchedulerOutput, requests: dict[str, Request]) -> None:
    """What the engine does after the forward: each request that caught up gets a token; done ones finish."""
    for chunk in output.chunks:
        request = requests[chunk.request_id]
        if chunk.needs_logits:
            request.output_token_ids.append(7)
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request)


def test_admission_by_priority_then_arrival() -> None:
    scheduler = Scheduler(BlockPool(64), block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    requests = {r.request_id: r for r in [make_request("low", 3, priority=0, max_tokens=1),
                                          make_request("high-1", 3, priority=5, max_tokens=1),
                                          make_request("high-2", 3, priority=5, max_tokens=1),
                                          make_request("mid", 3, priority=1, max_tokens=1)]}
    for request in requests.values():
        scheduler.add(request)
    order = []
    for _ in range(4):
        output = scheduler.schedule()
        assert len(output.chunks) == 1  # max_num_seqs=1
        order.append(output.chunks[0].request_id)
        fake_model_step(scheduler, output, requests)
    assert order == ["high-1", "high-2", "mid", "low"]
    assert scheduler.pool.num_free_blocks == 64


def test_chunked_prefill_respects_budget_and_never_stalls_decodes() -> None:
    scheduler = Scheduler(BlockPool(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    short = make_request("short", 2)
    requests = {"short": short}
    scheduler.add(short)
    fake_model_step(scheduler, scheduler.schedule(), requests)  # short is now decoding
    long = make_request("long", 25, max_tokens=3)
    requests["long"] = long
    scheduler.add(long)
    long_chunks = []
    for _ in range(3):
        output = scheduler.schedule()
        assert output.num_tokens <= 10
        by_id = {c.request_id: c for c in output.chunks}
        assert len(by_id["short"].token_ids) == 1  # the decode runs every step, scheduled first
        assert output.chunks[0].request_id == "short"
        long_chunks.append((by_id["long"].start_position, len(by_id["long"].token_ids), by_id["long"].needs_logits))
        fake_model_step(scheduler, output, requests)
    assert long_chunks == [(0, 9, False), (9, 9, False), (18, 7, True)]
    assert long.num_output_tokens == 1 and long.num_computed_tokens == 25


def test_preemption_picks_lowest_priority_latest_arrival_and_resumes() -> None:
    # 6 blocks of 4 tokens; three 8-token prompts take 2 blocks each; the first decode step needs a 3rd block.
    scheduler = Scheduler(BlockPool(6), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = make_request("a", 8, priority=1), make_request("b", 8, priority=0), make_request("c", 8, priority=1)
    requests = {r.request_id: r for r in (a, b, c)}
    for request in (a, b, c):
        scheduler.add(request)
    fake_model_step(scheduler, scheduler.schedule(), requests)
    assert [r.num_computed_tokens for r in (a, b, c)] == [8, 8, 8]
    output = scheduler.schedule()  # a and c (priority 1) go first; a needs block #7 -> b (priority 0) preempted
    assert output.preempted_ids == ("b",)
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.output_token_ids == [7]  # kept: it will recompute prompt + output
    assert scheduler.num_preemptions == 1
    assert [ch.request_id for ch in output.chunks] == ["a", "c"]  # both grow into the blocks b left
    assert scheduler.pool.num_free_blocks == 0


def test_preempted_request_resumes_with_recompute() -> None:
    scheduler = Scheduler(BlockPool(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_request("a", 8, max_tokens=2), make_request("b", 8, max_tokens=3)
    requests = {"a": a, "b": b}
    scheduler.add(a)
    scheduler.add(b)
    fake_model_step(scheduler, scheduler.schedule(), requests)
    output = scheduler.schedule()  # a needs a 3rd block: b (later arrival) is the victim
    assert output.preempted_ids == ("b",)
    fake_model_step(scheduler, output, requests)  # a finishes (2 tokens), freeing its blocks
    assert a.status is RequestStatus.FINISHED
    output = scheduler.schedule()
    (chunk,) = output.chunks
    assert chunk.request_id == "b" and chunk.start_position == 0
    assert list(chunk.token_ids) == b.prompt_token_ids + [7]  # prompt + the output it already had
    assert chunk.needs_logits
