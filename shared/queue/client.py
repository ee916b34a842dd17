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
        ks, model, tenant = self.keyspace, job.model, keys.tenant_of(job.owner)
        policy = self._policies.of(job.owner)
        shard = ks.placement(job.id, job.owner, job.idempotency_key, policy.has_limits)
        if ks.shard_of(job.id) != shard:
            raise ValueError(f"id: job id {job.id} maps to queue shard {ks.shard_of(job.id)}, but this submission "
                             f"goes to shard {shard} (make its id with job_id_for)")
        # An absent optional key is the job's own key again (a cluster refuses '', which is in another slot).
        idem = (ks.idempotency(job.owner, job.idempotency_key, shard) if job.idempotency_key is not None
                else ks.job(job.id))
        job_keys = [ks.job(job.id), ks.queue(model, shard), ks.queue_seq(model, shard), ks.config(shard), idem,
                    ks.queue_tenant(model, tenant, shard), ks.queue_tenants(model, shard),
                    ks.queue_deadlines(model, shard), ks.owner_jobs(job.owner, shard)]
        args: list[str | int | float] = [job.model_dump_json(), policy.weight]
        if policy.has_limits:
            job_keys.append(ks.queue_rate(model, tenant, shard))
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

    def job_id_for(self, owner: str | None, idempotency_key: str | None = None, base: str | None = None) -> str:
        """An id for a new job of ``owner`` in the queue shard its submission goes to (``Keyspace.job_id_for``,
        with the owner's rate limits from this process's policies)."""
        return self.keyspace.job_id_for(owner, idempotency_key, self._policies.of(owner).has_limits, base)

    async def expire(self, model: str, limit: int = 100) -> int:
        """Finalise ``expired`` the queued jobs of ``model`` whose start-by time passed, in every shard; how many.
        Claims do it too; the API's reaper calls this for models no worker claims from."""
        ks, total = self.keyspace, 0
        for shard in ks.shards:
            total += int(await self._scripts.expire(
                keys=[ks.queue(model, shard), ks.inflight(shard), ks.queue_deadlines(model, shard)],
                args=[self._ctx[shard], limit]))
        return total

    async def _configured(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a script that reads ``ts:config``; when the config is missing (a Redis that lost its data since
        this process started), store it and run the script again."""
        try:
            return await call()
        except ResponseError as exc:
            if "is missing: start the tokenspool" not in str(exc):
                raise
        await self.publish_config()
        return await call()

    async def get(self, job_id: str) -> JobRecord | None:
        """The job's record, or None when it does not exist (never did, or its result TTL ran out)."""
        raw = await self._redis.hgetall(self.keyspace.job(job_id))
        return record_from_fields({as_text(k): as_text(v) for k, v in raw.items()}) if raw else None

    async def get_submission(self, job_id: str) -> JobSubmission | None:
        """The job as submitted (owner, background flag, params), or None if missing or malformed."""
        raw = await self._redis.hget(self.keyspace.job(job_id), "submission")
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
        status, owner = await self._redis.hmget(self.keyspace.job(job_id), ["status", "owner"])
        if status is None:
            return False, None
        if owner is None:
            submission = await self.get_submission(job_id)
            return submission is not None, submission.owner if submission else None
        return True, as_text(owner) or None

    async def recent_jobs(self, owner: str | None, limit: int) -> list[JobRecord]:
        """The newest ``limit`` jobs ``owner`` submitted (None: the jobs submitted without a key), newest first,
        read without their submissions; jobs whose record expired are skipped."""
        ks = self.keyspace
        async with self._redis.pipeline(transaction=False) as pipe:
            for shard in ks.shards:
                pipe.zrevrange(ks.owner_jobs(owner, shard), 0, limit - 1, withscores=True)
            per_shard = await pipe.execute()
        newest = sorted((entry for entries in per_shard for entry in entries), key=lambda e: -float(e[1]))[:limit]
        job_ids = [as_text(job_id) for job_id, _ in newest]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(ks.job(job_id), RECORD_FIELDS)
            rows = await pipe.execute() if job_ids else []
        return [record_from_fields({name: as_text(v) for name, v in zip(RECORD_FIELDS, row, strict=True)
                                    if v is not None})
                for row in rows if row[0] is not None]

    async def running_jobs(self) -> list[tuple[str, str | None, str | None]]:
        """``(job_id, worker_id, owner)`` of every running job (the in-flight set), for the fleet view."""
        ks = self.keyspace
        async with self._redis.pipeline(transaction=False) as pipe:
            for shard in ks.shards:
                pipe.zrange(ks.inflight(shard), 0, -1)
            job_ids = [as_text(x) for ids in await pipe.execute() for x in ids]
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(ks.job(job_id), ["worker_id", "owner"])
            rows = await pipe.execute() if job_ids else []
        return [(job_id, as_text(worker) if worker else None, as_text(owner) if owner else None)
                for job_id, (worker, owner) in zip(job_ids, rows, strict=True)]

    async def cancel(self, job_id: str) -> JobRecord | None:
        """Cancel: a queued job is cancelled now; a running one is flagged and its worker told to abort it
        (its record turns ``cancelled`` when the worker finalises). Finished jobs are left as they are."""
        ks = self.keyspace
        shard = ks.shard_of(job_id)
        reply = await self._configured(lambda: self._scripts.cancel(
            keys=[ks.job(job_id), ks.inflight(shard), ks.config(shard)], args=[job_id]))
        return record_from_fields(reply_fields(reply)) if reply else None

    async def rollback(self, job_ids: Sequence[str], error: str) -> int:
        """Undo jobs a refused batch created: each is cancelled (``error`` recorded on those still
        queued) and its idempotency key deleted, so a retry with the same keys submits them afresh rather than
        finding the cancelled jobs (one script call per queue shard). Returns how many of the jobs existed."""
        if not job_ids:
            return 0
        ks, found = self.keyspace, 0
        for shard in ks.shards:
            ids = [job_id for job_id in job_ids if ks.shard_of(job_id) == shard]
            if ids:
                found += int(await self._scripts.rollback(keys=[ks.inflight(shard), *(ks.job(i) for i in ids)],
                                                          args=[self._ctx[shard], error, *ids]))
        return found

    async def queue_depth_by_priority(self, model: str) -> dict[int, int]:
        """Queued jobs of ``model`` per priority (only priorities with jobs), over every shard."""
        depths: dict[int, int] = {}
        for shard in self.keyspace.shards:
            for priority, depth in (await self._shard_depths(self.keyspace.queue(model, shard))).items():
                depths[priority] = depths.get(priority, 0) + depth
        return depths

    async def _shard_depths(self, key: str) -> dict[int, int]:
        """One shard's queue per priority: a skip scan over the score ranges, one round trip per priority present
        (plus one), instead of reading the whole queue: each priority owns ``(-p * 2**32, (-p + 1) * 2**32)``."""
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
        """How many jobs the shards' dead-letter sets hold (entries are pruned after 7 days)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for shard in self.keyspace.shards:
                pipe.zcard(self.keyspace.dead_letter(shard))
            return sum(int(n) for n in await pipe.execute())

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
        log_key = self.keyspace.job_log(job_id)
        chunk = await self._redis.xrange(log_key, min=f"({after_seq}-0", max="+", count=count) or []
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
