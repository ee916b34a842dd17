"""What each outbox write does in Redis, with its metrics and lifecycle log line; lost leases come back as data.

A publish the queue refuses (stale fence) means another holder has the job: its ``(job id, fence)`` goes into
``lost`` for the step loop to drop the job (``take_lost``), and a result queued behind it is not written.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import OutOfMemoryError, ResponseError

from shared.lifecycle_log import RECOVERIES, LifecycleEvent, text_fields
from shared.schemas import TokenEvent
from worker.context import WorkerContext
from worker.jobs import ActiveJob
from worker.outbox import Finish, Publish, Release, Write

log = logging.getLogger(__name__)

FINISHED_METRIC = {"finished": "completed", "cancelled": "cancelled", "expired": "expired"}


class JobWriter:
    """Writes a worker's jobs to the queue (``write`` is called by the outbox's one task, in order)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._lost: set[tuple[str, int]] = set()  # (job id, fence) of attempts whose lease was lost

    def take_lost(self) -> set[tuple[str, int]]:
        """Attempts found lost since the last call (their publishes were refused)."""
        lost, self._lost = self._lost, set()
        return lost

    async def write(self, write: Write) -> None:
        if isinstance(write, Publish):
            await self._publish(write.batches)
        elif isinstance(write, Finish):
            await self._finish(write.job)
        else:
            await self._release(write)

    async def _publish(self, batches: list[tuple[ActiveJob, list[TokenEvent]]]) -> None:
        accepted = await self._ctx.redis(self._ctx.queue.publish_many,
                                     [(job.job_id, job.claim.fence, events) for job, events in batches])
        now = time.time()
        for (job, _), ok in zip(batches, accepted, strict=True):
            if not ok:
                self._lost.add((job.job_id, job.claim.fence))
            elif not job.first_token_published and any(c.token_ids for c in job.choices):
                job.first_token_published = True
                self._ctx.metrics.on_first_token(job.claim.submission.created_at, now)
                log.info("job %s first token", job.job_id, extra=self._fields("first_token", job))

    async def _finish(self, job: ActiveJob) -> None:
        if (job.job_id, job.claim.fence) in self._lost:
            log.warning("job %s dropped: lease lost", job.job_id, extra=self._fields("lease_lost", job))
        elif job.error is not None:
            if await self._ctx.redis(self._ctx.queue.fail, job.job_id, job.claim.fence, job.error):
                self._ctx.metrics.on_job_event("failed")
                log.warning("job %s failed: %s", job.job_id, job.error, extra=self._fields("failed", job))
            else:
                log.warning("job %s result rejected: lease lost", job.job_id, extra=self._fields("lease_lost", job))
        else:
            await self._complete(job)

    async def _complete(self, job: ActiveJob) -> None:
        result = job.result()
        try:
            ok = await self._ctx.redis(self._ctx.queue.complete, job.job_id, job.claim.fence, result)
        except ResponseError as e:  # the script refused this job's record (written by hand?): fail it, keep serving
            if isinstance(e, OutOfMemoryError):
                raise
            job.error = f"the queue refused the job's result: {e}"
            await self._finish(job)  # the fail path, which logs it
            return
        if not ok:
            log.warning("job %s result rejected: lease lost (stale fence)", job.job_id,
                        extra=self._fields("lease_lost", job))
            return
        reasons = {c.finish_reason for c in result.choices}
        event: LifecycleEvent = ("cancelled" if "abort" in reasons else "expired" if "timeout" in reasons
                                 else "finished")
        self._ctx.metrics.on_job_finished(FINISHED_METRIC[event], job.claim.submission.created_at, time.time())
        for choice in job.choices:
            self._ctx.metrics.on_sequence_finished(len(choice.token_ids), choice.first_token_at, choice.last_token_at)
        log.info("job %s %s", job.job_id, event,
                 extra=self._fields(event, job, finish_reasons=[c.finish_reason for c in result.choices],
                                    prompt_tokens=result.usage.prompt_tokens,
                                    completion_tokens=result.usage.completion_tokens,
                                    **text_fields(self._ctx.settings.log_prompts,
                                                  output=[c.text for c in result.choices])))

    async def _release(self, release: Release) -> None:
        job = release.job
        give_up_s = release.give_up_s if release.give_up_s is not None else self._ctx.redis.give_up_s
        status = await self._ctx.redis.within(give_up_s, self._ctx.queue.release, job.job_id, job.claim.fence,
                                          release.crashed)
        if status is None:
            log.warning("job %s not released: lease lost", job.job_id, extra=self._fields("lease_lost", job))
            return
        self._ctx.metrics.on_requeue_status(status)
        log.info("job %s released by its worker: %s", job.job_id, status,
                 extra=self._fields(RECOVERIES[status].by_worker, job, crashed=release.crashed))

    def _fields(self, event: LifecycleEvent, job: ActiveJob, **fields: object) -> dict[str, object]:
        return self._ctx.fields(event, job.job_id, **fields)
