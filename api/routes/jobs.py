"""The job resource: submit (one or a batch), read, stream events (SSE, resumable), cancel.

Jobs submitted here run to completion whoever watches them: a client that drops its event stream reconnects
with ``Last-Event-ID`` and continues without a gap or a duplicate. Reads are scoped to the API key that
created the job; another key gets the same 404 as a job that does not exist.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Response
from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from api.auth import can_access
from api.deps import CatalogDep, MetricsDep, OwnerDep, QueueDep, SettingsDep
from api.errors import invalid_request, job_not_found
from api.progress import with_progress
from api.relay import REDIS_FAILURES, JobRelay
from api.sse import STREAM_LOST, EventStreamResponse, format_event
from api.submission import (
    build_submission,
    check_beam_search,
    check_caps,
    check_length,
    count_prompt_tokens,
    deadlines,
    record_submitted,
    refused,
    resolve_model,
    submit,
)
from api.tokenization import ServedModel
from api.webhooks.outbox import check_callback_url
from shared.config import Settings
from shared.job_stream import MAX_EVENT_SEQ
from shared.queue import JobQueue, QueueFullError, RateLimitedError
from shared.queue.client import ClientSide
from shared.schemas import (
    MAX_TIMEOUT_S,
    ChatMessage,
    DoneEvent,
    ErrorEvent,
    GenerationParams,
    JobRecord,
    JobStatus,
    JobSubmission,
    RestartEvent,
    StreamEvent,
    TokenEvent,
    check_unicode,
)

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
_PARAM_FIELDS = frozenset(GenerationParams.model_fields)
_TextPrompt = Annotated[str, Field(min_length=1)]
_TokenPrompt = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _JobOptions(GenerationParams):
    """Sampling parameters (flat, as in OpenAI requests) plus what every job request may set."""

    model: str | None = Field(None, description="default: the served model")
    n: int = Field(1, ge=1, description="choices; capped by the server's max_n")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    background: bool = Field(False, description="stored with the job; jobs submitted here always run to the end")
    queue_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S,
                                          description="must start within this many seconds, else it ends expired; "
                                          "default: the server's queue_timeout_s")
    timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S,
                                    description="must end within this many seconds (a running job stops with "
                                    "finish reason timeout); default: the server's job_timeout_s")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_unicode(data)

    def params(self) -> GenerationParams:
        return GenerationParams(**self.model_dump(include=set(_PARAM_FIELDS)))


class JobCreate(_JobOptions):
    """``POST /v1/jobs``: exactly one of ``prompt``, ``messages`` or ``prompt_token_ids``."""

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200,
                                        description="a repeated key returns the first job instead of a new one")
    webhook_url: str | None = Field(None, max_length=2048, description="also send the job's terminal event here "
                                    "(its host must be in the operator's webhook_allowed_hosts)")

    @model_validator(mode="after")
    def _one_prompt(self) -> JobCreate:
        given = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        if given != 1:
            # ctx["param"] names the field in the error body (api/errors.py): a check across fields has no loc.
            if given == 0:
                raise PydanticCustomError("missing_prompt", "Missing required parameter: 'prompt' (or 'messages' "
                                          "or 'prompt_token_ids').",
                                          {"param": "prompt", "code": "missing_required_parameter"})
            raise PydanticCustomError("one_prompt", "Give only one of 'prompt', 'messages' or 'prompt_token_ids', "
                                      "not {given}.", {"param": "prompt", "given": given, "code": "invalid_value"})
        return self


class JobBatchCreate(_JobOptions):
    """``POST /v1/jobs/batch``: many prompts (text or token ids) with shared options, one job each."""

    prompts: list[_TextPrompt | _TokenPrompt] = Field(min_length=1)
    idempotency_key: str | None = Field(None, min_length=1, max_length=190,
                                        description="job i gets the key '<key>:<i>'")


class JobLinks(BaseModel):
    self: str
    events: str


class JobAccepted(BaseModel):
    id: str
    status: str
    links: JobLinks


class JobBatchAccepted(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobAccepted]


def _accepted(record: JobRecord) -> JobAccepted:
    return JobAccepted(id=record.id, status=record.status.value,
                       links=JobLinks(self=f"/v1/jobs/{record.id}", events=f"/v1/jobs/{record.id}/events"))


async def _prepare(settings: Settings, queue: ClientSide, model: ServedModel, options: _JobOptions, owner: str | None,
                   *,
                   prompt: str | None = None, messages: list[ChatMessage] | None = None,
                   prompt_token_ids: list[int] | None = None, idempotency_key: str | None = None) -> JobSubmission:
    params = options.params()
    check_beam_search(settings, params, param="beam_width")
    num_prompt_tokens = await count_prompt_tokens(model, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                            messages=messages)
    check_length(model, num_prompt_tokens, params.max_tokens, param="messages" if messages else "prompt")
    return build_submission(job_id=queue.job_id_for(owner, idempotency_key), model=model, params=params,
                            owner=owner, n=options.n,
                            priority=options.priority, background=options.background, prompt=prompt,
                            prompt_token_ids=prompt_token_ids, messages=messages, idempotency_key=idempotency_key,
                            **deadlines(settings, options.queue_timeout_s, options.timeout_s))


@router.post("", status_code=202, response_model=JobAccepted)
async def create_job(body: JobCreate, response: Response, settings: SettingsDep, queue: QueueDep,
                     catalog: CatalogDep, metrics: MetricsDep, owner: OwnerDep) -> JobAccepted:
    """Enqueue one job. A repeated ``idempotency_key`` answers 200 with the first job (``Idempotent-Replayed``)."""
    check_caps(settings, max_tokens=body.max_tokens, n=body.n)
    check_callback_url(settings, body.webhook_url, param="webhook_url")
    model = await resolve_model(catalog, body.model)
    submission = await _prepare(settings, queue, model, body, owner, prompt=body.prompt, messages=body.messages,
                          prompt_token_ids=body.prompt_token_ids, idempotency_key=body.idempotency_key)
    if body.webhook_url is not None:
        submission = submission.model_copy(update={"webhook_url": body.webhook_url})
    record, created = await submit(queue, submission, metrics, endpoint="jobs", response=response)
    if not created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return _accepted(record)


@router.post("/batch", status_code=202, response_model=JobBatchAccepted)
async def create_jobs(body: JobBatchCreate, settings: SettingsDep, queue: QueueDep, catalog: CatalogDep,
                      metrics: MetricsDep, owner: OwnerDep) -> JobBatchAccepted:
    """Enqueue one job per prompt, all or none: a queue that fills up midway cancels those already queued."""
    if len(body.prompts) > settings.max_batch_size:
        raise invalid_request(f"at most {settings.max_batch_size} prompts per batch, got {len(body.prompts)}",
                              param="prompts")
    check_caps(settings, max_tokens=body.max_tokens, n=body.n)
    model = await resolve_model(catalog, body.model)
    submissions = [
        await _prepare(settings, queue, model, body, owner,
                       prompt=p if isinstance(p, str) else None, prompt_token_ids=p if isinstance(p, list) else None,
                       idempotency_key=f"{body.idempotency_key}:{i}" if body.idempotency_key else None)
        for i, p in enumerate(body.prompts)
    ]
    records: list[JobRecord] = []
    created_ids: list[str] = []
    try:
        for submission in submissions:
            record, created = await queue.submit(submission)
            records.append(record)
            if created:
                created_ids.append(record.id)
                record_submitted(metrics, submission, "batch")
    except (QueueFullError, RateLimitedError) as exc:
        # Only the jobs this call created: a job an idempotency key replayed belongs to an earlier request.
        await queue.rollback(created_ids, "its batch was refused (queue full or rate limit) and rolled back")
        raise refused(exc, owner, metrics) from exc
    return JobBatchAccepted(data=[_accepted(r) for r in records])


async def _owned(queue: JobQueue, job_id: str, owner: str | None) -> None:
    """Return if the caller may see the job; else the same 404 as for a job that does not exist. Only the
    record's owner field is read, never the submission: another tenant's prompt size must not show in timing."""
    if not _JOB_ID.match(job_id):
        raise job_not_found(job_id)
    exists, job_owner = await queue.get_owner(job_id)
    if not exists or not can_access(owner, job_owner):
        raise job_not_found(job_id)


@router.get("/{job_id}", response_model=JobRecord)
async def get_job(job_id: str, queue: QueueDep, catalog: CatalogDep, owner: OwnerDep) -> JobRecord:
    """The job's record; while it runs, with its text so far and its prompt tokens (from its event log)."""
    await _owned(queue, job_id, owner)
    record = await queue.get(job_id)
    if record is None:
        raise job_not_found(job_id)
    if record.status is JobStatus.RUNNING:
        submission = await queue.get_submission(job_id)  # read only once the owner is known to be the caller
        if submission is not None:
            return await with_progress(queue, catalog, submission, record)
    return record


