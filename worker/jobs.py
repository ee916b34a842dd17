"""A claimed job inside the worker: how it becomes engine requests, and what its choices have produced.

The pure half of the Redis <-> engine bridge (``worker.runner``): a job's prompt as token ids, the engine
request ids of its choices, step outputs folded into per-choice progress, the events to publish and the final
result, and the model card a worker registers. No Redis and no asyncio here, so all of it is testable with a
tokenizer and hand-made step outputs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.queue import ClaimedJob
from shared.schemas import (
    Choice,
    FinishReason,
    JobResult,
    JobSubmission,
    ModelCard,
    SpecDecodeStats,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from shared.tool_prompt import template_inputs, template_supports_tools
from worker.engine import Logprob, StepOutput
from worker.port import EnginePort, Tokenizer
from worker.token_bytes import TokenBytes


def request_id(job_id: str, index: int) -> str:
    """Engine request id of choice ``index`` of a job (CONTRACTS.md)."""
    return f"{job_id}#{index}"


def split_request_id(rid: str) -> tuple[str, int]:
    job_id, _, index = rid.rpartition("#")
    return job_id, int(index)


def prompt_token_ids(job: JobSubmission, tokenizer: Tokenizer) -> list[int]:
    """The job's prompt as token ids: given ids as they are, text as ``encode`` does (as ``Engine.generate``),
    messages rendered with the model's chat template plus the generation prompt."""
    if job.prompt_token_ids is not None:
        return list(job.prompt_token_ids)
    if job.prompt is not None:
        return list(tokenizer.encode(job.prompt))
    assert job.messages is not None
    if not tokenizer.chat_template:
        raise ValueError("messages: this model has no chat template; send prompt or prompt_token_ids")
    messages, tools = template_inputs([m.model_dump(exclude_none=True) for m in job.messages],
                                      [t.model_dump(exclude_none=True) for t in job.tools or []],
                                      template_supports_tools(tokenizer.chat_template))
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    # The template already holds the special tokens (BOS etc.), as apply_chat_template(tokenize=True) assumes.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def to_token_logprobs(logprobs: Sequence[Logprob], tokenizer: Tokenizer, token_bytes: TokenBytes
                      ) -> list[TokenLogprob]:
    """Engine logprobs with the tokens' text and raw bytes, as the wire schema carries them."""
    return [TokenLogprob(token_id=lp.token_id, token=tokenizer.decode([lp.token_id]), logprob=lp.logprob,
                         top=[(tid, tokenizer.decode([tid]), v) for tid, v in lp.top],
                         bytes=list(token_bytes.bytes_of(lp.token_id)),
                         top_bytes=[list(token_bytes.bytes_of(tid)) for tid, _ in lp.top])
            for lp in logprobs]


@dataclass
class ChoiceState:
    """What one choice produced so far."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    beam_score: float | None = None
    first_token_at: float | None = None  # time.monotonic() of the step that produced the first/latest token
    last_token_at: float | None = None


@dataclass
class ActiveJob:
    """A claimed job in the engine: its choices' progress and the next attempt-local event number."""

    claim: ClaimedJob
    choices: list[ChoiceState]
    next_seq: int = 1
    first_token_published: bool = False
    error: str | None = None  # a choice failed in the engine: the whole job fails with this reason
    deadline: float | None = None  # time.monotonic() past which the job stops (its timeout_s), None: never

    @classmethod
    def start(cls, claim: ClaimedJob) -> ActiveJob:
        wants_logprobs = claim.submission.params.logprobs is not None
        deadline = time.monotonic() + claim.time_left_s if claim.time_left_s is not None else None
        return cls(claim, [ChoiceState(logprobs=[] if wants_logprobs else None) for _ in range(claim.submission.n)],
                   deadline=deadline)

    def past_deadline(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    @property
    def job_id(self) -> str:
        return self.claim.submission.id

    @property
    def done(self) -> bool:
        return self.error is not None or all(c.finish_reason is not None for c in self.choices)

    def unfinished_request_ids(self) -> list[str]:
        return [request_id(self.job_id, i) for i, c in enumerate(self.choices) if c.finish_reason is None]

    def apply(self, out: StepOutput, index: int, logprobs: list[TokenLogprob] | None) -> TokenEvent | None:
        """Record one step's output of choice ``index``; the event to publish, if it carries anything."""
        choice = self.choices[index]
        if out.error is not None:  # the engine failed this choice alone: the job fails, its siblings are aborted
            self.error = self.error or f"generation failed: {out.error}"
            choice.finish_reason = "abort"
            return None
        choice.texts.append(out.text_delta)
        choice.token_ids += out.new_token_ids
        if out.new_token_ids:
            choice.last_token_at = time.monotonic()
            choice.first_token_at = choice.first_token_at or choice.last_token_at
        if choice.logprobs is not None and logprobs:
            choice.logprobs += logprobs
        choice.num_prompt_tokens = out.num_prompt_tokens
        choice.num_cached_tokens = out.num_cached_tokens
        choice.num_draft_tokens += out.num_draft_tokens
        choice.num_accepted_tokens += out.num_accepted_tokens
        if out.beam_score is not None:
            choice.beam_score = out.beam_score
        if out.finished:
            choice.finish_reason = out.finish_reason or "stop"
        if not out.text_delta and not out.new_token_ids:
            return None
        event = TokenEvent(seq=self.next_seq, index=index, text=out.text_delta, token_ids=list(out.new_token_ids),
                           logprobs=logprobs if choice.logprobs is not None else None,
                           num_prompt_tokens=choice.num_prompt_tokens if self.next_seq == 1 else None)
        self.next_seq += 1
        return event

    def abort(self, reason: FinishReason = "abort") -> None:
        """The unfinished choices end now, text so far kept: ``abort`` (a cancel) or ``timeout`` (its deadline)."""
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = reason

    def result(self) -> JobResult:
        """Choices in index order; the prompt is counted once (the n choices share it)."""
        choices = [
            Choice(index=i, text="".join(c.texts), finish_reason=c.finish_reason, token_ids=c.token_ids,
                   logprobs=c.logprobs,
                   spec_decode=SpecDecodeStats(num_draft_tokens=c.num_draft_tokens,
                                               num_accepted_tokens=c.num_accepted_tokens)
                   if c.num_draft_tokens else None, beam_score=c.beam_score)
            for i, c in enumerate(self.choices)
        ]
        first = self.choices[0]
        usage = Usage(prompt_tokens=first.num_prompt_tokens, cached_tokens=first.num_cached_tokens,
                      completion_tokens=sum(len(c.token_ids) for c in self.choices))
        return JobResult(choices=choices, usage=usage)


def model_card(name: str, engine: EnginePort) -> ModelCard:
    """What the API needs to validate and template requests for this model without loading it."""
    tokenizer = engine.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return ModelCard(
        name=name, max_model_len=engine.max_model_len, eos_token_ids=list(engine.eos_token_ids),
        chat_template=tokenizer.chat_template,
        vocab_size=engine.vocab_size,  # the model's vocabulary (ids the engine accepts), not the tokenizer's length
        tokenizer_json=backend.to_str() if backend is not None else None,
        special_tokens={k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)},
    )
