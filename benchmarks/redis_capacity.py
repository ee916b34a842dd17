"""How many generated tokens one Redis node carries: the queue's ceiling, measured with no model in the way.

    .venv/bin/python benchmarks/redis_capacity.py [--jobs 64,128,256,512,1024] [--step-ms 25] [--level-s 12]
        [--variant after=. --variant before=/path/to/other/checkout] [--cluster]   (tokenspool bench redis-capacity)

A private redis-server (AOF everysec, as the embedded one runs), a real ``tokenspool api`` process, and
simulated workers (``benchmarks/simulated_workers.py``: the production ``shared.queue`` code with no model; every
``--step-ms`` one ``publish_many`` call per worker for all its jobs, one token each). The ramp raises the number of
concurrent jobs level by level, so the offered rate is ``jobs * 1000 / step_ms`` tokens/s. Each job is submitted
with submit.lua (``JobQueue.submit``) and followed to its end by its own SSE client on ``GET
/v1/jobs/{id}/events``; when it ends, its client submits the next (a closed loop holding ``jobs`` jobs). With
``--sse-share`` below 1 only that share of the jobs is streamed, the others wait on their record (one read per
0.5 s): the API and the clients, Python on the same machine, saturate long before Redis does.

Per level, over the window after ``--warmup-s``: tokens/s and jobs/s, publish-call latency p50/p99 (the simulated
worker's ``publish_many`` round trip), SSE delivery lag p50/p99 (publish call start to the SSE client reading the
token), and from Redis's own counters (robust to a busy machine) per generated token: Redis CPU microseconds (INFO
cpu), commands (INFO commandstats, commands inside scripts included) and bytes in and out (INFO stats); plus each
process's CPU seconds, to show which one saturated. A level is sustained when publish p99 <= ``--p99-limit-ms``
and the simulated workers kept >= 90 % of their step rate; a variant's ceiling is its best sustained level.
Each run is bounded: no level starts after ``--max-run-s``; all traffic is on 127.0.0.1.

``--cluster`` runs the same on a local 3-master Redis Cluster (``LocalRedisCluster``, no replicas, each master
with AOF everysec unless ``--no-aof``) with ``--queue-shards`` (default 3 there, 1 on a node) given to the API,
the simulated workers and the clients: Redis's counters are summed over the masters, and each master's CPU
seconds are reported too (how evenly the shards spread the load).

``--publish-only STEPS`` measures the publish path alone instead: per level, one client publishes STEPS steps
back to back for that many jobs (no API, no subscribers, no claims or completions in between), with Redis's
counters read around exactly those steps.

``--variant NAME=DIR`` runs the simulated workers on the ``shared/`` package in DIR (a checkout of another commit,
e.g. ``git archive <commit> shared | tar -x -C DIR``), alternating the variants level by level in one run (their
order flips every level): a before/after comparison of the queue code under the same API, Redis and machine
state. Results: ``benchmarks/results/redis_capacity.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import BlockingConnectionPool, Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import read_cpu_info  # noqa: E402
from benchmarks.redis_capacity_report import (  # noqa: E402
    Followed,
    Ramp,
    ceilings,
    line,
    publish_only_line,
    publish_only_row,
    summarize,
    write_markdown,
)
from benchmarks.simulated_workers import lag_ms  # noqa: E402
from shared import keys  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.launcher.redis_cluster import LocalRedisCluster  # noqa: E402
from shared.launcher.redis_server import RedisServer, free_port  # noqa: E402
from shared.queue import JobQueue  # noqa: E402
from shared.redis_client import is_cluster_url, open_client  # noqa: E402
from shared.schemas import GenerationParams, JobStatus, JobSubmission  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "capacity-bench"
SIMULATED_WORKERS = ROOT / "benchmarks" / "simulated_workers.py"


async def _follow(client: httpx.AsyncClient, job_id: str, want_tokens: int, seen: Followed, began: float) -> bool:
    """Read one job's SSE stream to its ``done`` event (``began``: when its submission was sent). False when the
    API refused the stream (recorded as a bad job; the caller then waits on the job's record)."""
    tokens, event, status = 0, "", ""
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        if response.status_code != 200:
            seen.bad_jobs.append(f"{job_id}: the stream answered {response.status_code} "
                                 f"{(await response.aread()).decode(errors='replace')[:200]}")
            return False
        seen.opens.append((time.time(), 1000 * (time.time() - began)))
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if event == "token":
                    now = time.time()
                    tokens += 1
                    seen.lags.append((now, lag_ms(data["text"], now)))
                elif event in ("done", "error"):
                    status = data.get("status", event)
                    break
    seen.tokens += tokens
    seen.jobs_done += 1
    if status != "succeeded" or tokens != want_tokens:
        seen.bad_jobs.append(f"{job_id}: {status}, {tokens} tokens")
    return True


async def _poll(queue: JobQueue, job_id: str, want_tokens: int, seen: Followed, interval_s: float) -> None:
    """Wait for a job nobody streams to end, reading its record (one small read per ``interval_s``)."""
    while (record := await queue.get(job_id)) is None or not record.status.is_terminal:
        await asyncio.sleep(interval_s)
    tokens = record.usage.completion_tokens
    seen.tokens_polled += tokens
    seen.jobs_polled += 1
    if record.status is not JobStatus.SUCCEEDED or tokens != want_tokens:
        seen.bad_jobs.append(f"{job_id}: {record.status.value}, {tokens} tokens (polled)")


async def _client_loop(queue: JobQueue, client: httpx.AsyncClient, output_len: int, stream: bool,
                       stop: asyncio.Event, seen: Followed) -> None:
    """Submit a job, follow it to its end (its SSE stream, else its record), repeat until ``stop``."""
    while not stop.is_set():
        job_id = secrets.token_hex(12)
        began = time.time()
        await queue.submit(JobSubmission(id=job_id, model=MODEL, prompt="x", created_at=began,
                                         params=GenerationParams(max_tokens=output_len)))
        if not stream or not await _follow(client, job_id, output_len, seen, began):
            await _poll(queue, job_id, output_len, seen, interval_s=0.5)


def _cpu_s(pid: int) -> float:
    """utime + stime of a process in seconds (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _redis_counters(r: Redis) -> dict[str, float]:
    """One Redis node's cumulative CPU seconds, commands, bytes, and per-command calls and microseconds."""
    info = await r.info("all")
    counters = {"cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                "commands": float(info["total_commands_processed"]),
                "net_in_bytes": float(info["total_net_input_bytes"]),
                "net_out_bytes": float(info["total_net_output_bytes"])}
    for name, value in info.items():
        if name.startswith("cmdstat_") and isinstance(value, dict):
            counters[f"calls:{name[8:]}"] = float(value["calls"])
            counters[f"usec:{name[8:]}"] = float(value["usec"])
    return counters


async def _summed_counters(node_urls: list[str]) -> dict[str, float]:
    """Every node's counters summed, plus each node's CPU seconds as ``cpu_s:<i>`` (``node_urls``' order)."""
    total: dict[str, float] = {}
    for i, url in enumerate(node_urls):
        async with Redis.from_url(url, decode_responses=True) as r:  # the node itself, not the cluster client
            counters = await _redis_counters(r)
        for name, value in counters.items():
            total[name] = total.get(name, 0.0) + value
        total[f"cpu_s:{i}"] = counters["cpu_s"]
    return total


async def _snapshot(node_urls: list[str], pids: dict[str, int]) -> tuple[float, dict[str, float], dict[str, float]]:
    """Redis's counters (summed over the masters) and each process's CPU seconds, at one moment (the midpoint of
    the INFO calls, on connections of their own: the clients' pool may be queued up behind thousands of
    submissions)."""
    before = time.time()
    counters, cpu = await _summed_counters(node_urls), {k: _cpu_s(p) for k, p in pids.items()}
    return (before + time.time()) / 2, counters, cpu


@dataclass(frozen=True)
class Backend:
    """The Redis under test: the URL every process is given, and each master's own URL (for its counters)."""

    url: str
    node_urls: list[str]


@contextlib.contextmanager
def _start_backend(args: argparse.Namespace, tmp: Path) -> Iterator[Backend]:
    """A private redis-server, or with ``--cluster`` a local 3-master cluster (no replicas), AOF unless --no-aof."""
    if args.cluster:
        with LocalRedisCluster(3, replicas=0, data_dir=tmp / "cluster", appendonly=not args.no_aof) as cluster:
            yield Backend(cluster.url, [f"redis://{m.host}:{m.port}/0" for m in cluster.masters()])
    else:
        with RedisServer(tmp / "redis", appendonly=not args.no_aof) as server:
            yield Backend(server.url, [server.url])


async def _open_shared_client(url: str) -> Redis:
    """The clients' Redis client. Blocking and bounded on a node, as the API's: thousands of client loops share a
    few connections. A cluster client cannot block on its pool (it raises when a node's pool is exhausted), so
    there each node's pool is large enough for every client loop at once."""
    if is_cluster_url(url):
        return await open_client(url, decode_responses=True, max_connections=4096)
    # As the API opens its node client (open_client takes no pool class): a blocking pool of 32.
    return Redis.from_pool(BlockingConnectionPool.from_url(url, decode_responses=True, max_connections=32,
                                                           timeout=60))


@dataclass(frozen=True)
class Stack:
    """The processes under test: Redis and the API (their pids, for CPU time), and the Redis client."""

    backend: Backend
    redis_pids: list[int]  # one per master, in ``backend.node_urls``' order
    api_pid: int
    base_url: str
    redis: Redis
    settings: Settings  # the clients' (queue_shards as the API's and the workers')


async def _start_workers(stack: Stack, code_root: Path, args: argparse.Namespace, out: Path
                         ) -> subprocess.Popen[bytes]:
    """The simulated workers on the queue code in ``code_root``, once all of them registered."""
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    proc = subprocess.Popen([sys.executable, str(SIMULATED_WORKERS), stack.backend.url, MODEL, str(out),
                             "--workers", str(args.workers), "--step-ms", str(args.step_ms),
                             *(["--queue-shards", str(args.queue_shards)] if args.queue_shards > 1 else [])],
                            stdin=subprocess.PIPE, env=env, cwd=tempfile.gettempdir())
    deadline = time.monotonic() + 60
    while await stack.redis.zcard(keys.WORKERS) < args.workers:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the simulated workers did not register")
        await asyncio.sleep(0.05)
    return proc


async def run_level(stack: Stack, variant: str, code_root: Path, num_jobs: int, args: argparse.Namespace,
                    tmp: Path) -> dict[str, Any]:
    """One level of one variant: ``num_jobs`` concurrent jobs for ``warmup_s + level_s``, then a drain."""
    samples_path = tmp / f"samples-{variant}-{num_jobs}.json"
    workers = await _start_workers(stack, code_root, args, samples_path)
    queue = JobQueue(stack.redis, stack.settings)
    seen, stop = Followed(), asyncio.Event()
    limits = httpx.Limits(max_connections=num_jobs + 8, max_keepalive_connections=num_jobs + 8)
    pids = {"redis": stack.redis_pids[0]} if len(stack.redis_pids) == 1 else {
        f"redis:{i}": pid for i, pid in enumerate(stack.redis_pids)}
    pids |= {"api": stack.api_pid, "workers": workers.pid, "clients": os.getpid()}
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120, limits=limits) as client:
            num_streamed = max(1, round(args.sse_share * num_jobs))
            loops = [asyncio.create_task(_client_loop(queue, client, args.output_len, i < num_streamed, stop,
                                                      seen)) for i in range(num_jobs)]
            await asyncio.sleep(args.warmup_s)
            t0, redis0, cpu0 = await _snapshot(stack.backend.node_urls, pids)
            await asyncio.sleep(args.level_s)
            t1, redis1, cpu1 = await _snapshot(stack.backend.node_urls, pids)
            stop.set()  # every client finishes its job and submits no other: the level drains
            await asyncio.gather(*loops)
    finally:
        workers.stdin.close()  # type: ignore[union-attr]  # their stop signal: they write their samples and exit
        workers.wait(60)
    samples = json.loads(samples_path.read_text())
    ramp = Ramp(args.step_ms, args.workers, args.p99_limit_ms, args.sse_share)
    return summarize(variant, num_jobs, ramp, (t0, t1), samples, seen,
                     {k: redis1.get(k, 0.0) - redis0.get(k, 0.0) for k in redis1},
                     {k: cpu1[k] - cpu0[k] for k in cpu1}, os.getloadavg()[0])


