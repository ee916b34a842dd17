"""What ``benchmarks/redis_capacity.py`` reports: one row per level, the ceiling per variant, the Markdown table.

Pure functions of what the simulated workers and the clients recorded and of Redis's counter deltas, so the
arithmetic is tested on known data (tests/benchmarks/test_redis_capacity.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.loadgen_report import percentile

# A level is sustained when the simulated workers kept this share of their step rate (and publish p99 held).
SUSTAINED_SHARE = 0.9


@dataclass(frozen=True)
class Ramp:
    """The settings every level of a run shares."""

    step_ms: float
    workers: int
    p99_limit_ms: float
    sse_share: float


@dataclass
class Followed:
    """What the SSE clients of one level received."""

    jobs_done: int = 0
    tokens: int = 0
    bad_jobs: list[str] = field(default_factory=list)  # ended other than succeeded, or with a wrong token count
    lags: list[tuple[float, float]] = field(default_factory=list)  # (wall time read, lag ms)
    opens: list[tuple[float, float]] = field(default_factory=list)  # (wall time, ms from submit to SSE headers)
    jobs_polled: int = 0  # jobs not followed by SSE (--sse-share < 1): their end read from the record
    tokens_polled: int = 0


def summarize(variant: str, num_jobs: int, ramp: Ramp, window: tuple[float, float], samples: dict[str, Any],
              seen: Followed, redis: dict[str, float], cpu: dict[str, float], load_average_1m: float
              ) -> dict[str, Any]:
    """One level's row: rates and latencies inside ``window`` (wall times), Redis's and each process's counter
    deltas over it per generated token, and the level's totals (every token published and received). ``redis``
    holds the counters summed over every master and each master's own CPU seconds as ``cpu_s:<i>``."""
    t0, t1 = window
    span = t1 - t0
    calls = [(lat, jobs) for wall, lat, jobs in samples["publishes"] if t0 <= wall < t1]
    tokens = sum(jobs for _, jobs in calls)
    lags = [lag for wall, lag in seen.lags if t0 <= wall < t1]
    opens = [ms for wall, ms in seen.opens if t0 <= wall < t1]
    jobs_done = sum(1 for wall in samples["completions"] if t0 <= wall < t1)
    per_token = 1 / tokens if tokens else 0.0
    commands = {name[6:]: redis[name] * per_token for name in redis if name.startswith("calls:") and redis[name]}
    offered = num_jobs * 1000 / ramp.step_ms
    row: dict[str, Any] = {
        "variant": variant, "jobs": num_jobs, "offered_tokens_per_s": offered,
        "tokens_per_s": tokens / span, "jobs_per_s": jobs_done / span, "publish_calls_per_s": len(calls) / span,
        "publish_p50_ms": 1000 * percentile([lat for lat, _ in calls], 50) if calls else None,
        "publish_p99_ms": 1000 * percentile([lat for lat, _ in calls], 99) if calls else None,
        "sse_lag_p50_ms": percentile(lags, 50) if lags else None,
        "sse_lag_p99_ms": percentile(lags, 99) if lags else None,
        "stream_open_p50_ms": percentile(opens, 50) if opens else None,
        "stream_open_p99_ms": percentile(opens, 99) if opens else None,
        "redis_cpu_us_per_token": 1e6 * redis["cpu_s"] * per_token,
        "redis_cpu_share": redis["cpu_s"] / span,
        "redis_cpu_share_per_master": [redis[f"cpu_s:{i}"] / span for i in range(_num_masters(redis))],
        "redis_commands_per_token": redis["commands"] * per_token,
        "redis_bytes_in_per_token": redis["net_in_bytes"] * per_token,
        "redis_bytes_out_per_token": redis["net_out_bytes"] * per_token,
        "redis_calls_per_token": dict(sorted(commands.items(), key=lambda kv: -kv[1])),
        "redis_evalsha_us_per_token": redis.get("usec:evalsha", 0.0) * per_token,
        "process_cpu_share": {k: v / span for k, v in cpu.items()}, "load_average_1m": load_average_1m,
        "process_cpu_us_per_token": {k: 1e6 * v * per_token for k, v in cpu.items()},
        "tokens_published": samples["tokens_accepted"], "tokens_received": seen.tokens,
        "jobs_followed": seen.jobs_done, "jobs_polled": seen.jobs_polled, "tokens_polled": seen.tokens_polled,
        "sse_share": ramp.sse_share, "bad_jobs": seen.bad_jobs[:10], "num_bad_jobs": len(seen.bad_jobs),
        "stale_publishes": samples["stale_publishes"], "queue_code": samples["queue_code"],
    }
    # Sustained: publish p99 within the limit, and the simulated workers kept their step rate (a closed loop
    # never holds every job at every step: each job's end and the next submission leave its slot idle a while).
    row["step_rate_share"] = row["publish_calls_per_s"] / (ramp.workers * 1000 / ramp.step_ms)
    row["sustained"] = bool(row["publish_p99_ms"] is not None and row["publish_p99_ms"] <= ramp.p99_limit_ms
                            and row["step_rate_share"] >= SUSTAINED_SHARE)
    return row


