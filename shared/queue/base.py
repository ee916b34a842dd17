"""The job queue's shared half: records and replies of the Redis job protocol (docs/protocol.md), and the
connection, the scripts and the key layout both sides of ``JobQueue`` use. Nothing here imports torch."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis

from shared import keys
from shared.config import Settings
from shared.live_channels import LiveChannels
from shared.pubsub import as_text
from shared.schemas import (
    JobRecord,
    JobResult,
    JobStatus,
    JobSubmission,
    Usage,
)
from shared.scripts import Scripts

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The model's queue holds ``max_queue_length`` jobs; the client should retry after ``retry_after_s``."""

    def __init__(self, model: str, depth: int, retry_after_s: int) -> None:
        super().__init__(f"queue of model {model!r} is full ({depth} jobs); retry after {retry_after_s} s")
        self.model = model
        self.depth = depth
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class RateState:
    """A tenant's rate budget for one model after a submission, as OpenAI's ``x-ratelimit-*`` headers carry it
    (limits 0 = unlimited)."""

    limit_requests: int
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> RateState | None:
        """The ``<rate>`` part of a submit.lua reply (empty: no limits)."""
        if not reply:
            return None
        rpm, left_r, reset_r, tpm, left_t, reset_t = (as_text(x) for x in reply)
        return cls(int(rpm), max(0, int(left_r)), max(0.0, float(reset_r)), int(tpm), max(0, int(left_t)),
                   max(0.0, float(reset_t)))


class RateLimitedError(Exception):
    """The tenant's rate limit refused a submission: ``limit`` is ``requests``, ``tokens`` or ``jobs``;
    ``retry_after_s`` is None when the request can never pass (more tokens than the per-minute limit)."""

    def __init__(self, tenant: str, limit: str, retry_after_s: float | None, state: RateState | None) -> None:
        when = f"retry after {retry_after_s:.1f} s" if retry_after_s is not None else "it can never pass"
        super().__init__(f"rate limit of {limit} reached for {tenant}; {when}")
        self.tenant = tenant
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.state = state


@dataclass(frozen=True)
class ClaimedJob:
    """A job a worker now holds: its ``fence`` must accompany every write, ``attempt`` counts from 1. A job
    claimed ``alone`` must run with no other job beside it until it ends (crash isolation, docs/protocol.md)."""

    submission: JobSubmission
    fence: int
    attempt: int
    alone: bool = False  # an isolated job (it was running when a worker crashed): run nothing beside it
    time_left_s: float | None = None  # seconds left before its total timeout when claimed (Redis time); None: none


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


def reply_fields(flat: Sequence[Any]) -> dict[str, str]:
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


def script_config(settings: Settings, keyspace: keys.Keyspace, shard: int) -> dict[str, str | int | float]:
    """What the scripts of one queue shard need besides their keys: the shard's key layout (scripts derive the keys
    of job ids they discover, ``Keyspace.layout``) and the settings that decide TTLs, caps and retries. Worker-side
    scripts get it as their ``ctx`` argument; submit and cancel read the same values from the shard's config hash
    (``publish_config``)."""
    return {
        **keyspace.layout(shard), "lease_ttl_s": settings.lease_ttl_s,
        "result_ttl_s": settings.result_ttl_s, "max_attempts": settings.max_attempts,
        "stream_maxlen": settings.stream_maxlen, "dead_keep_s": keys.DEAD_LETTER_KEEP_S,
        "max_queue_length": settings.max_queue_length, "owner_jobs_keep": keys.OWNER_JOBS_KEEP,
        "events_maxlen": keys.JOB_EVENTS_MAXLEN,
    }


class ShardLayoutError(RuntimeError):
    """This Redis holds jobs laid out for another number of queue shards than this process's ``queue_shards``."""


class QueueBase:
    """One Redis client (a single node or a ``RedisCluster``), the loaded scripts, the key space of the
    deployment's queue shards and the ``ctx`` each shard's transition scripts take."""

    def __init__(self, redis: Redis, settings: Settings, poll_interval_s: float = 2.0) -> None:
        self._redis = redis
        self._settings = settings
        self._scripts = Scripts.load(redis)
        self.keyspace = keys.Keyspace(settings.queue_shards)
        # A stream or cancellation listener re-checks Redis after this long without a message, so a missed
        # pub/sub message (a reconnect) costs at most this delay and a finished job never hangs a reader.
        self._poll_s = poll_interval_s
        self._ctx = [json.dumps(script_config(settings, self.keyspace, shard)) for shard in self.keyspace.shards]
        self.live_channels = LiveChannels(redis, poll_interval_s)  # one pub/sub connection for every open stream
        self._policies = settings.tenant_policies()
        self._cards_sent: set[str] = set()
        self._claim_turn = 0  # the shard a worker's claims look at first among equals, moving on at every claim

    async def publish_config(self, replace: bool = True) -> None:
        """Store each shard's key layout and the settings the scripts read (``ts:config:{<tag>}``) and the shard
        tags (``ts:shards``), so another backend's submit and cancel need only the job's own data. An API stores
        its settings at start (``replace``); a worker only when none are stored (a new or wiped Redis). Their
        settings must agree: a difference is logged. A different number of shards is refused
        (``ShardLayoutError``): the processes would look for the same jobs under different keys."""
        tags = ",".join(self.keyspace.tags)
        stored_tags = await self._redis.get(keys.SHARDS)
        if stored_tags is not None and as_text(stored_tags) != tags:
            raise ShardLayoutError(f"this Redis is laid out for queue shards {as_text(stored_tags)!r} ({keys.SHARDS}), "
                                   f"this process for {tags!r}: give every API and worker the same queue_shards")
        for shard in self.keyspace.shards:
            await self._publish_shard_config(shard, replace)
        await self._redis.set(keys.SHARDS, tags)

    async def _publish_shard_config(self, shard: int, replace: bool) -> None:
        key = self.keyspace.config(shard)
        mine = {name: str(value) for name, value in script_config(self._settings, self.keyspace, shard).items()}
        stored = {as_text(k): as_text(v) for k, v in (await self._redis.hgetall(key)).items()}
        if stored and not replace:
            return
        differ = sorted(name for name, value in mine.items() if name in stored and stored[name] != value)
        if differ:
            log.warning("settings differ from those another process stored in %s: %s; using this process's",
                        key, ", ".join(f"{n}={stored[n]!r}->{mine[n]!r}" for n in differ))
        await self._redis.hset(key, items=[x for pair in mine.items() for x in pair])

    @property
    def redis(self) -> Redis:
        return self._redis

    @property
    def poll_interval_s(self) -> float:
        return self._poll_s


def invalid_reason(exc: ValueError) -> str:
    """Why a submission is invalid, without echoing its values: pydantic's message quotes the input (the
    prompt), and prompts must stay out of logs."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'submission'}: {e['msg']}"
                         for e in exc.errors(include_input=False, include_url=False))
    return str(exc)
