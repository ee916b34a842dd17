"""Turning a validated request into a ``JobSubmission``: model, caps, prompt length, ownership, queue limits.

Both the job endpoints and the OpenAI endpoints go through here, so a limit is enforced the same way (and with
the same error) whichever door a request came in by.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, TypedDict

from fastapi import Response
from pydantic import ValidationError

from api.chat_template import ChatTemplateError
from api.errors import APIError, invalid_input, invalid_request
from api.metrics import ApiMetrics
from api.tokenization import ModelCatalog, ServedModel
from shared.config import Settings
from shared.lifecycle_log import job_fields
from shared.queue import JobQueue, QueueFullError, RateLimitedError, RateState
from shared.sampling import MAX_INT
from shared.schemas import ChatMessage, GenerationParams, JobRecord, JobSubmission, ToolSpec

log = logging.getLogger(__name__)


async def resolve_model(catalog: ModelCatalog, name: str | None) -> ServedModel:
    """The requested model (default: the served one); 404 ``model_not_found`` for an unknown name."""
    model_name = name or await catalog.default_name()
    model = await catalog.get(model_name)
    if model is None:
        served = ", ".join(await catalog.names())
        raise APIError(404, f"model {model_name!r} does not exist; served: {served}", param="model",
                       code="model_not_found")
    return model


def check_caps(settings: Settings, *, max_tokens: int | None, n: int) -> None:
    """The server's caps on one request, beyond the schema's own ranges."""
    if max_tokens is not None and max_tokens > settings.max_tokens_cap:
        raise invalid_request(f"max_tokens must be at most {settings.max_tokens_cap}, got {max_tokens}",
                              param="max_tokens", code="max_tokens_too_large")
    if n > settings.max_n:
        raise invalid_request(f"n must be between 1 and {settings.max_n}, got {n}", param="n")


def check_beam_search(settings: Settings, params: GenerationParams, *, param: str) -> None:
    """What the workers' engines (same settings) cannot run: beams beyond their seats, or beside speculative
    decoding. ``param`` names the field that asked for beam search (``beam_width``; ``n`` for the OpenAI routes)."""
    if params.beam_width <= 1:
        return
    if params.grammar is not None:
        raise invalid_request("beam search cannot be combined with response_format, guided_* or a required or named "
                              "tool_choice", param=param)
    if settings.speculative:
        raise invalid_request(f"beam search is not available on workers running speculative decoding "
                              f"({settings.speculative!r}); remove {param}", param=param)
    if params.beam_width > settings.max_num_seqs:
        raise invalid_request(f"beam width must be at most max_num_seqs ({settings.max_num_seqs}), got "
                              f"{params.beam_width}", param=param)


def render_chat(model: ServedModel, messages: list[ChatMessage], tools: list[ToolSpec] | None = None) -> str | None:
    """The model's chat template applied to ``messages`` and ``tools`` (None when the model has no card yet)."""
    if model.card is None:
        return None
    if model.chat_template is None:
        raise invalid_request(f"model {model.name!r} has no chat template; send a plain prompt instead",
                              param="messages", code="no_chat_template")
    try:
        return model.chat_template.render([m.model_dump(exclude_none=True) for m in messages],
                                          add_generation_prompt=True,
                                          tools=[t.model_dump(exclude_none=True) for t in tools or []])
    except ChatTemplateError as exc:
        raise invalid_request(f"the chat template rejected the messages: {exc}", param="messages") from exc


async def count_prompt_tokens(model: ServedModel, *, prompt: str | None = None,
                              prompt_token_ids: list[int] | None = None,
                              messages: list[ChatMessage] | None = None, tools: list[ToolSpec] | None = None
                              ) -> int | None:
    """Prompt tokens as the worker will see them; None when the API cannot know (no tokenizer yet).

    Token ids are also range-checked here: an id past the vocabulary would fail deep inside the worker. Text is
    first checked against the model's character bound (cheap), then tokenized off the event loop.
    """
    if prompt_token_ids is not None:
        # Before a worker has published the model's card the vocabulary is unknown, but no vocabulary reaches
        # MAX_INT: an id past it could only overflow the worker's int64 tensors.
        card = model.card
        limit = card.vocab_size if card is not None else MAX_INT + 1
        if any(t >= limit for t in prompt_token_ids):
            bound = f"the vocabulary size {limit}" if card is not None else f"{limit} (no vocabulary is larger)"
            raise invalid_request(f"prompt token ids must be below {bound}", param="prompt_token_ids")
        return len(prompt_token_ids)
    if messages is not None:
        rendered = render_chat(model, messages, tools)
        if rendered is None:
            return None
        check_chars(model, rendered, param="messages")
        return await model.count_chat_tokens(rendered)
    assert prompt is not None
    check_chars(model, prompt, param="prompt")
    return await model.count_prompt_tokens(prompt)


def check_chars(model: ServedModel, text: str, param: str) -> None:
    """400 ``context_length_exceeded`` for a text longer than any prompt that fits the model's context, before
    spending time on tokenizing it (``ServedModel.max_prompt_chars``)."""
    limit = model.max_prompt_chars
    if limit is not None and len(text) > limit:
        raise invalid_request(
            f"This model's maximum context length is {model.max_model_len} tokens, and no prompt that fits has "
            f"more than {limit} characters; this one has {len(text)}. Please reduce the prompt.",
            param=param, code="context_length_exceeded",
        )


def default_max_tokens(settings: Settings, model: ServedModel, num_prompt_tokens: int | None) -> int:
    """For chat requests without a limit: the rest of the context window, within the server's cap."""
    if model.max_model_len is None or num_prompt_tokens is None:
        return settings.max_tokens_cap
    return max(1, min(settings.max_tokens_cap, model.max_model_len - num_prompt_tokens))


