"""OpenAI-compatible endpoints. Every request becomes a job (``cmpl-<job id>`` is ``GET /v1/jobs/<job id>``).

The job's stream is subscribed before the job is enqueued; streamed responses relay deltas as they arrive,
non-streamed ones wait for the final record. A client that disconnects cancels its job unless it asked for
``background: true``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from api.deps import CatalogDep, MetricsDep, OwnerDep, QueueDep, SettingsDep
from api.errors import APIError, invalid_request
from api.openai_format import chat_response, completion_response
from api.openai_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageIn,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    ModelObject,
    SamplingRequest,
)
from api.openai_prompts import finished_job, run_prompts, split_prompts
from api.openai_stream import ChatChunks, ChunkFormat, CompletionChunks, openai_stream
from api.relay import JobRelay, run_until_disconnect
from api.sse import EventStreamResponse
from api.structured_output import grammar_of
from api.submission import (
    build_params,
    build_submission,
    check_beam_search,
    check_caps,
    check_length,
    count_prompt_tokens,
    deadlines,
    default_max_tokens,
    rate_headers,
    record_submitted,
    refused,
    resolve_model,
)
from api.tokenization import ModelCatalog, ServedModel
from api.tool_calls import ToolCallChunks, ToolPlan, apply_tool_calls, plan_tools
from shared.config import Settings
from shared.queue import JobQueue, QueueFullError, RateLimitedError
from shared.queue.client import ClientSide
from shared.schemas import ChatMessage, FunctionCall, GenerationParams, Grammar, JobRecord, JobSubmission, ToolCall

router = APIRouter(prefix="/v1", tags=["openai"])

_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@router.get("/models", response_model=ModelList)
async def list_models(catalog: CatalogDep, _owner: OwnerDep) -> ModelList:
    """The served models: every model a worker has published, plus the configured one."""
    data = []
    for name in await catalog.names():
        model = await catalog.get(name)
        data.append(ModelObject(id=name, max_model_len=model.max_model_len if model else None))
    return ModelList(data=data)


@router.get("/models/{model_id:path}", response_model=ModelObject)
async def retrieve_model(model_id: str, catalog: CatalogDep, _owner: OwnerDep) -> ModelObject:
    """One served model (``client.models.retrieve``); 404 ``model_not_found`` for any other name."""
    if model_id not in await catalog.names():
        raise APIError(404, f"The model '{model_id}' does not exist", type="invalid_request_error",
                       code="model_not_found", param="model")
    model = await catalog.get(model_id)
    return ModelObject(id=model_id, max_model_len=model.max_model_len if model else None)


@router.post("/completions", response_model=CompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
async def create_completion(body: CompletionRequest, request: Request, settings: SettingsDep, queue: QueueDep,
                            catalog: CatalogDep, metrics: MetricsDep, owner: OwnerDep) -> Response:
    model, submissions = await completion_submissions(body, settings, catalog, queue, owner)
    created = int(time.time())
    if len(submissions) > 1:
        return await run_prompts(request, queue, metrics, submissions, created=created, n=body.n,
                                 want_logprobs=body.logprobs is not None)
    submission = submissions[0]
    job_id = submission.id
    fmt = CompletionChunks(f"cmpl-{job_id}", created, model.name, body.logprobs is not None)

    def render(job: JobRecord) -> CompletionResponse:
        return completion_response(job, completion_id=f"cmpl-{job_id}", created=created, n=body.n,
                                   want_logprobs=body.logprobs is not None)

    return await _run_job(request, queue, metrics, submission, body, fmt, render, endpoint="completions")


@router.post("/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, settings: SettingsDep,
                                 queue: QueueDep, catalog: CatalogDep, metrics: MetricsDep, owner: OwnerDep
                                 ) -> Response:
    model, submission, tool_plan = await chat_submission(body, settings, catalog, queue, owner)
    job_id = submission.id
    created = int(time.time())
    chunks = ChatChunks(f"chatcmpl-{job_id}", created, model.name, body.logprobs)
    fmt: ChunkFormat = ToolCallChunks(chunks, tool_plan) if tool_plan else chunks

    def render(job: JobRecord) -> ChatCompletionResponse:
        response = chat_response(job, completion_id=f"chatcmpl-{job_id}", created=created, n=body.n,
                                 want_logprobs=body.logprobs)
        return apply_tool_calls(response, tool_plan) if tool_plan else response

    return await _run_job(request, queue, metrics, submission, body, fmt, render, endpoint="chat")


async def completion_submissions(body: CompletionRequest, settings: Settings, catalog: ModelCatalog,
                                 queue: ClientSide, owner: str | None, *, job_id: str | None = None,
                                 priority: int | None = None, background: bool | None = None
                                 ) -> tuple[ServedModel, list[JobSubmission]]:
    """The jobs of a completion request, after every check the endpoint makes (APIError when it refuses).
    ``job_id``/``priority``/``background`` override the request's (a batch line: one prompt, its own id)."""
    _reject_unsupported_completion(body)
    check_caps(settings, max_tokens=body.max_tokens, n=body.n)
    prompts = split_prompts(body.prompt)
    if len(prompts) > 1 and body.stream:
        raise invalid_request("a list of prompts cannot be streamed; stream one request per prompt", param="prompt")
    if len(prompts) > settings.max_batch_size:
        raise invalid_request(f"at most {settings.max_batch_size} prompts per request, got {len(prompts)}",
                              param="prompt")
    if job_id is not None and len(prompts) > 1:
        raise invalid_request("a batch line takes one prompt, got a list", param="prompt")
    model = await resolve_model(catalog, body.model)
    params = _params(body, max_tokens=body.max_tokens, logprobs=body.logprobs)
    params = params.model_copy(update={"grammar": grammar_of(body.response_format, body.structured_extras())})
    check_beam_search(settings, params, param="n")
    submissions = []
    for prompt, prompt_token_ids in prompts:
        num_prompt_tokens = await count_prompt_tokens(model, prompt=prompt, prompt_token_ids=prompt_token_ids)
        check_length(model, num_prompt_tokens, params.max_tokens, param="prompt")
        submissions.append(build_submission(
            job_id=job_id or queue.job_id_for(owner), model=model, params=params, owner=owner, n=body.n,
            priority=body.priority if priority is None else priority,
            background=body.background if background is None else background, prompt=prompt,
            prompt_token_ids=prompt_token_ids, **deadlines(settings, body.queue_timeout_s, body.timeout_s)))
    return model, submissions


