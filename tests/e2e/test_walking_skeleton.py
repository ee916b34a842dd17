"""The walking skeleton, end to end: real ``tokenspool api`` and ``tokenspool worker`` processes serving SmolLM2
from the test Redis, checked against transformers' own greedy ``generate``; then ``tokenspool up`` as a user
runs it, stopped with Ctrl-C, leaving no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared.launcher.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):",
]
STARTUP_TIMEOUT_S = 240.0
JOB_TIMEOUT_S = 180.0


def tokenspool_command() -> list[str]:
    """The installed console script, as a user runs it (``python -m shared.launcher.cli`` if it is not installed)."""
    script = Path(sys.executable).parent / "tokenspool"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "shared.launcher.cli"]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSPOOL_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, num_chars: int = 4000) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n" + self.log.read_text(errors="replace")[-num_chars:]


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Process:
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or clean_env(),
                                start_new_session=True)
    return Process(name, proc, log)


def stop(process: Process, timeout_s: float = 60.0) -> None:
    """SIGTERM (a worker drains), then SIGKILL to the whole process group."""
    if process.proc.poll() is None:
        os.killpg(process.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.proc.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.proc.pid, signal.SIGKILL)
    process.proc.wait()


def wait_until(condition: Callable[[], bool], processes: list[Process], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for process in processes:
            if process.proc.poll() is not None:
                pytest.fail(f"{process.name} died while waiting for {what}\n{process.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n"
                        + "\n".join(p.tail() for p in processes))
        time.sleep(0.25)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Stack:
    base_url: str
    processes: list[Process]


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`tokenspool api` + `tokenspool worker` (SmolLM2, CPU, fp32) against the test Redis."""
    if not redis_server.running:
        redis_server.start()
    redis.Redis.from_url(redis_server.url).flushall()
    logs = tmp_path_factory.mktemp("walking-skeleton-logs")
    port = free_port()
    cli = tokenspool_command()
    api = spawn("api", [*cli, "api", "--port", str(port), "--redis-url", redis_server.url, "--model", "smollm2"],
                logs)
    worker = spawn("worker", [*cli, "worker", "--redis-url", redis_server.url, "--model", "smollm2",
                              "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "8"], logs)
    processes = [api, worker]
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(f"{base_url}/readyz"), processes, STARTUP_TIMEOUT_S, "/readyz (a live worker)")
        yield Stack(base_url, processes)
    finally:
        for process in reversed(processes):  # the worker first, while the API and Redis are still up
            stop(process)


@dataclass(frozen=True)
class Reference:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@pytest.fixture(scope="module")
def greedy(smollm2: Path) -> dict[str, Reference]:
    """transformers' greedy generate, fp32 on CPU: what the worker must reproduce token for token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    references = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, S]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)  # [1, S+N]
        new = out[0, ids.shape[1]:].tolist()
        stopped = bool(new) and new[-1] == eos
        text = tokenizer.decode(new, skip_special_tokens=True)
        references[prompt] = Reference(text, ids.shape[1], len(new), "stop" if stopped else "length")
    return references


def submit(base_url: str, prompt: str, **extra: Any) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "priority": 0, **extra}
    response = httpx.post(f"{base_url}/v1/jobs", json=body, timeout=30)
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert accepted["status"] == "queued"
    return str(accepted["id"])


def poll(base_url: str, job_id: str, processes: list[Process]) -> dict[str, Any]:
    job: dict[str, Any] = {}

    def finished() -> bool:
        nonlocal job
        response = httpx.get(f"{base_url}/v1/jobs/{job_id}", timeout=10)
        assert response.status_code == 200, response.text
        job = response.json()
        return job["status"] in ("succeeded", "failed", "cancelled")

    wait_until(finished, processes, JOB_TIMEOUT_S, f"job {job_id}")
    return job


def read_sse(base_url: str, job_id: str, headers: dict[str, str] | None = None) -> list[tuple[int, str, Any]]:
    """(id, event, data) of every event until the stream ends."""
    events: list[tuple[int, str, Any]] = []
    fields: dict[str, str] = {}
    with httpx.stream("GET", f"{base_url}/v1/jobs/{job_id}/events", headers=headers, timeout=JOB_TIMEOUT_S) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith(":"):
                continue  # a keep-alive comment
            if line:
                key, _, value = line.partition(":")
                fields[key] = fields.get(key, "") + value.removeprefix(" ")
                continue
            if "data" in fields:
                events.append((int(fields.get("id", "0")), fields.get("event", "message"), json.loads(fields["data"])))
            fields = {}
    return events


def assert_matches(job: dict[str, Any], expected: Reference) -> None:
    assert job["status"] == "succeeded", job
    assert job["text"] == expected.text
    assert job["usage"]["prompt_tokens"] == expected.prompt_tokens
    assert job["usage"]["completion_tokens"] == expected.completion_tokens
    assert job["finish_reason"] == expected.finish_reason
    assert job["error"] is None
    assert job["created_at"] <= job["started_at"] <= job["finished_at"]


def test_health_and_readiness(stack: Stack) -> None:
    assert httpx.get(f"{stack.base_url}/healthz").json()["status"] == "ok"
    ready = httpx.get(f"{stack.base_url}/readyz").json()
    assert ready["status"] == "ready" and ready["workers"] >= 1


def test_polled_jobs_match_transformers_greedy(stack: Stack, greedy: dict[str, Reference]) -> None:
    job_ids = {prompt: submit(stack.base_url, prompt, priority=i) for i, prompt in enumerate(PROMPTS)}
    for prompt, job_id in job_ids.items():
        job = poll(stack.base_url, job_id, stack.processes)
        assert job["id"] == job_id
        assert_matches(job, greedy[prompt])


def test_sse_stream_delivers_the_same_text_and_resumes(stack: Stack, greedy: dict[str, Reference]) -> None:
    prompt = PROMPTS[0]
    job_id = submit(stack.base_url, prompt)
    events = read_sse(stack.base_url, job_id)
    kinds = [kind for _, kind, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) == {"token"}, kinds
    ids = [event_id for event_id, _, _ in events]
    assert ids == list(range(1, len(events) + 1))
    deltas = [data["text"] for _, kind, data in events if kind == "token"]
    final = events[-1][2]
    assert "".join(deltas) == final["text"]
    assert_matches(final, greedy[prompt])
    assert httpx.get(f"{stack.base_url}/v1/jobs/{job_id}").json() == final

    # A client that saw the first two events reconnects with Last-Event-ID and gets the rest, without gaps.
    resumed = read_sse(stack.base_url, job_id, headers={"Last-Event-ID": "2"})
    assert [event_id for event_id, _, _ in resumed] == ids[2:]
    assert "".join(deltas[:2]) + "".join(d["text"] for _, k, d in resumed if k == "token") == final["text"]


def test_openai_client_completion_matches_greedy(stack: Stack, greedy: dict[str, Reference]) -> None:
    from openai import OpenAI

    with OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", timeout=JOB_TIMEOUT_S, max_retries=0) as client:
        prompt = PROMPTS[1]
        completion = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0)
        assert completion.choices[0].text == greedy[prompt].text
        assert completion.usage is not None
        assert completion.usage.completion_tokens == greedy[prompt].completion_tokens
        stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == greedy[prompt].text


async def test_async_openai_client_streamed_and_not_matches_greedy(stack: Stack,
                                                                   greedy: dict[str, Reference]) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", timeout=JOB_TIMEOUT_S, max_retries=0)
    prompt = PROMPTS[2]
    completion = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0)
    assert completion.choices[0].text == greedy[prompt].text
    stream = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True)
    assert "".join([chunk.choices[0].text async for chunk in stream if chunk.choices]) == greedy[prompt].text
    await client.close()


# --- `tokenspool up`, as a user runs it ----------------------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_tokenspool_up_serves_and_stops_cleanly_on_ctrl_c(tmp_path: Path, greedy: dict[str, Reference]) -> None:
    port = free_port()
    up = spawn("up", [*tokenspool_command(), "up", "--port", str(port), "--workers", "1", "--data-dir",
                      str(tmp_path / "data"), "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "4"],
               tmp_path)
    try:
        wait_until(lambda: "tokenspool: ready" in up.log.read_text(), [up], STARTUP_TIMEOUT_S, "`up` to be ready")
        banner = up.log.read_text()
        assert f"http://127.0.0.1:{port}" in banner and "curl" in banner
        base_url = f"http://127.0.0.1:{port}"
        prompt = PROMPTS[2]
        assert_matches(poll(base_url, submit(base_url, prompt), [up]), greedy[prompt])

        # A worker that dies is restarted (the API stays up meanwhile) and the next job is served.
        [worker] = [pid for pid in descendants(up.proc.pid) if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
                    and b"shared.launcher.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: "restarting worker-0" in up.log.read_text(), [up], 30, "the worker's restart")
        assert http_ok(f"{base_url}/healthz")
        prompt = PROMPTS[0]
        assert_matches(poll(base_url, submit(base_url, prompt), [up]), greedy[prompt])

        redis_port = int((tmp_path / "data" / "redis" / "redis.port").read_text())
        assert port_open(redis_port)
        processes = descendants(up.proc.pid)
        assert len(processes) >= 3, processes  # redis-server, the API, the worker (and their helpers)

        started = time.monotonic()
        os.kill(up.proc.pid, signal.SIGINT)  # what Ctrl-C sends
        assert up.proc.wait(90) == 0, up.tail()
        assert time.monotonic() - started < 60
        assert not [pid for pid in processes if alive(pid)], "orphans left behind"
        assert not port_open(port) and not port_open(redis_port)
        assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()
        assert "tokenspool: stopped" in up.log.read_text()
    finally:
        stop(up)