def check_length(model: ServedModel, num_prompt_tokens: int | None, max_tokens: int, param: str) -> None:
    """400 ``context_length_exceeded`` when prompt + completion cannot fit the model's context window."""
    limit = model.max_model_len
    if limit is None or num_prompt_tokens is None:
        return
    if num_prompt_tokens + max_tokens > limit:
        raise invalid_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param=param, code="context_length_exceeded",
        )


def build_params(fields: dict[str, Any]) -> GenerationParams:
    """``GenerationParams`` from request fields, dropping unset (None) ones so the defaults apply."""
    try:
        return GenerationParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise invalid_input(exc) from exc


def build_submission(*, job_id: str, model: ServedModel, params: GenerationParams, owner: str | None, n: int,
                     priority: int, background: bool, idempotency_key: str | None = None,
                     prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                     messages: list[ChatMessage] | None = None, tools: list[ToolSpec] | None = None,
                     queue_timeout_s: float | None = None, timeout_s: float | None = None) -> JobSubmission:
    """The wire job. Idempotency keys need no scoping here: the queue keys them by owner, so two tenants
    choosing the same key never see each other's job."""
    try:
        return JobSubmission(
            id=job_id, model=model.name, prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages,
            tools=tools or None,
            params=params, n=n, priority=priority, idempotency_key=idempotency_key,
            owner=owner, background=background, created_at=time.time(), queue_timeout_s=queue_timeout_s,
            timeout_s=timeout_s,
        )
    except ValidationError as exc:
        raise invalid_input(exc) from exc


def rate_headers(state: RateState | None) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for a key's budget (only the limits it has)."""
    if state is None:
        return {}
    headers: dict[str, str] = {}
    for kind, limit, left, reset_s in (("requests", state.limit_requests, state.remaining_requests,
                                        state.reset_requests_s),
                                       ("tokens", state.limit_tokens, state.remaining_tokens, state.reset_tokens_s)):
        if limit:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(left)
            headers[f"x-ratelimit-reset-{kind}"] = reset_duration(reset_s)
    return headers


def reset_duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def rate_limited(exc: RateLimitedError, owner: str | None, metrics: ApiMetrics) -> APIError:
    """429 ``rate_limit_exceeded`` with ``Retry-After`` and the key's ``x-ratelimit-*`` headers."""
    metrics.rate_limited(owner, exc.limit)
    what = {"requests": "requests per minute", "tokens": "tokens per minute", "jobs": "unfinished jobs"}[exc.limit]
    headers = rate_headers(exc.state)
    if exc.retry_after_s is None:
        message = f"Request too large: it needs more tokens than this key's {what} limit allows."
    else:
        retry_after = max(1, math.ceil(exc.retry_after_s))
        headers["Retry-After"] = str(retry_after)
        message = f"Rate limit reached on {what} for this API key. Please try again in {retry_after}s."
    return APIError(429, message, type=exc.limit, code="rate_limit_exceeded", headers=headers)


def refused(exc: QueueFullError | RateLimitedError, owner: str | None, metrics: ApiMetrics) -> APIError:
    """The 429 that answers a submission the queue refused (queue full, or a rate limit)."""
    if isinstance(exc, RateLimitedError):
        return rate_limited(exc, owner, metrics)
    return queue_full(exc, metrics)


class Deadlines(TypedDict):
    """A job's timeouts, as ``build_submission`` takes them."""

    queue_timeout_s: float | None
    timeout_s: float | None


def deadlines(settings: Settings, queue_timeout_s: float | None, timeout_s: float | None) -> Deadlines:
    """A job's ``queue_timeout_s`` and ``timeout_s``: the request's, else the server's defaults."""
    return {"queue_timeout_s": queue_timeout_s if queue_timeout_s is not None else settings.queue_timeout_s,
            "timeout_s": timeout_s if timeout_s is not None else settings.job_timeout_s}


def queue_full(exc: QueueFullError, metrics: ApiMetrics) -> APIError:
    """429 with ``Retry-After`` (whole seconds, at least 1) from the queue's estimate."""
    metrics.jobs_rejected.labels("queue_full").inc()
    retry_after = max(1, math.ceil(exc.retry_after_s))
    return APIError(429, f"the queue is full; retry after {retry_after} s", code="queue_full",
                    headers={"Retry-After": str(retry_after)})


async def submit(queue: JobQueue, submission: JobSubmission, metrics: ApiMetrics, endpoint: str,
                 response: Response | None = None) -> tuple[JobRecord, bool]:
    """Enqueue (no stream); 429 when the model's queue is full or a rate limit refuses it. ``response`` gets the
    key's ``x-ratelimit-*`` headers."""
    try:
        record, created, rate = await queue.submit_with_rate(submission)
    except (QueueFullError, RateLimitedError) as exc:
        raise refused(exc, submission.owner, metrics) from exc
    if response is not None:
        response.headers.update(rate_headers(rate))
    if created:
        record_submitted(metrics, submission, endpoint)
    return record, created


def record_submitted(metrics: ApiMetrics, submission: JobSubmission, endpoint: str) -> None:
    """Count and log a job this API enqueued (never its prompt: the worker logs that, if ``log_prompts``)."""
    metrics.job_submitted(submission.model, endpoint, submission.owner)
    log.info("job %s submitted", submission.id,
             extra=job_fields("submitted", submission.id, submission.model, endpoint=endpoint,
                              priority=submission.priority, n=submission.n, background=submission.background))
