"""The cumulative counts a worker sends with its heartbeat (``WorkerMetrics.totals``) are its Prometheus counters:
what the console's throughput and latency charts are computed from."""

from __future__ import annotations

import pytest

from worker.engine import EngineStats
from worker.metrics import WorkerMetrics


def test_totals_follow_the_workers_own_counters() -> None:
    metrics = WorkerMetrics("m")
    assert metrics.totals().num_generated_tokens == 0 and metrics.totals().e2e_sum_s == 0
    stats = EngineStats(num_running=1, num_waiting=0, num_total_blocks=8, num_free_blocks=4)
    metrics.on_step(0.01, 1, 5, stats)
    metrics.on_step(0.01, 1, 3, stats)
    metrics.on_first_token(100.0, 100.5)
    metrics.on_first_token(100.0, 101.5)
    metrics.on_job_finished("completed", 100.0, 104.0)
    totals = metrics.totals()
    assert totals.num_generated_tokens == 8
    assert totals.num_first_tokens == 2 and totals.ttft_sum_s == pytest.approx(2.0)
    assert totals.num_finished_jobs == 1 and totals.e2e_sum_s == pytest.approx(4.0)
    assert WorkerMetrics("other").totals().num_generated_tokens == 0  # registries are per worker