async def run_publish_only(redis_url: str, redis: Redis, variant: str, code_root: Path, num_jobs: int,
                           num_steps: int, tmp: Path) -> dict[str, Any]:
    """The publish path alone for one variant: ``num_jobs`` jobs per step, ``num_steps`` steps back to back
    (``simulated_workers.publish_only``), no API, no clients, no pacing. On one node only."""
    queue = JobQueue(redis, Settings(redis_url=redis_url, max_queue_length=100_000))
    model = f"{MODEL}-publish"
    for _ in range(num_jobs):
        await queue.submit(JobSubmission(id=secrets.token_hex(12), model=model, prompt="x",
                                         params=GenerationParams(max_tokens=num_steps + 1)))
    out = tmp / f"publish-{variant}-{num_jobs}.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SIMULATED_WORKERS), redis_url, model, str(out), "--max-jobs", str(num_jobs),
        "--publish-only", str(num_steps), env={**os.environ, "PYTHONPATH": str(code_root)}, cwd=tempfile.gettempdir(),
        stdin=subprocess.DEVNULL)
    if await proc.wait() != 0:
        raise RuntimeError(f"publish-only run of {variant} failed")
    return publish_only_row(variant, json.loads(out.read_text()), os.getloadavg()[0])


def _start_api(redis_url: str, port: int, queue_shards: int) -> subprocess.Popen[bytes]:
    """``tokenspool api`` of this checkout, as a process of its own."""
    env = {**os.environ, "TOKENSPOOL_REDIS_URL": redis_url, "TOKENSPOOL_PORT": str(port),
           "TOKENSPOOL_HOST": "127.0.0.1", "TOKENSPOOL_LOG_LEVEL": "WARNING",
           "TOKENSPOOL_MAX_QUEUE_LENGTH": "100000", "TOKENSPOOL_QUEUE_SHARDS": str(queue_shards),
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "shared.launcher.cli", "api"], env=env, cwd=ROOT)


