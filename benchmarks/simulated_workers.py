"""Simulated workers for ``benchmarks/redis_capacity.py``: the queue traffic of GPU workers, with no model.

    python benchmarks/simulated_workers.py REDIS_URL MODEL OUT.json [--workers 4] [--step-ms 25] [--max-jobs 1024]
        [--queue-shards 1]

A load harness, not a worker: each simulated worker registers, claims jobs of ``MODEL`` through the production
``shared.queue.JobQueue`` (claim.lua), and every ``--step-ms`` publishes one token for each job it holds with one
``publish_many`` call (what a worker's outbox sends per engine step), then completes each job that reached its
``max_tokens`` (complete.lua), renewing its leases and heartbeating once a second. Which queue code runs is the one
first on ``PYTHONPATH``, so the parent can run this file against another checkout's ``shared/`` (before/after).
``REDIS_URL`` may name a cluster (``redis+cluster://``); ``--queue-shards`` must then be the API's.

A token's text is the wall-clock millisecond of its publish call modulo 10^8 (8 digits), so an SSE client can tell
how late it arrived. Runs until stdin closes, then writes every publish call ``[wall start, latency s, jobs]``
(one token per job), every completion's wall time and the tokens accepted to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import Settings
from shared.queue import ClaimedJob, JobQueue
from shared.redis_client import open_client
from shared.schemas import Choice, JobResult, ModelCard, TokenEvent, Usage, WorkerInfo

TOKEN_ID = 260
STAMP_MODULO_MS = 10**8


def stamp(wall_s: float) -> str:
    """A token's text: the publish time in ms modulo 10^8, 8 digits."""
    return f"{int(wall_s * 1000) % STAMP_MODULO_MS:08d}"


def lag_ms(text: str, wall_s: float) -> float:
    """How long ago (ms) a token stamped ``text`` was published, for a reader at ``wall_s``."""
    return float((int(wall_s * 1000) - int(text)) % STAMP_MODULO_MS)


@dataclass
class Samples:
    """What the simulated workers measured, for the parent to cut into levels by wall time."""

    publishes: list[tuple[float, float, int]] = field(default_factory=list)  # wall start, latency s, jobs (= tokens)
    completions: list[float] = field(default_factory=list)
    tokens_accepted: int = 0
    stale_publishes: int = 0


async def _simulate(settings: Settings, model: str, worker_id: str, step_s: float, max_jobs: int,
                    samples: Samples, stop: threading.Event) -> None:
    assert settings.redis_url is not None
    redis = await open_client(settings.redis_url)
    queue = JobQueue(redis, settings)
    card = ModelCard(name=model, max_model_len=8192, eos_token_ids=[0], vocab_size=49152)
    started = time.time()

    def info() -> WorkerInfo:
        return WorkerInfo(id=worker_id, model=model, max_num_seqs=max_jobs, heartbeat_at=time.time(),
                          started_at=started)

    await queue.register_worker(info(), card)
    held: dict[str, tuple[ClaimedJob, int]] = {}  # job id -> (claim, tokens published)
    next_heartbeat = time.monotonic() + 1.0
    while not stop.is_set():
        began = time.monotonic()
        if len(held) < max_jobs:
            for job in await queue.claim(model, worker_id, max_jobs - len(held), idle=not held):
                held[job.submission.id] = (job, 0)
        if held:
            wall, sent = time.time(), time.monotonic()
            text = stamp(wall)
            batches = [(job_id, job.fence, [TokenEvent(seq=n + 1, text=text, token_ids=[TOKEN_ID])])
                       for job_id, (job, n) in held.items()]
            accepted = await queue.publish_many(batches)
            samples.publishes.append((wall, time.monotonic() - sent, len(batches)))
            for (job_id, _, _), ok in zip(batches, accepted, strict=True):
                job, n = held[job_id]
                if ok:
                    held[job_id] = (job, n + 1)
                    samples.tokens_accepted += 1
                else:
                    samples.stale_publishes += 1
                    del held[job_id]
            for job_id, (job, n) in [(j, v) for j, v in held.items() if v[1] >= v[0].submission.params.max_tokens]:
                del held[job_id]
                await queue.complete(job_id, job.fence, JobResult(
                    choices=[Choice(index=0, text="", finish_reason="length", token_ids=[TOKEN_ID] * n)],
                    usage=Usage(prompt_tokens=1, completion_tokens=n)))
                samples.completions.append(time.time())
        if began >= next_heartbeat:
            await queue.register_worker(info(), card)
            await queue.renew(worker_id, {job_id: job.fence for job_id, (job, _) in held.items()})
            next_heartbeat = began + 1.0
        await asyncio.sleep(max(0.0, step_s - (time.monotonic() - began)))
    await queue.deregister_worker(worker_id)
    await redis.aclose()