@router.delete("/{job_id}", response_model=JobRecord)
async def cancel_job(job_id: str, queue: QueueDep, owner: OwnerDep) -> JobRecord:
    """Cancel a queued or running job; a finished job is returned unchanged."""
    await _owned(queue, job_id, owner)
    record = await queue.cancel(job_id)
    if record is None:
        raise job_not_found(job_id)
    return record


@router.get("/{job_id}/events", response_class=Response,
            responses={200: {"content": {"text/event-stream": {}}, "description": "SSE: token|restart|done|error"}})
async def job_events(job_id: str, queue: QueueDep, metrics: MetricsDep, owner: OwnerDep,
                     last_event_id: Annotated[str | None, Header()] = None,
                     after: Annotated[int | None, Query(ge=0, le=MAX_EVENT_SEQ, description="as Last-Event-ID")
                                      ] = None
                     ) -> EventStreamResponse:
    """The job's events from the start, or after ``Last-Event-ID``: ``id: <seq>``, ``event: <type>``,
    ``data: <json>``. The stream ends after ``done`` (data: the final job) or ``error``."""
    await _owned(queue, job_id, owner)
    after_seq = after if after is not None else _parse_last_event_id(last_event_id)
    relay = JobRelay(queue, job_id, after_seq=after_seq)
    await relay.start()
    return EventStreamResponse(_job_event_stream(relay, metrics))


