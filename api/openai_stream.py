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
)
from api.relay import JobRelay
from api.sse import format_event
from shared.schemas import DoneEvent, ErrorEvent, JobStatus, RestartEvent, TokenEvent, TokenLogprob, Usage

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


def _data(chunk: BaseModel) -> bytes:
    return format_event(chunk.model_dump_json())


def _error(message: str) -> bytes:
    return format_event(error_body(500, message, type="server_error"))


async def openai_stream(relay: JobRelay, fmt: ChunkFormat, *, n: int, include_usage: bool,
                        metrics: ApiMetrics) -> AsyncIterator[bytes]:
    """Relay a job as OpenAI chunks; always closes the relay (unsubscribing) when the response ends."""
    metrics.open_streams.inc()
    text = StreamText()
    try:
        for index in range(n):
            opening = fmt.opening(index)
            if opening is not None:
                yield _data(opening)
        async for event in relay.events():
            if isinstance(event, TokenEvent):
                new = text.push(event.index, event.text)
                if new or (event.logprobs and not text.choices[event.index].replay):
                    delta = fmt.delta(event.index, new, event.logprobs)
                    if delta is not None:  # a format may hold text back (api.tool_calls)
                        yield _data(delta)
            elif isinstance(event, RestartEvent):
                text.restart()
            elif isinstance(event, ErrorEvent):
                yield _error(event.message)
            elif isinstance(event, DoneEvent):
                for chunk in _closing_chunks(event, fmt, text, n, include_usage):
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


def _closing_chunks(done: DoneEvent, fmt: ChunkFormat, text: StreamText, n: int, include_usage: bool
                    ) -> list[bytes]:
    job = done.job
    if job.status == JobStatus.FAILED or (job.status == JobStatus.EXPIRED and not job.choices):
        return [_error(job.error or f"the job {job.status.value}")]
    by_index = {choice.index: choice for choice in job.choices}
    chunks = []
    for index in range(n):
        choice = by_index.get(index)
        if choice is None or job.status == JobStatus.CANCELLED:
            # A cancelled job's record may hold less than was streamed: close the choice, add nothing.
            chunks.append(_data(fmt.finish(index, "", (choice.finish_reason if choice else None) or "abort")))
            continue
        rest = text.remainder(index, choice.text)
        chunks.append(_data(fmt.finish(index, rest, choice.finish_reason or "abort")))
    if include_usage:
        chunks.append(_data(fmt.usage(job.usage)))
    return chunks
