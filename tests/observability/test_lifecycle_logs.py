"""The worker's log: JSON lines only, one per job transition with job_id, model and worker_id, and no prompt or
output text by default."""

from __future__ import annotations

import time

import pytest

from shared.queue import JobQueue
from shared.schemas import GenerationParams, JobStatus
from tests.observability.helpers import MODEL, WORKER_ID, ObservedWorker
from tests.queue.queue_helpers import make_job
from tests.queue.worker_process import wait_final

pytestmark = pytest.mark.slow
SECRET_PROMPT = "Quokka marmalade recipe from Zanzibar"


async def test_each_transition_is_one_json_line_with_the_job_fields_and_no_text(observed_worker: ObservedWorker,
                                                                              queue: JobQueue) -> None:
    job = make_job(prompt=SECRET_PROMPT, created_at=time.time(),
                   params=GenerationParams(max_tokens=12, temperature=0, ignore_eos=True))
    await queue.submit(job)
    record = await wait_final(queue, job.id)
    assert record.status == JobStatus.SUCCEEDED
    deadline = time.monotonic() + 5
    while not any(line.get("event") == "finished" and line.get("job_id") == job.id
                  for line in observed_worker.log_lines()):
        assert time.monotonic() < deadline, "no finished line"
        time.sleep(0.05)

    lines = observed_worker.log_lines()  # every line parses as JSON (no progress bars, no raw prints)
    mine = [line for line in lines if line.get("job_id") == job.id]
    assert [line["event"] for line in mine] == ["claimed", "first_token", "finished"]
    for line in mine:
        assert (line["model"], line["worker_id"], line["level"]) == (MODEL, WORKER_ID, "INFO")
        assert line["logger"] == "worker.runner" and job.id in line["msg"]
    claimed, _, finished = mine
    assert claimed["attempt"] == 1 and claimed["num_prompt_tokens"] == record.usage.prompt_tokens
    assert finished["completion_tokens"] == 12 and finished["finish_reasons"] == ["length"]
    log_text = observed_worker.process.log_path.read_text()
    assert SECRET_PROMPT not in log_text and "Zanzibar" not in log_text
    assert "prompt" not in claimed and "output" not in finished
