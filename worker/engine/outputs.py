"""What the engine hands back: frozen records, the only things that leave ``worker.engine``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "error": the request could not go on (its logits were not finite, or sampling it raised); ``StepOutput.error``
# says why. Only that request ends: the rest of the batch continues.
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class Logprob:
    """Log-probability of the chosen token, and the top alternatives ``(token_id, logprob)`` when asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """What happened to one request in one ``Engine.step()``.

    ``text_delta`` never ends inside a multi-byte character; the concatenation of a request's deltas equals its
    final text exactly (stop strings already removed). A finished request appears once with ``finished=True``.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: tuple[Logprob, ...] = ()
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None  # set with finish_reason "error"
    beam_score: float | None = None  # beam search: the hypothesis' sum of log-probs / length ** length_penalty


@dataclass(frozen=True)
class RequestOutput:
    """The complete result of one request, as returned by ``Engine.generate``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    logprobs: tuple[Logprob, ...] = ()
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and worker heartbeats."""

    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        used = self.num_total_blocks - self.num_free_blocks
        return used / self.num_total_blocks if self.num_total_blocks else 0.0
