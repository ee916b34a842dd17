"""Soak: many jobs with mixed parameters, priorities, random cancellations and client disconnects against a real
stack, then checks that nothing leaked.

    .venv/bin/python benchmarks/soak.py [--jobs 1000] [--model smollm2 | --tiny] [--workers 1] [--concurrency 32]

The stack is started as ``tokenspool up`` starts it (a private redis-server with AOF in a temporary folder, then
``tokenspool api`` and ``--workers`` x ``tokenspool worker``). Jobs go through every door: ``POST /v1/jobs``
then polled, or followed over SSE; ``/v1/completions``; streamed ``/v1/chat/completions``. About
``--cancel-fraction`` of them are cancelled (``DELETE``) at a random moment and ``--disconnect-fraction`` of the
streamed ones are dropped by their client after the first event. Checks (exit 1 when one fails):

* every job reaches a terminal state (succeeded, failed or cancelled);
* no KV block leaks: once idle, each worker's heartbeat reports ``kv_cache_usage == 0`` (the engine counts a
  block free when no request uses it, including cached-but-unused prefix blocks, which stay evictable);
* Redis holds the keys it held before the load plus, per job, its record and event log, each with the result
  TTL (nothing without an expiry, no stray keys);
* worker RSS after the load vs. after warm-up (the first tenth of the jobs): reported, and checked against
  ``--max-rss-growth-mb``.

Results go to ``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import PROMPT_WORDS  # noqa: E402
from shared import keys  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.launcher.redis_server import RedisServer, free_port  # noqa: E402
from shared.launcher.supervisor import Supervisor  # noqa: E402
from shared.launcher.up import child_specs  # noqa: E402
from shared.schemas import WorkerInfo  # noqa: E402

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

RESULTS = ROOT / "benchmarks" / "results"
TERMINAL = ("succeeded", "failed", "cancelled")
KINDS = ("poll", "sse", "completion", "chat_stream")
KIND_WEIGHTS = (35, 25, 20, 20)
MODEL_NAME = "soak"


@dataclass(frozen=True)
class SoakConfig:
    jobs: int = 1000
    model: str = "smollm2"
    workers: int = 1
    concurrency: int = 32
    cancel_fraction: float = 0.1
    disconnect_fraction: float = 0.1
    max_tokens: int = 48
    seed: int = 0
    max_num_seqs: int = 16
    startup_timeout_s: float = 300.0
    drain_timeout_s: float = 300.0  # for every job to be final after the clients are done
    max_rss_growth_mb: float = 200.0


@dataclass
class JobPlan:
    """What the client does with one job."""

    kind: str
    body: dict[str, Any]
    cancel_after_s: float | None
    disconnect: bool


@dataclass
class Outcome:
    job_id: str | None = None
    client_error: str | None = None


@dataclass
class Report:
    config: dict[str, Any]
    duration_s: float = 0.0
    num_jobs_seen: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    not_terminal: list[str] = field(default_factory=list)
    client_errors: list[str] = field(default_factory=list)
    cancels_sent: int = 0
    disconnects: int = 0
    idle_workers: list[dict[str, Any]] = field(default_factory=list)
    kv_leak: bool = True
    redis_keys_baseline: int = 0
    redis_keys_after: int = 0
    redis_job_keys: int = 0
    redis_stray_keys: list[str] = field(default_factory=list)
    redis_keys_without_ttl: list[str] = field(default_factory=list)
    rss_mb_after_warmup: list[float] = field(default_factory=list)
    rss_mb_end: list[float] = field(default_factory=list)
    rss_mb_peak: list[float] = field(default_factory=list)
    rss_growth_mb: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def plan_jobs(config: SoakConfig, rng: random.Random) -> list[JobPlan]:
    """Mixed prompts, lengths, sampling parameters, priorities, doors, cancellations and disconnects."""
    plans = []
    for _ in range(config.jobs):
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(2, 40)))
        temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
        body: dict[str, Any] = {"max_tokens": rng.randint(1, config.max_tokens), "temperature": temperature,
                                "ignore_eos": rng.random() < 0.5}
        if temperature:
            body |= {"seed": rng.randrange(2**31), "top_p": rng.choice([1.0, 0.9]), "top_k": rng.choice([0, 20])}
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(PROMPT_WORDS)]
        if kind in ("poll", "sse"):
            body |= {"prompt": prompt, "priority": rng.randint(-5, 5), "n": rng.choice([1, 1, 1, 2])}
            if rng.random() < 0.1:
                body["logprobs"] = 2
        elif kind == "completion":
            body |= {"prompt": prompt}
        else:
            body |= {"messages": [{"role": "user", "content": prompt}], "stream": True}
        cancel = kind != "completion" and rng.random() < config.cancel_fraction
        disconnect = kind in ("sse", "chat_stream") and rng.random() < config.disconnect_fraction
        plans.append(JobPlan(kind, body, rng.uniform(0.0, 1.0) if cancel else None, disconnect))
    return plans


async def _cancel_later(client: httpx.AsyncClient, job_id: str, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    response = await client.delete(f"/v1/jobs/{job_id}")
    response.raise_for_status()


async def _read_sse(lines: AsyncIterator[str], stop_after_first: bool) -> str | None:
    """Read SSE data lines until the stream ends (or the first one); the first data line is returned."""
    first = None
    async for line in lines:
        if line.startswith("data: "):
            first = first or line[6:]
            if stop_after_first:
                break
    return first


async def run_job(client: httpx.AsyncClient, plan: JobPlan, cancels: list[asyncio.Task[None]]) -> Outcome:
    """One client: submit through the plan's door, cancel or disconnect as planned, return the job id."""
    outcome = Outcome()
    if plan.kind in ("poll", "sse"):
        response = await client.post("/v1/jobs", json=plan.body)
        response.raise_for_status()
        outcome.job_id = response.json()["id"]
        if plan.cancel_after_s is not None:
            cancels.append(asyncio.create_task(_cancel_later(client, outcome.job_id, plan.cancel_after_s)))
        if plan.kind == "sse":
            async with client.stream("GET", f"/v1/jobs/{outcome.job_id}/events") as events:
                await _read_sse(events.aiter_lines(), stop_after_first=plan.disconnect)
    elif plan.kind == "completion":
        response = await client.post("/v1/completions", json=plan.body)
        response.raise_for_status()
        outcome.job_id = response.json()["id"].removeprefix("cmpl-")
    else:
        async with client.stream("POST", "/v1/chat/completions", json=plan.body) as response:
            response.raise_for_status()
            lines = response.aiter_lines()
            first = await _read_sse(lines, stop_after_first=True)
            outcome.job_id = json.loads(first or "{}").get("id", "").removeprefix("chatcmpl-") or None
            if outcome.job_id and plan.cancel_after_s is not None:
                cancels.append(asyncio.create_task(_cancel_later(client, outcome.job_id, plan.cancel_after_s)))
            if not plan.disconnect:
                await _read_sse(lines, stop_after_first=False)
    return outcome


