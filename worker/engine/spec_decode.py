"""Speculative decoding inside the continuous batch: propose, verify in the same forward pass, keep a prefix.

Before each step, every running request that has caught up with its tokens (a decode is due) may get up to
``num_speculative_tokens`` proposed tokens in ``request.spec_token_ids``. The scheduler computes them right after
the last known token, in the same flattened forward pass as everyone else's decodes and prefills, and the model
runner returns logits at all k + 1 positions. ``SpeculativeDecoder.verify`` then decides which tokens to keep
(``rejection_sampler.py``: exact in distribution, identical for greedy), and the engine advances
``num_computed_tokens`` over the kept ones only: the rejected positions' K/V slots are simply overwritten later.

Proposers: ``NgramProposer`` (prompt lookup, no model) here, ``DraftProposer`` (a smaller model) in
``spec_draft.py``. Policy: speculation only while at most ``speculative_max_batch`` requests run; above that, the
extra verification tokens cost more than the decode steps they save (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from worker.engine.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import Logprob
from worker.engine.proposal import Proposal, Proposer
from worker.engine.rejection_sampler import rejection_sample
from worker.engine.request import Request
from worker.engine.sampler import Sampler, SamplingBatch, _logprobs, compute_probs, prepare_sampling_batch
from worker.engine.scheduler import ScheduledChunk


def ngram_lookup(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_n..min_n, longest first)
    and return the up to ``num_tokens`` tokens that followed it."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # windows of tokens[:-1] start at 0..L-1-n: never the suffix itself, and a token always follows
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L - n, n]
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return [int(t) for t in tokens[start:start + num_tokens]]
    return []


class NgramProposer:
    """Proposes the continuation of the request's own earlier text (prompt + output): no model, no state."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Proposal]:
        return [Proposal(tuple(ngram_lookup(r.prompt_token_ids + r.output_token_ids, k, self.min_n, self.max_n)))
                for r, k in zip(requests, max_tokens, strict=True)]

    def forget(self, keep_request_ids: set[str]) -> None:
        return None


@dataclass(frozen=True)
class Verified:
    """Tokens one request emits this step (before stop conditions), their logprobs and the speculation tally."""

    token_ids: list[int]
    logprobs: list[Logprob | None]
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass(eq=False)
class _Row:
    """One request being verified: its first logits row, its scheduled draft tokens and what it emitted so far."""

    request: Request
    first_row: int
    draft: tuple[int, ...]
    draft_probs: torch.Tensor | None
    emitted: list[int] = field(default_factory=list)
    logprobs: list[Logprob | None] = field(default_factory=list)


