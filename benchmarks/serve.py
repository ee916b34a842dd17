"""The cost of the queue: one workload through HTTP + Redis, and through the engine alone in this process.

    .venv/bin/python benchmarks/serve.py [--base-url URL] [--num-prompts 32] [--input-len 128] [--output-len 64]
    .venv/bin/python benchmarks/serve.py load [tokenspool bench serve options]   # the load generator alone

(a) Through the API: without ``--base-url`` a private stack is started as ``tokenspool up`` does (a redis-server
    in a temporary folder, then ``tokenspool api`` and one ``tokenspool worker``, configured from the
    ``TOKENSPOOL_*`` environment), and stopped afterwards. All prompts are sent at once (streaming
    ``/v1/completions``) for throughput, then ``--ttft-requests`` prompts one at a time for TTFT at low load.
(b) The engine alone, with the worker's own ``EngineConfig`` (``worker.main.engine_config``): ``generate()`` on
    the same prompts for throughput, and ``add_request`` + ``step()`` until the first token for TTFT (the time
    includes tokenizing the prompt, as the worker does).
Goals: API output throughput >= 90% of the engine's; API TTFT p50 at concurrency 1 no more than 20 ms above
the engine's. With ``--base-url`` the served engine settings must match the environment's for a fair ratio.
Results go to ``benchmarks/results/serve.json``; a markdown table is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
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

from shared.config import Settings  # noqa: E402
from shared.loadgen import BenchConfig, BenchRequest, random_requests, run_bench_serve, run_benchmark  # noqa: E402
from shared.loadgen_report import BenchSummary, percentile, summarize  # noqa: E402
from shared.redis_server import RedisServer, free_port  # noqa: E402
from shared.supervisor import Supervisor, child_specs  # noqa: E402

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
            "duration_s": summary.duration_s, "output_throughput": summary.output_throughput,
            "total_token_throughput": summary.total_token_throughput, "ttft_ms": asdict(summary.ttft_ms),
            "tpot_ms": asdict(summary.tpot_ms), "errors": summary.errors}


def measure_api(base_url: str, requests: list[BenchRequest], ttft_requests: list[BenchRequest],
                warmup: list[BenchRequest], timeout_s: float) -> dict[str, Any]:
    """Throughput with every request at once, then TTFT one request at a time, through streaming completions."""
    config = BenchConfig(base_url=base_url, endpoint="completions", timeout_s=timeout_s)
    sequential = BenchConfig(base_url=base_url, endpoint="completions", timeout_s=timeout_s, max_concurrency=1)
    asyncio.run(run_benchmark(sequential, warmup))  # first-call costs (model, connections) out of the way
    results, duration_s = asyncio.run(run_benchmark(config, requests, progress=sys.stderr))
    load = summarize(results, duration_s)
    results, duration_s = asyncio.run(run_benchmark(sequential, ttft_requests, progress=sys.stderr))
    low = summarize(results, duration_s)
    return {"throughput_run": _summary_fields(load), "low_load_run": _summary_fields(low)}


def measure_engine(settings: Settings, requests: list[BenchRequest], ttft_requests: list[BenchRequest],
                   warmup: list[BenchRequest]) -> dict[str, Any]:
    """The same work on the engine in this process: ``generate()`` for throughput, ``step()`` for TTFT."""
    from worker.engine import Engine, SamplingParams
    from worker.main import engine_config

    engine = Engine(engine_config(settings))

    def params(request: BenchRequest) -> SamplingParams:
        return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)

    engine.generate([r.prompt for r in warmup], [params(r) for r in warmup])
    start = time.perf_counter()
    outputs = engine.generate([r.prompt for r in requests], [params(r) for r in requests])
    seconds = time.perf_counter() - start
    num_output = sum(len(o.token_ids) for o in outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts_ms = [engine_ttft_s(engine, f"ttft-{i}", r.prompt, params(r)) * 1000 for i, r in enumerate(ttft_requests)]
    return {"duration_s": seconds, "output_tokens": num_output, "prompt_tokens": num_prompt,
            "output_throughput": num_output / seconds, "total_token_throughput": (num_prompt + num_output) / seconds,
            "ttft_ms": {"mean": sum(ttfts_ms) / len(ttfts_ms), "p50": percentile(ttfts_ms, 50), "values": ttfts_ms}}


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


def compare(api: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    ratio = api["throughput_run"]["output_throughput"] / engine["output_throughput"]
    api_ttft = api["low_load_run"]["ttft_ms"]["p50"]
    added_ms = api_ttft - engine["ttft_ms"]["p50"] if api_ttft is not None else None
    return {"throughput_ratio": ratio, "added_ttft_ms": added_ms,
            "meets_throughput_goal": ratio >= GOAL_THROUGHPUT_RATIO,
            "meets_ttft_goal": added_ms is not None and added_ms <= GOAL_ADDED_TTFT_MS}


def markdown_table(api: dict[str, Any], engine: dict[str, Any], verdict: dict[str, Any]) -> str:
    thr, low = api["throughput_run"], api["low_load_run"]
    added = verdict["added_ttft_ms"]
    rows = [
        ("output throughput (tok/s)", f"{thr['output_throughput']:.1f}", f"{engine['output_throughput']:.1f}",
         f"{verdict['throughput_ratio']:.1%}", f">= {GOAL_THROUGHPUT_RATIO:.0%}",
         verdict["meets_throughput_goal"]),
        ("TTFT p50 at concurrency 1 (ms)", _ms(low["ttft_ms"]["p50"]), _ms(engine["ttft_ms"]["p50"]),
         "n/a" if added is None else f"{added:+.1f} ms", f"<= +{GOAL_ADDED_TTFT_MS:.0f} ms",
         verdict["meets_ttft_goal"]),
        ("TTFT mean at concurrency 1 (ms)", _ms(low["ttft_ms"]["mean"]), _ms(engine["ttft_ms"]["mean"]), "", "", None),
    ]
    lines = ["| measure | API (HTTP + Redis) | engine alone | API vs engine | goal | met |",
             "|---|---:|---:|---:|---:|:-:|"]
    for name, a, e, diff, goal, met in rows:
        lines.append(f"| {name} | {a} | {e} | {diff} | {goal} | {'' if met is None else 'yes' if met else 'no'} |")
    failed = thr["num_failed"] + low["num_failed"]
    if failed:
        lines.append(f"\n{failed} API requests failed: {thr['errors'] | low['errors']}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def run_queue_cost(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running API; default: start a private stack")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests of the throughput run")
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request (ignore_eos)")
    parser.add_argument("--ttft-requests", type=int, default=8, help="requests of the low-load TTFT run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for the stack to be ready")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    args = parser.parse_args(argv)
    if args.ttft_requests < 2:
        parser.error("--ttft-requests must be >= 2")
    settings = Settings()
    rng = random.Random(args.seed)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, rng)
    ttft_requests = random_requests(args.ttft_requests, args.input_len, TTFT_OUTPUT_LEN, 0.0, rng)
    # Distinct prompts: warming up on measured ones would turn their prefill into prefix-cache hits.
    warmup = random_requests(2, args.input_len, 4, 0.0, rng)

    if args.base_url:
        api = measure_api(args.base_url, requests, ttft_requests, warmup, args.timeout)
    else:
        with private_stack(settings, args.startup_timeout) as base_url:
            api = measure_api(base_url, requests, ttft_requests, warmup, args.timeout)
    engine = measure_engine(settings, requests, ttft_requests, warmup)
    verdict = compare(api, engine)
    table = markdown_table(api, engine, verdict)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        # The load average tells a reader whether other work shared the CPUs (CPU numbers are noise then).
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": sys.version,
                    "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
        "settings": {k: v for k, v in settings.model_dump(mode="json").items() if k not in ("api_keys", "redis_url")},
        "base_url": args.base_url or "private stack",
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "ttft_requests": args.ttft_requests, "ttft_output_len": TTFT_OUTPUT_LEN, "seed": args.seed},
        "api": api, "engine": engine, **verdict, "table": table,
    }, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if api["throughput_run"]["num_failed"] + api["low_load_run"]["num_failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["load"]:
        return run_bench_serve(argv[1:])
    return run_queue_cost(argv)


if __name__ == "__main__":
    raise SystemExit(main())
