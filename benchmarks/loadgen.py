"""``tokenspool bench serve``: a load generator against the HTTP API, in the manner of ``vllm bench serve``.

Requests (random word prompts, or a JSONL dataset) leave at the times of a Poisson process of
``--request-rate`` per second (``inf``: all at once), with at most ``--max-concurrency`` in flight, through
OpenAI streaming ``/v1/completions`` or the job API (``POST /v1/jobs``, then its SSE events). Every streamed
response is timed: time to first token, the gaps between chunks, end-to-end latency. ``benchmarks.loadgen_report``
turns the results into a table, JSON and a PNG. Pure asyncio + httpx (no torch), so it runs on any client.
Everything is bounded: ``--num-prompts`` requests, each cut off after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.loadgen_report import RequestResult, format_table, result_json, summarize, write_json, write_plot

Endpoint = Literal["completions", "jobs"]

# Common English words that SmolLM2's tokenizer encodes as one token each (with their leading space), so a
# prompt of N random words is about N tokens.
_WORDS = """
the of and to in is was for on that with as by at from his her they be this have are not but had all one were
we when there can an which their said if do will each about how up out them then she many some so these would
other into has more two like him see time could no make than first been its who now people my made over did
down only way find use may water long little very after words called just where most know get through back
much go good new write our me man too any day same right look think also around another came come work three
word must because does part even place well such here take why help put different away again off went old
number great tell men say small every found still between name should home big give air line set own under
read last never us left end along while might next sound below saw something thought both few those always
show large often together asked house world going want school important until form food keep children feet
land side without boy once animal life enough took sometimes four head above kind began almost live page got
"""
PROMPT_WORDS = tuple(_WORDS.split())


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. ``num_prompt_tokens`` is an estimate (word count); the server's usage overrides it."""

    prompt: str
    max_tokens: int
    num_prompt_tokens: int


@dataclass(frozen=True)
class BenchConfig:
    """Where and how to send the requests."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: Endpoint = "completions"
    model: str | None = None
    api_key: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    timeout_s: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    rng: random.Random) -> list[BenchRequest]:
    """Prompts of random words; lengths uniform in ``[len * (1 - ratio), len * (1 + ratio)]``."""
    _check(num_prompts >= 1, "num_prompts", ">= 1", num_prompts)
    _check(input_len >= 1, "random_input_len", ">= 1", input_len)
    _check(output_len >= 1, "random_output_len", ">= 1", output_len)
    _check(0 <= range_ratio < 1, "random_range_ratio", "in [0, 1)", range_ratio)

    def length(n: int) -> int:
        return rng.randint(max(1, round(n * (1 - range_ratio))), max(1, round(n * (1 + range_ratio))))

    requests = []
    for _ in range(num_prompts):
        num_words = length(input_len)
        requests.append(BenchRequest(" ".join(rng.choices(PROMPT_WORDS, k=num_words)), length(output_len),
                                     num_words))
    return requests


def load_dataset(path: Path, num_prompts: int | None, default_max_tokens: int) -> list[BenchRequest]:
    """The first ``num_prompts`` requests (all when None) of a JSONL file of ``{"prompt", "max_tokens"}`` lines;
    a line without ``max_tokens`` gets ``default_max_tokens``. Blank lines are skipped."""
    _check(num_prompts is None or num_prompts >= 1, "num_prompts", ">= 1", num_prompts)
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, 1):
            if num_prompts is not None and len(requests) == num_prompts:
                break
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"dataset {path} line {lineno}: not JSON ({exc.msg})") from None
            prompt = item.get("prompt") if isinstance(item, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"dataset {path} line {lineno}: prompt must be a non-empty string")
            max_tokens = item.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"dataset {path} line {lineno}: max_tokens must be an integer >= 1, "
                                 f"got {max_tokens!r}")
            requests.append(BenchRequest(prompt, max_tokens, len(prompt.split())))
    if not requests or (num_prompts is not None and len(requests) < num_prompts):
        raise ValueError(f"num_prompts: dataset {path} holds {len(requests)} requests, asked for {num_prompts}")
    return requests


def arrival_offsets(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Send times in seconds after the start: a Poisson process (exponential gaps of mean ``1 / rate``)
    starting at 0, or all 0 for an infinite rate."""
    _check(request_rate > 0, "request_rate", "> 0 (or inf)", request_rate)
    if math.isinf(request_rate):
        return [0.0] * num_requests
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


