"""``POST /v1/responses``: OpenAI's Responses API, basic: text (or message) input, text output, streamed as its
semantic events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).

Each request is one job of chat messages (``instructions`` become the system message), so it queues, streams and
cancels like a chat completion. ``text.format`` json_object / json_schema constrain the output as
``response_format`` does. Refused with a 400 naming the field: ``previous_response_id`` and ``conversation``
(nothing is stored), ``tools``/``tool_choice``, ``reasoning``, ``include``, and non-text input parts.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from api.deps import CatalogDep, MetricsDep, OwnerDep, QueueDep, SettingsDep
from api.errors import invalid_request
from api.openai_format import StreamText
from api.openai_models import SamplingRequest
from api.relay import JobRelay
from api.routes.openai import _run_job
from api.sse import EventStreamResponse, format_event
from api.structured_output import grammar_of
from api.submission import (
    build_params,
    build_submission,
    check_caps,
    check_length,
    count_prompt_tokens,
    default_max_tokens,
    queue_full,
    record_submitted,
    resolve_model,
)
from shared.queue import QueueFullError
from shared.schemas import ChatMessage, DoneEvent, ErrorEvent, JobRecord, JobStatus, RestartEvent, TokenEvent

router = APIRouter(prefix="/v1", tags=["openai"])

_UNSUPPORTED = ("previous_response_id", "conversation", "tools", "tool_choice", "reasoning", "include", "prompt",
                "stream_options", "top_logprobs", "background", "max_tool_calls")


class ResponsesRequest(BaseModel):
    """The fields tokenspool reads; the unsupported ones are declared so that sending one is a 400."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: Any = None
    conversation: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: Any = None
    include: list[Any] | None = None
    prompt: Any = None
    stream_options: Any = None  # chat's usage options: a Response streams its usage in response.completed
    top_logprobs: Any = None
    background: Any = None  # a job is durable anyway: POST /v1/jobs, or a batch, for fire-and-forget
    max_tool_calls: Any = None


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        role, content = item.get("role"), item.get("content")
        if item.get("type", "message") != "message" or role not in ("user", "assistant", "system", "developer"):
            raise invalid_request("input items must be messages of role user, assistant, system or developer",
                                  param=f"input.{i}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                       and isinstance(p.get("text"), str) for p in content):
                raise invalid_request("only text content parts are supported", param=f"input.{i}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid_request("message content must be text", param=f"input.{i}.content")
        messages.append(ChatMessage(role=role, content=content))
    return messages


def _response(job_id: str, created: int, model: str, body: ResponsesRequest, status: str, text: str,
              job: JobRecord | None = None) -> dict[str, Any]:
    """The Response object (``status``: in_progress, completed, incomplete)."""
    usage = None
    if job is not None:
        usage = {"input_tokens": job.usage.prompt_tokens, "output_tokens": job.usage.completion_tokens,
                 "total_tokens": job.usage.prompt_tokens + job.usage.completion_tokens,
                 "input_tokens_details": {"cached_tokens": job.usage.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    item_status = "in_progress" if status == "in_progress" else status
    output = [] if status == "in_progress" else [{
        "type": "message", "id": f"msg_{job_id}", "status": item_status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {"id": f"resp_{job_id}", "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "metadata": body.metadata or {},
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": body.text or {"format": {"type": "text"}}}


def _final_status(job: JobRecord) -> str:
    return "incomplete" if job.choices and job.choices[0].finish_reason == "length" else "completed"


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request, settings: SettingsDep, queue: QueueDep,
                          catalog: CatalogDep, metrics: MetricsDep, owner: OwnerDep) -> Response:
    for name in _UNSUPPORTED:
        if getattr(body, name) is not None:
            raise invalid_request(f"{name} is not supported", param=name)
    check_caps(settings, max_tokens=body.max_output_tokens, n=1)
    messages = _messages(body)
    model = await resolve_model(catalog, body.model)
    num_prompt_tokens = await count_prompt_tokens(model, messages=messages)
    text_format = (body.text or {}).get("format")
    if text_format is not None and text_format.get("type") == "json_schema":  # flat here, nested in chat's
        text_format = {"type": "json_schema", "json_schema": text_format}
    params = build_params({"max_tokens": body.max_output_tokens or default_max_tokens(settings, model,
                                                                                       num_prompt_tokens),
                           "temperature": body.temperature, "top_p": body.top_p})
    params = params.model_copy(update={"grammar": grammar_of(text_format, {})})
    check_length(model, num_prompt_tokens, params.max_tokens, param="input")
    job_id = queue.job_id_for(owner)
    submission = build_submission(job_id=job_id, model=model, params=params, owner=owner, n=1, priority=0,
                                  background=False, messages=messages)
    created = int(time.time())
    if body.stream:
        relay = JobRelay(queue, job_id, submission=submission)
        try:
            await relay.start()
        except QueueFullError as exc:
            raise queue_full(exc, metrics) from exc
        record_submitted(metrics, submission, "responses")
        async def cancel_if_abandoned() -> None:
            if not relay.finished:
                await queue.cancel(job_id)

        return EventStreamResponse(_events(relay, job_id, created, model.name, body),
                                   on_disconnect=cancel_if_abandoned)

    class _Rendered(BaseModel):
        model_config = ConfigDict(extra="allow")

    def render(job: JobRecord) -> BaseModel:
        text = job.choices[0].text if job.choices else ""
        return _Rendered(**_response(job_id, created, model.name, body, _final_status(job), text, job))

    return await _run_job(request, queue, metrics, submission, SamplingRequest(), None,  # type: ignore[arg-type]
                          render, endpoint="responses")


async def _events(relay: JobRelay, job_id: str, created: int, model: str, body: ResponsesRequest
                  ) -> AsyncIterator[bytes]:
    """The Responses API's streaming events for one job; always closes the relay."""
    seq = 0
    item_id = f"msg_{job_id}"

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return format_event({"type": kind, "sequence_number": seq, **fields}, event=kind)

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    text = StreamText()
    sent = ""
    try:
        yield event("response.created", response=_response(job_id, created, model, body, "in_progress", ""))
        yield event("response.in_progress", response=_response(job_id, created, model, body, "in_progress", ""))
        yield event("response.output_item.added", output_index=0, item={
            "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
        yield event("response.content_part.added", **where, part={"type": "output_text", "text": "",
                                                                   "annotations": []})
        async for message in relay.events():
            if isinstance(message, TokenEvent):
                new = text.push(message.index, message.text)
                if new:
                    sent += new
                    yield event("response.output_text.delta", **where, delta=new)
            elif isinstance(message, RestartEvent):
                text.restart()
            elif isinstance(message, ErrorEvent):
                yield event("error", message=message.message)
            elif isinstance(message, DoneEvent):
                job = message.job
                if job.status is JobStatus.FAILED:
                    yield event("response.failed", response={
                        **_response(job_id, created, model, body, "failed", sent, job),
                        "error": {"code": "server_error", "message": job.error or "the job failed"}})
                    return
                final = job.choices[0].text if job.choices and job.status is JobStatus.SUCCEEDED else sent
                rest = text.remainder(0, final)
                if rest:
                    yield event("response.output_text.delta", **where, delta=rest)
                status = _final_status(job)
                yield event("response.output_text.done", **where, text=final)
                yield event("response.content_part.done", **where, part={"type": "output_text", "text": final,
                                                                          "annotations": []})
                response = _response(job_id, created, model, body, status, final, job)
                yield event("response.output_item.done", output_index=0, item=response["output"][0])
                yield event(f"response.{status}", response=response)
    finally:
        await relay.close()
