"""Files of the OpenAI Files API, kept in Redis so every API replica serves every file.

A file is one hash (``shared.keys.file``): its metadata fields and its ``content``, expiring after
``file_retention_s``. Each owner's file ids sit in a sorted set by creation time for listing; ids whose hash has
expired are pruned when listed. Files are tenant-scoped like jobs: another API key gets the same 404 as a file
that does not exist.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

from pydantic import BaseModel
from redis.asyncio import Redis

from api.auth import can_access
from shared import keys
from shared.pubsub import as_text

FilePurpose = Literal["batch", "batch_output"]
# A hash's fields as redis-py's ``hset(mapping=...)`` types them.
HashFields = dict[str | bytes | bytearray | memoryview | int | float, str | bytes | int]
_META = ("id", "owner", "filename", "purpose", "bytes", "created_at", "expires_at")


class FileObject(BaseModel):
    """OpenAI's ``file`` object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def _object(fields: dict[str, str]) -> FileObject:
    return FileObject(id=fields["id"], bytes=int(fields["bytes"]), created_at=int(fields["created_at"]),
                      expires_at=int(fields["expires_at"]), filename=fields["filename"],
                      purpose=fields["purpose"])


class FileStore:
    """Create, read, list and delete files of one owner at a time (``owner`` None = the open API)."""

    def __init__(self, redis: Redis, retention_s: int) -> None:
        self._redis = redis
        self._retention_s = retention_s

    async def create(self, owner: str | None, filename: str, purpose: FilePurpose, content: bytes,
                     file_id: str | None = None) -> FileObject:
        """Store ``content``; with a given ``file_id`` (batch outputs) a second call rewrites the same file."""
        now = int(time.time())
        file_id = file_id or new_file_id()
        fields: HashFields = {"id": file_id, "owner": owner or "", "filename": filename, "purpose": purpose,
                  "bytes": len(content), "created_at": now, "expires_at": now + self._retention_s}
        # The file, then its owner's index: two slots on a Redis Cluster, so two steps (a crash between leaves a
        # file its owner's list does not show, which expires with its retention).
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.file(file_id), mapping={**fields, "content": content})
            pipe.expire(keys.file(file_id), self._retention_s)
            await pipe.execute()
        await self._redis.zadd(keys.files_of(owner), {file_id: time.time()})  # sub-second: listing order is exact
        return _object({str(k): str(v) for k, v in fields.items()})

    async def get(self, owner: str | None, file_id: str) -> FileObject | None:
        """The file's metadata, or None when it does not exist, expired, or belongs to another owner."""
        fields = await self._meta(file_id)
        if fields is None or not can_access(owner, fields["owner"] or None):
            return None
        return _object(fields)

    async def content(self, owner: str | None, file_id: str) -> bytes | None:
        if await self.get(owner, file_id) is None:
            return None
        raw = await self._redis.hget(keys.file(file_id), "content")
        return raw.encode() if isinstance(raw, str) else raw

    async def list_owned(self, owner: str | None, purpose: str | None = None, limit: int = 10_000,
                   after: str | None = None) -> FileList:
        """The owner's files, newest first; expired ids are pruned on the way."""
        ids = [as_text(x) for x in await self._redis.zrevrange(keys.files_of(owner), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        found: list[FileObject] = []
        gone: list[str] = []
        for file_id in ids:
            fields = await self._meta(file_id)
            if fields is None:
                gone.append(file_id)
            elif purpose is None or fields["purpose"] == purpose:
                found.append(_object(fields))
            if len(found) > limit:
                break
        if gone:
            await self._redis.zrem(keys.files_of(owner), *gone)
        page = found[:limit]
        return FileList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                        has_more=len(found) > limit)

    async def delete(self, owner: str | None, file_id: str) -> bool:
        if await self.get(owner, file_id) is None:
            return False
        await self._redis.delete(keys.file(file_id))  # then the index entry (a listing prunes one left behind)
        await self._redis.zrem(keys.files_of(owner), file_id)
        return True

    async def _meta(self, file_id: str) -> dict[str, str] | None:
        values = await self._redis.hmget(keys.file(file_id), list(_META))
        if values[0] is None:
            return None
        return {name: as_text(v) if v is not None else "" for name, v in zip(_META, values, strict=True)}
