#!/usr/bin/env python3
"""The cost of the queue: one workload through HTTP + Redis, and through the engine alone in this process.

    .venv/bin/python benchmarks/serve.py [--base-url URL] [--num-prompts 32] [--input-len 128] [--output-len 64]
    .venv/bin/python benchmarks/serve.py load [tokenspool bench serve options]   # the load generator alone

(a) Through the API: without ``--base-url`` a private stack is started as ``tokenspool up`` does (a redis-server
    in a temporary folder, then ``tokenspool api`` and one ``tokenspool worker``, configured from the
    ``TOKENSPOOL_*`` environment), and stopped afterwards. All prompts of a round are sent at once (streaming
    ``/v1/completions``) for throughput; ``--ttft-requests`` prompts go one at a time for TTFT at low load.
(b) The engine alone, in this process while the stack idles, with the worker's own ``EngineConfig``
    (``worker.main.engine_config``): ``generate()`` on the same prompts for throughput, and ``add_request`` +
    ``step()`` until the first token for TTFT (the time includes tokenizing the prompt, as the worker does).
The two are interleaved (``measure``): on a shared VM whose speed drifts by 20% within minutes, measuring one
system after the other compared two machines. Goals: API output throughput >= 90% of the engine's (pooled over
the rounds); API TTFT at concurrency 1 no more than 20 ms above the engine's (median of the per-prompt
differences). With ``--base-url`` the served engine settings must match the environment's for a fair ratio.
Results go to ``benchmarks/results/serve.json``; a markdown table is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import BenchConfig, BenchRequest, random_requests, run_bench_serve, run_benchmark  # noqa: E402
from benchmarks.loadgen_report import BenchSummary, RequestResult, percentile, summarize  # noqa: E402
from shared.config import Settings, no_tokenizer_thread_pool  # noqa: E402
from shared.launcher.redis_server import RedisServer, free_port  # noqa: E402
from shared.launcher.supervisor import Supervisor  # noqa: E402
from shared.launcher.up import child_specs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GOAL_THROUGHPUT_RATIO = 0.90
GOAL_ADDED_TTFT_MS = 20.0
TTFT_OUTPUT_LEN = 16  # low-load requests: short, only their first token is timed


@contextmanager
def private_stack(settings: Settings, startup_timeout_s: float) -> Iterator[str]:
    """Redis, the API and one worker, as ``tokenspool up`` starts them; yields the base URL once a worker is
    ready and stops everything (workers first) on exit."""
    with tempfile.TemporaryDirectory(prefix="tokenspool-bench-") as tmp:
        redis = RedisServer(Path(tmp) / "redis", appendonly=False)
        port = free_port()
        stack_settings = settings.model_copy(update={"workers": 1, "host": "127.0.0.1", "port": port,
                                                     "log_level": "WARNING"})
        api, workers = child_specs(stack_settings, redis.url, port)
        supervisor = Supervisor(api, workers, redis)
        base_url = f"http://127.0.0.1:{port}"
        try:
            supervisor.start()
            print(f"waiting for the stack at {base_url} (the worker loads {settings.model}) ...", file=sys.stderr)
            if supervisor.wait(until=lambda: _ready(base_url), timeout_s=startup_timeout_s) is not None:
                raise RuntimeError(f"the stack did not become ready: {supervisor.dead_child() or 'timed out'}")
            yield base_url
        finally:
            supervisor.stop()


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/readyz", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False
    finally:
        time.sleep(0.5)  # polled in a loop: at most twice a second


def _summary_fields(summary: BenchSummary) -> dict[str, Any]:
    return {"num_completed": summary.num_completed, "num_failed": summary.num_failed,
            "duration_s": summary.duration_s, "output_tokens": summary.total_output_tokens,
            "output_throughput": summary.output_throughput,
            "total_token_throughput": summary.total_token_throughput, "ttft_ms": asdict(summary.ttft_ms),
            "tpot_ms": asdict(summary.tpot_ms), "errors": summary.errors}


class EngineAlone:
    """The worker's engine (its own ``EngineConfig``) in this process, driven the way the worker drives it."""

    def __init__(self, settings: Settings) -> None:
        from worker.engine import Engine
        from worker.main import engine_config

        self.engine = Engine(engine_config(settings))
        self._ids = itertools.count()

    @staticmethod
    def params(request: BenchRequest) -> Any:
        from worker.engine import SamplingParams

        return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)

    def throughput(self, requests: list[BenchRequest]) -> dict[str, Any]:
        """``generate()`` on every request at once."""
        start = time.perf_counter()
        outputs = self.engine.generate([r.prompt for r in requests], [self.params(r) for r in requests])
        seconds = time.perf_counter() - start
        num_output = sum(len(o.token_ids) for o in outputs)
        return {"duration_s": seconds, "output_tokens": num_output, "output_throughput": num_output / seconds}

    def ttft_ms(self, request: BenchRequest) -> float:
        """Milliseconds from tokenizing the prompt to the step that yields its first token (then aborted)."""
        return engine_ttft_s(self.engine, f"ttft-{next(self._ids)}", request.prompt, self.params(request)) * 1000


