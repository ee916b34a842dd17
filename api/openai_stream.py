"""Streamed OpenAI responses: job stream events relayed as ``data: {chunk}`` lines, then ``data: [DONE]``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from api.errors import error_body
from api.metrics import ApiMetrics
from api.openai_format import StreamDiverged, StreamText, chat_logprobs, completion_logprobs, usage_info
from api.openai_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
)
from api.relay import JobRelay
from api.sse import format_event
from shared.schemas import (
    DoneEvent,
    ErrorEvent,
    JobStatus,
    RestartEvent,
    StreamEvent,
    TokenEvent,
    TokenLogprob,
    Usage,
)

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


class ChunkFormat(Protocol):
    """How one endpoint shapes its chunks."""

    def opening(self, index: int) -> BaseModel | None: ...
    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel | None: ...
    def finish(self, index: int, text: str, finish_reason: str) -> BaseModel: ...
    def usage(self, usage: Usage) -> BaseModel: ...


@dataclass(frozen=True)
class CompletionChunks:
    completion_id: str
    created: int
    model: str
    want_logprobs: bool

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.completion_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage_info(usage) if usage is not None else None)

    def opening(self, index: int) -> BaseModel | None:
        return None

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        lps = completion_logprobs(logprobs or []) if self.want_logprobs else None
        return self._chunk([CompletionChoice(index=index, text=text, logprobs=lps)])

    def finish(self, index: int, text: str, finish_reason: str) -> BaseModel:
        return self._chunk([CompletionChoice(index=index, text=text, finish_reason=finish_reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)


@dataclass(frozen=True)
class ChatChunks:
    completion_id: str
    created: int
    model: str
    want_logprobs: bool

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.completion_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage_info(usage) if usage is not None else None)

    def opening(self, index: int) -> BaseModel | None:
        # OpenAI sends the role first, with empty content, once per choice.
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> BaseModel:
        lps = chat_logprobs(logprobs or []) if self.want_logprobs else None
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=lps)])

    def finish(self, index: int, text: str, finish_reason: str) -> BaseModel:
        delta = ChatDelta(content=text) if text else ChatDelta()
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)


@dataclass
class RunningUsage:
    """A streamed job's usage so far, for ``stream_options.continuous_usage_stats`` (vLLM's extension): the
    prompt's tokens as the worker counted them (the first token event of each attempt carries the count) and the
    tokens of all choices of the current attempt so far; at the end, the final record's usage."""

    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0

    def observe(self, event: StreamEvent) -> None:
        if isinstance(event, TokenEvent):
            if event.num_prompt_tokens is not None:
                self.num_prompt_tokens = event.num_prompt_tokens
            self.num_completion_tokens += len(event.token_ids)
        elif isinstance(event, RestartEvent):
            # The next attempt generates from scratch; its text is swallowed (no chunks) until it passes what was
            # sent, by which point it has counted at least the tokens behind that text again.
            self.num_completion_tokens = 0
        elif isinstance(event, DoneEvent):  # the record's count (the only one when no token came first)
            self.num_prompt_tokens = event.job.usage.prompt_tokens
            self.num_completion_tokens = event.job.usage.completion_tokens

    def info(self, *, before_output: bool = False) -> UsageInfo:
        """The usage so far; ``before_output``: as it was before the first token (chat's role chunks)."""
        completion_tokens = 0 if before_output else self.num_completion_tokens
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=self.num_prompt_tokens + completion_tokens)


def _data(chunk: BaseModel, usage: UsageInfo | None = None) -> bytes:
    """One chunk as an SSE event; with ``usage`` (continuous usage stats), the chunk carries it."""
    if usage is not None:
        assert "usage" in type(chunk).model_fields, type(chunk)
        chunk = chunk.model_copy(update={"usage": usage})
    return format_event(chunk.model_dump_json())


def _error(message: str) -> bytes:
    return format_event(error_body(500, message, type="server_error"))


def _openings(fmt: ChunkFormat, n: int, usage: UsageInfo | None) -> list[bytes]:
    return [_data(opening, usage) for index in range(n) if (opening := fmt.opening(index)) is not None]


async def openai_stream(relay: JobRelay, fmt: ChunkFormat, *, n: int, include_usage: bool, metrics: ApiMetrics,
                        continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """Relay a job as OpenAI chunks; always closes the relay (unsubscribing) when the response ends.

    With ``continuous_usage`` every chunk carries the usage so far; the opening chunks (chat's role chunks) then
    wait for the job's first event, which brings the prompt's token count from the worker."""
    metrics.open_streams.inc()
    text = StreamText()
    running = RunningUsage() if continuous_usage else None
    opened = running is None  # the opening chunks went out (at once without continuous usage)
    try:
        if running is None:
            for chunk in _openings(fmt, n, None):
                yield chunk
        async for event in relay.events():
            usage = None
            if running is not None:
                running.observe(event)
                usage = running.info()
                if not opened:
                    opened = True
                    for chunk in _openings(fmt, n, running.info(before_output=True)):
                        yield chunk
            if isinstance(event, TokenEvent):
                new = text.push(event.index, event.text)
                if new or (event.logprobs and not text.choices[event.index].replay):
                    delta = fmt.delta(event.index, new, event.logprobs)
                    if delta is not None:  # a format may hold text back (api.tool_calls)
                        yield _data(delta, usage)
            elif isinstance(event, RestartEvent):
                text.restart()
            elif isinstance(event, ErrorEvent):
                yield _error(event.message)
            elif isinstance(event, DoneEvent):
                final = usage_info(event.job.usage) if running is not None else None  # as the usage chunk's
                for chunk in _closing_chunks(event, fmt, text, n, include_usage, final):
                    yield chunk
        yield DONE
    except StreamDiverged:
        yield _error("the job was restarted and regenerated different text; retry the request (use a seed or "
                     "temperature 0 for reproducible restarts)")
        yield DONE
    except Exception:
        log.exception("stream of job %s failed", relay.job_id)
        yield _error("the stream failed")
        yield DONE
    finally:
        metrics.open_streams.dec()
        await relay.close()


def _closing_chunks(done: DoneEvent, fmt: ChunkFormat, text: StreamText, n: int, include_usage: bool,
                    usage: UsageInfo | None) -> list[bytes]:
    """The choices' finish chunks (each carrying ``usage`` when given) and the usage chunk."""
    job = done.job
    if job.status == JobStatus.FAILED or (job.status == JobStatus.EXPIRED and not job.choices):
        return [_error(job.error or f"the job {job.status.value}")]
    by_index = {choice.index: choice for choice in job.choices}
    chunks = []
    for index in range(n):
        choice = by_index.get(index)
        if choice is None or job.status == JobStatus.CANCELLED:
            # A cancelled job's record may hold less than was streamed: close the choice, add nothing.
            chunks.append(_data(fmt.finish(index, "", (choice.finish_reason if choice else None) or "abort"), usage))
            continue
        rest = text.remainder(index, choice.text)
        chunks.append(_data(fmt.finish(index, rest, choice.finish_reason or "abort"), usage))
    if include_usage:
        chunks.append(_data(fmt.usage(job.usage)))
    return chunks