async def iter_sse(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """``(event, data)`` of each server-sent event; comments (pings) and ``id:`` lines are skipped."""
    event: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            event = line[6:].strip()
    if data:
        yield event, "\n".join(data)


class RequestFailed(Exception):
    """The server answered, but not with a complete generation (an error status, event or chunk)."""


class _Recorder:
    """Collects one request's timings while its stream is read."""

    def __init__(self, request: BenchRequest, run_start: float) -> None:
        self.run_start = run_start
        self.sent = time.perf_counter()
        self.first_token: float | None = None
        self.chunk_times: list[float] = []
        self.num_chunk_tokens = 0
        self.usage: dict[str, Any] | None = None
        self.num_prompt_tokens = request.num_prompt_tokens
        self.job_id: str | None = None

    def chunk(self, num_tokens: int = 1) -> None:
        now = time.perf_counter()
        self.first_token = self.first_token or now
        self.chunk_times.append(now)
        self.num_chunk_tokens += num_tokens

    def restart(self) -> None:
        """The job restarted on another worker: its text so far is void (the first token stays what it was)."""
        self.chunk_times, self.num_chunk_tokens = [], 0

    def result(self, error: str | None) -> RequestResult:
        end = time.perf_counter()
        usage = self.usage or {}
        times = self.chunk_times
        return RequestResult(
            success=error is None, start_s=self.sent - self.run_start, e2e_s=end - self.sent,
            ttft_s=None if self.first_token is None else self.first_token - self.sent,
            itl_s=tuple(b - a for a, b in zip(times, times[1:], strict=False)),
            chunk_times_s=tuple(t - self.run_start for t in times),
            num_prompt_tokens=int(usage.get("prompt_tokens") or self.num_prompt_tokens),
            num_output_tokens=int(usage.get("completion_tokens") or self.num_chunk_tokens), error=error)


def _body(request: BenchRequest, config: BenchConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": request.prompt, "max_tokens": request.max_tokens,
                            "temperature": config.temperature, "ignore_eos": config.ignore_eos}
    if config.model:
        body["model"] = config.model
    return body


async def _raise_for_status(response: httpx.Response, expected: int) -> None:
    if response.status_code != expected:
        text = (await response.aread()).decode(errors="replace")[:200]
        raise RequestFailed(f"HTTP {response.status_code}: {text}")


async def _stream_completion(client: httpx.AsyncClient, request: BenchRequest, config: BenchConfig,
                             rec: _Recorder) -> None:
    body = {**_body(request, config), "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        await _raise_for_status(response, 200)
        async for _, data in iter_sse(response):
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RequestFailed(str(chunk["error"].get("message", chunk["error"])))
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                rec.chunk()
            if chunk.get("usage"):
                rec.usage = chunk["usage"]
    raise RequestFailed("the stream ended without [DONE]")


async def _stream_job(client: httpx.AsyncClient, request: BenchRequest, config: BenchConfig,
                      rec: _Recorder) -> None:
    response = await client.post("/v1/jobs", json=_body(request, config))
    await _raise_for_status(response, 202)
    rec.job_id = response.json()["id"]
    async with client.stream("GET", f"/v1/jobs/{rec.job_id}/events") as response:
        await _raise_for_status(response, 200)
        async for event, data in iter_sse(response):
            payload = json.loads(data)
            if event == "token":
                rec.chunk(len(payload.get("token_ids") or ()) or 1)
            elif event == "restart":
                rec.restart()
            elif event == "error":
                raise RequestFailed(str(payload.get("message", payload)))
            elif event == "done":
                rec.usage = payload.get("usage")
                if payload.get("status") != "succeeded":
                    raise RequestFailed(f"job {payload.get('status')}: {payload.get('error')}")
                return
    raise RequestFailed("the event stream ended without a done event")


async def send_request(client: httpx.AsyncClient, request: BenchRequest, config: BenchConfig,
                       run_start: float) -> RequestResult:
    """Send one request and time its stream; never raises for a failed request (the result says why)."""
    rec = _Recorder(request, run_start)
    stream = _stream_completion if config.endpoint == "completions" else _stream_job
    error: str | None = None
    try:
        async with asyncio.timeout(config.timeout_s):
            await stream(client, request, config, rec)
    except TimeoutError:
        error = f"timed out after {config.timeout_s:g} s"
    except (httpx.HTTPError, RequestFailed, ValueError, KeyError) as exc:  # JSONDecodeError is a ValueError
        error = f"{type(exc).__name__}: {exc}"
    result = rec.result(error)
    if error is not None and rec.job_id is not None:  # a job outlives its stream: don't leave it running
        with contextlib.suppress(httpx.HTTPError):
            await client.delete(f"/v1/jobs/{rec.job_id}", timeout=5.0)
    return result


class _Progress:
    """A status line on ``out``: rewritten in place on a terminal, a line every 5 s otherwise."""

    def __init__(self, total: int, out: TextIO | None) -> None:
        self.total, self.out = total, out
        self.num_done = self.num_failed = 0
        self.start = time.perf_counter()
        self.is_tty = out is not None and out.isatty()

    def record(self, result: RequestResult) -> None:
        self.num_done += 1
        self.num_failed += not result.success

    def show(self, final: bool = False) -> None:
        if self.out is None:
            return
        line = (f"bench serve: {self.num_done}/{self.total} done, {self.num_failed} errors, "
                f"{time.perf_counter() - self.start:.1f} s")
        self.out.write(f"\r{line}\033[K" + ("\n" if final else "") if self.is_tty else line + "\n")
        self.out.flush()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.25 if self.is_tty else 5.0)
            self.show()


async def run_benchmark(config: BenchConfig, requests: Sequence[BenchRequest],
                        progress: TextIO | None = None) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at the configured arrival rate and concurrency; returns the results in request
    order and the run's duration (first send to last answer, seconds)."""
    _check(config.max_concurrency is None or config.max_concurrency >= 1, "max_concurrency", ">= 1",
           config.max_concurrency)
    _check(config.timeout_s > 0, "timeout", "> 0", config.timeout_s)
    offsets = arrival_offsets(len(requests), config.request_rate, random.Random(f"arrivals-{config.seed}"))
    slots = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    tracker = _Progress(len(requests), progress)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # No connection cap (httpx's default of 100 would silently limit concurrency), and no proxies from the
    # environment: a proxy in the path would be measured too.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=config.max_concurrency or 256)
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, timeout=config.timeout_s,
                                 limits=limits, trust_env=False) as client:
        run_start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, run_start + offset - time.perf_counter()))
            async with slots:
                result = await send_request(client, request, config, run_start)
            tracker.record(result)
            return result

        ticker = asyncio.create_task(tracker.run())
        try:
            results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets, strict=True)))
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        duration_s = time.perf_counter() - run_start
    tracker.show(final=True)
    return list(results), duration_s


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tokenspool bench serve`` (named as ``vllm bench serve`` names them)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the API (default %(default)s)")
    parser.add_argument("--endpoint", choices=("completions", "jobs"), default="completions",
                        help="OpenAI streaming /v1/completions, or POST /v1/jobs + its SSE events")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    parser.add_argument("--model", default=None, help="model name to request (default: the server's)")
    parser.add_argument("--dataset", type=Path, default=None,
                        help='JSONL, one {"prompt": ..., "max_tokens": ...} per line (default: random prompts)')
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests to send (default: 100, or every line of --dataset)")
    parser.add_argument("--random-input-len", type=int, default=128, help="prompt words (~tokens)")
    parser.add_argument("--random-output-len", type=int, default=64,
                        help="max_tokens (also for dataset lines without one)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second; inf sends all at once (default)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly max_tokens (default on)")
    parser.add_argument("--seed", type=int, default=0, help="for prompts, lengths and arrivals")
    parser.add_argument("--result-json", type=Path, default=None, help="write the summary and per-request data")
    parser.add_argument("--plot", type=Path, default=None, help="write latency histograms and throughput (PNG)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                       request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                       timeout_s=args.timeout, temperature=args.temperature, ignore_eos=args.ignore_eos,
                       seed=args.seed)


