"""Worker faults under load, through the real API: kill -9 while 20 jobs stream, SIGTERM drain, and two workers
racing for one queue with a frozen (zombie) worker among them. Real processes, real Redis, the tiny Llama."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from shared import keys
from tests.reliability.stack import ApiProcess, assert_clean_stream, follow, frozen, poll, submit, worker_log
from tests.worker.worker_process import WorkerProcess

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow

PROMPTS = ["The sea was", "Once upon a time", "In the beginning", "Dear diary,"]
GREEDY_TOKENS = 64
LONG_TOKENS = 700  # far more than the draining worker can produce within its drain timeout


@pytest.fixture(scope="module")
def greedy(tiny_llama: Path) -> dict[str, list[int]]:
    """transformers' greedy ``generate`` of each prompt (EOS masked for the full length, as min_tokens does)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engine.helpers import reference_greedy
    from worker.engine import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS)
    with torch.no_grad():
        return {p: reference_greedy(model, tokenizer.encode(p), params) for p in PROMPTS}


async def _running_on(redis: Redis, job_ids: list[str], worker_id: str, min_events: int) -> dict[str, int]:
    """The jobs running on ``worker_id`` that have published at least ``min_events`` events, with how many."""
    held = {}
    for job_id in job_ids:
        status, wid, seq = await redis.hmget(KS.job(job_id), "status", "worker_id", "seq")
        if status == b"running" and wid == worker_id.encode() and int(seq or 0) >= min_events:
            held[job_id] = int(seq)
    return held


async def _wait_running_on(redis: Redis, job_ids: list[str], worker: WorkerProcess, count: int,
                           min_events: int = 3, timeout_s: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while len(held := await _running_on(redis, job_ids, worker.worker_id, min_events)) < count:
        assert time.monotonic() < deadline, worker.log_tail()
        await asyncio.sleep(0.02)
    return held


async def _wait_claimed(redis: Redis, job_ids: list[str], worker: WorkerProcess, timeout_s: float = 60) -> None:
    """Until every job was claimed by ``worker`` (running or already finished there)."""
    deadline = time.monotonic() + timeout_s
    while {await redis.hget(KS.job(job_id), "worker_id") for job_id in job_ids} != {worker.worker_id.encode()}:
        assert time.monotonic() < deadline, worker.log_tail()
        await asyncio.sleep(0.02)


async def test_kill_9_while_20_jobs_stream_every_job_finishes_with_the_greedy_text(
        api_process: ApiProcess, new_worker: Callable[..., WorkerProcess], standing_worker: WorkerProcess,
        redis_url: str, greedy: dict[str, list[int]]) -> None:
    survivor, victim = standing_worker, new_worker("kill-victim").start()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(20)]
    body = {"max_tokens": GREEDY_TOKENS, "min_tokens": GREEDY_TOKENS, "temperature": 0}
    async with httpx.AsyncClient(base_url=api_process.base_url, timeout=60) as client, \
            Redis.from_url(redis_url) as redis:
        job_ids = [await submit(client, p, **body) for p in prompts]
        streams = [asyncio.create_task(follow(client, job_id)) for job_id in job_ids]
        await _wait_running_on(redis, job_ids, victim, count=4)
        victim.signal(signal.SIGKILL)
        victim.wait(10)
        await asyncio.sleep(0.1)  # a script the victim sent just before dying still lands
        held = await _running_on(redis, job_ids, victim.worker_id, min_events=1)  # its lease has not run out yet
        assert held
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)

    for prompt, stream in zip(prompts, results, strict=True):
        assert_clean_stream(stream)
        assert stream.ids[0] == 1
        assert stream.final["choices"][0]["token_ids"] == greedy[prompt], stream.job_id
    by_id = {s.job_id: s for s in results}
    for job_id, num_events in held.items():  # the killed worker's jobs: restarted once, finished by the survivor
        stream = by_id[job_id]
        # Every event the victim published came first (its lease had not run out: nobody else ran the job).
        assert stream.kinds.count("restart") == 1 and stream.kinds.index("restart") == num_events, stream.kinds[:6]
        assert (stream.final["worker_id"], stream.final["attempts"]) == (survivor.worker_id, 2)
    assert survivor.proc is not None and survivor.proc.poll() is None


