"""Draft-model proposals: a smaller model sharing the target's tokenizer runs k cheap steps ahead.

The draft is a second ``ModelRunner`` (same paged attention, ``KVCache`` and ``BlockPool`` machinery) with its own
pool of the same number of blocks, and its own block table and ``num_computed`` per request. Each step it first
catches up on the request's tokens it has not seen (the whole prompt the first time, afterwards the tokens
emitted last step) in one batched pass, then samples one token per pass for k passes. Its K/V past the known
tokens is tentative and simply recomputed/overwritten next step, so rejection needs no bookkeeping here.

``write_truncated_draft`` builds a draft for a model that has no smaller sibling: its first layers, final norm and
LM head (the mechanism works with any draft a user brings).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from worker.engine.block_pool import BlockPool
from worker.engine.config import EngineConfig, EnginePlan
from worker.engine.kv_cache import num_blocks_needed
from worker.engine.model_runner import ModelRunner
from worker.engine.proposal import Proposal
from worker.engine.request import Request
from worker.engine.sampler import compute_probs, prepare_sampling_batch
from worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from worker.models import resolve_model


def write_truncated_draft(target: str | Path, out: Path, num_layers: int) -> Path:
    """Save a draft model made of ``target``'s first ``num_layers`` decoder layers (same weights), its final norm
    and LM head, and its tokenizer, into ``out``."""
    folder = resolve_model(str(target))
    model = AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=num_layers, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


@dataclass(eq=False)
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of the request whose draft K/V is cached


class DraftProposer:
    """Proposes by sampling a draft model with the request's own sampling parameters (q as close to p as it gets)."""

    def __init__(self, config: EngineConfig, target_plan: EnginePlan, target_vocab_size: int,
                 target_tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int]) -> None:
        assert config.draft_model is not None
        folder = resolve_model(config.draft_model)
        if AutoTokenizer.from_pretrained(folder).get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(f"EngineConfig.draft_model must share the target model's tokenizer, got "
                             f"{config.draft_model!r}")
        draft_config = dataclasses.replace(
            config, model=str(folder), num_kv_blocks=target_plan.num_kv_blocks, kv_cache_bytes=None,
            max_model_len=target_plan.max_model_len, speculative_method=None, draft_model=None)
        self.runner = ModelRunner(draft_config, folder)
        self.pool = BlockPool(self.runner.plan.num_kv_blocks)
        self.block_size = self.runner.plan.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.vocab_size = target_vocab_size
        self.eos_token_ids = eos_token_ids
        self._states: dict[str, _DraftState] = {}

    def forget(self, keep_request_ids: set[str]) -> None:
        for request_id in [r for r in self._states if r not in keep_request_ids]:
            self.pool.free(self._states.pop(request_id).block_ids)

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Proposal]:
        ready, chunks = self._catch_up_chunks(requests, max_tokens)
        proposals = {id(r): Proposal(()) for r in requests}
        if not chunks:
            return list(proposals.values())
        logits = self.runner.execute(SchedulerOutput(tuple(chunks)))  # [len(ready), V_draft]
        drafts: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        alive = list(range(len(ready)))
        for j in range(max((k for _, k in ready), default=0)):
            q = self._draft_probs(logits, [ready[i][0] for i in alive], [drafts[i] for i in alive])  # [A, V]
            for row, i in enumerate(alive):
                request = ready[i][0]
                token_id = int(torch.multinomial(q[row], 1, generator=request.generator))
                drafts[i].append(token_id)
                probs[i].append(q[row])
            alive = [i for i in alive if len(drafts[i]) < ready[i][1]]
            if not alive:
                break
            logits = self.runner.execute(SchedulerOutput(tuple(
                ScheduledChunk(ready[i][0].request_id, (drafts[i][-1],), ready[i][0].num_tokens + j,
                               tuple(self._states[ready[i][0].request_id].block_ids), needs_logits=True)
                for i in alive)))
        for (request, _), tokens, rows in zip(ready, drafts, probs, strict=True):
            proposals[id(request)] = Proposal(tuple(tokens), torch.stack(rows))
        return list(proposals.values())

    def _catch_up_chunks(self, requests: Sequence[Request], max_tokens: Sequence[int]
                         ) -> tuple[list[tuple[Request, int]], list[ScheduledChunk]]:
        """One chunk per request with the tokens the draft has not computed yet (within the token budget, with
        blocks for the k - 1 tentative tokens after them). Requests that fully caught up are ``ready`` to draft."""
        budget = self.max_num_batched_tokens
        ready: list[tuple[Request, int]] = []
        chunks: list[ScheduledChunk] = []
        for request, k in zip(requests, max_tokens, strict=True):
            state = self._states.setdefault(request.request_id, _DraftState())
            start = state.num_computed
            num_new = min(request.num_tokens - start, budget)
            if num_new <= 0:
                continue  # token budget spent: this request does not speculate this step
            caught_up = start + num_new == request.num_tokens
            missing = (num_blocks_needed(start + num_new + (k - 1 if caught_up else 0), self.block_size)
                       - len(state.block_ids))
            block_ids = self.pool.allocate(missing) if missing > 0 else []
            if block_ids is None:
                continue  # draft pool full: no speculation for this request this step
            state.block_ids.extend(block_ids)
            state.num_computed = start + num_new
            budget -= num_new
            chunks.append(ScheduledChunk(request.request_id, tuple(request.token_ids_slice(start, start + num_new)),
                                         start, tuple(state.block_ids), needs_logits=caught_up))
            if caught_up:
                ready.append((request, k))
        return ready, chunks

    def _draft_probs(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> torch.Tensor:
        """q for the next draft token of each request, processed with the request's own sampling parameters.

        ``logits``: [A, V_draft] -> [A, V_target] (a draft vocabulary is cut or padded to the target's)."""
        vocab_size = logits.shape[1]
        if vocab_size > self.vocab_size:
            logits = logits[:, :self.vocab_size]
        elif vocab_size < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - vocab_size), value=float("-inf"))
        batch = prepare_sampling_batch(
            [r.params for r in requests], [r.prompt_token_ids for r in requests],
            [r.output_token_ids + d for r, d in zip(requests, drafts, strict=True)],
            [r.generator for r in requests], self.eos_token_ids, self.runner.device)
        return compute_probs(logits, batch)
