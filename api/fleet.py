"""The service as the API's ``/metrics`` shows it: queue depth per model and priority, the dead-letter set, and
each live worker's engine gauges from its heartbeat (names: docs/operations.md).

prometheus-client calls ``collect()`` synchronously inside the ``/metrics`` handler, on the event loop, so it must
never wait on Redis: it renders the latest ``FleetSnapshot``, which ``refresh_forever`` reads every few seconds.
A snapshot that could not be refreshed is dropped rather than shown stale, so the series go absent (and KEDA
falls back) instead of freezing at old values.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from shared.queue import JobQueue
from shared.schemas import WorkerInfo

if TYPE_CHECKING:
    from api.fleet_history import FleetHistory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetSnapshot:
    """One read of the shared state: ``queue_depths[model][priority]``, live workers, dead-letter set size."""

    queue_depths: dict[str, dict[int, int]]
    workers: tuple[WorkerInfo, ...]
    num_dead_letters: int

    @classmethod
    async def read(cls, queue: JobQueue, served_model: str) -> FleetSnapshot:
        """Queues of every model with a card, a live worker, or served by default (priority 0 shown even when
        empty, so a drained queue reads 0 rather than nothing)."""
        workers = tuple(await queue.live_workers())
        models = {served_model, *(w.model for w in workers), *await queue.model_names()}
        depths = {model: {0: 0, **await queue.queue_depth_by_priority(model)} for model in sorted(models)}
        return cls(depths, workers, await queue.num_dead_letters())


class FleetCollector(Collector):
    """Renders the latest snapshot; nothing at all before the first one or after a failed refresh."""

    def __init__(self) -> None:
        self._snapshot: FleetSnapshot | None = None

    def update(self, snapshot: FleetSnapshot | None) -> None:
        self._snapshot = snapshot  # one reference assignment: atomic for the scrape that reads it

    def describe(self) -> Iterable[GaugeMetricFamily]:
        """The names only, so the registry can refuse clashes without a snapshot."""
        return list(_families())

    def collect(self) -> Iterable[GaugeMetricFamily]:
        snapshot = self._snapshot
        if snapshot is None:
            return []
        depth, dead, live, running, waiting, kv = _families()
        for model, by_priority in snapshot.queue_depths.items():
            for priority, count in sorted(by_priority.items()):
                depth.add_metric([model, str(priority)], count)
        dead.add_metric([], snapshot.num_dead_letters)
        live_per_model: dict[str, int] = {}
        for w in snapshot.workers:
            live_per_model[w.model] = live_per_model.get(w.model, 0) + 1
            running.add_metric([w.id, w.model], w.num_running)
            waiting.add_metric([w.id, w.model], w.num_waiting)
            kv.add_metric([w.id, w.model], w.kv_cache_usage)
        for model in snapshot.queue_depths:
            live.add_metric([model], live_per_model.get(model, 0))
        return [depth, dead, live, running, waiting, kv]


def _families() -> Iterator[GaugeMetricFamily]:
    yield GaugeMetricFamily("tokenspool_queue_depth", "jobs queued, not yet claimed", labels=["model", "priority"])
    yield GaugeMetricFamily("tokenspool_dead_letter_jobs", "jobs in the dead-letter set (kept 7 days)", labels=[])
    yield GaugeMetricFamily("tokenspool_live_workers", "workers with a live heartbeat", labels=["model"])
    yield GaugeMetricFamily("tokenspool_worker_running_requests", "a worker's running sequences, from its heartbeat",
                            labels=["worker", "model"])
    yield GaugeMetricFamily("tokenspool_worker_waiting_requests", "a worker's waiting sequences, from its heartbeat",
                            labels=["worker", "model"])
    yield GaugeMetricFamily("tokenspool_worker_kv_cache_usage_ratio", "a worker's KV cache usage, from its heartbeat",
                            labels=["worker", "model"])


def refresh_interval_s(heartbeat_interval_s: float) -> float:
    """Worker data changes once per heartbeat; refreshing faster would only load Redis. Between 0.5 and 5 s."""
    return min(5.0, max(0.5, heartbeat_interval_s))


async def refresh_forever(collector: FleetCollector, queue: JobQueue, served_model: str, interval_s: float,
                          history: FleetHistory | None = None) -> None:
    """Refresh ``collector`` (and ``history``, the console's charts) now and then every ``interval_s``; a failed
    read clears the collector until the next success."""
    while True:
        try:
            snapshot = await FleetSnapshot.read(queue, served_model)
            collector.update(snapshot)
            if history is not None:
                history.add(snapshot)
        except (RedisError, OSError, ValueError) as exc:  # ValueError: a malformed heartbeat
            collector.update(None)
            log.warning("reading queue and worker state for /metrics failed: %s; retrying in %.1f s", exc,
                        interval_s)
        await asyncio.sleep(interval_s)
