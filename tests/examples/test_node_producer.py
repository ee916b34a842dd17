"""examples/node: the Node.js producer written from docs/protocol.md, run against a real Redis and a real worker
(the tiny random-weight model), as another backend would use tokenspool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared import keys
from shared.launcher.redis_server import RedisServer
from tests.worker.worker_process import REPO, WorkerProcess

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "node"


@pytest.fixture()
def worker(redis_url: str, redis_server: RedisServer, tiny_llama: Path, tmp_path: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(redis_server.url, tiny_llama, tmp_path, "node-example-w1").start()
    yield process
    process.stop()


def test_the_node_producer_submits_streams_polls_and_cancels(worker: WorkerProcess, redis_url: str) -> None:
    node = shutil.which("node")
    assert node is not None, "Node.js is needed (make setup installs the example's packages with npm)"
    assert (EXAMPLE / "node_modules" / "redis").is_dir(), "run make setup (npm ci in examples/node)"
    done = subprocess.run([node, "producer.mjs"], cwd=EXAMPLE, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "REDIS_URL": redis_url, "MODEL": "tiny"})
    assert done.returncode == 0, done.stderr + worker.log_tail()
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    assert summary["outcome"] == "created" and summary["priority"] == "5"
    assert summary["again"] == "existing" and summary["again_id"] == summary["id"]
    # Resumed after three events without a gap or a duplicate, to the done marker; the streamed text is the result.
    assert summary["resumed_after"] == 3
    assert summary["seqs"] == list(range(1, len(summary["seqs"]) + 1))
    assert summary["last_event"] == {"seq": len(summary["seqs"]), "type": "done", "status": "succeeded"}
    assert summary["status"] == "succeeded" and summary["usage"]["completion_tokens"] == 24
    assert summary["streamed_text"] == summary["text"] != ""
    # Cancelled while running: flagged, then finalised by the worker with the text so far.
    assert summary["cancel_seen_status"] == "running" and summary["cancel_cancel_flag"] == "1"
    assert summary["cancelled_status"] == "cancelled" and summary["cancelled_finish_reason"] == "abort"
    assert "priority must be an integer in [-1000, 1000]" in summary["refused"]
    with redis.Redis.from_url(redis_url) as r:
        assert r.zcard(KS.inflight(0)) == 0
