"""Batches end to end with real worker and API processes and the official ``openai`` client: SmolLM2 answering a
small batch exactly as it answers the same requests online; and a batch whose worker is SIGKILLed and whose API
process is SIGKILLed and restarted midway (a tiny random Llama, for speed): it completes, every line once, none lost,
none run to completion twice.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from shared import keys
from tests.reliability.stack import MODEL as TINY_MODEL
from tests.reliability.stack import ApiProcess, frozen
from tests.worker.worker_process import WorkerProcess

KS = keys.Keyspace()  # the key layout of one queue shard, what these tests run with

pytestmark = pytest.mark.slow

MODEL = "smol-batch"  # its own queue
NUM_LINES = 24  # enough that the kill after the first finished line lands mid-batch on a fast machine
MAX_TOKENS = 64


def _wait(client: openai.OpenAI, batch_id: str, until: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
            if until(batch):
                return batch
        except openai.APIConnectionError:
            pass  # the API is restarting
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture()
def cleanup() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def test_smollm2_batch_matches_online_answers(redis_url: str, smollm2: Path, tmp_path: Path,
                                              cleanup: contextlib.ExitStack) -> None:
    worker = WorkerProcess(redis_url, smollm2, tmp_path, "smol-w", name=MODEL).start()
    api = ApiProcess(redis_url, tmp_path, model=MODEL, batch_poll_s=0.2).start()
    try:
        client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        cleanup.callback(client.close)
        bodies = [{"model": MODEL, "max_tokens": 4, "temperature": 0,
                   "messages": [{"role": "user", "content": f"What is the capital of {country}?"}]}
                  for country in ("France", "Italy")]
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                 for i, body in enumerate(bodies)]
        file_id = client.files.create(file=("q.jsonl", _jsonl(lines)), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        done = _wait(client, batch.id, lambda b: b.status == "completed", 240, "the batch")
        assert done.request_counts.completed == 2 and done.output_file_id is not None
        output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        online = client.chat.completions.create(**bodies[0])
        assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
        assert all(line["response"]["body"]["choices"][0]["message"]["content"] for line in output)
        assert [b.id for b in client.batches.list().data] == [batch.id]
    finally:
        api.stop()
        worker.stop()


def test_batch_survives_worker_and_api_kills(redis_url: str, api_process: ApiProcess,
                                             standing_worker: WorkerProcess,
                                             new_worker: Callable[..., WorkerProcess],
                                             cleanup: contextlib.ExitStack) -> None:
    """The session's API process and standing worker (tiny Llama), and one worker of this test's own: the standing
    worker is frozen until this one has run part of the batch and been killed, and the API killed too."""
    worker = new_worker("batch-w1", max_num_seqs=1)  # one line at a time: the kill lands mid-batch
    client = openai.OpenAI(base_url=f"{api_process.base_url}/v1", api_key="x", max_retries=3, timeout=60)
    cleanup.callback(client.close)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY_MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                       "prompt": f"Line {i} of the batch:"}}
             for i in range(NUM_LINES)]
    with frozen(standing_worker):
        worker.start()
        file_id = client.files.create(file=("lines.jsonl", _jsonl(lines)), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
        assert batch.status == "in_progress"
        _wait(client, batch.id, lambda b: b.request_counts.completed >= 1, 120, "a first line")
        worker.signal(signal.SIGKILL)  # mid-batch: its running lines' leases expire and they are requeued
        worker.wait(10)
        api_process.kill(signal.SIGKILL)
    api_process.start()
    done = _wait(client, batch.id, lambda b: b.status not in ("in_progress", "finalizing"), 240, "the batch")
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == \
        (NUM_LINES, NUM_LINES, 0)
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == [f"line-{i}" for i in range(NUM_LINES)]
    for line in output:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["choices"][0]["text"]
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    job_ids = [line["response"]["request_id"] for line in output]
    assert len(set(job_ids)) == NUM_LINES
    with redis.Redis.from_url(redis_url) as r:
        # Both workers ran lines of the batch: the kill really interrupted it.
        workers = {r.hget(KS.job(job_id), "worker_id") for job_id in job_ids}
        assert workers <= {b"batch-w1", b"standing"} and b"standing" in workers