class SpeculativeDecoder:
    """Owns a proposer, the batch-size policy and the verification of one step's proposals."""

    def __init__(self, config: EngineConfig, proposer: Proposer, sampler: Sampler, eos_token_ids: list[int],
                 device: torch.device) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.proposer = proposer
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._proposals: dict[str, Proposal] = {}
        self.num_draft_tokens = 0  # proposed tokens that were verified
        self.num_accepted_tokens = 0  # of which kept

    def num_tokens_to_propose(self, batch_size: int) -> int:
        """The policy: full speculation for small batches, none above ``speculative_max_batch``."""
        return self.num_speculative_tokens if batch_size <= self.max_batch else 0

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` of every running request that is about to decode (others get none)."""
        self._proposals = {}
        for request in running:
            request.spec_token_ids = []
        k = self.num_tokens_to_propose(len(running))
        if k == 0:
            return
        # Caught up (only the last sampled token lacks K/V); never propose past max_tokens.
        due = [(r, min(k, r.max_tokens - r.num_output_tokens - 1)) for r in running if r.num_uncomputed_tokens == 1]
        due = [(r, n) for r, n in due if n > 0]
        if not due:
            return
        proposals = self.proposer.propose([r for r, _ in due], [n for _, n in due])
        for (request, _), proposal in zip(due, proposals, strict=True):
            if proposal.token_ids:
                request.spec_token_ids = list(proposal.token_ids)
                self._proposals[request.request_id] = proposal

    def forget(self, keep: Sequence[Request]) -> None:
        """Free the proposer's state of requests that stopped running (finished, aborted, preempted)."""
        self.proposer.forget({r.request_id for r in keep})

    def verify(self, requests: Sequence[Request], chunks: Sequence[ScheduledChunk], logits: torch.Tensor
               ) -> list[Verified]:
        """``logits``: [sum(1 + num_spec_tokens), V], each chunk's rows in order. One ``Verified`` per chunk."""
        rows: list[_Row] = []
        first_row = 0
        for request, chunk in zip(requests, chunks, strict=True):
            k = chunk.num_spec_tokens
            proposal = self._proposals.get(request.request_id)
            draft_probs = proposal.draft_probs if proposal is not None and k else None
            draft_probs = draft_probs[:k] if draft_probs is not None else None  # the budget may have cut the draft
            rows.append(_Row(request, first_row, chunk.token_ids[len(chunk.token_ids) - k:], draft_probs))
            first_row += 1 + k
            request.spec_token_ids = []
        stochastic = [r for r in rows if r.draft_probs is not None and not r.request.params.is_greedy]
        self._verify_by_matching([r for r in rows if r.draft_probs is None or r.request.params.is_greedy], logits)
        self._verify_by_rejection(stochastic, logits)
        return [Verified(r.emitted, r.logprobs, len(r.draft), len(r.emitted) - 1) for r in rows]

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request's step in the global tally (accepted = kept after stop conditions)."""
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def _batch(self, rows: Sequence[_Row], num_drafted: Sequence[int]) -> SamplingBatch:
        """Sampling tensors where row i's output so far includes its first ``num_drafted[i]`` draft tokens."""
        requests = [r.request for r in rows]
        return prepare_sampling_batch(
            [r.params for r in requests], [r.prompt_token_ids for r in requests],
            [r.output_token_ids + list(row.draft[:n]) for r, row, n in zip(requests, rows, num_drafted, strict=True)],
            [r.generator for r in requests], self.eos_token_ids, self.device)

    def _verify_by_matching(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Deterministic proposals and greedy requests (the one-hot cases of ``rejection_sampler``): draw
        t_j ~ p_j with the ordinary sampler and the request's generator, round by round, while each draw matched its
        draft token. Requests without a proposal take part in round 0 only, exactly as in a step without speculation.
        """
        alive = rows
        j = 0
        while alive:
            index = torch.tensor([r.first_row + j for r in alive], dtype=torch.long, device=logits.device)
            result = self.sampler(logits[index], self._batch(alive, [j] * len(alive)))
            for row, token_id, logprob in zip(alive, result.token_ids.tolist(), result.logprobs, strict=True):
                row.emitted.append(token_id)
                row.logprobs.append(logprob)
            # t_j == d_j: d_j is accepted and p_{j+1} decides the next token; otherwise t_j is the resampled token
            alive = [r for r in alive if j < len(r.draft) and r.emitted[-1] == r.draft[j]]
            j += 1

    def _verify_by_rejection(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """A draft model's sampled proposals: Leviathan et al.'s min(1, p/q) rule on the target's p rows."""
        if not rows:
            return
        expanded = [(r, j) for r in rows for j in range(len(r.draft) + 1)]  # one p row per draft position + bonus
        index = torch.tensor([r.first_row + j for r, j in expanded], dtype=torch.long, device=logits.device)
        raw = logits[index]  # [sum(k + 1), V]
        target_probs = compute_probs(raw, self._batch([r for r, _ in expanded], [j for _, j in expanded]))
        offset = 0
        emitted_rows: list[int] = []
        for row in rows:
            k = len(row.draft)
            assert row.draft_probs is not None
            row.emitted = rejection_sample(target_probs[offset:offset + k + 1], row.draft_probs, row.draft,
                                           row.request.generator)
            emitted_rows.extend(range(offset, offset + len(row.emitted)))
            offset += k + 1
        emitted_ids = torch.tensor([t for r in rows for t in r.emitted], dtype=torch.long, device=logits.device)
        num_logprobs = tuple(r.request.params.logprobs for r in rows for _ in r.emitted)
        # the sampler's own logprob records (raw-logit log_softmax + top-N), so both paths report alike
        logprobs = iter(_logprobs(raw[emitted_rows], emitted_ids, num_logprobs))
        for row in rows:
            row.logprobs = [next(logprobs) for _ in row.emitted]


def make_speculative_decoder(config: EngineConfig, runner: ModelRunner, sampler: Sampler,
                             tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int]
                             ) -> SpeculativeDecoder | None:
    """The configured speculative decoder, or None when ``speculative_method`` is None."""
    if config.speculative_method is None:
        return None
    proposer: Proposer
    if config.speculative_method == "ngram":
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        from worker.engine.spec_draft import DraftProposer  # loads a second model: only when asked for

        proposer = DraftProposer(config, runner.plan, runner.shape.vocab_size, tokenizer, eos_token_ids)
    return SpeculativeDecoder(config, proposer, sampler, eos_token_ids, runner.device)