async def run(redis_url: str, model: str, num_workers: int, step_s: float, max_jobs: int,
              stop: threading.Event, queue_shards: int = 1) -> Samples:
    """``num_workers`` simulated workers in this process until ``stop``; their samples merged."""
    samples = Samples()
    settings = Settings(redis_url=redis_url, lease_ttl_s=30, queue_shards=queue_shards)
    await asyncio.gather(*(_simulate(settings, model, f"sim-worker-{i}", step_s, max_jobs, samples, stop)
                           for i in range(num_workers)))
    return samples


async def publish_only(redis_url: str, model: str, max_jobs: int, num_steps: int) -> dict[str, object]:
    """The publish path alone: claim up to ``max_jobs`` queued jobs of ``model`` and publish ``num_steps`` steps
    of one token each back to back (no pacing, no claims or completions in between), reading Redis's CPU time,
    commands and input bytes around exactly those steps; then complete the jobs."""
    redis = await open_client(redis_url)
    queue = JobQueue(redis, Settings(redis_url=redis_url, lease_ttl_s=600))
    claims = await queue.claim(model, "publish-only", max_jobs)

    def step(n: int) -> list[tuple[str, int, list[TokenEvent]]]:
        return [(c.submission.id, c.fence, [TokenEvent(seq=n, text=" the", token_ids=[TOKEN_ID])]) for c in claims]

    async def counters() -> tuple[float, float, float]:
        info = await redis.info("all")
        return (float(info["used_cpu_sys"]) + float(info["used_cpu_user"]), float(info["total_commands_processed"]),
                float(info["total_net_input_bytes"]))

    await queue.publish_many(step(1))  # loads the script
    latencies = []
    before = await counters()
    began = time.monotonic()
    for n in range(2, num_steps + 2):
        sent = time.monotonic()
        assert all(await queue.publish_many(step(n)))
        latencies.append(time.monotonic() - sent)
    wall_s = time.monotonic() - began
    after = await counters()
    for c in claims:
        await queue.complete(c.submission.id, c.fence, JobResult(
            choices=[Choice(index=0, text="", finish_reason="length")], usage=Usage(prompt_tokens=1)))
    await redis.aclose()
    return {"jobs": len(claims), "tokens": len(claims) * num_steps, "wall_s": wall_s, "latencies_s": latencies,
            "redis_cpu_s": after[0] - before[0], "redis_commands": after[1] - before[1],
            "redis_net_in_bytes": after[2] - before[2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("redis_url")
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--max-jobs", type=int, default=1024, help="jobs one simulated worker holds at most")
    parser.add_argument("--queue-shards", type=int, default=1, help="the deployment's queue_shards (as the API's)")
    parser.add_argument("--publish-only", type=int, metavar="STEPS", default=0,
                        help="measure STEPS back-to-back publish steps of the queued jobs instead (publish_only)")
    args = parser.parse_args(argv)
    queue_code = str(Path(sys.modules["shared"].__file__ or "").parent)
    if args.publish_only:
        result = asyncio.run(publish_only(args.redis_url, args.model, args.max_jobs, args.publish_only))
        args.out.write_text(json.dumps({**result, "queue_code": queue_code}))
        return 0
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    samples = asyncio.run(run(args.redis_url, args.model, args.workers, args.step_ms / 1000, args.max_jobs, stop,
                              args.queue_shards))
    args.out.write_text(json.dumps({"publishes": samples.publishes, "completions": samples.completions,
                                    "tokens_accepted": samples.tokens_accepted,
                                    "stale_publishes": samples.stale_publishes,
                                    "queue_code": queue_code}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
