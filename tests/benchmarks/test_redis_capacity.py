"""benchmarks/redis_capacity.py at a tiny scale: a real Redis, API and simulated workers; the report adds up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.machine import read_cpu_info
from benchmarks.redis_capacity import main
from benchmarks.redis_capacity_report import ceilings
from benchmarks.simulated_workers import lag_ms, stamp
from shared.launcher.redis_cluster import cluster_support_problem


def test_a_tiny_ramp_reports_what_the_clients_received(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    assert main(["--jobs", "2,6", "--step-ms", "20", "--output-len", "8", "--workers", "2", "--level-s", "1.5",
                 "--warmup-s", "0.5", "--sse-share", "0.5", "--no-aof", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cpu"] == read_cpu_info().describe() and result["load_average_start"] >= 0
    assert [(r["variant"], r["jobs"]) for r in result["rows"]] == [("current", 2), ("current", 6)]
    for row in result["rows"]:
        # Every token a simulated worker published reached an SSE client (half the jobs streamed) or the record
        # of a polled job, and every job ended succeeded with exactly its tokens.
        assert row["num_bad_jobs"] == 0, row["bad_jobs"]
        assert row["jobs_followed"] > 0 and row["tokens_received"] == row["jobs_followed"] * 8
        assert row["jobs_polled"] > 0 and row["tokens_polled"] == row["jobs_polled"] * 8
        assert row["tokens_published"] == row["tokens_received"] + row["tokens_polled"]
        assert row["stale_publishes"] == 0
        assert row["offered_tokens_per_s"] == row["jobs"] * 50
        assert 0 < row["tokens_per_s"] <= 1.2 * row["offered_tokens_per_s"]
        assert 0 < row["publish_p50_ms"] <= row["publish_p99_ms"]
        assert 0 <= row["sse_lag_p50_ms"] <= row["sse_lag_p99_ms"]
        # Redis's own counters: CPU, and per token one XADD and one SPUBLISH at least (done events add some).
        assert row["redis_cpu_us_per_token"] > 0 and row["redis_bytes_out_per_token"] > 0
        assert row["redis_calls_per_token"]["xadd"] >= 1 and row["redis_calls_per_token"]["spublish"] >= 1
        assert row["redis_cpu_share_per_master"] == [row["redis_cpu_share"]]  # one node: the whole of it
        assert row["queue_code"].endswith("shared")
    markdown = out.with_suffix(".md").read_text()
    assert "| current | 6 |" in markdown and result["cpu"] in markdown


def test_a_tiny_ramp_on_a_cluster_sums_the_masters_counters(tmp_path: Path) -> None:
    problem = cluster_support_problem()
    if problem is not None:
        pytest.skip(f"no local Redis Cluster here: {problem}")
    out = tmp_path / "cluster.json"
    assert main(["--cluster", "--jobs", "12", "--step-ms", "20", "--output-len", "8", "--workers", "2",
                 "--level-s", "2", "--warmup-s", "0.5", "--sse-share", "0.5", "--no-aof", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cluster_masters"] == 3 and result["queue_shards"] == 3
    [row] = result["rows"]
    assert row["num_bad_jobs"] == 0, row["bad_jobs"]  # every stream served (tests/test_live_channels_cluster.py)
    assert row["tokens_published"] == row["tokens_received"] + row["tokens_polled"] > 0
    # Every master served jobs (12 jobs spread over 3 shards), and the total is the masters' sum.
    shares = row["redis_cpu_share_per_master"]
    assert len(shares) == 3 and all(share > 0 for share in shares)
    assert sum(shares) == pytest.approx(row["redis_cpu_share"])
    assert row["redis_calls_per_token"]["spublish"] >= 1
    assert "3 masters" in out.with_suffix(".md").read_text()


def test_the_ceiling_is_the_best_sustained_level() -> None:
    rows = [{"variant": "a", "jobs": 1, "tokens_per_s": 100.0, "sustained": True},
            {"variant": "a", "jobs": 2, "tokens_per_s": 190.0, "sustained": True},
            {"variant": "a", "jobs": 4, "tokens_per_s": 210.0, "sustained": False},
            {"variant": "b", "jobs": 1, "tokens_per_s": 90.0, "sustained": False}]
    best = ceilings(rows, ["a", "b"])
    assert best["a"] is rows[1] and best["b"] is None


def test_token_stamps_measure_lag_across_the_modulo() -> None:
    assert stamp(1234.5678) == "01234567"
    assert lag_ms(stamp(1000.0), 1000.25) == 250.0
    assert lag_ms(stamp(99_999.999), 100_000.004) == 5.0  # 10^8 ms wraps to 0


def test_publish_only_measures_the_publish_path_alone(tmp_path: Path) -> None:
    out = tmp_path / "publish.json"
    assert main(["--publish-only", "5", "--jobs", "3", "--no-aof", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["jobs"] == 3 and row["tokens"] == 15 and row["tokens_per_s"] > 0
    # Per job and step HMGET + XADD + PUBLISH + HSET inside the script, one EVALSHA per step (and the INFO that
    # opened the window): 4 + (5 + 1) / 15 commands per token.
    assert abs(row["redis_commands_per_token"] - (4 + 6 / 15)) < 1e-9
    assert row["redis_cpu_us_per_token"] > 0 and 0 < row["publish_p50_ms"] <= row["publish_p99_ms"]
    assert "| current | 3 |" in out.with_suffix(".md").read_text()
