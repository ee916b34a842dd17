"""A batch input file checked line by line before anything runs, through the chat and completions endpoints'
own request models and checks (``chat_submission`` / ``completion_submissions``): a line the endpoint would
refuse fails the batch with the endpoint's message, param and code, and the line number."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from api.batches.models import BatchError, InputLine, PreparedLine
from api.errors import APIError, invalid_input
from api.openai_models import ChatCompletionRequest, CompletionRequest
from api.routes.openai import chat_submission, completion_submissions
from api.tokenization import ModelCatalog
from shared import keys
from shared.config import Settings
from shared.queue.client import ClientSide

MAX_ERRORS = 100  # errors reported per batch; validation stops there


@dataclass(frozen=True)
class Validated:
    """The outcome: prepared lines when ``errors`` is empty."""

    lines: list[PreparedLine]
    errors: list[BatchError]


@dataclass(frozen=True)
class LineContext:
    """What every line of one batch is checked against."""

    batch_id: str
    endpoint: str
    owner: str | None
    settings: Settings
    catalog: ModelCatalog
    queue: ClientSide


def line_job_id(queue: ClientSide, batch_id: str, owner: str | None, index: int) -> str:
    """The job id of line ``index`` of a batch: fixed by the line (submitting a line twice finds the job), and in
    the queue shard the owner's jobs go to (``ClientSide.job_id_for``)."""
    return queue.job_id_for(owner, base=keys.batch_job_id(batch_id, index))


async def validate_file(content: bytes, ctx: LineContext) -> Validated:
    """Every non-blank line of ``content`` prepared, or the errors that fail the batch (at most MAX_ERRORS)."""
    try:
        text = content.decode()
    except UnicodeDecodeError:
        return Validated([], [BatchError(code="invalid_file", message="the input file is not UTF-8 text")])
    raw_lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not raw_lines:
        return Validated([], [BatchError(code="empty_file", message="the input file has no requests")])
    if len(raw_lines) > ctx.settings.batch_max_lines:
        return Validated([], [BatchError(code="too_many_requests", param="input_file_id",
                                         message=f"a batch holds at most {ctx.settings.batch_max_lines} requests, "
                                                 f"this file has {len(raw_lines)}")])
    lines: list[PreparedLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for number, raw in raw_lines:
        try:
            lines.append(await _prepare_line(raw, len(lines), seen, ctx))
        except APIError as exc:
            errors.append(BatchError(code=exc.code or "invalid_request", message=exc.message, param=exc.param,
                                     line=number))
            if len(errors) >= MAX_ERRORS:
                break
    return Validated(lines if not errors else [], errors)


async def _prepare_line(raw: str, index: int, seen: set[str], ctx: LineContext) -> PreparedLine:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the line is not valid JSON: {exc}", code="invalid_json_line") from None
    try:
        line = InputLine.model_validate(data)
    except ValidationError as exc:
        raise invalid_input(exc) from None
    if line.url != ctx.endpoint:
        raise APIError(400, f"the line's url {line.url!r} is not the batch's endpoint {ctx.endpoint!r}",
                       param="url", code="invalid_url")
    if line.custom_id in seen:
        raise APIError(400, f"custom_id {line.custom_id!r} is used by an earlier line", param="custom_id",
                       code="duplicate_custom_id")
    seen.add(line.custom_id)
    job_id = line_job_id(ctx.queue, ctx.batch_id, ctx.owner, index)
    priority = ctx.settings.batch_priority
    try:
        if ctx.endpoint == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(line.body)
            _no_stream(chat.stream)
            _, submission, tool_plan = await chat_submission(chat, ctx.settings, ctx.catalog, ctx.queue, ctx.owner,
                                                             job_id=job_id, priority=priority, background=True)
            if tool_plan is not None:  # the output file would need the tool-call parsing the endpoint does
                raise APIError(400, "tools are not supported in batch lines", param="tools", code="unsupported_value")
            return PreparedLine(custom_id=line.custom_id, want_logprobs=bool(chat.logprobs), submission=submission)
        completion = CompletionRequest.model_validate(line.body)
        _no_stream(completion.stream)
        _, submissions = await completion_submissions(completion, ctx.settings, ctx.catalog, ctx.queue, ctx.owner,
                                                  job_id=job_id,
                                                  priority=priority, background=True)
    except ValidationError as exc:
        raise invalid_input(exc) from None
    return PreparedLine(custom_id=line.custom_id, want_logprobs=completion.logprobs is not None,
                        submission=submissions[0])


def _no_stream(stream: bool) -> None:
    if stream:
        raise APIError(400, "stream is not supported in a batch", param="body.stream", code="invalid_value")
