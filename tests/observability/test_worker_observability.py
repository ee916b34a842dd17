"""What a real worker process (tiny model) tells operators after real jobs: its Prometheus endpoint (checked
against the metrics contract in docs/operations.md), its heartbeat gauges, and its JSON lifecycle log lines.
One module so the tests share one worker start."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from shared.queue import JobQueue
from shared.schemas import GenerationParams, JobStatus
from tests.deploy.test_k8s_manifests import contract_metrics
from tests.observability.helpers import MODEL, ObservedWorker, delta, exported_types, value
from tests.queue.queue_helpers import make_job
from tests.worker.worker_process import wait_final, wait_tokens
from worker.engine.outputs import EngineStats
from worker.metrics import WorkerMetrics

pytestmark = pytest.mark.slow
# Long enough to fill a few KV blocks, so the second job finds whole blocks in the prefix cache.
SECRET_PROMPT = "Quokka marmalade recipe from Zanzibar"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the old wooden fence. " * 4


async def test_finished_jobs_are_counted_timed_and_their_tokens_summed(observed_worker: ObservedWorker,
                                                                       queue: JobQueue) -> None:
    before = observed_worker.scrape()
    records = []
    for max_tokens in (6, 9):  # one after the other: each step computes exactly one sequence
        job = make_job(prompt=PROMPT, created_at=time.time(),
                       params=GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        await queue.submit(job)
        records.append(await wait_final(queue, job.id))
    assert [r.status for r in records] == [JobStatus.SUCCEEDED] * 2
    await asyncio.sleep(0.5)  # a heartbeat refreshes the gauges after the last step
    after = observed_worker.scrape()

    def d(name: str, **labels: str) -> float:
        return delta(before, after, name, model=MODEL, **labels)

    assert d("tokenspool_jobs_total", event="completed") == 2
    assert d("tokenspool_jobs_total", event="failed") == 0
    assert d("tokenspool_generation_tokens_total") == 15
    assert d("tokenspool_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in records) > 0
    for hist in ("queue_wait_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_latency_seconds"):
        assert d(f"tokenspool_{hist}_count") == 2, hist
    # Latencies nest: wait <= first token <= end to end (sums over the same two jobs).
    assert 0 <= d("tokenspool_queue_wait_seconds_sum") <= d("tokenspool_time_to_first_token_seconds_sum")
    assert d("tokenspool_time_to_first_token_seconds_sum") <= d("tokenspool_e2e_latency_seconds_sum")
    assert d("tokenspool_e2e_latency_seconds_sum") < 60
    steps = d("tokenspool_step_duration_seconds_count")
    assert steps >= 15 and d("tokenspool_batch_size_count") == steps
    assert d("tokenspool_batch_size_sum") == steps  # one sequence at a time
    # The second job reuses the first one's prompt blocks.
    assert records[1].usage.cached_tokens > 0
    assert d("tokenspool_prefix_cache_hits_total") == sum(r.usage.cached_tokens for r in records)
    assert d("tokenspool_prefix_cache_queries_total") >= d("tokenspool_prefix_cache_hits_total")
    assert d("tokenspool_preemptions_total") == 0
    assert d("tokenspool_spec_decode_draft_tokens_total") == 0
    assert value(after, "tokenspool_running_requests", model=MODEL) == 0
    assert value(after, "tokenspool_waiting_requests", model=MODEL) == 0


async def test_a_running_job_shows_in_heartbeat_and_gauges_and_its_cancel_is_counted(
        observed_worker: ObservedWorker, queue: JobQueue) -> None:
    before = observed_worker.scrape()
    job = make_job(prompt="Once upon a time", created_at=time.time(),
                   params=GenerationParams(max_tokens=900, temperature=0, ignore_eos=True))
    await queue.submit(job)
    await wait_tokens(queue, job.id, 3)
    deadline = time.monotonic() + 10
    while True:
        infos = [w for w in await queue.live_workers() if w.id == observed_worker.worker_id]
        if infos and infos[0].num_running == 1:
            break
        assert time.monotonic() < deadline, f"heartbeat never showed the running job: {infos}"
        await asyncio.sleep(0.05)
    assert infos[0].model == MODEL and 0 < infos[0].kv_cache_usage <= 1 and infos[0].num_waiting == 0
    during = observed_worker.scrape()
    assert value(during, "tokenspool_running_requests", model=MODEL) == 1
    assert 0 < value(during, "tokenspool_kv_cache_usage_ratio", model=MODEL) <= 1

    await queue.cancel(job.id)
    assert (await wait_final(queue, job.id)).status == JobStatus.CANCELLED
    await asyncio.sleep(0.5)
    after = observed_worker.scrape()
    assert delta(before, after, "tokenspool_jobs_total", model=MODEL, event="cancelled") == 1
    assert delta(before, after, "tokenspool_jobs_total", model=MODEL, event="completed") == 0
    assert value(after, "tokenspool_running_requests", model=MODEL) == 0


def test_every_exported_tokenspool_metric_is_in_the_contract_with_its_type(observed_worker: ObservedWorker) -> None:
    exported = exported_types(httpx.get(observed_worker.metrics_url, timeout=10).text)
    contract = contract_metrics()
    assert exported == {name: kind for name, kind in contract.items() if name in exported}
    workers_part = {"tokenspool_queue_wait_seconds", "tokenspool_time_to_first_token_seconds",
                    "tokenspool_time_per_output_token_seconds", "tokenspool_e2e_latency_seconds",
                    "tokenspool_prompt_tokens_total", "tokenspool_generation_tokens_total",
                    "tokenspool_running_requests", "tokenspool_waiting_requests", "tokenspool_kv_cache_usage_ratio",
                    "tokenspool_prefix_cache_queries_total", "tokenspool_prefix_cache_hits_total",
                    "tokenspool_preemptions_total", "tokenspool_spec_decode_draft_tokens_total",
                    "tokenspool_spec_decode_accepted_tokens_total", "tokenspool_batch_size",
                    "tokenspool_step_duration_seconds", "tokenspool_jobs_total"}
    assert workers_part <= set(exported)


def test_engine_counters_count_each_increase_once_even_from_a_stale_snapshot() -> None:
    metrics = WorkerMetrics("m")
    stats = [EngineStats(1, 0, 10, 5, num_preemptions=p, prefix_cache_hits=h, num_draft_tokens=4 * p)
             for p, h in ((1, 16), (3, 32), (2, 16), (4, 48))]  # the third is a heartbeat's older snapshot
    for s in stats:
        metrics.on_engine_stats(s)
    samples = {(s.name, s.labels.get("model")): s.value for m in metrics.registry.collect() for s in m.samples}
    assert samples[("tokenspool_preemptions_total", "m")] == 4
    assert samples[("tokenspool_prefix_cache_hits_total", "m")] == 48
    assert samples[("tokenspool_spec_decode_draft_tokens_total", "m")] == 16
    assert samples[("tokenspool_kv_cache_usage_ratio", "m")] == 0.5



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
        assert (line["model"], line["worker_id"], line["level"]) == (MODEL, observed_worker.worker_id, "INFO")
        assert line["logger"].startswith("worker.") and job.id in line["msg"]
    claimed, _, finished = mine
    assert claimed["attempt"] == 1 and claimed["num_prompt_tokens"] == record.usage.prompt_tokens
    assert finished["completion_tokens"] == 12 and finished["finish_reasons"] == ["length"]
    log_text = observed_worker.process.log_path.read_text()
    assert SECRET_PROMPT not in log_text and "Zanzibar" not in log_text
    assert "prompt" not in claimed and "output" not in finished
