"""The job queue: the Redis job protocol seen from Python (docs/protocol.md), for the API and the workers.

Every state change is one Lua script (``shared/lua``), so the queue stays consistent whatever mix of API
processes, workers and other backends uses it at once. Reads are plain commands. Nothing here imports torch.
Reading one job's event stream is ``shared.job_stream``; the pub/sub plumbing is ``shared.pubsub``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from shared import keys
from shared.config import Settings
from shared.job_stream import JobStreamReader, entry_event
from shared.lifecycle_log import RECOVERIES, job_fields
from shared.pubsub import TRANSIENT_ERRORS, as_text, listen
from shared.schemas import (
    JobRecord,
    JobResult,
    JobStatus,
    JobSubmission,
    ModelCard,
    RestartEvent,
    StreamEvent,
    TokenEvent,
    Usage,
    WorkerInfo,
)
from shared.scripts import Scripts

log = logging.getLogger(__name__)

REAP_BATCH = 100
REPLAY_PAGE = 256  # log entries per read (~40 KB of token events)
__all__ = ["TRANSIENT_ERRORS", "ClaimedJob", "JobQueue", "QueueFullError", "RecoveredJob"]


class QueueFullError(Exception):
    """The model's queue holds ``max_queue_length`` jobs; the client should retry after ``retry_after_s``."""

    def __init__(self, model: str, depth: int, retry_after_s: int) -> None:
        super().__init__(f"queue of model {model!r} is full ({depth} jobs); retry after {retry_after_s} s")
        self.model = model
        self.depth = depth
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ClaimedJob:
    """A job a worker now holds: its ``fence`` must accompany every write, ``attempt`` counts from 1. A job
    claimed ``alone`` must run with no other job beside it until it ends (crash isolation, docs/protocol.md)."""

    submission: JobSubmission
    fence: int
    attempt: int
    alone: bool = False  # an isolated job (it was running when a worker crashed): run nothing beside it


@dataclass(frozen=True)
class RecoveredJob:
    """A running job taken back from its worker by the reaper, and its new ``status``: ``queued`` (requeued, a
    restart for its readers), ``failed`` (out of attempts, dead-lettered) or ``cancelled`` (a cancel was pending)."""

    job_id: str
    model: str
    worker_id: str | None
    status: str


# Queue scores are ``-priority * PRIORITY_STRIDE + seq`` with 0 < seq < PRIORITY_STRIDE (shared/keys.py).
PRIORITY_STRIDE = 2**32


