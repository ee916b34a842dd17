"""Job records and stream events rendered as OpenAI completion / chat completion bodies and chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

from api.openai_models import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from shared.schemas import Choice, JobRecord, TokenLogprob, Usage


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def token_bytes(lp: TokenLogprob) -> bytes:
    """The token's raw bytes (recorded by the worker; older records: its text in UTF-8)."""
    return bytes(lp.bytes) if lp.bytes is not None else lp.token.encode()


def completion_logprobs(logprobs: list[TokenLogprob], text_offset: int = 0) -> CompletionLogprobs:
    """The legacy completions format: parallel lists, ``text_offset`` counted in characters of the text (a token
    that starts inside a multi-byte character points at that character)."""
    offsets = []
    generated = b""
    for lp in logprobs:
        offsets.append(text_offset + len(generated.decode("utf-8", errors="ignore")))
        generated += token_bytes(lp)
    return CompletionLogprobs(
        tokens=[lp.token for lp in logprobs],
        token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=[{token: value for _, token, value in lp.top} or {lp.token: lp.logprob} for lp in logprobs],
        text_offset=offsets,
    )


def chat_logprobs(logprobs: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=lp.token, logprob=lp.logprob, bytes=list(token_bytes(lp)),
            top_logprobs=[TopLogprob(token=token, logprob=value,
                                     bytes=lp.top_bytes[i] if lp.top_bytes else list(token.encode()))
                          for i, (_, token, value) in enumerate(lp.top)],
        )
        for lp in logprobs
    ])


def _choices(job: JobRecord, n: int) -> list[Choice]:
    """All ``n`` choices in index order; a cancelled job may lack some, which then come back empty."""
    by_index = {choice.index: choice for choice in job.choices}
    return [by_index.get(i) or Choice(index=i, text="", finish_reason="abort") for i in range(n)]


def completion_response(job: JobRecord, *, completion_id: str, created: int, n: int, want_logprobs: bool
                        ) -> CompletionResponse:
    return CompletionResponse(
        id=completion_id, created=created, model=job.model, usage=usage_info(job.usage),
        choices=[
            CompletionChoice(
                index=c.index, text=c.text, finish_reason=c.finish_reason or "abort",
                logprobs=completion_logprobs(c.logprobs or []) if want_logprobs else None,
            )
            for c in _choices(job, n)
        ],
    )


def chat_response(job: JobRecord, *, completion_id: str, created: int, n: int, want_logprobs: bool
                  ) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=completion_id, created=created, model=job.model, usage=usage_info(job.usage),
        choices=[
            ChatChoice(
                index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason or "abort",
                logprobs=chat_logprobs(c.logprobs or []) if want_logprobs else None,
            )
            for c in _choices(job, n)
        ],
    )


class StreamDiverged(Exception):
    """After a restart the job produced different text than the client already received."""


@dataclass
class _ChoiceText:
    sent: str = ""
    replay: str | None = None  # text regenerated since a restart, while it is still a prefix of ``sent``


@dataclass
class StreamText:
    """What each choice's client has received, so a job restart (another worker regenerating from scratch)
    does not send the same text twice.

    An OpenAI stream cannot take text back. After a ``restart`` event the regenerated text is swallowed while it
    repeats what was sent, and streaming resumes where the client left off. Greedy or seeded jobs regenerate
    identically; if the new text differs, ``StreamDiverged`` ends the stream with an error instead of
    silently mixing two generations. The final record is checked the same way (``remainder``), which also
    delivers any tail the live stream did not carry.
    """

    choices: dict[int, _ChoiceText] = field(default_factory=dict)

    def push(self, index: int, text: str) -> str:
        """The part of a token delta that is new to the client ('' while replaying)."""
        state = self.choices.setdefault(index, _ChoiceText())
        if state.replay is None:
            state.sent += text
            return text
        state.replay += text
        if len(state.replay) <= len(state.sent):
            if not state.sent.startswith(state.replay):
                raise StreamDiverged
            return ""
        if not state.replay.startswith(state.sent):
            raise StreamDiverged
        new = state.replay[len(state.sent):]
        state.sent, state.replay = state.replay, None
        return new

    def restart(self) -> None:
        for state in self.choices.values():
            state.replay = ""

    def remainder(self, index: int, final_text: str) -> str:
        """Text of the final record the client has not received yet."""
        state = self.choices.setdefault(index, _ChoiceText())
        if not final_text.startswith(state.sent):
            raise StreamDiverged
        rest = final_text[len(state.sent):]
        state.sent, state.replay = final_text, None
        return rest