async def chat_submission(body: ChatCompletionRequest, settings: Settings, catalog: ModelCatalog,
                          queue: ClientSide, owner: str | None, *, job_id: str | None = None,
                          priority: int | None = None, background: bool | None = None
                          ) -> tuple[ServedModel, JobSubmission, ToolPlan | None]:
    """The job of a chat completion request, after every check the endpoint makes (APIError when it refuses), and
    its tool plan (None without tools): how its output becomes tool calls."""
    _reject_unsupported_chat(body)
    requested_max = body.max_completion_tokens or body.max_tokens
    check_caps(settings, max_tokens=requested_max, n=body.n)
    messages = _chat_messages(body.messages)
    tool_plan = plan_tools(body)
    tools = tool_plan.tools if tool_plan else None
    model = await resolve_model(catalog, body.model)
    num_prompt_tokens = await count_prompt_tokens(model, messages=messages, tools=tools)
    max_tokens = requested_max or default_max_tokens(settings, model, num_prompt_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(body, max_tokens=max_tokens, logprobs=logprobs)
    params = params.model_copy(update={"grammar": _chat_grammar(body, tool_plan)})
    check_beam_search(settings, params, param="n")
    check_length(model, num_prompt_tokens, params.max_tokens, param="messages")
    submission = build_submission(job_id=job_id or queue.job_id_for(owner), model=model, params=params,
                                  owner=owner, n=body.n,
                                  priority=body.priority if priority is None else priority,
                                  background=body.background if background is None else background,
                                  messages=messages, tools=tools,
                                  **deadlines(settings, body.queue_timeout_s, body.timeout_s))
    return model, submission, tool_plan


async def _run_job(request: Request, queue: JobQueue, metrics: MetricsDep, submission: JobSubmission,
                   body: SamplingRequest, fmt: ChunkFormat, render: Callable[[JobRecord], BaseModel],
                   endpoint: str) -> Response:
    """Subscribe, enqueue, then stream the job or wait for it; cancel it if the client leaves."""
    relay = JobRelay(queue, submission.id, submission=submission)
    try:
        await relay.start()
    except (QueueFullError, RateLimitedError) as exc:
        raise refused(exc, submission.owner, metrics) from exc
    record_submitted(metrics, submission, endpoint)

    async def cancel_if_abandoned() -> None:
        if not submission.background and not relay.finished:
            await queue.cancel(submission.id)

    headers = rate_headers(relay.rate)
    if body.stream:
        options = body.stream_options
        stream = openai_stream(relay, fmt, n=submission.n, include_usage=options is not None and options.include_usage,
                               continuous_usage=options is not None and options.continuous_usage_stats,
                               metrics=metrics)
        response = EventStreamResponse(stream, on_disconnect=cancel_if_abandoned)
        response.headers.update(headers)
        return response
    try:
        final, disconnected = await run_until_disconnect(relay.final, request.receive)
    finally:
        await relay.close()
    if disconnected:
        with anyio.CancelScope(shield=True):
            await cancel_if_abandoned()
        return Response(status_code=499)  # nobody reads this: the client is gone
    return Response(render(finished_job(final)).model_dump_json(), media_type="application/json", headers=headers)


def _params(body: SamplingRequest, *, max_tokens: int | None, logprobs: int | None) -> GenerationParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop) if body.stop is not None else None
    return build_params({
        "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "seed": body.seed, "stop": stop, "stop_token_ids": tuple(body.stop_token_ids or ()) or None,
        "ignore_eos": body.ignore_eos, "min_tokens": body.min_tokens, "logprobs": logprobs,
        **_beam_fields(body),
    })


