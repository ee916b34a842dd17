"""The fleet over the last minutes, for the console's charts: queue depth, running sequences, throughput and
latency, one point per refresh of the fleet snapshot (``api.fleet.refresh_forever``).

Throughput and latency come from the cumulative counts each worker sends with its heartbeat (``WorkerTotals``):
a worker's rate is the change between its last two heartbeats, timed by its own clock, so a refresh that sees
the same heartbeat twice repeats the rate instead of reading zero. The history lives in the API process (each
replica keeps its own) and starts empty when the process starts.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel

from api.fleet import FleetSnapshot
from shared.schemas import WorkerInfo, WorkerTotals

HISTORY_WINDOW_S = 600.0  # ten minutes of points


class FleetPoint(BaseModel):
    """The fleet at one moment: latency means are over the workers' last heartbeat intervals (None: no job
    produced a first token, or finished, in them)."""

    at: float
    num_queued: int
    num_running: int
    tokens_per_s: float
    jobs_per_s: float
    mean_ttft_s: float | None
    mean_e2e_s: float | None


@dataclass(frozen=True)
class WorkerRate:
    """One worker's change between its last two heartbeats."""

    heartbeat_at: float
    totals: WorkerTotals
    tokens_per_s: float = 0.0
    jobs_per_s: float = 0.0
    ttft_sum_s: float = 0.0
    num_first_tokens: int = 0
    e2e_sum_s: float = 0.0
    num_finished_jobs: int = 0


def next_rate(previous: WorkerRate | None, info: WorkerInfo) -> WorkerRate | None:
    """The worker's rate after heartbeat ``info``: unchanged when the heartbeat is the one already seen, zero
    at the first sighting (or after its counters went back: a restarted process under the same id)."""
    if info.totals is None:
        return None
    if previous is not None and info.heartbeat_at == previous.heartbeat_at:
        return previous
    new = info.totals
    if previous is None or info.heartbeat_at < previous.heartbeat_at or new.num_generated_tokens < \
            previous.totals.num_generated_tokens or new.num_finished_jobs < previous.totals.num_finished_jobs:
        return WorkerRate(info.heartbeat_at, new)
    old = previous.totals
    dt = info.heartbeat_at - previous.heartbeat_at
    return WorkerRate(info.heartbeat_at, new,
                      tokens_per_s=(new.num_generated_tokens - old.num_generated_tokens) / dt,
                      jobs_per_s=(new.num_finished_jobs - old.num_finished_jobs) / dt,
                      ttft_sum_s=max(0.0, new.ttft_sum_s - old.ttft_sum_s),
                      num_first_tokens=max(0, new.num_first_tokens - old.num_first_tokens),
                      e2e_sum_s=max(0.0, new.e2e_sum_s - old.e2e_sum_s),
                      num_finished_jobs=new.num_finished_jobs - old.num_finished_jobs)


def _mean(total: float, count: int) -> float | None:
    return total / count if count else None


class FleetHistory:
    """The points of the last ``window_s`` seconds (at one per ``interval_s``) and each live worker's rate."""

    def __init__(self, interval_s: float, window_s: float = HISTORY_WINDOW_S) -> None:
        self._points: deque[FleetPoint] = deque(maxlen=max(2, math.ceil(window_s / interval_s)))
        self._rates: dict[str, WorkerRate] = {}

    def add(self, snapshot: FleetSnapshot, at: float | None = None) -> FleetPoint:
        """Record ``snapshot``; workers absent from it are forgotten."""
        rates = {w.id: rate for w in snapshot.workers
                 if (rate := next_rate(self._rates.get(w.id), w)) is not None}
        self._rates = rates
        live = rates.values()
        point = FleetPoint(
            at=time.time() if at is None else at,
            num_queued=sum(sum(by_priority.values()) for by_priority in snapshot.queue_depths.values()),
            num_running=sum(w.num_running for w in snapshot.workers),
            tokens_per_s=sum(r.tokens_per_s for r in live),
            jobs_per_s=sum(r.jobs_per_s for r in live),
            mean_ttft_s=_mean(sum(r.ttft_sum_s for r in live), sum(r.num_first_tokens for r in live)),
            mean_e2e_s=_mean(sum(r.e2e_sum_s for r in live), sum(r.num_finished_jobs for r in live)),
        )
        self._points.append(point)
        return point

    def points(self) -> list[FleetPoint]:
        return list(self._points)

    def tokens_per_s(self, worker_id: str) -> float:
        """The worker's generation rate over its last heartbeat interval (0 when not known yet)."""
        rate = self._rates.get(worker_id)
        return rate.tokens_per_s if rate else 0.0