def measure(base_url: str, settings: Settings, rounds: list[list[BenchRequest]],
            ttft_requests: list[BenchRequest], warmup: list[BenchRequest], timeout_s: float) -> dict[str, Any]:
    """Both systems on the same prompts, interleaved so that a machine whose speed drifts (a shared VM) slows
    both alike: throughput rounds alternate which system goes first, and every low-load prompt goes through the
    API and the engine back to back (order alternating), giving paired TTFTs. The two engines are separate, so
    neither finds the other's prompts in its prefix cache. The stack idles while the engine runs."""
    config = BenchConfig(base_url=base_url, endpoint="completions", timeout_s=timeout_s)
    sequential = BenchConfig(base_url=base_url, endpoint="completions", timeout_s=timeout_s, max_concurrency=1)
    alone = EngineAlone(settings)
    asyncio.run(run_benchmark(sequential, warmup))  # first-call costs (model, connections) out of the way
    alone.throughput(warmup)

    def api_round(requests: list[BenchRequest]) -> dict[str, Any]:
        results, duration_s = asyncio.run(run_benchmark(config, requests, progress=sys.stderr))
        return _summary_fields(summarize(results, duration_s))

    api_runs: list[dict[str, Any]] = []
    engine_runs: list[dict[str, Any]] = []
    for i, requests in enumerate(rounds):
        if i % 2 == 0:
            api_runs.append(api_round(requests))
            engine_runs.append(alone.throughput(requests))
        else:
            engine_runs.append(alone.throughput(requests))
            api_runs.append(api_round(requests))

    api_results: list[RequestResult] = []
    api_seconds = 0.0
    engine_ttfts: list[float] = []
    for i, request in enumerate(ttft_requests):
        if i % 2:
            engine_ttfts.append(alone.ttft_ms(request))
        results, duration_s = asyncio.run(run_benchmark(sequential, [request]))
        api_results += results
        api_seconds += duration_s
        if i % 2 == 0:
            engine_ttfts.append(alone.ttft_ms(request))
    api_ttfts = [r.ttft_s * 1000 if r.success and r.ttft_s is not None else None for r in api_results]
    paired = [a - e for a, e in zip(api_ttfts, engine_ttfts, strict=True) if a is not None]
    return {
        "api": {"throughput_runs": api_runs, "low_load_run": _summary_fields(summarize(api_results, api_seconds))},
        "engine": {"throughput_runs": engine_runs,
                   "ttft_ms": {"mean": statistics.fmean(engine_ttfts), "p50": percentile(engine_ttfts, 50),
                               "values": engine_ttfts}},
        "paired_added_ttft_ms": {"p50": percentile(paired, 50) if paired else None, "values": paired},
    }


def engine_ttft_s(engine: Any, request_id: str, prompt: str, params: Any) -> float:
    """Seconds from tokenizing ``prompt`` to the step that yields its first token (then the request is aborted)."""
    start = time.perf_counter()
    token_ids = engine.tokenizer.encode(prompt)
    engine.add_request(request_id, token_ids, params)
    try:
        for _ in range(len(token_ids) + 2):  # chunked prefill needs at most one step per prompt token
            if any(out.request_id == request_id and out.new_token_ids for out in engine.step()):
                return time.perf_counter() - start
        raise RuntimeError(f"request {request_id} produced no token within {len(token_ids) + 2} steps")
    finally:
        engine.abort(request_id)


def pooled_throughput(runs: list[dict[str, Any]]) -> float:
    """Output tokens over seconds, summed over a system's rounds."""
    tokens: float = sum(r["output_tokens"] for r in runs)
    seconds: float = sum(r["duration_s"] for r in runs)
    return tokens / seconds