def priority_of_score(score: float) -> int:
    """The priority encoded in a queue score (``-priority * 2**32 + seq``, docs/protocol.md)."""
    return -math.floor(score / PRIORITY_STRIDE)


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    """A flat ``[field, value, ...]`` script reply (HGETALL inside Lua) as a dict."""
    return {as_text(flat[i]): as_text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _float(fields: dict[str, str], name: str) -> float | None:
    value = fields.get(name)
    return float(value) if value else None


def record_from_fields(fields: dict[str, str]) -> JobRecord:
    """Build a JobRecord from the job hash (field names in docs/protocol.md); ``text`` mirrors choice 0."""
    result = JobResult.model_validate_json(fields["result"]) if fields.get("result") else None
    first = result.choices[0] if result and result.choices else None
    return JobRecord(
        id=fields["id"],
        model=fields["model"],
        status=JobStatus(fields["status"]),
        priority=int(fields.get("priority", 0)),
        attempts=int(fields.get("attempts", 0)),
        text=first.text if first else None,
        finish_reason=first.finish_reason if first else None,
        choices=result.choices if result else [],
        usage=result.usage if result else Usage(),
        error=fields.get("error"),
        worker_id=fields.get("worker_id") or None,
        created_at=_float(fields, "created_at"),
        started_at=_float(fields, "started_at"),
        first_token_at=_float(fields, "first_token_at"),
        finished_at=_float(fields, "finished_at"),
    )


class JobQueue:
    """Client and worker side of the job protocol over one ``redis.asyncio.Redis`` client."""

    def __init__(self, redis: Redis, settings: Settings, poll_interval_s: float = 2.0) -> None:
        self._redis = redis
        self._settings = settings
        self._scripts = Scripts.load(redis)
        # A stream or cancellation listener re-checks Redis after this long without a message, so a missed
        # pub/sub message (a reconnect) costs at most this delay and a finished job never hangs a reader.
        self._poll_s = poll_interval_s
        self._ctx = json.dumps({
            "job_prefix": keys.JOB_PREFIX, "job_suffix": keys.JOB_SUFFIX, "log_suffix": keys.LOG_SUFFIX,
            "live_suffix": keys.LIVE_SUFFIX, "queue_prefix": keys.QUEUE_PREFIX, "queue_suffix": keys.QUEUE_SUFFIX,
            "wake_suffix": keys.QUEUE_WAKE_SUFFIX,
            "worker_prefix": keys.WORKER_PREFIX, "cancels_suffix": keys.WORKER_CANCELS_SUFFIX,
            "control_prefix": keys.CONTROL_PREFIX, "lease_ttl_s": settings.lease_ttl_s,
            "result_ttl_s": settings.result_ttl_s, "max_attempts": settings.max_attempts,
            "stream_maxlen": settings.stream_maxlen, "dead_keep_s": keys.DEAD_LETTER_KEEP_S,
        })
        self._cards_sent: set[str] = set()

    @property
    def redis(self) -> Redis:
        return self._redis

    @property
    def poll_interval_s(self) -> float:
        return self._poll_s

    # --- client side ------------------------------------------------------------------------------------

    async def submit(self, job: JobSubmission) -> tuple[JobRecord, bool]:
        """Enqueue ``job`` (its id is given by the caller). Returns ``(record, created)``; an idempotency key
        already used by the same owner returns the existing job with ``created=False``.

        Raises QueueFullError when the model's queue is at ``max_queue_length``, ValueError for a taken id.
        """
        job_keys = [keys.job(job.id), keys.queue(job.model), keys.queue_seq(job.model)]
        if job.idempotency_key is not None:
            job_keys.append(keys.idempotency(job.owner, job.idempotency_key))
        try:
            reply = await self._scripts.submit(keys=job_keys, args=[job.model_dump_json(),
                                                                   self._settings.max_queue_length,
                                                                   keys.queue_wake(job.model)])
        except ResponseError as exc:
            raise ValueError(f"id: {exc}") from exc
        outcome = as_text(reply[0])
        if outcome == "full":
            retry_after = max(1, math.ceil(self._settings.heartbeat_interval_s))
            raise QueueFullError(job.model, int(reply[1]), retry_after)
        return record_from_fields(_pairs(reply[1])), outcome == "created"

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

    async def cancel(self, job_id: str) -> JobRecord | None:
        """Cancel: a queued job is cancelled now; a running one is flagged and its worker told to abort it
        (its record turns ``cancelled`` when the worker finalises). Finished jobs are left as they are."""
        reply = await self._scripts.cancel(keys=[keys.job(job_id), keys.INFLIGHT], args=[self._ctx, job_id])
        return record_from_fields(_pairs(reply)) if reply else None

    async def rollback(self, job_ids: Sequence[str], error: str) -> int:
        """Undo jobs a refused batch created, in one step: each is cancelled (``error`` recorded on those still
        queued) and its idempotency key deleted, so a retry with the same keys submits them afresh rather than
        finding the cancelled jobs. Returns how many of the jobs existed."""
        if not job_ids:
            return 0
        reply = await self._scripts.rollback(keys=[keys.INFLIGHT, *(keys.job(i) for i in job_ids)],
                                             args=[self._ctx, error, *job_ids])
        return int(reply)

    async def queue_depth(self, model: str) -> int:
        return int(await self._redis.zcard(keys.queue(model)))

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

    async def reap_expired(self) -> int:
        """Recover jobs whose lease expired: requeue, or fail and dead-letter after ``max_attempts``."""
        return len(await self.reap())

    async def reap(self) -> list[RecoveredJob]:
        """``reap_expired``, telling which jobs went where (for metrics); logs one line per job."""
        recovered: list[RecoveredJob] = []
        while True:
            reply = await self._scripts.reap(keys=[keys.INFLIGHT, keys.DEAD_LETTER, keys.WORKERS],
                                             args=[self._ctx, REAP_BATCH])
            for raw_id, model, worker_id, status in reply[1:]:
                job = RecoveredJob(as_text(raw_id), as_text(model), as_text(worker_id) or None, as_text(status))
                log.warning("job %s: lease of worker %s expired; job %s", job.job_id, job.worker_id, job.status,
                            extra=job_fields(RECOVERIES[job.status].by_reaper, job.job_id, job.model, job.worker_id))
                recovered.append(job)
            if int(reply[0]) < REAP_BATCH:
                return recovered

    async def dead_letters(self) -> list[str]:
        """Ids of jobs given up on after ``max_attempts``, oldest first."""
        return [as_text(x) for x in await self._redis.zrange(keys.DEAD_LETTER, 0, -1)]

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

    # --- worker side ------------------------------------------------------------------------------------

    async def register_worker(self, info: WorkerInfo, card: ModelCard) -> None:
        """Heartbeat: (re)register the worker, and publish its model card the first time (the card holds the
        tokenizer, megabytes, so later heartbeats do not resend it)."""
        info_ttl = max(1, math.ceil(self._settings.lease_ttl_s * keys.WORKER_INFO_TTL_LEASES))
        send_card = info.id not in self._cards_sent or not await self._redis.hexists(keys.MODEL_CARDS, card.name)
        await self._scripts.register(
            keys=[keys.WORKERS, keys.worker_info(info.id), keys.MODEL_CARDS],
            args=[info.id, info.model_dump_json(), info_ttl, card.name, card.model_dump_json() if send_card else ""],
        )
        self._cards_sent.add(info.id)

    async def deregister_worker(self, worker_id: str) -> None:
        """The worker leaves cleanly (its jobs must have been completed or released first)."""
        await self._scripts.deregister(keys=[keys.WORKERS, keys.worker_info(worker_id)], args=[worker_id])
        self._cards_sent.discard(worker_id)

    async def claim(self, model: str, worker_id: str, max_jobs: int, idle: bool = True) -> list[ClaimedJob]:
        """Take up to ``max_jobs`` jobs of ``model``, best priority first, under a lease of ``lease_ttl_s``.

        ``idle``: the worker holds no job. Only an idle worker is handed an isolated job (then alone); a busy one
        claims nothing behind an isolated job at the head of the queue, so it drains and can take it next.

        A job whose stored submission is not a valid JobSubmission for this queue fails at once with the
        validation error and is not returned; the caller never sees malformed jobs.
        """
        reply = await self._scripts.claim(keys=[keys.queue(model), keys.INFLIGHT],
                                          args=[self._ctx, worker_id, max_jobs, int(idle)])
        claimed = []
        for raw_id, raw_sub, fence, attempt, alone in reply:
            job_id = as_text(raw_id)
            try:
                submission = JobSubmission.model_validate_json(raw_sub)
                if submission.id != job_id or submission.model != model:
                    raise ValueError(f"submission id/model ({submission.id}, {submission.model}) do not match "
                                     f"its record ({job_id}) and queue ({model})")
            except ValueError as exc:  # pydantic's ValidationError is a ValueError
                reason = _invalid_reason(exc)
                log.warning("job %s is malformed, failing it: %s", job_id, reason, extra={"job_id": job_id})
                await self.fail(job_id, int(fence), f"invalid job: {reason}")
                continue
            claimed.append(ClaimedJob(submission, int(fence), int(attempt), alone=int(alone) == 1))
        return claimed

    async def renew(self, worker_id: str, fences: dict[str, int]) -> list[str]:
        """Extend the leases of the worker's jobs; returns the ids whose lease was lost (abort those)."""
        if not fences:
            return []
        args: list[str | int] = [self._ctx, worker_id]
        for job_id, fence in fences.items():
            args += [job_id, fence]
        return [as_text(x) for x in await self._scripts.renew(keys=[keys.INFLIGHT], args=args)]

    async def publish(self, job_id: str, fence: int, events: Sequence[TokenEvent | RestartEvent]) -> bool:
        """Append events to the job's replay log and channel. False: stale fence, the job is no longer ours."""
        return (await self.publish_many([(job_id, fence, events)]))[0]

    async def publish_many(self, batches: Iterable[tuple[str, int, Sequence[TokenEvent | RestartEvent]]],
                           ) -> list[bool]:
        """``publish`` for several jobs in one round trip (one pipeline per engine step).

        Each event's ``seq`` is its number within this claim (1, 2, ... per attempt, gap-free); Redis renumbers
        it with the job's own counter, so seq keeps growing across attempts, and drops numbers it already
        has, so a retried call never duplicates an event.
        """
        calls: list[tuple[str, list[str | int]]] = []
        for job_id, fence, events in batches:
            args: list[str | int] = [self._ctx, job_id, fence, int(any(isinstance(e, TokenEvent) for e in events))]
            for event in events:
                args += [event.seq, event.model_dump_json(exclude={"seq"})]
            calls.append((keys.job(job_id), args))
        try:
            replies = await self._publish_pipeline(calls)
        except NoScriptError:  # Redis restarted and lost its scripts: nothing ran; load it and send again
            await self._redis.script_load(self._scripts.publish.script)
            replies = await self._publish_pipeline(calls)
        return [bool(int(r)) for r in replies]

    async def _publish_pipeline(self, calls: Sequence[tuple[str, list[str | int]]]) -> list[Any]:
        """EVALSHA of publish.lua per job in one pipeline. Called directly rather than as registered scripts,
        which would make every pipeline ask ``SCRIPT EXISTS`` first: one round trip per engine step saved."""
        sha = self._scripts.publish.sha
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_key, args in calls:
                pipe.evalsha(sha, 1, job_key, *args)
            return list(await pipe.execute())

    async def complete(self, job_id: str, fence: int, result: JobResult) -> bool:
        """Write the result with the final status: ``cancelled`` if any choice was aborted (a cancel), else
        ``succeeded``. False: stale fence, rejected."""
        aborted = any(c.finish_reason == "abort" for c in result.choices)
        status = JobStatus.CANCELLED if aborted else JobStatus.SUCCEEDED
        ok = await self._scripts.complete(keys=[keys.job(job_id), keys.INFLIGHT],
                                          args=[self._ctx, job_id, fence, status.value, result.model_dump_json()])
        return bool(int(ok))

    async def fail(self, job_id: str, fence: int, error: str) -> bool:
        """Fail the job for good with ``error`` (no retry). False: stale fence, rejected."""
        ok = await self._scripts.fail(keys=[keys.job(job_id), keys.INFLIGHT], args=[self._ctx, job_id, fence, error])
        return bool(int(ok))

    async def release(self, job_id: str, fence: int, charge_attempt: bool) -> bool:
        """Give a running job back to its queue at its priority (a restart event tells its readers).
        ``charge_attempt=False`` (drain) does not count the attempt. False: stale fence."""
        return await self.release_job(job_id, fence, charge_attempt) is not None

    async def release_job(self, job_id: str, fence: int, charge_attempt: bool) -> str | None:
        """``release``, returning the job's new status (``queued``; ``failed`` when that was its last attempt and
        it was dead-lettered; ``cancelled`` when a cancel was pending), or None for a stale fence."""
        reply = await self._scripts.release(keys=[keys.job(job_id), keys.INFLIGHT, keys.DEAD_LETTER],
                                            args=[self._ctx, job_id, fence, int(charge_attempt)])
        status = as_text(reply)
        return None if status == "0" else status

    def cancellations(self, worker_id: str) -> AsyncGenerator[str, None]:
        """Job ids the worker must abort: live from its control channel, and every ``poll_interval_s`` again
        from its durable cancel set (so a message missed during a reconnect is not lost). An id may repeat
        until the worker finalises the job."""
        async def pending() -> list[str]:
            return [as_text(job_id) for job_id in await self._redis.smembers(keys.worker_cancels(worker_id))]

        return listen(self._redis, keys.control(worker_id), pending, f"control channel of {worker_id}", self._poll_s)

    def wakeups(self, model: str) -> AsyncGenerator[str, None]:
        """A job id each time one enters the model's queue (submitted or requeued), from its wake channel; an
        empty string after every (re)connect and every quiet ``poll_interval_s``, when one may have been missed.
        Many idle workers may wake for one job: they race to claim it and the losers find nothing."""
        async def maybe_missed() -> list[str]:
            return [""]

        return listen(self._redis, keys.queue_wake(model), maybe_missed, f"wake channel of {model}", self._poll_s)

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


def _invalid_reason(exc: ValueError) -> str:
    """Why a submission is invalid, without echoing its values: pydantic's message quotes the input (the
    prompt), and prompts must stay out of logs."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'submission'}: {e['msg']}"
                         for e in exc.errors(include_input=False, include_url=False))
    return str(exc)
