"""The load generator of ``tokenspool bench serve``: its statistics, arrivals and datasets on known data, then
whole runs against the real API (uvicorn on a free port, the test Redis) served by the production worker over
the scripted engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn

from api.app import create_app
from benchmarks.loadgen import (
    PROMPT_WORDS,
    BenchConfig,
    BenchRequest,
    arrival_offsets,
    load_dataset,
    random_requests,
    run_bench_serve,
    run_benchmark,
)
from benchmarks.loadgen_report import (
    RequestResult,
    describe_ms,
    format_table,
    output_tokens_per_second,
    percentile,
    summarize,
)
from shared.config import Settings
from shared.launcher.redis_server import free_port
from tests.worker.scripted_engine import MODEL, InProcessWorker

# --- statistics on known data ------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    data = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    assert percentile(data, 0) == 1.0
    assert percentile(data, 50) == pytest.approx(2.5)
    assert percentile(data, 90) == pytest.approx(3.7)
    assert percentile(data, 99) == pytest.approx(3.97)
    assert percentile(data, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    hundred = [float(i) for i in range(1, 101)]
    assert percentile(hundred, 90) == pytest.approx(90.1)
    with pytest.raises(ValueError, match="values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be in"):
        percentile(data, 101)


def test_describe_ms_converts_seconds_and_handles_no_data() -> None:
    dist = describe_ms([0.010, 0.020, 0.030, 0.040])
    assert (dist.count, dist.mean, dist.p50) == (4, pytest.approx(25.0), pytest.approx(25.0))
    assert dist.p99 == pytest.approx(39.7)
    empty = describe_ms([])
    assert (empty.count, empty.mean, empty.p50, empty.p90, empty.p99) == (0, None, None, None, None)


def _result(start: float, ttft: float, gaps: list[float], tokens: int, prompt: int = 10) -> RequestResult:
    times = [start + ttft + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    return RequestResult(success=True, start_s=start, e2e_s=times[-1] - start, ttft_s=ttft, itl_s=tuple(gaps),
                         chunk_times_s=tuple(times), num_prompt_tokens=prompt, num_output_tokens=tokens)


def test_summarize_counts_only_completed_requests() -> None:
    results = [
        _result(0.0, 0.1, [0.05] * 4, tokens=5),  # e2e 0.3, tpot (0.3 - 0.1) / 4 = 0.05
        _result(0.5, 0.3, [0.1] * 2, tokens=3),  # e2e 0.5, tpot 0.1
        RequestResult(success=False, start_s=1.0, e2e_s=2.0, error="HTTP 400: too long"),
        RequestResult(success=False, start_s=1.0, e2e_s=2.0, error="HTTP 400: too long"),
    ]
    summary = summarize(results, duration_s=2.0)
    assert (summary.num_requests, summary.num_completed, summary.num_failed) == (4, 2, 2)
    assert (summary.total_input_tokens, summary.total_output_tokens) == (20, 8)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(4.0)
    assert summary.total_token_throughput == pytest.approx(14.0)
    assert summary.ttft_ms.mean == pytest.approx(200.0)
    assert summary.tpot_ms.mean == pytest.approx(75.0)
    assert summary.e2e_ms.p50 == pytest.approx(400.0)
    assert summary.itl_ms.count == 6 and summary.itl_ms.mean == pytest.approx(400 / 6)
    assert summary.errors == {"HTTP 400: too long": 2}
    table = format_table(summary)
    assert "Failed requests:" in table and "HTTP 400: too long" in table
    assert RequestResult(success=True, start_s=0, e2e_s=1, ttft_s=0.5, num_output_tokens=1).tpot_s is None


def test_throughput_over_time_buckets_add_up_to_the_output_tokens() -> None:
    # 4 chunks carrying 8 tokens (2 per chunk) at 0.2, 0.7, 1.2, 2.5 s
    result = RequestResult(success=True, start_s=0.0, e2e_s=2.5, ttft_s=0.2, chunk_times_s=(0.2, 0.7, 1.2, 2.5),
                           num_output_tokens=8)
    assert output_tokens_per_second([result], duration_s=2.6) == [4.0, 2.0, 2.0]
    assert output_tokens_per_second([result], duration_s=2.6, bucket_s=0.5) == [4.0, 4.0, 4.0, 0.0, 0.0, 4.0]


# --- arrivals and requests ---------------------------------------------------------------------------------


def test_poisson_arrivals_have_mean_interval_one_over_rate() -> None:
    offsets = arrival_offsets(20_000, 5.0, random.Random(7))
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.05)  # exponential: stdev == mean
    assert arrival_offsets(50, 5.0, random.Random(7)) == offsets[:50]  # a fixed seed repeats
    assert arrival_offsets(3, math.inf, random.Random(7)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets(3, 0.0, random.Random(7))


def test_random_requests_lengths_and_seed() -> None:
    requests = random_requests(200, 100, 20, 0.5, random.Random(1))
    assert all(50 <= r.num_prompt_tokens <= 150 and 10 <= r.max_tokens <= 30 for r in requests)
    assert all(len(r.prompt.split()) == r.num_prompt_tokens for r in requests)
    assert all(set(r.prompt.split()) <= set(PROMPT_WORDS) for r in requests)
    assert min(r.num_prompt_tokens for r in requests) < 60 and max(r.num_prompt_tokens for r in requests) > 140
    assert random_requests(200, 100, 20, 0.5, random.Random(1)) == requests
    assert {(r.num_prompt_tokens, r.max_tokens) for r in random_requests(5, 8, 4, 0.0, random.Random(2))} == {(8, 4)}
    with pytest.raises(ValueError, match="random_range_ratio"):
        random_requests(1, 8, 4, 1.0, random.Random(2))


def test_load_dataset(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "hello world", "max_tokens": 3}\n\n{"prompt": "the quick brown fox"}\n'
                    '{"prompt": "third", "max_tokens": 9}\n')
    assert load_dataset(path, None, default_max_tokens=7) == [
        BenchRequest("hello world", 3, 2), BenchRequest("the quick brown fox", 7, 4), BenchRequest("third", 9, 1)]
    assert [r.prompt for r in load_dataset(path, 2, 7)] == ["hello world", "the quick brown fox"]
    with pytest.raises(ValueError, match="num_prompts: .* holds 3 requests, asked for 4"):
        load_dataset(path, 4, 7)
    path.write_text('{"prompt": "ok"}\n{"prompt": "bad", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="line 2: max_tokens must be an integer >= 1"):
        load_dataset(path, None, 7)
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: not JSON"):
        load_dataset(path, None, 7)
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 1: prompt must be a non-empty string"):
        load_dataset(path, None, 7)


# --- whole runs against the real API -----------------------------------------------------------------------


def _settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, model=MODEL, lease_ttl_s=5.0, heartbeat_interval_s=1.0)


@pytest.fixture()
def start_stack(redis_url: str) -> Iterator[Callable[[float], tuple[str, InProcessWorker]]]:
    """The real API under uvicorn on a free port, plus the worker over a scripted engine (a step per
    ``token_delay_s``)."""
    started: list[tuple[uvicorn.Server, threading.Thread, InProcessWorker]] = []

    def start(token_delay_s: float) -> tuple[str, InProcessWorker]:
        settings = _settings(redis_url)
        worker = InProcessWorker(redis_url, settings, token_delay_s=token_delay_s).start()
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                               log_level="warning", timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, name=f"api-{port}", daemon=True)
        thread.start()
        started.append((server, thread, worker))
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "API did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}", worker

    yield start
    for server, thread, worker in started:
        server.should_exit = True
        thread.join(15)
        worker.stop()


@pytest.mark.parametrize("endpoint", ["completions", "jobs"])
def test_bench_serve_end_to_end(endpoint: str, start_stack: Callable[[float], tuple[str, InProcessWorker]],
                                tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base_url, worker = start_stack(0.002)
    json_path, png_path = tmp_path / "out" / "result.json", tmp_path / "out" / "plot.png"
    plot = ["--plot", str(png_path)] if endpoint == "completions" else []  # ~2 s of matplotlib: once is enough
    code = run_bench_serve([
        "--base-url", base_url, "--endpoint", endpoint, "--num-prompts", "12", "--random-input-len", "16",
        "--random-output-len", "6", "--random-range-ratio", "0.5", "--request-rate", "200",
        "--max-concurrency", "4", "--timeout", "20", "--seed", "3", "--result-json", str(json_path), *plot,
    ])
    assert code == 0
    expected = random_requests(12, 16, 6, 0.5, random.Random(3))
    data = json.loads(json_path.read_text())
    summary = data["summary"]
    assert (summary["num_completed"], summary["num_failed"]) == (12, 0)
    # The scripted engine generates exactly max_tokens tokens and counts one prompt token per word.
    assert summary["total_output_tokens"] == sum(r.max_tokens for r in expected)
    assert summary["total_input_tokens"] == sum(r.num_prompt_tokens for r in expected)
    assert [r["num_output_tokens"] for r in data["requests"]] == [r.max_tokens for r in expected]
    assert sorted(worker.claimed) == sorted(set(worker.claimed)) and len(worker.claimed) == 12
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in data["requests"])
    assert all(len(r["itl_s"]) == r["num_output_tokens"] - 1 for r in data["requests"])
    assert summary["ttft_ms"]["count"] == 12 and summary["ttft_ms"]["p50"] > 0
    assert summary["output_throughput"] > 0
    assert sum(data["output_tokens_per_s"]["values"]) == pytest.approx(summary["total_output_tokens"])
    assert data["config"]["endpoint"] == endpoint and data["config"]["api_key"] is None
    if plot:
        assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out, err = capsys.readouterr()
    assert "Successful requests:" in out and "TTFT" in out
    assert "bench serve: 12/12 done, 0 errors" in err


def test_failures_are_counted_and_timed_out_jobs_cancelled(
        start_stack: Callable[[float], tuple[str, InProcessWorker]]) -> None:
    base_url, worker = start_stack(0.2)
    requests = [BenchRequest("hello world", 1, 2),
                BenchRequest("too long for the context", 10_000, 5),  # over max_tokens_cap: HTTP 400
                BenchRequest("slow one", 50, 2)]  # 50 tokens x 0.2 s: cut off by the timeout
    config = BenchConfig(base_url=base_url, endpoint="jobs", timeout_s=1.5)
    results, duration_s = asyncio.run(run_benchmark(config, requests))
    assert [r.success for r in results] == [True, False, False]
    assert results[0].num_output_tokens == 1
    assert results[1].error is not None and "HTTP 400" in results[1].error
    assert results[2].error == "timed out after 1.5 s"
    assert 1.5 <= duration_s < 10
    deadline = time.monotonic() + 5
    while len(worker.cancelled) != 1:  # the slow job only: the first one had finished, the second never queued
        assert time.monotonic() < deadline, "the timed-out job was not cancelled"
        time.sleep(0.02)
    assert len(worker.claimed) == 2 and worker.cancelled <= set(worker.claimed)
