"""A real ``python -m worker`` subprocess for the worker tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from shared import keys
from shared.queue import TRANSIENT_ERRORS, JobQueue
from shared.redis_client import connect_sync
from shared.schemas import JobRecord, RestartEvent, StreamEvent, TokenEvent

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """One worker serving ``model`` (a folder) as ``name``; short leases so recovery tests are quick."""

    def __init__(self, redis_url: str, model: Path, log_dir: Path, worker_id: str, name: str = "tiny",
                 module: str = "worker", **settings: object) -> None:
        self.redis_url = redis_url
        self.worker_id = worker_id
        self.log_path = log_dir / f"{worker_id}.log"
        env = {"TOKENSPOOL_REDIS_URL": redis_url, "TOKENSPOOL_MODEL": str(model), "TOKENSPOOL_MODEL_NAME": name,
               "TOKENSPOOL_WORKER_ID": worker_id, "TOKENSPOOL_LEASE_TTL_S": "2", "TOKENSPOOL_DEVICE": "cpu",
               # float32: tests compare worker output with transformers' float32 greedy tokens; the default is
               # bf16 on CPUs with AMX and the own decoder (int4 on GGUF weights) on the others.
               "TOKENSPOOL_DTYPE": "float32", "TOKENSPOOL_HEARTBEAT_INTERVAL_S": "0.3", "TOKENSPOOL_MAX_NUM_SEQS": "8",
               "TOKENSPOOL_NUM_KV_BLOCKS": "512", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        env.update({f"TOKENSPOOL_{k.upper()}": str(v) for k, v in settings.items()})
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.module = module  # what ``python -m`` runs: the real worker, or a test worker built on it

    def start(self, timeout_s: float = 90.0) -> WorkerProcess:
        """Start it and wait until it is registered in Redis (model loaded)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=self.env, cwd=REPO,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        with connect_sync(self.redis_url) as client:
            while client.zscore(keys.WORKERS, self.worker_id) is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.worker_id} did not start:\n{self.log_tail()}")
                time.sleep(0.1)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_config(r: redis.Redis, timeout_s: float = 30.0) -> None:
    """Wait until ``ts:config`` is stored: tests flush Redis, and a worker stores it again at its next heartbeat
    (as every backend submitting with raw commands needs it, docs/protocol.md)."""
    deadline = time.monotonic() + timeout_s
    while not r.exists(KS.config(0)):
        assert time.monotonic() < deadline, "no worker stored ts:config again"
        time.sleep(0.05)


async def wait_final(queue: JobQueue, job_id: str, timeout_s: float = 60.0) -> JobRecord:
    """Poll until the job ends, riding out a Redis restart as a real client does (retrying the read)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            record = await queue.get(job_id)
        except TRANSIENT_ERRORS:
            record = None
        if record is not None and record.status.is_terminal:
            return record
        await asyncio.sleep(0.05)
    raise TimeoutError(f"job {job_id} not finished after {timeout_s} s: {await queue.get(job_id)}")


async def wait_tokens(queue: JobQueue, job_id: str, count: int, timeout_s: float = 60.0) -> None:
    """Until the job's log holds ``count`` events (the job is mid-generation)."""
    deadline = time.monotonic() + timeout_s
    while len(await queue.replay(job_id, 0)) < count:
        assert time.monotonic() < deadline, f"job {job_id} produced no tokens"
        await asyncio.sleep(0.02)


def client_text(events: list[StreamEvent]) -> str:
    """What a streaming client shows: token text, discarded at every restart."""
    text = ""
    for event in events:
        if isinstance(event, RestartEvent):
            text = ""
        elif isinstance(event, TokenEvent):
            text += event.text
    return text


async def read_all(queue: JobQueue, job_id: str) -> list[StreamEvent]:
    async with queue.open_stream(job_id) as stream:
        return [event async for event in stream]


async def read_first(queue: JobQueue, job_id: str) -> StreamEvent:
    async with queue.open_stream(job_id) as stream:
        return await anext(aiter(stream))