def _num_masters(redis: dict[str, float]) -> int:
    return sum(1 for name in redis if name.startswith("cpu_s:"))


def ceilings(rows: Sequence[dict[str, Any]], variants: Sequence[str]) -> dict[str, dict[str, Any] | None]:
    """Per variant, its highest sustained level (None when no level was sustained)."""
    best: dict[str, dict[str, Any] | None] = {}
    for variant in variants:
        sustained = [r for r in rows if r["variant"] == variant and r["sustained"]]
        best[variant] = max(sustained, key=lambda r: r["tokens_per_s"]) if sustained else None
    return best


def publish_only_row(variant: str, run: dict[str, Any], load_average_1m: float) -> dict[str, Any]:
    """A ``--publish-only`` level: what ``simulated_workers.publish_only`` measured, per token."""
    tokens = run["tokens"]
    return {"variant": variant, "jobs": run["jobs"], "tokens": tokens, "tokens_per_s": tokens / run["wall_s"],
            "publish_p50_ms": 1000 * percentile(run["latencies_s"], 50),
            "publish_p99_ms": 1000 * percentile(run["latencies_s"], 99),
            "redis_cpu_us_per_token": 1e6 * run["redis_cpu_s"] / tokens,
            "redis_commands_per_token": run["redis_commands"] / tokens,
            "redis_bytes_in_per_token": run["redis_net_in_bytes"] / tokens,
            "load_average_1m": load_average_1m, "queue_code": run["queue_code"]}


def publish_only_line(row: dict[str, Any]) -> str:
    """One ``--publish-only`` level on one line."""
    return (f"{row['variant']:>8} {row['jobs']:5d} jobs per step: {row['tokens_per_s']:8.0f} tok/s from one client, "
            f"publish p50 / p99 {row['publish_p50_ms']:.1f} / {row['publish_p99_ms']:.1f} ms, Redis "
            f"{row['redis_cpu_us_per_token']:5.1f} us/token, {row['redis_commands_per_token']:.2f} cmds/token, "
            f"{row['redis_bytes_in_per_token']:.0f} bytes in/token, load {row['load_average_1m']:.1f}")


def line(row: dict[str, Any]) -> str:
    """One level on one line, as the run prints it."""
    shares = row["redis_cpu_share_per_master"]
    masters = "; per master " + " / ".join(f"{100 * x:.0f}%" for x in shares) if len(shares) > 1 else ""
    return (f"{row['variant']:>8} {row['jobs']:5d} jobs: {row['tokens_per_s']:8.0f} tok/s (offered "
            f"{row['offered_tokens_per_s']:.0f}), {row['jobs_per_s']:6.1f} jobs/s, publish p99 "
            f"{row['publish_p99_ms'] or 0:6.1f} ms, SSE lag p99 {row['sse_lag_p99_ms'] or 0:6.1f} ms, Redis "
            f"{row['redis_cpu_us_per_token']:5.1f} us/token ({100 * row['redis_cpu_share']:.0f}% of a core{masters}), "
            f"{row['redis_commands_per_token']:.1f} cmds/token, {row['num_bad_jobs']} bad jobs, "
            f"load {row['load_average_1m']:.1f}")


def _backend(result: dict[str, Any]) -> str:
    masters = result.get("cluster_masters", 0)
    return f"a local Redis Cluster of {masters} masters (no replicas)" if masters else "one Redis node"