def requests_from_args(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset is not None:
        return load_dataset(args.dataset, args.num_prompts, args.random_output_len)
    return random_requests(args.num_prompts or 100, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, random.Random(args.seed))


def run_bench_serve(argv: list[str] | None = None) -> int:
    """``tokenspool bench serve``: run the load, print the table, write JSON/PNG.

    Exit status: 0 when at least one request completed, 1 when none did, 2 for bad options or a bad dataset.
    """
    parser = argparse.ArgumentParser(prog="tokenspool bench serve", description=__doc__.split("\n\n")[0])
    add_bench_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        requests = requests_from_args(args)
        results, duration_s = asyncio.run(run_benchmark(config, requests, None if args.no_progress else sys.stderr))
    except (ValueError, OSError) as exc:
        print(f"tokenspool bench serve: {exc}", file=sys.stderr)
        return 2
    summary = summarize(results, duration_s)
    print(format_table(summary))
    if args.result_json is not None:
        described = asdict(config) | {"api_key": None, "num_prompts": len(requests),
                                      "dataset": None if args.dataset is None else str(args.dataset)}
        write_json(args.result_json, result_json(summary, results, described))
    if args.plot is not None:
        write_plot(args.plot, summary, results, title=f"{config.endpoint} @ {config.request_rate:g} req/s, "
                                                      f"concurrency {config.max_concurrency or 'unbounded'}")
    return 0 if summary.num_completed else 1


if __name__ == "__main__":
    raise SystemExit(run_bench_serve())
