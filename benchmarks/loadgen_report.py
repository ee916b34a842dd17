"""What ``tokenspool bench serve`` measured, summarized: percentiles, the result table, JSON and a PNG.

The load generator (``benchmarks.loadgen``) produces one :class:`RequestResult` per request; everything here is a
pure function of those results and the run's duration, so the statistics are tested on known data.
Latencies are reported in milliseconds, as ``vllm bench serve`` does. matplotlib is imported only by
:func:`write_plot` (and only its Agg canvas: no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it. Times are seconds; ``start_s`` and ``chunk_times_s`` are measured from
    the start of the run, the latencies from this request's send time."""

    success: bool
    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()  # gaps between consecutive streamed chunks
    chunk_times_s: tuple[float, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (tokens - 1)``; None below two tokens."""
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds; all None when nothing was measured."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True)
class BenchSummary:
    """The headline numbers of a run. Throughputs count completed requests only, over the whole run."""

    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    errors: dict[str, int] = field(default_factory=dict)  # message -> count, most frequent first


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between closest ranks as numpy's default does."""
    if not values:
        raise ValueError("values must not be empty")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe_ms(values_s: Sequence[float]) -> Distribution:
    """Mean, p50, p90 and p99 of ``values_s`` (seconds) in milliseconds."""
    if not values_s:
        return Distribution(0, None, None, None, None)
    ms = [v * 1000 for v in values_s]
    p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
    return Distribution(len(ms), sum(ms) / len(ms), p50, p90, p99)


def summarize(results: Sequence[RequestResult], duration_s: float) -> BenchSummary:
    """Throughputs and latency distributions of a run that took ``duration_s`` (first send to last answer)."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    errors = Counter(r.error or "unknown error" for r in results if not r.success)
    return BenchSummary(
        num_requests=len(results), num_completed=len(done), num_failed=len(results) - len(done),
        duration_s=duration_s, total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(done) * per_s, output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        ttft_ms=describe_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=describe_ms([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=describe_ms([gap for r in done for gap in r.itl_s]),
        e2e_ms=describe_ms([r.e2e_s for r in done]),
        errors=dict(errors.most_common()),
    )


def output_tokens_per_second(results: Sequence[RequestResult], duration_s: float,
                             bucket_s: float = 1.0) -> list[float]:
    """Output throughput over time: tokens per second in consecutive ``bucket_s`` buckets from the start.

    A request's tokens are spread evenly over its chunks (a chunk may hold several tokens, and the server's
    usage count is the truth), so the buckets add up to the run's total output tokens.
    """
    num_buckets = max(1, math.ceil(duration_s / bucket_s))
    buckets = [0.0] * num_buckets
    for r in results:
        if not r.success or not r.chunk_times_s:
            continue
        weight = r.num_output_tokens / len(r.chunk_times_s)
        for t in r.chunk_times_s:
            buckets[min(int(t / bucket_s), num_buckets - 1)] += weight
    return [b / bucket_s for b in buckets]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_table(summary: BenchSummary, title: str = "Serving Benchmark Result") -> str:
    """The end-of-run table: counts and throughputs, then mean/p50/p90/p99 of each latency."""
    width = 60
    rows = [
        ("Successful requests", str(summary.num_completed)),
        ("Failed requests", str(summary.num_failed)),
        ("Benchmark duration (s)", _fmt(summary.duration_s)),
        ("Total input tokens", str(summary.total_input_tokens)),
        ("Total generated tokens", str(summary.total_output_tokens)),
        ("Request throughput (req/s)", _fmt(summary.request_throughput)),
        ("Output token throughput (tok/s)", _fmt(summary.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(summary.total_token_throughput)),
    ]
    lines = [f" {title} ".center(width, "=")]
    lines += [f"{name + ':':<44}{value:>16}" for name, value in rows]
    lines.append("-" * width)
    lines.append(f"{'(ms)':<12}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for name, dist in (("TTFT", summary.ttft_ms), ("TPOT", summary.tpot_ms), ("ITL", summary.itl_ms),
                       ("E2E", summary.e2e_ms)):
        lines.append(f"{name:<12}" + "".join(f"{_fmt(v):>12}" for v in (dist.mean, dist.p50, dist.p90, dist.p99)))
    for message, count in list(summary.errors.items())[:5]:
        lines.append(f"error x{count}: {message}")
    lines.append("=" * width)
    return "\n".join(lines)


def result_json(summary: BenchSummary, results: Sequence[RequestResult], config: Mapping[str, Any],
                bucket_s: float = 1.0) -> dict[str, Any]:
    """Everything a later comparison needs: the configuration, the summary, throughput over time and each
    request's own measurements. Infinite numbers (``request_rate: inf``) are written as the string "inf"."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in config.items()},
        "summary": asdict(summary),
        "output_tokens_per_s": {"bucket_s": bucket_s,
                                "values": output_tokens_per_second(results, summary.duration_s, bucket_s)},
        "requests": [
            {"success": r.success, "start_s": r.start_s, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s,
             "num_prompt_tokens": r.num_prompt_tokens, "num_output_tokens": r.num_output_tokens,
             "itl_s": list(r.itl_s), "error": r.error}
            for r in results
        ],
    }


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")


def write_plot(path: Path, summary: BenchSummary, results: Sequence[RequestResult], title: str = "",
               bucket_s: float = 1.0) -> None:
    """A 2x2 PNG: TTFT, TPOT and E2E histograms (ms) and output tokens per second over the run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in results if r.success]
    histograms = [
        ("TTFT (ms)", [r.ttft_s * 1000 for r in done if r.ttft_s is not None], summary.ttft_ms),
        ("TPOT (ms)", [t * 1000 for r in done if (t := r.tpot_s) is not None], summary.tpot_ms),
        ("E2E latency (ms)", [r.e2e_s * 1000 for r in done], summary.e2e_ms),
    ]
    figure = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2).flatten()
    for ax, (label, values, dist) in zip(axes, histograms, strict=False):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
            for name, value, style in (("p50", dist.p50, "--"), ("p99", dist.p99, ":")):
                ax.axvline(value, color="tab:red", linestyle=style, label=f"{name} {value:.1f}")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    rates = output_tokens_per_second(results, summary.duration_s, bucket_s)
    axes[3].bar([i * bucket_s for i in range(len(rates))], rates, width=bucket_s, align="edge", color="tab:green")
    axes[3].set_xlabel("time since start (s)")
    axes[3].set_ylabel(f"output tokens/s ({bucket_s:g} s buckets)")
    figure.suptitle(title or f"{summary.num_completed}/{summary.num_requests} requests, "
                             f"{summary.output_throughput:.1f} output tok/s")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