def _beam_fields(body: SamplingRequest) -> dict[str, object]:
    """vLLM's ``use_beam_search``: a beam search of width ``n`` that returns all n beams. Streaming it is refused
    (the beams are only known when the search ends; vLLM refuses it too), and so are its knobs without it."""
    if not body.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(body, name) is not None:
                raise invalid_request(f"{name} needs use_beam_search: true", param=name)
        return {}
    if body.stream:
        raise invalid_request("beam search cannot be streamed: its beams are only known when the search ends; "
                              "send stream: false", param="stream")
    if body.n < 2:
        raise invalid_request("use_beam_search needs n >= 2 (n is the beam width)", param="n")
    return {"beam_width": body.n, "length_penalty": body.length_penalty, "early_stopping": body.early_stopping}
def _chat_grammar(body: ChatCompletionRequest, tool_plan: ToolPlan | None) -> Grammar | None:
    """The response_format's grammar, or the one a required/named tool choice needs (not both)."""
    grammar = grammar_of(body.response_format, body.structured_extras())
    tool_grammar = tool_plan.grammar() if tool_plan else None
    if grammar is not None and tool_grammar is not None:
        raise invalid_request("a required or named tool_choice cannot be combined with response_format",
                              param="tool_choice")
    return grammar or tool_grammar


def _chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """OpenAI messages as wire ChatMessages: text content only (content parts joined); tool calls kept."""
    out = []
    for i, message in enumerate(messages):
        if message.role not in _CHAT_ROLES:
            raise invalid_request(f"role must be one of {', '.join(_CHAT_ROLES)}", param=f"messages.{i}.role")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise invalid_request("only text content parts are supported", param=f"messages.{i}.content")
            content = "\n".join(part.text or "" for part in content)
        if content is None and not (message.role == "assistant" and message.tool_calls):
            raise invalid_request("message content is required", param=f"messages.{i}.content")
        tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments))
                      for c in message.tool_calls or []] or None
        if tool_calls and message.role != "assistant":
            raise invalid_request("only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls")
        out.append(ChatMessage(role=message.role, content=content or "", tool_calls=tool_calls,
                               tool_call_id=message.tool_call_id, name=message.name))
    return out


def _reject_unsupported_completion(body: CompletionRequest) -> None:
    _reject_unsupported_stream_options(body)
    if body.echo:
        raise invalid_request("echo is not supported", param="echo")
    if body.suffix:
        raise invalid_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid_request("best_of is not supported (other than best_of == n)", param="best_of")
    if body.logit_bias:
        raise invalid_request("logit_bias is not supported", param="logit_bias")


# (tool_choice and parallel_tool_calls are checked with tools: api/tool_calls.py)
_UNHONOURED_CHAT_FIELDS = ("functions", "function_call", "audio", "reasoning_effort", "prediction",
                           "web_search_options")


def _reject_unsupported_stream_options(body: SamplingRequest) -> None:
    options = body.stream_options
    if options is not None and not body.stream:
        raise invalid_request("stream_options is only allowed with stream: true", param="stream_options")
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        # vLLM ignores it without include_usage; here a field accepted is a field honoured
        raise invalid_request("continuous_usage_stats needs include_usage: true",
                              param="stream_options.continuous_usage_stats")
    if options is not None and options.include_obfuscation:
        raise invalid_request("include_obfuscation is not supported: stream events are never padded (send false "
                              "or leave it out)", param="stream_options.include_obfuscation")


def _reject_unsupported_chat(body: ChatCompletionRequest) -> None:
    _reject_unsupported_stream_options(body)
    for name in _UNHONOURED_CHAT_FIELDS:
        if getattr(body, name) is not None:
            raise invalid_request(f"{name} is not supported", param=name)
    if body.modalities is not None and body.modalities != ["text"]:
        raise invalid_request("only the text modality is supported", param="modalities")
    if body.top_logprobs and not body.logprobs:
        raise invalid_request("top_logprobs requires logprobs: true", param="top_logprobs")
    if body.logit_bias:
        raise invalid_request("logit_bias is not supported", param="logit_bias")
