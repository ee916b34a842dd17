"""Job events for webhooks: the API replicas read the job-event streams (``Keyspace.job_events``, one per queue
shard, one entry per terminal transition, appended by ``finish`` in lib.lua) as one consumer group and queue a
webhook event for each entry.

An entry is acknowledged only after its messages are queued; entries a replica read but never acknowledged (it
died) are claimed by another replica after ``CLAIM_IDLE_MS``. Message ids are derived from the job and its status,
so an entry handled twice is still delivered once. Jobs of batch lines raise no job events (their batch's event
covers them).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from api.webhooks.outbox import WebhookOutbox
from shared import keys
from shared.pubsub import as_text
from shared.queue import record_from_fields
from shared.schemas import JobSubmission

log = logging.getLogger(__name__)

CLAIM_IDLE_MS = 30_000
READ_COUNT = 100


class JobEventReader:
    """One replica's consumer in the ``webhooks`` group of one queue shard's job-event stream (a replica runs one
    reader per shard: a stream is a key, in its shard's slot)."""

    def __init__(self, redis: Redis, outbox: WebhookOutbox, keyspace: keys.Keyspace, shard: int,
                 block_ms: int = 1000) -> None:
        self._redis = redis
        self._outbox = outbox
        self._keyspace = keyspace
        self._stream = keyspace.job_events(shard)
        self._block_ms = block_ms
        self._consumer = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"

    async def ensure_group(self) -> None:
        """Create the group at the stream's end (events before the first replica started raise nothing)."""
        try:
            await self._redis.xgroup_create(self._stream, keys.JOB_EVENTS_GROUP, id="$", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run_forever(self) -> None:
        await self.ensure_group()
        while True:
            try:
                await self.run_once()
            except Exception:
                log.warning("reading job events failed; retrying", exc_info=True)
                await asyncio.sleep(1.0)

    async def run_once(self) -> int:
        """Handle abandoned entries, then new ones; returns how many were handled."""
        _, claimed, _ = await self._redis.xautoclaim(self._stream, keys.JOB_EVENTS_GROUP, self._consumer,
                                                     CLAIM_IDLE_MS, start_id="0-0", count=READ_COUNT)
        entries = list(claimed)
        reply: Any = await self._redis.xreadgroup(keys.JOB_EVENTS_GROUP, self._consumer, {self._stream: ">"},
                                                  count=READ_COUNT, block=self._block_ms)
        for _, stream_entries in reply or []:  # [[stream, [(entry_id, fields), ...]], ...]
            entries += stream_entries
        for entry_id, fields in entries:
            await self._handle({as_text(k): as_text(v) for k, v in (fields or {}).items()})
            await self._redis.xack(self._stream, keys.JOB_EVENTS_GROUP, entry_id)
        return len(entries)

    async def _handle(self, fields: dict[str, str]) -> None:
        job_id = fields.get("job_id", "")
        if not job_id or job_id.startswith("batch_"):
            return
        raw = await self._redis.hgetall(self._keyspace.job(job_id))
        if not raw:
            return  # gone already (its TTL ran out while no replica ran)
        job_fields = {as_text(k): as_text(v) for k, v in raw.items()}
        job = record_from_fields(job_fields)
        if not job.status.is_terminal:
            return  # requeued since (Redis lost it and a backend resubmitted it)
        await self._outbox.job_event(job, _callback_url(job_fields.get("submission")))


def _callback_url(submission_json: str | None) -> str | None:
    if not submission_json:
        return None
    try:
        return JobSubmission.model_validate_json(submission_json).webhook_url
    except ValidationError:
        return None
