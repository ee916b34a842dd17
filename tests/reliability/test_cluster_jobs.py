"""The job lifecycle end to end on a single Redis node and on a real Redis Cluster (3 masters, 1 replica each,
3 queue shards): real ``tokenspool api`` and worker processes, the tiny Llama.

Each test runs on both: submit and poll, SSE streams resumed with ``Last-Event-ID``, cancel, priority order across
shards, ``kill -9`` of a worker and a SIGTERM drain while jobs stream. On the cluster only: a master is killed
while jobs stream; once its replica took over, every job ends succeeded (or failed with a recorded reason), none
stays unfinished, and none has two final events in its log.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared import keys
from shared.launcher.redis_cluster import LocalRedisCluster
from shared.launcher.redis_server import RedisServer, free_port
from shared.redis_client import connect_sync
from tests.e2e.test_walking_skeleton import spawn, stop, tokenspool_command, wait_until
from tests.reliability.stack import MODEL, ApiProcess, assert_clean_stream, follow, poll, start_workers, submit
from tests.worker.worker_process import WorkerProcess

pytestmark = pytest.mark.slow

PROMPTS = ["The sea was", "Once upon a time", "In the beginning", "Dear diary,"]


@dataclass(frozen=True)
class Backend:
    """A Redis to run the stack on: its URL, the queue shards used there, and the cluster (None: one node)."""

    name: str
    url: str
    queue_shards: int
    cluster: LocalRedisCluster | None


@pytest.fixture(scope="module", params=["node", "cluster"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """One Redis per variant for the whole module, flushed at its start (tests leave no unfinished jobs)."""
    if request.param == "node":
        server: RedisServer = request.getfixturevalue("redis_server")
        if not server.running:
            server.start()
        connect_sync(server.url).flushall()
        return Backend("node", server.url, 1, None)
    cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
    cluster.revive()
    cluster.flushall()
    return Backend("cluster", cluster.url, 3, cluster)


@dataclass
class Stack:
    backend: Backend
    api: ApiProcess
    workers: list[WorkerProcess]
    model: Path
    log_dir: Path

    def worker(self, name: str, **settings: object) -> WorkerProcess:
        return WorkerProcess(self.backend.url, self.model, self.log_dir, f"w-{self.backend.name}-{name}", name=MODEL,
                             queue_shards=self.backend.queue_shards, **settings)

    def with_live_workers(self, count: int) -> Stack:
        """Replace workers an earlier test killed or drained, so ``count`` serve."""
        self.workers = [w for w in self.workers if w.alive()]
        spares = [self.worker(f"{len(self.workers) + i}-{id(self)}-{i}", max_num_seqs=4)
                  for i in range(count - len(self.workers))]
        self.workers += start_workers(spares) if spares else []
        return self


@pytest.fixture(scope="module")
def module_stack(backend: Backend, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The API and two workers, started once per variant (each start costs seconds of model loading)."""
    logs = tmp_path_factory.mktemp(f"cluster-jobs-{backend.name}")
    api = ApiProcess(backend.url, logs, queue_shards=backend.queue_shards).start(timeout_s=60)
    stack = Stack(backend, api, [], tiny_llama, logs)
    try:
        yield stack.with_live_workers(2)
    finally:
        for worker in stack.workers:
            worker.stop()
        api.stop()


@pytest.fixture()
def stack(module_stack: Stack) -> Stack:
    return module_stack.with_live_workers(2)


def _final_events(backend: Backend, job_id: str) -> int:
    """How many final (``done``) events the job's replay log holds."""
    ks = keys.Keyspace(backend.queue_shards)
    with connect_sync(backend.url) as client:
        return sum(1 for _, fields in client.xrange(ks.job_log(job_id)) if b'"type":"done"' in fields[b"data"])


