"""The job queue, the API's side (and any client's): submit, read, cancel and roll back jobs, stream their events,
and see the fleet (queue depths, live workers, model cards, dead letters)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from pydantic import ValidationError
from redis.exceptions import ResponseError

from shared import keys
from shared.job_stream import JobStreamReader, entry_event
from shared.pubsub import as_text
from shared.queue.base import (
    PRIORITY_STRIDE,
    QueueBase,
    QueueFullError,
    RateLimitedError,
    RateState,
    priority_of_score,
    record_from_fields,
    reply_fields,
)
from shared.schemas import (
    JobRecord,
    JobSubmission,
    ModelCard,
    StreamEvent,
    WorkerInfo,
)

REPLAY_PAGE = 256  # log entries per read (~40 KB of token events)
# The job hash fields a JobRecord is built from (everything but the submission, which may be megabytes).
RECORD_FIELDS = ("id", "model", "status", "priority", "attempts", "result", "error", "worker_id", "created_at",
                 "started_at", "first_token_at", "finished_at")


class ClientSide(QueueBase):
    """Client operations of the job protocol."""

    async def submit(self, job: JobSubmission) -> tuple[JobRecord, bool]:
        """Enqueue ``job`` (its id is given by the caller). Returns ``(record, created)``; an idempotency key
        already used by the same owner returns the existing job with ``created=False``.

        Raises QueueFullError when the model's queue is at ``max_queue_length``, ValueError for a taken id.
        """
        record, created, _ = await self.submit_with_rate(job)
        return record, created

    async def submit_with_rate(self, job: JobSubmission) -> tuple[JobRecord, bool, RateState | None]:
        """``submit``, also returning the tenant's rate budget after it (None when its key has no limits).

        The owner's policy (``Settings.api_key_policies``) gives the fair-share weight and the limits, enforced
        in the same script that enqueues. Raises RateLimitedError when a limit refuses the job.
        """
        model, tenant = job.model, keys.tenant_of(job.owner)
        policy = self._policies.of(job.owner)
        idem = keys.idempotency(job.owner, job.idempotency_key) if job.idempotency_key is not None else ""
        job_keys = [keys.job(job.id), keys.queue(model), keys.queue_seq(model), keys.CONFIG, idem,
                    keys.queue_tenant(model, tenant), keys.queue_tenants(model), keys.queue_deadlines(model),
                    keys.owner_jobs(job.owner)]
        args: list[str | int | float] = [job.model_dump_json(), policy.weight]
        if policy.has_limits:
            job_keys.append(keys.queue_rate(model, tenant))
            args.append(json.dumps({"rpm": policy.rpm, "tpm": policy.tpm, "jobs": policy.max_jobs}))
        try:
            reply = await self._configured(lambda: self._scripts.submit(keys=job_keys, args=args))
        except ResponseError as exc:
            raise ValueError(f"id: {exc}") from exc
        outcome = as_text(reply[0])
        if outcome == "full":
            retry_after = max(1, math.ceil(self._settings.heartbeat_interval_s))
            raise QueueFullError(job.model, int(reply[1]), retry_after)
        if outcome == "limited":
            retry_s = float(as_text(reply[2]))
            raise RateLimitedError(policy.name, as_text(reply[1]), retry_s if retry_s >= 0 else None,
                                   RateState.from_reply(reply[3]))
        rate = RateState.from_reply(reply[2]) if len(reply) > 2 else None
        return record_from_fields(reply_fields(reply[1])), outcome == "created", rate

    async def expire(self, model: str, limit: int = 100) -> int:
        """Finalise ``expired`` the queued jobs of ``model`` whose start-by time passed; how many. Claims do it
        too; the API's reaper calls this for models no worker claims from."""
        return int(await self._scripts.expire(keys=[keys.queue(model), keys.INFLIGHT, keys.queue_deadlines(model)],
                                              args=[self._ctx, limit]))

    async def _configured(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a script that reads ``ts:config``; when the config is missing (a Redis that lost its data since
        this process started), store it and run the script again."""
        try:
            return await call()
        except ResponseError as exc:
            if not str(exc).startswith(f"{keys.CONFIG} is missing"):
                raise
        await self.publish_config()
        return await call()

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record, or None when it does not exist (never did, or its result TTL ran out)."""
        raw = await self._redis.hgetall(keys.job(job_id))
        return record_from_fields({as_text(k): as_text(v) for k, v in raw.items()}) if raw else None

    async def get_submission(self, job_id: str) -> JobSubmission | None:
        """The job as submitted (owner, background flag, params), or None if missing or malformed."""
        raw = await self._redis.hget(keys.job(job_id), "submission")
        if raw is None:
            return None
        try:
            return JobSubmission.model_validate_json(raw)
        except ValidationError:
            return None

    async def get_owner(self, job_id: str) -> tuple[bool, str | None]:
        """``(exists, owner)`` of the job, read without its submission (which may hold megabytes of prompt), so
        checking access costs the same whatever another tenant's job holds. A record written before the
        ``owner`` field existed falls back to its submission."""
        status, owner = await self._redis.hmget(keys.job(job_id), ["status", "owner"])
        if status is None:
            return False, None
        if owner is None:
            submission = await self.get_submission(job_id)
            return submission is not None, submission.owner if submission else None
        return True, as_text(owner) or None

    async def recent_jobs(self, owner: str | None, limit: int) -> list[JobRecord]:
        """The newest ``limit`` jobs ``owner`` submitted (None: the jobs submitted without a key), newest first,
        read without their submissions; jobs whose record expired are skipped."""
        job_ids = [as_text(x) for x in await self._redis.zrevrange(keys.owner_jobs(owner), 0, limit - 1)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(keys.job(job_id), RECORD_FIELDS)
            rows = await pipe.execute() if job_ids else []
        return [record_from_fields({name: as_text(v) for name, v in zip(RECORD_FIELDS, row, strict=True)
                                    if v is not None})
                for row in rows if row[0] is not None]

    async def running_jobs(self) -> list[tuple[str, str | None, str | None]]:
        """``(job_id, worker_id, owner)`` of every running job (the in-flight set), for the fleet view."""
        job_ids = [as_text(x) for x in await self._redis.zrange(keys.INFLIGHT, 0, -1)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(keys.job(job_id), ["worker_id", "owner"])
            rows = await pipe.execute() if job_ids else []
        return [(job_id, as_text(worker) if worker else None, as_text(owner) if owner else None)
                for job_id, (worker, owner) in zip(job_ids, rows, strict=True)]

    async def cancel(self, job_id: str) -> JobRecord | None:
        """Cancel: a queued job is cancelled now; a running one is flagged and its worker told to abort it
        (its record turns ``cancelled`` when the worker finalises). Finished jobs are left as they are."""
        reply = await self._configured(lambda: self._scripts.cancel(keys=[keys.job(job_id), keys.INFLIGHT,
                                                                          keys.CONFIG], args=[job_id]))
        return record_from_fields(reply_fields(reply)) if reply else None

    async def rollback(self, job_ids: Sequence[str], error: str) -> int:
        """Undo jobs a refused batch created, in one step: each is cancelled (``error`` recorded on those still
        queued) and its idempotency key deleted, so a retry with the same keys submits them afresh rather than
        finding the cancelled jobs. Returns how many of the jobs existed."""
        if not job_ids:
            return 0
        reply = await self._scripts.rollback(keys=[keys.INFLIGHT, *(keys.job(i) for i in job_ids)],
                                             args=[self._ctx, error, *job_ids])
        return int(reply)

    async def queue_depth_by_priority(self, model: str) -> dict[int, int]:
        """Queued jobs of ``model`` per priority (only priorities with jobs).

        A skip scan over the score ranges, one round trip per priority present (plus one), instead of reading
        the whole queue: each priority owns the score range ``(-p * 2**32, (-p + 1) * 2**32)``.
        """
        key = keys.queue(model)
        depths: dict[int, int] = {}
        start: float | str = "-inf"
        while True:
            first = await self._redis.zrangebyscore(key, start, "+inf", start=0, num=1, withscores=True)
            if not first:
                return depths
            priority = priority_of_score(float(first[0][1]))
            low = -priority * PRIORITY_STRIDE
            depths[priority] = int(await self._redis.zcount(key, f"({low}", f"({low + PRIORITY_STRIDE}"))
            start = low + PRIORITY_STRIDE

    async def model_names(self) -> list[str]:
        """Names of the models any worker ever published a card for (cheap: the cards are not read)."""
        return sorted(as_text(x) for x in await self._redis.hkeys(keys.MODEL_CARDS))

    async def num_dead_letters(self) -> int:
        """How many jobs the dead-letter set holds (entries are pruned after 7 days)."""
        return int(await self._redis.zcard(keys.DEAD_LETTER))

    async def live_workers(self) -> list[WorkerInfo]:
        """Workers whose last heartbeat is within one lease TTL (by Redis time)."""
        seconds, micros = await self._redis.time()
        cutoff = seconds + micros / 1e6 - self._settings.lease_ttl_s
        ids = [as_text(x) for x in await self._redis.zrangebyscore(keys.WORKERS, cutoff, "+inf")]
        if not ids:
            return []
        infos = await self._redis.mget([keys.worker_info(i) for i in ids])
        return [WorkerInfo.model_validate_json(raw) for raw in infos if raw is not None]

    async def model_cards(self) -> list[ModelCard]:
        """Cards of the models that at least one live worker serves."""
        served = sorted({w.model for w in await self.live_workers()})
        cards = [await self.model_card(name) for name in served]
        return [c for c in cards if c is not None]

    async def model_card(self, name: str) -> ModelCard | None:
        """The last card published for ``name``, live worker or not (jobs may queue while workers restart)."""
        raw = await self._redis.hget(keys.MODEL_CARDS, name)
        return ModelCard.model_validate_json(raw) if raw is not None else None

    @asynccontextmanager
    async def open_stream(self, job_id: str, after_seq: int = 0) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Subscribe to the job's events now; iterate for replay (after ``after_seq``) then live events.

        Events come once each, in seq order, and the iteration ends after the DoneEvent (or an ErrorEvent when
        the job does not exist or expired). Subscribing happens on enter, before any replay, so an event
        published in between is seen live and dropped as a duplicate of the replay.
        """
        reader = JobStreamReader(self, job_id, after_seq)
        await reader.subscribe()
        try:
            yield reader.events()
        finally:
            await reader.close()

    async def replay_page(self, job_id: str, after_seq: int, count: int = REPLAY_PAGE
                          ) -> tuple[list[dict[str, Any]], bool]:
        """One page of the job's log: up to ``count`` entries with seq > ``after_seq``, as parsed JSON objects in
        order, and whether the page was full (more may follow). Stream readers page through a long log rather
        than load it whole, so a slow reader holds one page, not the log."""
        chunk = await self._redis.xrange(keys.job_log(job_id), min=f"({after_seq}-0", max="+", count=count) or []
        return [entry_event(fields) for _, fields in chunk if fields], len(chunk) >= count

    async def replay(self, job_id: str, after_seq: int) -> list[dict[str, Any]]:
        """The whole log after ``after_seq`` (read page by page), for tests and tools; readers use pages."""
        entries: list[dict[str, Any]] = []
        while True:
            page, more = await self.replay_page(job_id, after_seq)
            entries += page
            if not more or not page:
                return entries
            after_seq = int(page[-1]["seq"])
