"""``GET /v1/jobs``: the caller's recent jobs, newest first, for the console's job list.

Read from the caller's recent-jobs indexes (``Keyspace.owner_jobs``, one per queue shard), so one key never sees
another key's jobs; with auth off, the jobs submitted without a key. Each entry is the job's record without its
choices (the text is cut to a preview); ``GET /v1/jobs/{id}`` has the rest.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel

from api.deps import OwnerDep, QueueDep
from shared.schemas import FinishReason, JobRecord, JobStatus, Usage

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

PREVIEW_CHARS = 200
MAX_LIST_LIMIT = 100


class JobSummary(BaseModel):
    """One job of the list: status, priority, timings, tokens and how it ended."""

    id: str
    model: str
    status: JobStatus
    priority: int
    attempts: int
    preview: str | None
    finish_reason: FinishReason | None
    usage: Usage
    error: str | None
    worker_id: str | None
    created_at: float | None
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobSummary]


def summary(record: JobRecord) -> JobSummary:
    fields = record.model_dump(exclude={"text", "choices"})
    return JobSummary(**fields, preview=record.text[:PREVIEW_CHARS] if record.text is not None else None)


@router.get("", response_model=JobList)
async def list_jobs(queue: QueueDep, owner: OwnerDep,
                    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT, description="newest first")] = 20
                    ) -> JobList:
    """The caller's most recent jobs (up to ``limit``), newest first; expired jobs are left out."""
    return JobList(data=[summary(r) for r in await queue.recent_jobs(owner, limit)])
