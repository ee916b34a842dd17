"""Advancing active batches, from any API replica: each round takes a batch's lease (a Redis lock), then

1. stops it when its completion window has ended (``batch_expired``) or it was cancelled: queued jobs are
   cancelled at once, running ones told to abort, and lines never submitted end with the stop code;
2. otherwise submits its next lines as ordinary jobs (at most ``batch_max_queued`` of the batch at once);
3. records the result of every line whose job is terminal (once per line: ``batch_result.lua``);
4. when every line has a result, writes the output and error files and ends the batch.

Every step reads its state from Redis and is safe to repeat: a line's job id is fixed by the line, so a line
submitted twice (a runner died between submitting and moving its cursor) finds its job instead of a second
one; a line's result is written once. Killing workers or restarting every API loses no line and completes none
twice. A job whose record has vanished (a Redis restart without its data) is submitted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import LockError

from api.batches.models import OutputLine
from api.batches.output import job_output, stopped_output
from api.batches.store import BatchState, BatchStore
from api.batches.validation import line_job_id
from api.files import FileStore
from api.metrics import ApiMetrics
from shared import keys
from shared.config import Settings
from shared.pubsub import as_text
from shared.queue import JobQueue, QueueFullError, record_from_fields
from shared.schemas import JobStatus, JobSubmission

log = logging.getLogger(__name__)

LEASE_S = 30.0  # a replica that stops mid-round loses the batch to another after this long
BatchFinished = Callable[[BatchState], Awaitable[object]]


class BatchRunner:
    """Advances every active batch; run ``run_forever`` in each API replica (they share the work by lease)."""

    def __init__(self, queue: JobQueue, store: BatchStore, files: FileStore, settings: Settings,
                 metrics: ApiMetrics | None = None, on_finished: BatchFinished | None = None) -> None:
        self._queue = queue
        self._redis = queue.redis
        self._store = store
        self._files = files
        self._settings = settings
        self._metrics = metrics
        self._on_finished = on_finished

    async def run_forever(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:
                log.warning("advancing batches failed; retrying in %.1f s", self._settings.batch_poll_s,
                            exc_info=True)
            await asyncio.sleep(self._settings.batch_poll_s)

    async def run_once(self) -> None:
        for batch_id in await self._store.active_ids():
            lock = self._redis.lock(keys.batch_lease(batch_id), timeout=LEASE_S, blocking=False)
            if not await lock.acquire():
                continue  # another replica holds it this round
            try:
                await self.advance(batch_id)
            except Exception:  # one broken batch must not stall the others: it is retried next round
                log.warning("batch %s: advancing failed; retrying next round", batch_id, exc_info=True)
            finally:
                try:
                    await lock.release()
                except LockError:
                    log.warning("batch %s: lease expired during a round", batch_id)

    async def advance(self, batch_id: str) -> None:
        """One round over one batch (the caller holds its lease)."""
        state = await self._store.state(batch_id)
        if state is None or state.batch.status not in ("in_progress", "cancelling", "finalizing"):
            await self._store.forget(batch_id)
            return
        now = int(time.time())
        expires_at = state.batch.expires_at
        if state.stop is None and expires_at is not None and now >= expires_at:
            await self._store.stop(batch_id, "batch_expired")
            state = await self._require(batch_id)
        if state.stop is not None:
            await self._stop_lines(state)
        else:
            await self._submit_lines(state)
        await self._collect(await self._require(batch_id))
        state = await self._require(batch_id)
        done = state.batch.request_counts
        if done.completed + done.failed >= state.total:
            await self._finalize(state)

    async def _require(self, batch_id: str) -> BatchState:
        state = await self._store.state(batch_id)
        assert state is not None, f"batch {batch_id} vanished during its round"
        return state

    async def _submit_lines(self, state: BatchState) -> None:
        done = state.batch.request_counts
        room = self._settings.batch_max_queued - (state.submitted - done.completed - done.failed)
        end = min(state.total, state.submitted + max(0, room))
        submitted = state.submitted
        try:
            for line in await self._store.lines(state.batch.id, state.submitted, end):
                await self._submit(line.submission)
                submitted += 1
        except QueueFullError:
            log.info("batch %s: queue full; %d lines wait for the next round", state.batch.id, end - submitted)
        finally:
            if submitted != state.submitted:
                await self._store.set_submitted(state.batch.id, submitted)

    async def _submit(self, submission: JobSubmission) -> None:
        """Enqueue a line's job (QueueFullError when its queue is full). A job with the line's id already there is
        the line's job (submitted before a crash) and counts as submitted."""
        try:
            _, created = await self._queue.submit(submission)
        except ValueError:
            return  # the id exists: this line's job
        if created and self._metrics is not None:
            self._metrics.job_submitted(submission.model, "batch")

    async def _stop_lines(self, state: BatchState) -> None:
        """Cancel the batch's unfinished jobs and end its never-submitted lines with the stop code."""
        assert state.stop is not None
        recorded = await self._store.result_indices(state.batch.id)
        for index in range(state.submitted):
            if index not in recorded:
                await self._queue.cancel(line_job_id(self._queue, state.batch.id, state.owner, index))
        for index in range(state.submitted, state.total):
            if index not in recorded:
                line = await self._store.line(state.batch.id, index)
                output = stopped_output(line, state.stop)
                await self._store.record(state.batch.id, index, "failed", output.model_dump_json())

    async def _collect(self, state: BatchState) -> None:
        """Record the result of every submitted line whose job is terminal."""
        recorded = await self._store.result_indices(state.batch.id)
        pending = [i for i in range(state.submitted) if i not in recorded]
        if not pending:
            return
        job_ids = [line_job_id(self._queue, state.batch.id, state.owner, i) for i in pending]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self._queue.keyspace.job(job_id), "status")
            statuses = await pipe.execute()
        for index, job_id, raw in zip(pending, job_ids, statuses, strict=True):
            if raw is None:
                await self._lost(state, index)
            elif JobStatus(as_text(raw)).is_terminal:
                raw_fields = await self._redis.hgetall(self._queue.keyspace.job(job_id))
                job = record_from_fields({as_text(k): as_text(v) for k, v in raw_fields.items()})
                line = await self._store.line(state.batch.id, index)
                outcome, output = job_output(line, state.batch.endpoint, job, state.stop)
                await self._store.record(state.batch.id, index, outcome, output.model_dump_json())

    async def _lost(self, state: BatchState, index: int) -> None:
        """A submitted line whose job record is gone (Redis lost it): run it again, or end it when stopping."""
        line = await self._store.line(state.batch.id, index)
        if state.stop is not None:
            await self._store.record(state.batch.id, index, "failed",
                                     stopped_output(line, state.stop).model_dump_json())
            return
        log.warning("batch %s: the job of line %d is gone; submitting it again", state.batch.id, index)
        with contextlib.suppress(QueueFullError):  # full: the next round tries again
            await self._submit(line.submission)

    async def _finalize(self, state: BatchState) -> None:
        """Write the output file (lines with a 200 response) and the error file (the others), in input order,
        and end the batch: completed, cancelled or expired."""
        batch_id = state.batch.id
        now = int(time.time())
        if state.stop is None and state.batch.status != "finalizing":
            await self._store.set_status(batch_id, "finalizing", "finalizing_at", now)
        results = await self._store.results(batch_id)
        if len(results) < state.total:
            return  # a stale round after the batch finished (its results are gone)
        ok = [line for _, line in results if _succeeded(line)]
        errors = [line for _, line in results if not _succeeded(line)]
        suffix = batch_id.removeprefix("batch_")
        output_id = await self._write(state, f"file-{suffix}-output", "output", ok)
        error_id = await self._write(state, f"file-{suffix}-errors", "errors", errors)
        status, field = {"batch_cancelled": ("cancelled", "cancelled_at"),
                         "batch_expired": ("expired", "expired_at")}.get(state.stop or "", ("completed",
                                                                                           "completed_at"))
        await self._store.finish(batch_id, status, field, now, output_id, error_id)
        log.info("batch %s %s: %d completed, %d failed", batch_id, status, state.batch.request_counts.completed,
                 state.batch.request_counts.failed)
        if self._on_finished is not None:
            final = await self._store.state(batch_id)
            if final is not None:
                await self._on_finished(final)

    async def _write(self, state: BatchState, file_id: str, kind: str, lines: list[str]) -> str | None:
        if not lines:
            return None
        content = "".join(f"{line}\n" for line in lines).encode()
        await self._files.create(state.owner, f"{state.batch.id}_{kind}.jsonl", "batch_output", content,
                                 file_id=file_id)
        return file_id


def _succeeded(line_json: str) -> bool:
    """Whether an output line holds a 200 response (it goes to the output file, the others to the error file)."""
    response = OutputLine.model_validate_json(line_json).response
    return response is not None and response.status_code == 200