async def _ramp(args: argparse.Namespace, variants: list[tuple[str, Path]], tmp: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with _start_backend(args, tmp) as backend:
        if args.publish_only:
            async with await open_client(backend.url, decode_responses=True) as redis:
                await JobQueue(redis, Settings(redis_url=backend.url)).publish_config()
                for level, num_jobs in enumerate(args.jobs):
                    for name, code_root in variants if level % 2 == 0 else variants[::-1]:
                        row = await run_publish_only(backend.url, redis, name, code_root, num_jobs, args.publish_only,
                                                     tmp)
                        rows.append(row)
                        print(publish_only_line(row), flush=True)
            return rows
        port = free_port()
        api = _start_api(backend.url, port, args.queue_shards)
        redis = await _open_shared_client(backend.url)
        settings = Settings(redis_url=backend.url, queue_shards=args.queue_shards)
        try:
            while not await redis.exists(keys.Keyspace(args.queue_shards).config(0)):
                if api.poll() is not None:
                    raise RuntimeError("the API exited at start")
                await asyncio.sleep(0.1)
            redis_pids = []
            for url in backend.node_urls:
                async with Redis.from_url(url, decode_responses=True) as node:
                    redis_pids.append(int((await node.info("server"))["process_id"]))
            stack = Stack(backend, redis_pids, api.pid, f"http://127.0.0.1:{port}", redis, settings)
            began = time.monotonic()
            for level, num_jobs in enumerate(args.jobs):
                # The variants alternate, and their order flips every level: neither always runs second.
                for name, code_root in variants if level % 2 == 0 else variants[::-1]:
                    row = await run_level(stack, name, code_root, num_jobs, args, tmp)
                    rows.append(row)
                    print(line(row), flush=True)
                if time.monotonic() - began > args.max_run_s:
                    print(f"stopping the ramp: past --max-run-s {args.max_run_s:.0f}", flush=True)
                    break
        finally:
            await redis.aclose()
            api.terminate()
            api.wait(30)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512, 1024],
                        help="comma-separated concurrent jobs, one level each")
    parser.add_argument("--step-ms", type=float, default=25.0, help="simulated engine step: one token per job")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per job")
    parser.add_argument("--workers", type=int, default=4, help="simulated workers (one process)")
    parser.add_argument("--level-s", type=float, default=12.0, help="measured seconds per level")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds per level before measuring")
    parser.add_argument("--p99-limit-ms", type=float, default=50.0)
    parser.add_argument("--max-run-s", type=float, default=300.0, help="start no new level after this")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                        help="the simulated workers' queue code: shared/ from DIR (default: this checkout)")
    parser.add_argument("--sse-share", type=float, default=1.0,
                        help="share of the jobs followed by an SSE client (the others: their record is polled)")
    parser.add_argument("--publish-only", type=int, metavar="STEPS", default=0,
                        help="instead of the ramp: the publish path alone, STEPS back-to-back steps per level (no API)")
    parser.add_argument("--no-aof", action="store_true", help="Redis without AOF persistence")
    parser.add_argument("--cluster", action="store_true",
                        help="a local 3-master Redis Cluster (no replicas) instead of one redis-server")
    parser.add_argument("--queue-shards", type=int, default=None,
                        help="queue shards, given to the API, the workers and the clients (default: 3 with "
                             "--cluster, else 1)")
    parser.add_argument("--out", type=Path, default=RESULTS / "redis_capacity.json", help="JSON; .md beside it")
    args = parser.parse_args(argv)
    if args.queue_shards is None:
        args.queue_shards = 3 if args.cluster else 1
    if args.publish_only and (args.cluster or args.queue_shards != 1):
        parser.error("--publish-only runs on one node with one queue shard")
    variants = [(v.split("=", 1)[0], Path(v.split("=", 1)[1]).resolve()) for v in args.variant] or [("current", ROOT)]
    for name, root in variants:
        if not (root / "shared" / "queue").is_dir():
            parser.error(f"--variant {name}: {root} holds no shared/queue package")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tokenspool-capacity-") as tmp:
        rows = asyncio.run(_ramp(args, variants, Path(tmp)))
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": read_cpu_info().describe(),
              "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
              "step_ms": args.step_ms, "workers": args.workers, "output_len": args.output_len,
              "level_s": args.level_s, "no_aof": args.no_aof, "sse_share": args.sse_share,
              "cluster_masters": 3 if args.cluster else 0, "queue_shards": args.queue_shards,
              "p99_limit_ms": args.p99_limit_ms,
              "variants": {name: str(root) for name, root in variants}, "rows": rows,
              "publish_only_steps": args.publish_only,
              "ceilings": {} if args.publish_only else ceilings(rows, [name for name, _ in variants])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out.with_suffix(".md"))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