def _parse_last_event_id(value: str | None) -> int:
    if value is None or not value.strip():
        return 0
    try:
        seq = int(value.strip())
    except ValueError:
        raise invalid_request("Last-Event-ID must be an event id (a sequence number)",
                              param="Last-Event-ID") from None
    if not 0 <= seq <= MAX_EVENT_SEQ:
        raise invalid_request(f"Last-Event-ID must be between 0 and {MAX_EVENT_SEQ}", param="Last-Event-ID")
    return seq


def _event_data(event: StreamEvent) -> dict[str, Any]:
    if isinstance(event, DoneEvent):
        return event.job.model_dump(mode="json")
    data: dict[str, Any] = event.model_dump(mode="json", exclude={"type"})
    return data


async def _job_event_stream(relay: JobRelay, metrics: MetricsDep) -> AsyncIterator[bytes]:
    metrics.open_streams.inc()
    try:
        async for event in relay.events():
            assert isinstance(event, TokenEvent | RestartEvent | DoneEvent | ErrorEvent)
            yield format_event(_event_data(event), event=event.type, id=event.seq)
    except REDIS_FAILURES:
        # Redis stayed away past the relay's own reopening: end without a terminal event (the job goes on), so the
        # client reconnects with Last-Event-ID as after any dropped connection (an EventSource does by itself).
        log.warning("event stream of job %s lost Redis", relay.job_id, exc_info=True, extra={"job_id": relay.job_id})
        yield STREAM_LOST
    except Exception:  # not Redis's: say so in-band (without the exception's words)
        log.warning("event stream of job %s failed", relay.job_id, exc_info=True, extra={"job_id": relay.job_id})
        yield format_event({"message": "the event stream failed"}, event="error")
    finally:
        metrics.open_streams.dec()
        await relay.close()
