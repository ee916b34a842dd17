"""The soak benchmark (benchmarks/soak.py), short: 100 jobs through every door of a real stack serving the tiny
Llama, with cancellations and client disconnects; then nothing may have leaked (jobs, KV blocks, Redis keys)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import SoakConfig, run

pytestmark = pytest.mark.slow


def test_soak_100_jobs_leaves_nothing_behind(tiny_llama: Path) -> None:
    report = run(SoakConfig(jobs=100, model=str(tiny_llama), concurrency=16, max_tokens=32,
                            cancel_fraction=0.15, disconnect_fraction=0.15, startup_timeout_s=120,
                            drain_timeout_s=60))
    assert report.failures == [], report
    assert report.num_jobs_seen == 100 and sum(report.statuses.values()) == 100
    assert report.statuses.get("succeeded", 0) > 50 and report.statuses.get("cancelled", 0) >= 5, report.statuses
    assert report.cancels_sent >= 5 and report.disconnects >= 5
    assert not report.kv_leak and [w["kv_cache_usage"] for w in report.idle_workers] == [0.0]
    assert report.redis_job_keys == 200 and report.redis_stray_keys == [] and report.redis_keys_without_ttl == []
    # + the model's FIFO counter and fair-share clock, the recent-jobs index of jobs without an owner, the event stream
    assert report.redis_keys_after == report.redis_keys_baseline + 200 + 4
