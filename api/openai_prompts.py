"""``/v1/completions`` with a list of prompts (LangChain's ``OpenAI.batch``, LiteLLM's ``text_completion``): one job
per prompt, all or none enqueued, answered together as OpenAI does: choice ``i * n + c`` is choice ``c`` of
prompt ``i``, usage summed. A stream of several prompts is refused (one request per prompt streams instead).
"""

from __future__ import annotations

import asyncio

import anyio
from fastapi import Request, Response

from api.errors import APIError, invalid_request
from api.metrics import ApiMetrics
from api.openai_format import completion_response, usage_info
from api.openai_models import CompletionResponse
from api.relay import JobRelay, run_until_disconnect
from api.submission import record_submitted, refused
from shared.queue import JobQueue, QueueFullError, RateLimitedError
from shared.schemas import DoneEvent, ErrorEvent, JobRecord, JobStatus, JobSubmission, Usage

Prompt = tuple[str | None, list[int] | None]  # (text, None) or (None, token ids)


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The request's prompts: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise invalid_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, [int(p) for p in prompt if isinstance(p, int)])]
    prompts: list[Prompt] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str) and item:
            prompts.append((item, None))
        elif isinstance(item, list) and item:
            prompts.append((None, list(item)))
        else:
            raise invalid_request("prompt must not be empty", param=f"prompt.{i}")
    return prompts


def finished_job(final: DoneEvent | ErrorEvent | None) -> JobRecord:
    """The job of a terminal event, or the error that answers the request (a refused input is a 400)."""
    if not isinstance(final, DoneEvent):
        message = final.message if final is not None else "the job's stream ended without a result"
        raise APIError(500, message, type="server_error", code="job_lost")
    if final.job.status == JobStatus.FAILED:
        error = final.job.error or "the job failed"
        if error.startswith("invalid job"):  # the worker refused the request's input (docs/protocol.md): a 400
            raise invalid_request(error, code="invalid_job")
        raise APIError(500, error, type="server_error", code="job_failed")
    if final.job.status == JobStatus.EXPIRED and not final.job.choices:  # not started before its deadline
        raise APIError(504, final.job.error or "expired: not started within its deadline", type="timeout",
                       code="job_expired")
    return final.job


async def run_prompts(request: Request, queue: JobQueue, metrics: ApiMetrics, submissions: list[JobSubmission],
                      *, created: int, n: int, want_logprobs: bool) -> Response:
    """Enqueue every prompt's job (rolled back together when the queue is full), wait for all, answer once."""
    relays = await _start_all(queue, metrics, submissions)
    try:
        finals, disconnected = await run_until_disconnect(
            lambda: asyncio.gather(*(relay.final() for relay in relays)), request.receive)
    finally:
        for relay in relays:
            await relay.close()
    if disconnected:
        with anyio.CancelScope(shield=True):
            for submission, relay in zip(submissions, relays, strict=True):
                if not submission.background and not relay.finished:
                    await queue.cancel(submission.id)
        return Response(status_code=499)  # nobody reads this: the client is gone
    jobs = [finished_job(final) for final in finals]
    return Response(_merge(jobs, created=created, n=n, want_logprobs=want_logprobs).model_dump_json(),
                    media_type="application/json")


async def _start_all(queue: JobQueue, metrics: ApiMetrics, submissions: list[JobSubmission]) -> list[JobRelay]:
    relays: list[JobRelay] = []
    try:
        for submission in submissions:
            relay = JobRelay(queue, submission.id, submission=submission)
            await relay.start()
            relays.append(relay)
    except (QueueFullError, RateLimitedError) as exc:
        await queue.rollback([r.job_id for r in relays], "its request was refused (queue full or rate limit) and "
                             "rolled back")
        for relay in relays:
            await relay.close()
        raise refused(exc, submissions[0].owner, metrics) from exc
    for submission in submissions:
        record_submitted(metrics, submission, "completions")
    return relays


def _merge(jobs: list[JobRecord], *, created: int, n: int, want_logprobs: bool) -> CompletionResponse:
    parts = [completion_response(job, completion_id=f"cmpl-{jobs[0].id}", created=created, n=n,
                                 want_logprobs=want_logprobs) for job in jobs]
    choices = [choice.model_copy(update={"index": i * n + choice.index})
               for i, part in enumerate(parts) for choice in part.choices]
    usage = Usage(prompt_tokens=sum(j.usage.prompt_tokens for j in jobs),
                  completion_tokens=sum(j.usage.completion_tokens for j in jobs),
                  cached_tokens=sum(j.usage.cached_tokens for j in jobs))
    return parts[0].model_copy(update={"choices": choices, "usage": usage_info(usage)})