async def test_submit_stream_resume_poll_and_cancel(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.api.base_url, timeout=30) as client:
        streamed = [await submit(client, p, max_tokens=24, temperature=0) for p in PROMPTS]
        polled = [await submit(client, p, max_tokens=16, temperature=0) for p in PROMPTS]
        doomed = await submit(client, "A very long story", max_tokens=700, ignore_eos=True)
        streams = await asyncio.gather(*(follow(client, job_id) for job_id in streamed))
        for stream in streams:
            assert_clean_stream(stream)
        # Resume: a reader that saw events 1..5 asks for the rest and gets exactly 6.. to the end.
        async with client.stream("GET", f"/v1/jobs/{streamed[0]}/events", headers={"Last-Event-ID": "5"}) as r:
            ids = [int(line[4:]) for line in [x async for x in r.aiter_lines()] if line.startswith("id: ")]
        assert ids == list(range(6, streams[0].ids[-1] + 1))
        for job_id in polled:
            job, _ = await poll(client, job_id)
            assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 16
        assert (await client.delete(f"/v1/jobs/{doomed}")).status_code in (200, 202)
        job, _ = await poll(client, doomed)
        assert job["status"] == "cancelled"
        for job_id in [*streamed, *polled, doomed]:
            assert _final_events(stack.backend, job_id) == 1
        # An idempotency key: the API makes the id in the key's shard, and the retry finds the first job.
        body = {"prompt": PROMPTS[0], "max_tokens": 2, "idempotency_key": f"retry-{stack.backend.name}"}
        first, again = await client.post("/v1/jobs", json=body), await client.post("/v1/jobs", json=body)
        assert (first.status_code, again.status_code) == (202, 200), (first.text, again.text)
        assert again.json()["id"] == first.json()["id"]


async def test_priority_order_holds_across_shards(backend: Backend, tiny_llama: Path, tmp_path: Path) -> None:
    """With no worker running, 8 low- then 8 high-priority jobs queue up (spread over the shards); one worker
    taking one job at a time then starts every high-priority job before any low-priority one."""
    model = f"{MODEL}-prio"  # a queue of its own: no worker of another test may claim these jobs early
    api = ApiProcess(backend.url, tmp_path, model=model, queue_shards=backend.queue_shards).start(timeout_s=60)
    worker = WorkerProcess(backend.url, tiny_llama, tmp_path, f"w-prio-{backend.name}", name=model,
                           queue_shards=backend.queue_shards, max_num_seqs=1)
    try:
        async with httpx.AsyncClient(base_url=api.base_url, timeout=30) as client:
            low = [await submit(client, f"low {i}", model=model, max_tokens=2, priority=-5) for i in range(8)]
            high = [await submit(client, f"high {i}", model=model, max_tokens=2, priority=5) for i in range(8)]
            if backend.queue_shards > 1:
                ks = keys.Keyspace(backend.queue_shards)
                assert len({ks.shard_of(job_id) for job_id in low + high}) > 1  # the jobs really are spread
            worker.start()
            finals = {job_id: (await poll(client, job_id))[0] for job_id in low + high}
        started = sorted(finals, key=lambda job_id: finals[job_id]["started_at"])
        assert set(started[:8]) == set(high), [(finals[j]["priority"], finals[j]["worker_id"]) for j in started]
    finally:
        worker.stop()
        api.stop()


async def test_kill_9_and_drain_of_workers_while_jobs_stream(stack: Stack) -> None:
    """kill -9 one worker mid-stream, then SIGTERM the other (a drain) once a new one serves beside it: every
    job still ends succeeded with a clean stream (restarted where its worker died) and one final event."""
    async with httpx.AsyncClient(base_url=stack.api.base_url, timeout=30) as client:
        job_ids = [await submit(client, PROMPTS[i % 4], max_tokens=48, temperature=0) for i in range(10)]
        readers = [asyncio.create_task(follow(client, job_id, timeout_s=240)) for job_id in job_ids]
        await asyncio.sleep(1.5)
        stack.workers[0].signal(signal.SIGKILL)
        stack.workers.append(stack.worker(f"spare-{len(stack.workers)}", max_num_seqs=4).start())
        stack.workers[1].signal(signal.SIGTERM)
        streams = await asyncio.gather(*readers)
        assert stack.workers[1].wait(60) == 0  # drained and exited cleanly
    for stream in streams:
        assert_clean_stream(stream)
    for job_id in job_ids:
        assert _final_events(stack.backend, job_id) == 1