async def test_sigterm_under_load_drains_and_hands_back_the_rest_uncharged(
        api_process: ApiProcess, new_worker: Callable[..., WorkerProcess], standing_worker: WorkerProcess,
        redis_url: str) -> None:
    drain_timeout_s = 0.5
    survivor = standing_worker
    draining = new_worker("drainer", drain_timeout_s=drain_timeout_s).start()
    short = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
    long = {"max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=api_process.base_url, timeout=60) as client, \
            Redis.from_url(redis_url) as redis:
        with frozen(survivor):  # the draining worker gets every job, and nobody takes one back before it exits
            long_ids = [await submit(client, f"Long story {i}", **long) for i in range(4)]
            await _wait_running_on(redis, long_ids, draining, count=4)
            short_ids = [await submit(client, f"Short story {i}", **short) for i in range(4)]
            await _wait_claimed(redis, short_ids, draining)  # they may be done already: 8 tokens are quick
            signalled = time.monotonic()
            draining.signal(signal.SIGTERM)
            while f"{draining.worker_id} draining" not in draining.log_tail():  # handled between engine steps
                await asyncio.sleep(0.02)
            queued_id = await submit(client, "Never claimed by a draining worker", **short)
            assert await asyncio.to_thread(draining.wait, drain_timeout_s + 20) == 0, draining.log_tail()
            exit_s = time.monotonic() - signalled
            for job_id in long_ids:  # handed back uncharged: queued again, no crash counted, not isolated
                fields = await redis.hmget(KS.job(job_id), "status", "attempts", "crashes", "isolate")
                assert fields == [b"queued", b"1", None, None], job_id
        finals = {job_id: (await poll(client, job_id))[0] for job_id in [*long_ids, *short_ids, queued_id]}
        streams = [await follow(client, job_id) for job_id in long_ids]

    # Exit within the drain timeout, plus process teardown (torch), which a loaded 2-core machine stretches.
    assert exit_s < drain_timeout_s + 10, exit_s
    for job_id in short_ids:  # finished within the drain timeout, on the draining worker
        assert (finals[job_id]["status"], finals[job_id]["worker_id"]) == ("succeeded", draining.worker_id)
    for job_id, stream in zip(long_ids, streams, strict=True):
        job = finals[job_id]
        assert (job["status"], job["worker_id"], job["attempts"]) == ("succeeded", survivor.worker_id, 2), job
        assert job["usage"]["completion_tokens"] == LONG_TOKENS
        assert stream.kinds[0] == "restart" and stream.events[0][2]["attempt"] == 2  # a late reader: log trimmed
        assert_clean_stream(stream)
    assert finals[queued_id]["worker_id"] == survivor.worker_id
    released = [e for e in worker_log(draining) if "job_id" in e and "released" in e["msg"]]
    assert sorted(e["job_id"] for e in released) == sorted(long_ids)


async def test_competing_workers_and_a_zombie_never_complete_a_job_twice(
        api_process: ApiProcess, new_worker: Callable[..., WorkerProcess], standing_worker: WorkerProcess,
        redis_url: str) -> None:
    """40 jobs, two workers; one is frozen (SIGSTOP) past its lease while holding jobs, so they are reaped and
    rerun by the other, then thawed: its late writes carry a stale fence and must all be rejected."""
    zombie, rival = new_worker("zombie").start(), standing_worker
    body = {"max_tokens": 48, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=api_process.base_url, timeout=60) as client, \
            Redis.from_url(redis_url) as redis:
        job_ids = [await submit(client, f"Race {i}", **body) for i in range(40)]
        await _wait_running_on(redis, job_ids, zombie, count=2, min_events=2)
        with frozen(zombie):
            await asyncio.sleep(0.1)  # a script the zombie sent just before the signal still lands
            # Every job leased to the zombie, streaming or not yet: one it claimed just before the signal has no
            # event yet, but its lease runs out and its late write is refused like the others'.
            held = await _running_on(redis, job_ids, zombie.worker_id, min_events=0)
            assert held
            await asyncio.sleep(2 + 1.5)  # its 2 s lease runs out; the rival's reaper requeues the jobs
        finals = {job_id: (await poll(client, job_id))[0] for job_id in job_ids}
        logs = {job_id: [e async for e in _log_events(redis, job_id)] for job_id in job_ids}

    accepted: Counter[str] = Counter()
    completed_by: dict[str, str] = {}
    rejected = []
    for worker in (zombie, rival):
        for entry in worker_log(worker):
            if entry.get("job_id") not in finals:
                continue  # the survivor's log holds earlier tests' jobs too
            if entry["msg"] == f"job {entry['job_id']} finished":
                accepted[entry["job_id"]] += 1
                completed_by[entry["job_id"]] = worker.worker_id
            elif "lease lost" in entry["msg"]:
                rejected.append(entry["job_id"])
    assert accepted == Counter({job_id: 1 for job_id in job_ids}), "a job completed more or less than once"
    for job_id in job_ids:
        job = finals[job_id]
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 48
        assert job["worker_id"] == completed_by[job_id]
        events = logs[job_id]
        assert [e["type"] for e in events].count("done") == 1
        assert "".join(e["text"] for e in events if e["type"] == "token") == job["text"]  # log trimmed at restart
    for job_id in held:  # rerun after the lease ran out: by the rival, or by the thawed zombie under a new fence
        assert finals[job_id]["attempts"] == 2
    assert rejected and set(rejected) <= set(held), "only the frozen jobs' leases were lost, and the zombie saw it"


async def _log_events(redis: Redis, job_id: str) -> AsyncIterator[dict[str, Any]]:
    for _, fields in await redis.xrange(KS.job_log(job_id)):
        yield json.loads(fields[b"data"])
