"""How many tokens one API process relays per CPU-second: the API as the bottleneck, not the model.

    .venv/bin/python benchmarks/api_relay.py [--concurrency 32,128] [--output-len 256] [--step-ms 25]

A GPU worker can produce thousands of tokens a second; every one of them passes through an API process
(pub/sub message in, OpenAI SSE chunk out). To size API replicas we need the API's CPU cost per token without a
CPU-bound model in the way. So the tokens here come from a **token source** in its own process, a load harness
standing in for a very fast worker (not a model, and not part of the product): it claims jobs through the real
queue and, every ``--step-ms``, publishes one token for each job it holds in one ``publish_many`` pipeline, the
way a worker decoding a large batch does, completing each job after ``--output-len`` tokens. Streaming
``/v1/completions`` clients (the ``tokenspool bench serve`` load generator, all requests at once) read them
through a real ``tokenspool api`` process on a private redis-server.

Reported per concurrency: tokens relayed per second, the API process's CPU seconds (from /proc) per 1000
tokens, and the token rate one API core could sustain (tokens / API CPU-second). Results:
``benchmarks/results/api_relay.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import BenchConfig, random_requests, run_benchmark  # noqa: E402
from benchmarks.loadgen_report import summarize  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.launcher.redis_server import RedisServer, free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "relay-bench"
SOURCE_ID = "token-source-1"
TOKEN_TEXT, TOKEN_ID = " the", 260  # one token, repeated: the API's cost does not depend on which


def _card() -> Any:
    """A model card with SmolLM2's tokenizer, so the API validates and counts prompts as it would for real."""
    from tokenizers import Tokenizer

    from shared.schemas import ModelCard
    from worker.models import resolve_model

    tokenizer = Tokenizer.from_file(str(resolve_model("smollm2") / "tokenizer.json"))
    return ModelCard(name=MODEL, max_model_len=8192, eos_token_ids=[0], chat_template=None, vocab_size=49152,
                     tokenizer_json=tokenizer.to_str(), special_tokens={})


async def _token_source(redis_url: str, step_s: float, ready: Any, stop: Any) -> None:
    """Claim every job of ``MODEL``; each step, one token for every job held, in one pipeline."""
    from redis.asyncio import Redis

    from shared.queue import ClaimedJob, JobQueue
    from shared.schemas import Choice, JobResult, TokenEvent, Usage, WorkerInfo

    redis = Redis.from_url(redis_url)
    queue = JobQueue(redis, Settings(redis_url=redis_url, lease_ttl_s=30))
    card, started = _card(), time.time()

    def info() -> WorkerInfo:
        return WorkerInfo(id=SOURCE_ID, model=MODEL, max_num_seqs=1024, heartbeat_at=time.time(), started_at=started)

    await queue.register_worker(info(), card)
    ready.set()
    held: dict[str, tuple[ClaimedJob, int]] = {}
    next_heartbeat = time.monotonic() + 1.0
    while not stop.is_set():
        began = time.monotonic()
        for job in await queue.claim(MODEL, SOURCE_ID, 1024):
            held[job.submission.id] = (job, 0)
        held = {job_id: (job, n + 1) for job_id, (job, n) in held.items()}
        if held:
            await queue.publish_many([(job_id, job.fence, [TokenEvent(seq=n, index=0, text=TOKEN_TEXT,
                                                                      token_ids=[TOKEN_ID])])
                                      for job_id, (job, n) in held.items()])
        for job_id, (job, n) in [(j, v) for j, v in held.items() if v[1] >= v[0].submission.params.max_tokens]:
            del held[job_id]
            await queue.complete(job_id, job.fence, JobResult(
                choices=[Choice(index=0, text=TOKEN_TEXT * n, finish_reason="length", token_ids=[TOKEN_ID] * n)],
                usage=Usage(prompt_tokens=1, completion_tokens=n)))
        if began >= next_heartbeat:
            await queue.register_worker(info(), card)
            await queue.renew(SOURCE_ID, {job_id: job.fence for job_id, (job, _) in held.items()})
            next_heartbeat = began + 1.0
        await asyncio.sleep(max(0.0, step_s - (time.monotonic() - began)))
    await queue.deregister_worker(SOURCE_ID)
    await redis.aclose()


def _run_source(redis_url: str, step_s: float, ready: Any, stop: Any) -> None:
    asyncio.run(_token_source(redis_url, step_s, ready, stop))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_ready(base_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            models = httpx.get(f"{base_url}/v1/models", timeout=2).json()
            if any(m["id"] == MODEL for m in models.get("data", [])):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the API at {base_url} did not list {MODEL} within {timeout_s} s")


def measure(base_url: str, api_pid: int, concurrency: int, output_len: int, seed: int) -> dict[str, Any]:
    """One round: ``concurrency`` streams at once; the API's CPU time around it."""
    requests = random_requests(concurrency, 32, output_len, 0.0, random.Random(seed))
    config = BenchConfig(base_url=base_url, endpoint="completions", model=MODEL, timeout_s=600)
    cpu_before = _cpu_seconds(api_pid)
    results, duration_s = asyncio.run(run_benchmark(config, requests))
    api_cpu_s = _cpu_seconds(api_pid) - cpu_before
    summary = summarize(results, duration_s)
    tokens = summary.total_output_tokens
    return {"concurrency": concurrency, "output_len": output_len, "completed": summary.num_completed,
            "failed": summary.num_failed, "duration_s": duration_s, "tokens": tokens,
            "tokens_per_s": tokens / duration_s, "api_cpu_s": api_cpu_s,
            "api_cpu_ms_per_1000_tokens": 1e6 * api_cpu_s / tokens if tokens else None,
            "tokens_per_api_cpu_s": tokens / api_cpu_s if api_cpu_s else None,
            "itl_p50_ms": summary.itl_ms.p50}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="32,128", help="comma-separated stream counts, one round each")
    parser.add_argument("--output-len", type=int, default=256, help="tokens per stream")
    parser.add_argument("--step-ms", type=float, default=25.0, help="the token source's step interval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "api_relay.json")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokenspool-relay-") as tmp, \
            RedisServer(Path(tmp) / "redis", appendonly=False) as redis:
        port = free_port()
        env = {**os.environ, "TOKENSPOOL_REDIS_URL": redis.url, "TOKENSPOOL_PORT": str(port),
               "TOKENSPOOL_HOST": "127.0.0.1", "TOKENSPOOL_LOG_LEVEL": "WARNING"}
        api = subprocess.Popen([sys.executable, "-m", "shared.launcher.cli", "api"], env=env, cwd=ROOT)
        ctx = multiprocessing.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        source = ctx.Process(target=_run_source, args=(redis.url, args.step_ms / 1000, ready, stop))
        source.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the token source did not start")
            base_url = f"http://127.0.0.1:{port}"
            _wait_ready(base_url)
            measure(base_url, api.pid, 8, 16, args.seed + 1000)  # warm-up: connections, imports, caches
            for i, concurrency in enumerate(int(c) for c in args.concurrency.split(",")):
                row = measure(base_url, api.pid, concurrency, args.output_len, args.seed + i)
                rows.append(row)
                print(f"concurrency {concurrency}: {row['tokens_per_s']:.0f} tok/s relayed, API "
                      f"{row['api_cpu_ms_per_1000_tokens']:.0f} CPU-ms per 1000 tokens "
                      f"(one API core: ~{row['tokens_per_api_cpu_s']:.0f} tok/s)", flush=True)
        finally:
            stop.set()
            source.join(30)
            api.terminate()
            api.wait(30)
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "load_average_1m": os.getloadavg()[0]},
              "step_ms": args.step_ms, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