async def test_master_failover_while_jobs_stream(stack: Stack) -> None:
    if stack.backend.cluster is None:
        pytest.skip("a failover needs the cluster")
    async with httpx.AsyncClient(base_url=stack.api.base_url, timeout=30) as client:
        job_ids = [await submit(client, PROMPTS[i % 4], max_tokens=64, temperature=0) for i in range(12)]
        ks = keys.Keyspace(stack.backend.queue_shards)
        on_killed = [job_id for job_id in job_ids if ks.shard_of(job_id) == 1]
        assert on_killed, "no job lives on the master about to die"
        killed = stack.backend.cluster.masters()[1]
        assert killed.slots[0][0] <= keys.crc16(ks.tags[1]) % keys.SLOTS <= killed.slots[0][1]
        await asyncio.sleep(1.0)
        successor = await asyncio.to_thread(stack.backend.cluster.kill_master, 1)
        assert successor.port != killed.port
        finals = [(await poll(client, job_id, timeout_s=240))[0] for job_id in job_ids]
    for job in finals:
        assert job["status"] == "succeeded" or (job["status"] == "failed" and job["error"]), job
    assert sum(job["status"] == "succeeded" for job in finals) >= len(finals) - 2
    for job_id in job_ids:
        assert _final_events(stack.backend, job_id) == 1


async def test_tokenspool_up_serves_from_the_cluster(backend: Backend, tiny_llama: Path, tmp_path: Path) -> None:
    """``tokenspool up --redis-url redis+cluster://...`` as a user runs it: a job end to end, then Ctrl-C."""
    if backend.cluster is None:
        pytest.skip("the single node runs `up` in tests/e2e")
    redis_cluster_url = backend.url
    port = free_port()
    up = spawn("up", [*tokenspool_command(), "up", "--port", str(port), "--workers", "1", "--redis-url",
                      redis_cluster_url, "--queue-shards", "3", "--model", str(tiny_llama), "--model-name", MODEL,
                      "--device", "cpu", "--max-num-seqs", "2"], tmp_path)
    try:
        wait_until(lambda: "tokenspool: ready" in up.log.read_text(), [up], 120, "`up` to be ready")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            job, _ = await poll(client, await submit(client, PROMPTS[0], max_tokens=8))
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 8
        with connect_sync(redis_cluster_url) as r:
            assert r.get(keys.SHARDS) == ",".join(keys.Keyspace(3).tags).encode()
        os.kill(up.proc.pid, signal.SIGINT)
        assert up.proc.wait(90) == 0, up.tail()
    finally:
        stop(up)


async def test_files_and_a_batch(stack: Stack) -> None:
    """The Files and Batch APIs: their own keys in one slot, their indexes in others, the lines' jobs spread over
    the shards (a batch owner without rate limits: each line's job in its id's shard)."""
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": PROMPTS[i % 4], "max_tokens": 4}} for i in range(6)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    async with httpx.AsyncClient(base_url=stack.api.base_url, timeout=30) as client:
        upload = await client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["id"]
        assert [f["id"] for f in (await client.get("/v1/files")).json()["data"]] == [file_id]
        created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                         "completion_window": "24h"})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        for _ in range(600):
            batch = (await client.get(f"/v1/batches/{batch_id}")).json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.1)
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 6, batch
        output = (await client.get(f"/v1/files/{batch['output_file_id']}/content")).text.splitlines()
        assert [json.loads(x)["custom_id"] for x in output] == [f"req-{i}" for i in range(6)]
        assert [b["id"] for b in (await client.get("/v1/batches")).json()["data"]] == [batch_id]
        assert (await client.delete(f"/v1/files/{file_id}")).status_code == 200
