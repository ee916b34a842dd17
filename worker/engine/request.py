"""Per-request state inside the engine.

There is no prefill phase and no decode phase: a request has ``num_tokens`` (prompt + output so far) and
``num_computed_tokens`` (how many of them have K/V in the cache). Each step the scheduler lets the second catch
up with the first by some number of tokens; when it has caught up the model's last logits give the next token.
A whole prompt, one chunk of a long prompt, one decode token, a prefix-cache hit and a recompute after preemption
are all the same mechanism.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.engine.block_pool import BlockHash
from worker.engine.outputs import FinishReason, Logprob
from worker.engine.sampling_params import SamplingParams

PENDING_TOKEN = -1  # the id of a token drawn on the device and not yet read back (``Request.num_pending_tokens``)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Mutable state of one request, owned by the engine; never handed outside ``worker.engine``.

    ``max_tokens`` is the effective output limit: the params' ``max_tokens`` clipped to the context length.
    ``arrival`` is a monotonically increasing admission number (ties in priority go to the earlier one).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    max_tokens: int
    generator: torch.Generator | None = None
    detokenizer: Any = None  # detokenizer.IncrementalDetokenizer; Any keeps this module free of tokenizers
    grammar: Any = None  # grammar.GrammarState when the output is constrained; it stands after the output tokens
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the leading full blocks, once computed
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_pending_forks: int = 0  # siblings (n > 1) that start from this request's prompt once it is computed
    text: str = ""
    # Proposed next tokens (speculative decoding), not yet part of the output: the scheduler computes them after
    # the last known token and the engine keeps the ones the target model accepts. Set fresh every step.
    spec_token_ids: list[int] = field(default_factory=list)
    # The beams of one beam-search request (this one included; empty otherwise): the scheduler preempts and
    # re-admits them together, and a beam whose next-token logits wait for its siblings' is not scheduled.
    beam_members: list[Request] = field(default_factory=list)
    # Tokens drawn in a step the device still runs (``overlap.py``), not yet read back: counted in ``num_tokens``
    # so that the next step can be scheduled behind them, their ids ``PENDING_TOKEN`` until they are appended.
    num_pending_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output, and any drawn tokens still pending."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output whose ids are known here: ``num_tokens`` less the pending ones."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output (+ ``PENDING_TOKEN`` for each pending one), without building
        the concatenation for decode steps."""
        num_prompt = len(self.prompt_token_ids)
        known_end = self.num_known_tokens
        if self.num_pending_tokens and end > known_end:
            known = self.token_ids_slice(start, known_end) if start < known_end else []
            return known + [PENDING_TOKEN] * (min(end, self.num_tokens) - max(start, known_end))
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: higher priority first, then earlier arrival."""
        return (-self.priority, self.arrival)


def validate_request(request_id: object, prompt_token_ids: object, params: object, priority: object,
                     vocab_size: int, max_model_len: int) -> None:
    """Reject bad input at the engine boundary with a ValueError naming the field and its allowed range."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise ValueError(f"prompt_token_ids must be a non-empty list of token ids, got {prompt_token_ids!r:.80}")
    max_prompt = max_model_len - 1  # room for at least one output token
    if len(prompt_token_ids) > max_prompt:
        raise ValueError(f"prompt_token_ids must have at most {max_prompt} tokens (max_model_len {max_model_len} "
                         f"minus one for output), got {len(prompt_token_ids)}")
    for i, token_id in enumerate(prompt_token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}] must be a token id in [0, {vocab_size}), got {token_id!r}")
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {token_id!r}")
