"""The worker's background tasks beside the step loop: lease renewal, registration and reaping, cancellations and
wake-ups. They hand their findings to the step loop as data (``take_lost``, ``take_cancelled``, ``nudge``)."""

from __future__ import annotations

import asyncio
import logging
import time

from shared.schemas import ModelCard, WorkerInfo
from worker.context import WorkerContext
from worker.jobs import ActiveJob

log = logging.getLogger(__name__)


class Control:
    """Runs beside the step loop of one worker; ``active`` is the step loop's own map of running jobs."""

    def __init__(self, ctx: WorkerContext, card: ModelCard, active: dict[str, ActiveJob]) -> None:
        self._ctx = ctx
        self._card = card
        self._active = active
        self._started_at = time.time()
        self._lost: set[tuple[str, int]] = set()  # (job id, fence) of attempts whose lease renewal was refused
        self._cancelled: set[str] = set()
        self.nudge = asyncio.Event()  # set when a job may be waiting in the queue, or a stop was requested

    def start(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._lease_loop(), name="leases"),
                asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
                asyncio.create_task(self._cancel_loop(), name="cancellations"),
                asyncio.create_task(self._wake_loop(), name="wakeups")]

    def take_lost(self) -> set[tuple[str, int]]:
        lost, self._lost = self._lost, set()
        return lost

    def take_cancelled(self) -> set[str]:
        cancelled, self._cancelled = self._cancelled, set()
        return cancelled

    async def register(self) -> None:
        await self._ctx.redis(self._ctx.queue.register_worker, await self._info(), self._card)

    async def _lease_loop(self) -> None:
        """Renew the leases of running jobs every heartbeat. Never waits for the engine: a step longer than the
        lease (a long prefill on a busy machine) must not let a healthy worker's jobs be taken away."""
        while True:
            await asyncio.sleep(self._ctx.settings.heartbeat_interval_s)
            try:
                fences = {job_id: job.claim.fence for job_id, job in self._active.items()}
                lost_ids = await self._ctx.redis(self._ctx.queue.renew, self._ctx.worker_id, fences)
                self._lost.update((job_id, fences[job_id]) for job_id in lost_ids)
            except Exception:
                log.exception("lease renewal of worker %s failed", self._ctx.worker_id)

    async def _heartbeat_loop(self) -> None:
        """Refresh the worker's registration (with the engine's stats) and reap expired leases, every heartbeat."""
        while True:
            await asyncio.sleep(self._ctx.settings.heartbeat_interval_s)
            try:
                await self.register()
                for recovered in await self._ctx.redis(self._ctx.queue.reap):
                    self._ctx.metrics.on_requeue_status(recovered.status)
            except Exception:
                log.exception("heartbeat of worker %s failed", self._ctx.worker_id)

    async def _cancel_loop(self) -> None:
        async for job_id in self._ctx.queue.cancellations(self._ctx.worker_id):
            self._cancelled.add(job_id)

    async def _wake_loop(self) -> None:
        async for _ in self._ctx.queue.wakeups(self._ctx.settings.served_model_name):
            self.nudge.set()

    async def _info(self) -> WorkerInfo:
        stats = await self._ctx.engine_thread.call(self._ctx.engine.stats)
        self._ctx.metrics.on_engine_stats(stats)
        return WorkerInfo(id=self._ctx.worker_id, model=self._ctx.settings.served_model_name,
                          max_num_seqs=self._ctx.settings.max_num_seqs, num_running=stats.num_running,
                          num_waiting=stats.num_waiting, kv_cache_usage=stats.kv_cache_usage,
                          heartbeat_at=time.time(), started_at=self._started_at,
                          totals=self._ctx.metrics.totals())