def compare(measured: dict[str, Any]) -> dict[str, Any]:
    api, engine = measured["api"], measured["engine"]
    ratio = pooled_throughput(api["throughput_runs"]) / pooled_throughput(engine["throughput_runs"])
    added_ms = measured["paired_added_ttft_ms"]["p50"]
    return {"throughput_ratio": ratio, "added_ttft_ms": added_ms,
            "round_ratios": [a["output_throughput"] / e["output_throughput"]
                             for a, e in zip(api["throughput_runs"], engine["throughput_runs"], strict=True)],
            "meets_throughput_goal": ratio >= GOAL_THROUGHPUT_RATIO,
            "meets_ttft_goal": added_ms is not None and added_ms <= GOAL_ADDED_TTFT_MS}


def markdown_table(measured: dict[str, Any], verdict: dict[str, Any]) -> str:
    api, engine = measured["api"], measured["engine"]
    low = api["low_load_run"]
    added = verdict["added_ttft_ms"]
    rounds = ", ".join(f"{r:.1%}" for r in verdict["round_ratios"])
    rows = [
        ("output throughput (tok/s)", f"{pooled_throughput(api['throughput_runs']):.1f}",
         f"{pooled_throughput(engine['throughput_runs']):.1f}", f"{verdict['throughput_ratio']:.1%} ({rounds})",
         f">= {GOAL_THROUGHPUT_RATIO:.0%}", verdict["meets_throughput_goal"]),
        ("TTFT p50 at concurrency 1 (ms)", _ms(low["ttft_ms"]["p50"]), _ms(engine["ttft_ms"]["p50"]),
         "n/a" if added is None else f"{added:+.1f} ms (paired)", f"<= +{GOAL_ADDED_TTFT_MS:.0f} ms",
         verdict["meets_ttft_goal"]),
        ("TTFT mean at concurrency 1 (ms)", _ms(low["ttft_ms"]["mean"]), _ms(engine["ttft_ms"]["mean"]), "", "", None),
    ]
    lines = ["| measure | API (HTTP + Redis) | engine alone | API vs engine | goal | met |",
             "|---|---:|---:|---:|---:|:-:|"]
    for name, a, e, diff, goal, met in rows:
        lines.append(f"| {name} | {a} | {e} | {diff} | {goal} | {'' if met is None else 'yes' if met else 'no'} |")
    failed = sum(r["num_failed"] for r in api["throughput_runs"]) + low["num_failed"]
    if failed:
        errors = [r["errors"] for r in api["throughput_runs"]] + [low["errors"]]
        lines.append(f"\n{failed} API requests failed: {errors}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def run_queue_cost(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running API; default: start a private stack")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests of each throughput round")
    parser.add_argument("--rounds", type=int, default=4, help="throughput rounds per system, interleaved")
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request (ignore_eos)")
    parser.add_argument("--ttft-requests", type=int, default=40, help="prompts of the low-load TTFT run (paired)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for the stack to be ready")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    args = parser.parse_args(argv)
    if args.ttft_requests < 2 or args.rounds < 1:
        parser.error("--ttft-requests must be >= 2 and --rounds >= 1")
    settings = Settings()
    rng = random.Random(args.seed)
    # Fresh prompts per round: a prompt seen in an earlier round would be a prefix-cache hit.
    rounds = [random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, rng)
              for _ in range(args.rounds)]
    ttft_requests = random_requests(args.ttft_requests, args.input_len, TTFT_OUTPUT_LEN, 0.0, rng)
    warmup = random_requests(2, args.input_len, 4, 0.0, rng)

    if args.base_url:
        measured = measure(args.base_url, settings, rounds, ttft_requests, warmup, args.timeout)
    else:
        with private_stack(settings, args.startup_timeout) as base_url:
            measured = measure(base_url, settings, rounds, ttft_requests, warmup, args.timeout)
    verdict = compare(measured)
    table = markdown_table(measured, verdict)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        # The load average tells a reader whether other work shared the CPUs (CPU numbers are noise then).
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": sys.version,
                    "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "settings": {k: v for k, v in settings.model_dump(mode="json").items() if k not in ("api_keys", "redis_url")},
        "base_url": args.base_url or "private stack",
        "workload": {"num_prompts": args.num_prompts, "rounds": args.rounds, "input_len": args.input_len,
                     "output_len": args.output_len, "ttft_requests": args.ttft_requests,
                     "ttft_output_len": TTFT_OUTPUT_LEN, "seed": args.seed},
        **measured, **verdict, "table": table,
    }, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    api = measured["api"]
    failed = sum(r["num_failed"] for r in api["throughput_runs"]) + api["low_load_run"]["num_failed"]
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    no_tokenizer_thread_pool()  # the engine alone runs in this process: as in the worker
    if argv[:1] == ["load"]:
        return run_bench_serve(argv[1:])
    return run_queue_cost(argv)


if __name__ == "__main__":
    raise SystemExit(main())
