"""A real tokenspool stack for the reliability tests: ``tokenspool api`` processes next to the worker processes
of ``tests/worker/worker_process.py``, and HTTP clients that stream (resuming with Last-Event-ID) and poll.

Process helpers come from the existing suites (imported, not copied); what is here is what they lack: an API
*process* that can be killed and restarted on the same port, and clients that ride out such restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shared.launcher.redis_server import free_port
from tests.e2e.test_walking_skeleton import Process, clean_env, http_ok, spawn, stop, tokenspool_command
from tests.worker.worker_process import WorkerProcess

TERMINAL = ("succeeded", "failed", "cancelled")
MODEL = "tiny-rel"  # the served model name: its own queue, so no other suite's worker or job mixes in


class ApiProcess:
    """``tokenspool api`` on a fixed port, so a restarted API is found where its clients left it."""

    def __init__(self, redis_url: str, log_dir: Path, name: str = "api", **settings: object) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.name = name
        self.port = free_port()
        self.settings = {"model": MODEL, "lease_ttl_s": 2, "heartbeat_interval_s": 0.3, **settings}
        self.generation = 0
        self.process: Process | None = None
        self.logs: list[Path] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ApiProcess:
        self.generation += 1
        argv = [*tokenspool_command(), "api", "--port", str(self.port), "--redis-url", self.redis_url]
        for key, value in self.settings.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        env = {**clean_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.process = spawn(f"{self.name}-{self.generation}", argv, self.log_dir, env)
        self.logs.append(self.process.log)
        deadline = time.monotonic() + timeout_s
        while not http_ok(f"{self.base_url}/healthz"):
            if self.process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"API did not start\n{self.process.tail()}")
            time.sleep(0.05)
        return self

    def kill(self, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 30.0) -> None:
        """Send ``sig`` to the API's process group and wait for it to exit."""
        assert self.process is not None
        os.killpg(self.process.proc.pid, sig)
        self.process.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process, timeout_s=10)

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs)


def start_workers(workers: Iterable[WorkerProcess]) -> list[WorkerProcess]:
    """Start several workers at once (each loads torch and the model: seconds apiece)."""
    workers = list(workers)
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(), workers))
    return workers


@contextlib.contextmanager
def frozen(worker: WorkerProcess) -> Iterator[None]:
    """SIGSTOP the worker for the block: it computes nothing, claims nothing and renews no lease."""
    worker.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.signal(signal.SIGCONT)


def worker_log(worker: WorkerProcess) -> list[dict[str, Any]]:
    """The worker's JSON log lines (other lines, e.g. warnings printed by libraries, are skipped)."""
    entries = []
    for line in worker.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return entries


# --- clients ---------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """Everything one SSE client received for one job, over however many connections it took."""

    job_id: str
    events: list[tuple[int | None, str, dict[str, Any]]] = field(default_factory=list)
    connections: int = 0

    @property
    def ids(self) -> list[int | None]:
        return [event_id for event_id, _, _ in self.events]

    @property
    def kinds(self) -> list[str]:
        return [kind for _, kind, _ in self.events]

    @property
    def final(self) -> dict[str, Any]:
        event_id, kind, data = self.events[-1]
        assert kind == "done", self.events[-3:]
        return data

    def shown_text(self) -> str:
        """What a client that discards its text at every ``restart`` event shows at the end."""
        text = ""
        for _, kind, data in self.events:
            if kind == "restart":
                text = ""
            elif kind == "token":
                text += data["text"]
        return text

    def shown_token_ids(self) -> list[int]:
        ids: list[int] = []
        for _, kind, data in self.events:
            if kind == "restart":
                ids = []
            elif kind == "token":
                ids += data["token_ids"]
        return ids


async def _read_events(response: httpx.Response, stream: Stream) -> bool:
    """Append the response's events; True once the job's last event (done or error) arrived."""
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line.startswith(":"):
            continue
        if line:
            key, _, value = line.partition(":")
            fields[key] = fields.get(key, "") + value.removeprefix(" ")
            continue
        if "data" in fields:
            event_id = int(fields["id"]) if "id" in fields else None
            kind = fields.get("event", "message")
            stream.events.append((event_id, kind, json.loads(fields["data"])))
            if kind in ("done", "error"):
                return True
        fields = {}
    return False


async def follow(client: httpx.AsyncClient, job_id: str, timeout_s: float = 120.0) -> Stream:
    """Stream a job's events to the end, reconnecting with ``Last-Event-ID`` whenever the connection drops
    (an API restart) or cannot be made (the API is down), as a browser's EventSource does."""
    stream = Stream(job_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = next((i for i in reversed(stream.ids) if i is not None), None)
        headers = {"Last-Event-ID": str(last)} if last is not None else {}
        try:
            async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
                if response.status_code == 200:
                    stream.connections += 1
                    if await _read_events(response, stream):
                        return stream
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"stream of job {job_id} did not end within {timeout_s} s: {stream.kinds[-5:]}")


async def poll(client: httpx.AsyncClient, job_id: str, timeout_s: float = 120.0,
               interval_s: float = 0.1) -> tuple[dict[str, Any], int]:
    """Poll ``GET /v1/jobs/{id}`` until the job is final, through API and Redis outages.
    Returns the final job and the number of polls that failed (connection refused, 5xx)."""
    failures = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = await client.get(f"/v1/jobs/{job_id}")
            if response.status_code == 200:
                job = response.json()
                if job["status"] in TERMINAL:
                    return job, failures
            else:
                assert response.status_code >= 500, response.text  # an outage; a 4xx would be a real error
                failures += 1
        except httpx.TransportError:
            failures += 1
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"job {job_id} not final after {timeout_s} s")


async def submit(client: httpx.AsyncClient, prompt: str, **params: Any) -> str:
    response = await client.post("/v1/jobs", json={"prompt": prompt, **params})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def assert_clean_stream(stream: Stream) -> None:
    """Consecutive ids (1, 2, 3, ... for a reader from the start) without a gap or a repeat across reconnects;
    ends with ``done``; a client that drops its text at each restart shows exactly the final text and tokens."""
    first = stream.ids[0]
    assert first is not None and stream.ids == list(range(first, first + len(stream.events))), stream.ids
    assert "error" not in stream.kinds, stream.events
    final = stream.final
    assert final["status"] == "succeeded", final
    assert stream.shown_text() == final["text"]
    assert stream.shown_token_ids() == final["choices"][0]["token_ids"]