def write_markdown(result: dict[str, Any], path: Path) -> None:
    """The run as Markdown: the machine and settings, one table row per level, the ceiling per variant."""
    if result["publish_only_steps"]:
        path.write_text("\n".join([
            f"CPU: **{result['cpu']}**; {result['date']}; load average {result['load_average_start']:.1f} at the "
            f"start, {result['load_average_end']:.1f} at the end; the publish path alone: "
            f"{result['publish_only_steps']} back-to-back steps of one token per job, no API, no subscribers; "
            f"Redis {'without' if result['no_aof'] else 'with'} AOF.", "",
            "| variant | jobs per step | tok/s (one client) | publish p50 / p99 ms | Redis us/token | cmds/token "
            "| bytes in per token | load |", "|---|---:|---:|---:|---:|---:|---:|---:|",
            *(f"| {r['variant']} | {r['jobs']} | {r['tokens_per_s']:.0f} | {r['publish_p50_ms']:.1f} / "
              f"{r['publish_p99_ms']:.1f} | {r['redis_cpu_us_per_token']:.1f} | {r['redis_commands_per_token']:.2f} "
              f"| {r['redis_bytes_in_per_token']:.0f} | {r['load_average_1m']:.1f} |" for r in result["rows"])]) + "\n")
        return
    lines = [f"CPU: **{result['cpu']}**; {result['date']}; load average {result['load_average_start']:.1f} at the "
             f"start, {result['load_average_end']:.1f} at the end; step {result['step_ms']:g} ms (one token per job "
             f"per step), {result['workers']} simulated workers, {result['output_len']} tokens per job, "
             f"{result['level_s']:g} s per level; {100 * result['sse_share']:.0f}% of the jobs followed by SSE "
             f"(the others polled); {_backend(result)}, {'without' if result['no_aof'] else 'with'} AOF; "
             f"{result.get('queue_shards', 1)} queue shard(s).", "",
             "| variant | jobs | offered tok/s | tok/s | jobs/s | publish p50 / p99 ms | SSE lag p50 / p99 ms "
             "| Redis us/token | Redis core | core per master | cmds/token | bytes in / out per token | EVALSHA/token "
             "| worker CPU us/token | API core | step rate kept | bad jobs | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['variant']} | {r['jobs']} | {r['offered_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} "
            f"| {r['jobs_per_s']:.1f} | {r['publish_p50_ms'] or 0:.1f} / {r['publish_p99_ms'] or 0:.1f} "
            f"| {r['sse_lag_p50_ms'] or 0:.0f} / {r['sse_lag_p99_ms'] or 0:.0f} | {r['redis_cpu_us_per_token']:.1f} "
            f"| {100 * r['redis_cpu_share']:.0f}% "
            f"| {' / '.join(f'{100 * share:.0f}%' for share in r['redis_cpu_share_per_master'])} "
            f"| {r['redis_commands_per_token']:.2f} "
            f"| {r['redis_bytes_in_per_token']:.0f} / {r['redis_bytes_out_per_token']:.0f} "
            f"| {r['redis_calls_per_token'].get('evalsha', 0):.3f} | {r['process_cpu_us_per_token']['workers']:.0f} "
            f"| {100 * r['process_cpu_share']['api']:.0f}% "
            f"| {100 * r['step_rate_share']:.0f}%{'' if r['sustained'] else ' (not sustained)'} "
            f"| {r['num_bad_jobs']} | {r['load_average_1m']:.1f} |")
    lines.append("")
    for variant, row in result["ceilings"].items():
        lines.append(f"- **{variant}**: " + (
            f"sustained {row['tokens_per_s']:.0f} tokens/s, {row['jobs_per_s']:.1f} jobs/s ({row['jobs']} jobs) "
            f"with publish p99 {row['publish_p99_ms']:.1f} ms; one Redis core at this cost would carry "
            f"~{1e6 / row['redis_cpu_us_per_token']:.0f} tokens/s" if row else "no level sustained"))
    if result.get("cluster_masters"):
        lines.append(f"- Redis counters are summed over the {result['cluster_masters']} masters; 'core per master' is "
                     "each master's own CPU time over the window (the masters in slot order).")
    path.write_text("\n".join(lines) + "\n")