async def drive(base_url: str, config: SoakConfig, plans: list[JobPlan], on_progress: Any) -> list[Outcome]:
    """Run every plan with at most ``concurrency`` clients at once."""
    limits = httpx.Limits(max_connections=config.concurrency * 2 + 8)
    semaphore = asyncio.Semaphore(config.concurrency)
    cancels: list[asyncio.Task[None]] = []
    done = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits, trust_env=False) as client:

        async def one(plan: JobPlan) -> Outcome:
            nonlocal done
            async with semaphore:
                try:
                    outcome = await run_job(client, plan, cancels)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                    outcome = Outcome(client_error=f"{plan.kind}: {type(exc).__name__}: {exc}")
            done += 1
            on_progress(done)
            return outcome

        outcomes = await asyncio.gather(*(one(plan) for plan in plans))
        for task in cancels:
            with suppress(httpx.HTTPError):
                await task
    return list(outcomes)


def wait_terminal(r: redis.Redis, job_ids: list[str], timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        with r.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(KS.job(job_id), "status")
            statuses = {job_id: (s or b"missing").decode() for job_id, s in zip(job_ids, pipe.execute(), strict=True)}
        if all(s in TERMINAL for s in statuses.values()) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.2)


def idle_worker_infos(r: redis.Redis, timeout_s: float) -> list[WorkerInfo]:
    """The workers' heartbeats once all report nothing running (or whatever they report at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ids = [x.decode() for x in r.zrange(keys.WORKERS, 0, -1)]
        infos = [WorkerInfo.model_validate_json(raw) for raw in r.mget([keys.worker_info(i) for i in ids]) if raw]
        idle = all(i.num_running == 0 and i.num_waiting == 0 and i.kv_cache_usage == 0 for i in infos)
        if (infos and idle) or time.monotonic() > deadline:
            return infos
        time.sleep(0.2)


def worker_rss_mb(supervisor: Supervisor) -> list[float]:
    rss = []
    for spec in supervisor.workers:
        with suppress(psutil.Error, KeyError):
            rss.append(psutil.Process(supervisor.procs[spec.name].pid).memory_info().rss / 2**20)
    return rss


def check_redis(r: redis.Redis, baseline: set[bytes], job_ids: list[str], report: Report) -> None:
    """Only baseline keys plus each job's record and log (with a TTL), and the bounded per-model and per-owner
    state: the FIFO counter, the tenants' fair-share clock, the recent-jobs index (it expires) and the job-event
    stream (capped)."""
    expected = {k.encode() for job_id in job_ids for k in (KS.job(job_id), KS.job_log(job_id))}
    bounded = (KS.queue_seq(MODEL_NAME, 0), KS.dead_letter(0), KS.queue_vtime(MODEL_NAME, 0), KS.owner_jobs(None, 0),
               KS.job_events(0))
    allowed = baseline | {k.encode() for k in bounded}
    after = set(r.scan_iter(count=1000))
    report.redis_keys_baseline, report.redis_keys_after = len(baseline), len(after)
    report.redis_job_keys = len(after & expected)
    report.redis_stray_keys = sorted(k.decode(errors="replace") for k in after - expected - allowed)[:20]
    report.redis_keys_without_ttl = sorted(k.decode(errors="replace") for k in after & expected
                                           if r.ttl(k) < 0)[:20]


@contextmanager
def soak_stack(config: SoakConfig, data_dir: Path) -> Iterator[tuple[str, Supervisor]]:
    """Redis (AOF on), the API and the workers, as ``tokenspool up`` starts them; stopped on exit."""
    server = RedisServer(data_dir / "redis", appendonly=True)
    port = free_port()
    settings = Settings(model=config.model, model_name=MODEL_NAME, workers=config.workers, host="127.0.0.1",
                        port=port, device="cpu", max_num_seqs=config.max_num_seqs, heartbeat_interval_s=0.5,
                        lease_ttl_s=10, log_level="WARNING", max_queue_length=max(10_000, config.jobs))
    api, workers = child_specs(settings, server.url, port)
    for spec in workers:  # one intra-op thread per worker: the client, API and Redis share the CPUs
        spec.env["OMP_NUM_THREADS"] = "1"
    supervisor = Supervisor(api, workers, server)
    base_url = f"http://127.0.0.1:{port}"
    try:
        supervisor.start()
        if supervisor.wait(until=lambda: _ready(base_url, settings.workers),
                           timeout_s=config.startup_timeout_s) is not None:
            raise RuntimeError(f"the stack did not become ready: {supervisor.dead_child() or 'timed out'}")
        yield base_url, supervisor
    finally:
        supervisor.stop()


def _ready(base_url: str, num_workers: int) -> bool:
    try:
        response = httpx.get(f"{base_url}/readyz", timeout=2.0, trust_env=False)
        return response.status_code == 200 and response.json().get("workers") == num_workers
    except httpx.HTTPError:
        return False
    finally:
        time.sleep(0.2)


def run(config: SoakConfig, log: Any = None) -> Report:
    """Start a stack, run the soak, check for leaks; the stack is gone when this returns."""
    report = Report(config=asdict(config))
    plans = plan_jobs(config, random.Random(config.seed))
    say = log or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="tokenspool-soak-") as tmp, soak_stack(config, Path(tmp)) as stack:
        base_url, supervisor = stack
        with redis.Redis.from_url(supervisor.redis.url if supervisor.redis else "") as r:
            baseline = set(r.scan_iter(count=1000))
            peak: list[float] = worker_rss_mb(supervisor)
            warmup_mark = max(1, config.jobs // 10)

            def on_progress(done: int) -> None:
                nonlocal peak
                rss = worker_rss_mb(supervisor)
                peak = [max(a, b) for a, b in zip(peak, rss, strict=False)] or rss
                if done == warmup_mark:
                    report.rss_mb_after_warmup = rss
                if done % max(1, config.jobs // 10) == 0:
                    say(f"{done}/{config.jobs} jobs done, worker RSS {[round(x) for x in rss]} MB")

            started = time.monotonic()
            outcomes = asyncio.run(drive(base_url, config, plans, on_progress))
            job_ids = [o.job_id for o in outcomes if o.job_id]
            statuses = wait_terminal(r, job_ids, config.drain_timeout_s)
            report.duration_s = time.monotonic() - started
            infos = idle_worker_infos(r, timeout_s=30)
            report.rss_mb_end, report.rss_mb_peak = worker_rss_mb(supervisor), peak
            check_redis(r, baseline, job_ids, report)

    report.num_jobs_seen = len(job_ids)
    report.statuses = dict(Counter(statuses.values()))
    report.not_terminal = [job_id for job_id, s in statuses.items() if s not in TERMINAL][:20]
    report.client_errors = [o.client_error for o in outcomes if o.client_error][:20]
    report.cancels_sent = sum(p.cancel_after_s is not None for p in plans)
    report.disconnects = sum(p.disconnect for p in plans)
    report.idle_workers = [i.model_dump(include={"id", "num_running", "num_waiting", "kv_cache_usage"})
                           for i in infos]
    report.kv_leak = not infos or any(i.kv_cache_usage != 0 or i.num_running for i in infos)
    if report.rss_mb_after_warmup and report.rss_mb_end:
        report.rss_growth_mb = max(e - w for e, w in zip(report.rss_mb_end, report.rss_mb_after_warmup,
                                                         strict=False))
    report.failures = _failures(config, report)
    return report


def _failures(config: SoakConfig, report: Report) -> list[str]:
    failures = []
    if report.num_jobs_seen != config.jobs:
        failures.append(f"only {report.num_jobs_seen} of {config.jobs} jobs got an id: {report.client_errors[:3]}")
    if report.not_terminal:
        failures.append(f"{len(report.not_terminal)} jobs not terminal, e.g. {report.not_terminal[:3]}")
    if report.client_errors:
        failures.append(f"{len(report.client_errors)} client errors, e.g. {report.client_errors[:3]}")
    if report.kv_leak:
        failures.append(f"KV blocks still in use when idle: {report.idle_workers}")
    if report.redis_stray_keys or report.redis_keys_without_ttl:
        failures.append(f"Redis leak: stray keys {report.redis_stray_keys[:5]}, "
                        f"job keys without TTL {report.redis_keys_without_ttl[:5]}")
    if report.rss_growth_mb > config.max_rss_growth_mb:
        failures.append(f"worker RSS grew {report.rss_growth_mb:.0f} MB after warm-up "
                        f"(limit {config.max_rss_growth_mb:.0f} MB)")
    return failures


def tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama (SmolLM2's tokenizer), for a quick soak of the machinery, not the model."""
    from tests.conftest import _save_tiny

    return _save_tiny("llama", folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--model", default="smollm2", help="built-in name or model folder (default smollm2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of --model")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=32, help="clients at once")
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens of a job: uniform in [1, this]")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-rss-growth-mb", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenspool-tiny-") as tmp:
        model = str(tiny_model(Path(tmp) / "tiny")) if args.tiny else args.model
        config = SoakConfig(jobs=args.jobs, model=model, workers=args.workers, concurrency=args.concurrency,
                            cancel_fraction=args.cancel_fraction, disconnect_fraction=args.disconnect_fraction,
                            max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                            max_rss_growth_mb=args.max_rss_growth_mb, seed=args.seed)
        report = run(config, log=lambda message: print(message, file=sys.stderr, flush=True))
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "load_average_1m": os.getloadavg()[0]},
              "model": "tiny random Llama" if args.tiny else args.model, "ok": report.ok, **asdict(report)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ok", "duration_s", "statuses", "rss_growth_mb", "failures")}, indent=2))
    print(f"wrote {args.out}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
