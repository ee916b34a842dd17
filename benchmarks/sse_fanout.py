"""How many open SSE streams one API process holds, and what each costs: memory and Redis connections.

    .venv/bin/python benchmarks/sse_fanout.py [--streams 1000,10000] [--client-processes 4] [--open-at-once 500]

A real ``tokenspool api`` process on a private redis-server; jobs pushed with the shipped submit.lua (no worker:
they stay queued, so every stream stays open and waits, as a client behind a long queue does). For each count,
that many clients open ``GET /v1/jobs/{id}/events`` at once; once every job's live channel is subscribed the
run reads the API process's RSS (/proc), Redis's client count and used memory, then closes the streams and
checks that every channel was unsubscribed. Results: ``benchmarks/results/sse_fanout.json``.

The clients are the slow side at thousands of streams (one Python process opening 5,000 httpx connections took
109 s), so they are split over ``--client-processes`` processes (this file run with ``--hold``), each opening at
most ``--open-at-once`` streams at a time (a stream counts as open once its response headers arrived); the API
is the same single process either way. Streams of 10,000 and more need ``ulimit -n`` above the stream count.
When the count of subscribed channels stops rising for 60 s short of every stream (the API ended some), the row
records how many were subscribed, and when the last one was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import read_cpu_info  # noqa: E402
from shared import keys  # noqa: E402
from shared.launcher.redis_server import RedisServer, free_port  # noqa: E402
from shared.scripts import lua_source  # noqa: E402

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "fanout-bench"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _wait(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(interval_s)


def _submit(r: redis.Redis, count: int) -> list[str]:
    """Queued jobs, pushed as another backend would."""
    submit = r.register_script(lua_source("submit"))
    ids = [secrets.token_hex(16) for _ in range(count)]
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        body = json.dumps({"id": job_id, "model": MODEL, "prompt": "waiting", "params": {"max_tokens": 1}})
        submit(keys=[KS.job(job_id), KS.queue(MODEL, 0), KS.queue_seq(MODEL, 0), KS.config(0)], args=[body],
               client=pipe)
    pipe.execute()
    return ids


async def _hold(base_url: str, ids: list[str], open_at_once: int, release: asyncio.Event) -> int:
    """Open one stream per job (at most ``open_at_once`` opening at a time), keep them all open until
    ``release``; returns how many answered 200."""
    limits = httpx.Limits(max_connections=len(ids) + 10, max_keepalive_connections=0)
    opening = asyncio.Semaphore(open_at_once)
    ok = 0

    async def one(client: httpx.AsyncClient, job_id: str) -> None:
        nonlocal ok
        async with opening:
            response = await client.send(client.build_request("GET", f"/v1/jobs/{job_id}/events"), stream=True)
        try:
            ok += response.status_code == 200
            await release.wait()
        finally:
            await response.aclose()

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, job_id) for job_id in ids))
    return ok


def hold_main(base_url: str, open_at_once: int) -> int:
    """A client process (``--hold``): job ids on stdin's first line, streams held until stdin closes, then the
    number answered 200 printed."""
    ids = sys.stdin.readline().split()

    async def run() -> int:
        release = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(sys.stdin.fileno(), lambda: release.set() if not sys.stdin.readline() else None)
        return await _hold(base_url, ids, open_at_once, release)

    print(asyncio.run(run()), flush=True)
    return 0


def _start_holders(base_url: str, ids: list[str], num_processes: int, open_at_once: int
                   ) -> list[subprocess.Popen[str]]:
    """``num_processes`` client processes holding a share of ``ids``' streams each."""
    holders = []
    for k in range(num_processes):
        share = ids[k::num_processes]
        proc = subprocess.Popen([sys.executable, __file__, "--hold", base_url, "--open-at-once",
                                 str(max(1, open_at_once // num_processes))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None
        proc.stdin.write(" ".join(share) + "\n")
        proc.stdin.flush()
        holders.append(proc)
    return holders


def _release_holders(holders: list[subprocess.Popen[str]]) -> int:
    """Close every client's streams; the number of streams that answered 200."""
    ok = 0
    for proc in holders:
        assert proc.stdin is not None
        proc.stdin.close()
    for proc in holders:
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.stdout.close()
        if proc.wait(300) != 0:
            raise RuntimeError(f"a client process exited with {proc.returncode}")
        ok += int(out.strip())
    return ok


def _wait_subscribed(r: redis.Redis, streams: int, began: float, stall_s: float = 60.0, limit_s: float = 900.0
                     ) -> tuple[int, float]:
    """How many live channels are subscribed once all ``streams`` are, or once the count has not risen for
    ``stall_s`` (streams the API ended early never subscribe again), and when it last rose."""
    best, best_at = 0, began
    while best < streams and time.monotonic() - best_at < stall_s and time.monotonic() - began < limit_s:
        time.sleep(0.2)  # each check lists every subscribed channel
        count = len(r.pubsub_shardchannels("ts:job:*:live"))
        if count > best:
            best, best_at = count, time.monotonic()
    return best, best_at


def measure(base_url: str, api_pid: int, r: redis.Redis, streams: int, num_processes: int, open_at_once: int
            ) -> dict[str, Any]:
    ids = _submit(r, streams)
    rss_before = _rss_kib(api_pid)
    used_before = int(r.info("memory")["used_memory"])
    began = time.monotonic()
    holders = _start_holders(base_url, ids, num_processes, open_at_once)
    answered_200 = 0
    try:
        subscribed, opened_at = _wait_subscribed(r, streams, began)
        row = {"streams": streams, "client_processes": num_processes, "subscribed": subscribed,
               "open_s": opened_at - began,
               "api_rss_mib": _rss_kib(api_pid) / 1024,
               "api_kib_per_stream": (_rss_kib(api_pid) - rss_before) / streams,
               "redis_clients": int(r.info("clients")["connected_clients"]),
               "redis_pubsub_connections": sum(1 for c in r.client_list() if "P" in c["flags"]),
               "redis_bytes_per_stream": (int(r.info("memory")["used_memory"]) - used_before) / streams}
    finally:
        answered_200 = _release_holders(holders)
    row["answered_200"] = answered_200
    _wait(lambda: not r.pubsub_shardchannels("ts:job:*:live"), 120, "every channel released")
    r.delete(KS.queue(MODEL, 0), *(KS.job(i) for i in ids))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1000,10000", help="comma-separated stream counts, one round each")
    parser.add_argument("--client-processes", type=int, default=4, help="client processes the streams are split over")
    parser.add_argument("--open-at-once", type=int, default=500, help="streams opening at a time, over all clients")
    parser.add_argument("--hold", metavar="BASE_URL", help=argparse.SUPPRESS)  # a client process (hold_main)
    parser.add_argument("--out", type=Path, default=RESULTS / "sse_fanout.json")
    args = parser.parse_args(argv)
    if args.hold:
        return hold_main(args.hold, args.open_at_once)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokenspool-fanout-") as tmp, \
            RedisServer(Path(tmp) / "redis", appendonly=False) as server, \
            redis.Redis.from_url(server.url, decode_responses=True) as r:
        port = free_port()
        env = {**os.environ, "TOKENSPOOL_REDIS_URL": server.url, "TOKENSPOOL_PORT": str(port),
               "TOKENSPOOL_HOST": "127.0.0.1", "TOKENSPOOL_LOG_LEVEL": "WARNING",
               "TOKENSPOOL_MAX_QUEUE_LENGTH": "100000"}
        api = subprocess.Popen([sys.executable, "-m", "shared.launcher.cli", "api"], env=env, cwd=ROOT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait(lambda: r.exists(KS.config(0)), 60, "the API stored ts:config")
            measure(base_url, api.pid, r, 50, 1, args.open_at_once)  # warm-up
            for count in (int(c) for c in args.streams.split(",")):
                row = measure(base_url, api.pid, r, count, args.client_processes, args.open_at_once)
                rows.append(row)
                print(f"{count} streams: API {row['api_rss_mib']:.0f} MiB RSS ({row['api_kib_per_stream']:.1f} KiB "
                      f"per stream), {row['redis_pubsub_connections']} pub/sub connection(s), "
                      f"{row['redis_clients']} Redis clients in all, {row['redis_bytes_per_stream']:.0f} Redis bytes "
                      f"per stream, {row['subscribed']} subscribed in {row['open_s']:.1f} s", flush=True)
        finally:
            api.terminate()
            api.wait(30)
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": read_cpu_info().describe(),
              "load_average_1m": os.getloadavg()[0], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
