"""A batch's state in Redis (docs/protocol.md, "Batches"): created, read, listed, stopped, its lines' results
recorded once each, and finished. Conditional transitions are Lua scripts (``batch_result``, ``batch_stop``);
unconditional writes to a batch's own keys (one hash slot) are MULTI transactions; the indexes (active set,
owner's list) are written after them, in another slot on a Redis Cluster."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from redis.asyncio import Redis

from api.auth import can_access
from api.batches.models import Batch, BatchError, BatchErrors, PreparedLine, RequestCounts
from api.files import HashFields
from shared import keys
from shared.pubsub import as_text
from shared.scripts import lua_source

_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
               "cancelled_at")
Outcome = Literal["completed", "failed"]


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class BatchState:
    """A batch as stored: the OpenAI object plus what the runner needs (owner, cursor, stop code, callback)."""

    batch: Batch
    owner: str | None
    submitted: int
    stop: str | None
    webhook_url: str | None

    @property
    def total(self) -> int:
        return self.batch.request_counts.total


def _int(fields: dict[str, str], name: str) -> int | None:
    value = fields.get(name)
    return int(value) if value else None


def _state(fields: dict[str, str]) -> BatchState:
    meta = json.loads(fields["meta"])
    errors = BatchErrors.model_validate_json(fields["errors"]) if fields.get("errors") else None
    counts = RequestCounts(total=int(fields.get("total", 0)), completed=int(fields.get("completed", 0)),
                           failed=int(fields.get("failed", 0)))
    batch = Batch(**meta, status=fields["status"], errors=errors, request_counts=counts,
                  output_file_id=fields.get("output_file_id") or None,
                  error_file_id=fields.get("error_file_id") or None,
                  **{name: _int(fields, name) for name in _TIMESTAMPS})
    return BatchState(batch=batch, owner=fields.get("owner") or None, submitted=int(fields.get("submitted", 0)),
                      stop=fields.get("stop") or None, webhook_url=fields.get("webhook_url") or None)


class BatchStore:
    """Batches in Redis, for the routes and the runner."""

    def __init__(self, redis: Redis, retention_s: int) -> None:
        self._redis = redis
        self._retention_s = retention_s
        self._record = redis.register_script(lua_source("batch_result"))
        self._stop = redis.register_script(lua_source("batch_stop"))

    async def create(self, batch: Batch, owner: str | None, lines: Sequence[PreparedLine],
                     webhook_url: str | None) -> None:
        """Store a new batch: ``in_progress`` with its lines (and on the active set), or ``failed`` as given."""
        meta = batch.model_dump(include={"id", "endpoint", "input_file_id", "completion_window", "created_at",
                                         "expires_at", "metadata", "model"})
        fields: HashFields = {"meta": json.dumps(meta), "owner": owner or "", "status": batch.status,
                                        "total": len(lines), "completed": 0, "failed": 0, "submitted": 0,
                                        "webhook_url": webhook_url or ""}
        fields.update({name: value for name in _TIMESTAMPS if (value := getattr(batch, name)) is not None})
        if batch.errors is not None:
            fields["errors"] = batch.errors.model_dump_json()
        # The batch's own keys in one transaction (one slot), then the indexes (other slots on a Redis Cluster).
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(batch.id), mapping=fields)
            if lines:
                pipe.rpush(keys.batch_lines(batch.id), *(line.model_dump_json() for line in lines))
            else:
                pipe.expire(keys.batch(batch.id), self._retention_s)
            await pipe.execute()
        if lines:
            await self._redis.zadd(keys.BATCHES_ACTIVE, {batch.id: time.time()})
        await self._redis.zadd(keys.batches_of(owner), {batch.id: time.time()})  # sub-second: a page's order is exact

    async def state(self, batch_id: str) -> BatchState | None:
        raw = await self._redis.hgetall(keys.batch(batch_id))
        return _state({as_text(k): as_text(v) for k, v in raw.items()}) if raw else None

    async def get(self, owner: str | None, batch_id: str) -> BatchState | None:
        """The batch, or None when it does not exist or belongs to another owner."""
        state = await self.state(batch_id)
        return state if state is not None and can_access(owner, state.owner) else None

    async def list_owned(self, owner: str | None, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """The owner's batches newest first, from after ``after``; and whether more follow."""
        key = keys.batches_of(owner)
        start = 0
        if after is not None:
            rank = await self._redis.zrevrank(key, after)
            start = rank + 1 if isinstance(rank, int) else 0
        ids = [as_text(x) for x in await self._redis.zrevrange(key, start, start + limit)]
        found = [state.batch for batch_id in ids[:limit] if (state := await self.state(batch_id)) is not None]
        gone = [batch_id for batch_id in ids[:limit] if batch_id not in {b.id for b in found}]
        if gone:
            await self._redis.zrem(key, *gone)
        return found, len(ids) > limit

    async def stop(self, batch_id: str, code: str, status: str = "", time_field: str = "", now: int = 0
                   ) -> str | None:
        """Stop the batch's unfinished lines with ``code`` (batch_stop.lua); its status before, None if missing."""
        reply = await self._stop(keys=[keys.batch(batch_id)], args=[code, status, time_field, now])
        return as_text(reply) if reply else None

    async def lines(self, batch_id: str, start: int, stop: int) -> list[PreparedLine]:
        """Lines ``start`` .. ``stop - 1``."""
        raw = await self._redis.lrange(keys.batch_lines(batch_id), start, stop - 1)
        return [PreparedLine.model_validate_json(x) for x in raw]

    async def line(self, batch_id: str, index: int) -> PreparedLine:
        raw = await self._redis.lindex(keys.batch_lines(batch_id), index)
        assert raw is not None, f"batch {batch_id} has no line {index}"
        return PreparedLine.model_validate_json(raw)

    async def set_submitted(self, batch_id: str, submitted: int) -> None:
        await self._redis.hset(keys.batch(batch_id), "submitted", submitted)

    async def result_indices(self, batch_id: str) -> set[int]:
        return {int(as_text(x)) for x in await self._redis.hkeys(keys.batch_results(batch_id))}

    async def record(self, batch_id: str, index: int, outcome: Outcome, line_json: str) -> bool:
        """Record line ``index``'s result unless it has one (batch_result.lua); True when this call did."""
        reply = await self._record(keys=[keys.batch(batch_id), keys.batch_results(batch_id)],
                                   args=[index, outcome, line_json])
        return bool(int(reply))

    async def results(self, batch_id: str) -> list[tuple[int, str]]:
        """Every recorded result as ``(index, output line JSON)``, in line order."""
        raw = await self._redis.hgetall(keys.batch_results(batch_id))
        return sorted((int(as_text(k)), as_text(v)) for k, v in raw.items())

    async def set_status(self, batch_id: str, status: str, time_field: str, now: int) -> None:
        await self._redis.hset(keys.batch(batch_id), mapping={"status": status, time_field: now})

    async def finish(self, batch_id: str, status: str, time_field: str, now: int, output_file_id: str | None,
                     error_file_id: str | None) -> None:
        """The terminal transition: status and files set, off the active set, lines and results dropped, the
        batch kept for the file retention time."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.batch(batch_id), mapping={"status": status, time_field: now,
                                                      "output_file_id": output_file_id or "",
                                                      "error_file_id": error_file_id or ""})
            pipe.expire(keys.batch(batch_id), self._retention_s)
            pipe.delete(keys.batch_lines(batch_id), keys.batch_results(batch_id))
            await pipe.execute()
        await self._redis.zrem(keys.BATCHES_ACTIVE, batch_id)  # another slot on a cluster: after the batch ended

    async def active_ids(self) -> list[str]:
        return [as_text(x) for x in await self._redis.zrange(keys.BATCHES_ACTIVE, 0, -1)]

    async def forget(self, batch_id: str) -> None:
        """Drop an id from the active set (its batch is gone or finished)."""
        await self._redis.zrem(keys.BATCHES_ACTIVE, batch_id)


def failed_batch_errors(errors: Sequence[BatchError]) -> BatchErrors:
    return BatchErrors(data=list(errors))
