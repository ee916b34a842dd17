"""Beam-search requests inside the continuous batch, on shared KV blocks.

A beam-search request is a *group* of ``beam_width`` internal requests (one per beam) that the scheduler runs like
any other request, beside ordinary ones. The group starts with one live beam (the prompt, prefilled once). When
every live beam has its next-token logits, ``worker.engine.beam`` picks the next beams and this module forks them:
a new beam takes its parent's block table (one reference more per block, so prompt and common-prefix blocks stay
shared) and the parent references are dropped, so the blocks of beams that were not continued are free at once.
The one block a beam writes into next, when still shared, is copied by the scheduler's copy-on-write. A beam whose
logits are in waits (unscheduled) for its siblings'; the scheduler preempts and re-admits a group as a whole.

The group reports once, when the search is over: one finished ``StepOutput`` per returned hypothesis, best first,
each with its ``beam_score``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from worker.engine.beam import BeamSearchState, BeamStep, Hypothesis
from worker.engine.block_pool import BlockPool
from worker.engine.draw import NOT_FINITE
from worker.engine.outputs import StepOutput
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import ScheduledChunk, Scheduler

log = logging.getLogger(__name__)

Detokenize = Callable[[list[int], list[int]], str]  # (prompt ids, output ids without a final stop token) -> text
Scrub = Callable[[Sequence[int]], None]  # block ids a failed group held, once freed


def beam_request_id(output_id: str, index: int) -> str:
    """The internal id of beam ``index`` of the group returned as ``output_id`` (never handed outside)."""
    return f"{output_id}/beam{index}"


@dataclass(eq=False)
class BeamGroup:
    """One beam-search request: its output ids (``num_return_sequences``), beams and search state."""

    output_ids: list[str]
    beams: list[Request]  # beam_width requests; the live ones are ``live``
    state: BeamSearchState
    stop_token_ids: frozenset[int]
    live: list[Request] = field(default_factory=list)  # shared as every live beam's ``beam_members``
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # beam id -> its logits row [V], this step

    def is_ready(self) -> bool:
        """Every live beam has caught up and has its logits (a preempted one has not: it recomputes them)."""
        return all(b.request_id in self.pending and b.status is RequestStatus.RUNNING and b.num_uncomputed_tokens == 0
                   for b in self.live)


class BeamSearch:
    """The engine's beam-search groups: takes their logit rows out of each step and forks their beams."""

    def __init__(self, scheduler: Scheduler, pool: BlockPool, requests: dict[str, Request],
                 detokenize: Detokenize, scrub: Scrub) -> None:
        self._scheduler = scheduler
        self._pool = pool
        self._requests = requests  # the engine's: every beam lives there while its group runs
        self._detokenize = detokenize
        self._scrub = scrub  # a failed group's freed blocks: zeroed and uncached (``Engine._scrub``)
        self._groups: dict[str, BeamGroup] = {}  # output id -> group
        self._group_of_beam: dict[str, BeamGroup] = {}

    def __contains__(self, output_id: object) -> bool:
        return output_id in self._groups

    def is_beam(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of the internal beam requests."""
        return request_id in self._group_of_beam

    @property
    def num_groups(self) -> int:
        return len({id(g) for g in self._groups.values()})

    def add(self, output_ids: list[str], beams: list[Request], eos_token_ids: Sequence[int]) -> None:
        """Start a group: ``beams[0]`` is queued with the prompt; the others join at the first fork."""
        params = beams[0].params
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        state = BeamSearchState(params.beam_width, beams[0].max_tokens, params.length_penalty,
                                params.early_stopping, sorted(stop_ids), params.min_tokens, params.logprobs)
        group = BeamGroup(list(output_ids), beams, state, stop_ids, live=[beams[0]])
        for output_id in output_ids:
            self._groups[output_id] = group
        for beam in beams:
            self._requests[beam.request_id] = beam
            self._group_of_beam[beam.request_id] = group
        beams[0].beam_members = group.live
        beams[0].num_pending_forks = len(beams) - 1  # the scheduler keeps seats for the beams of the first fork
        self._scheduler.add(beams[0])

    def take(self, chunks: list[ScheduledChunk], logits: torch.Tensor
             ) -> tuple[list[ScheduledChunk], torch.Tensor, list[StepOutput]]:
        """Keep the beams' logit rows (one per chunk: no speculation with beams); returns the other chunks, their
        rows, and the outputs of groups that finished (or failed) this step."""
        others: list[int] = []
        touched: dict[int, BeamGroup] = {}
        for i, chunk in enumerate(chunks):
            group = self._group_of_beam.get(chunk.request_id)
            if group is None:
                others.append(i)
                continue
            group.pending[chunk.request_id] = logits[i].clone()  # not a view: the step's logits may go
            touched[id(group)] = group
        events: list[StepOutput] = []
        for group in touched.values():
            if group.is_ready():
                events += self._advance(group)
        if len(others) == len(chunks):
            return chunks, logits, events
        rows = torch.tensor(others, dtype=torch.long, device=logits.device)
        return [chunks[i] for i in others], logits[rows], events

    def abort(self, output_id: str) -> bool:
        """Stop the whole group ``output_id`` belongs to and free its blocks; False if unknown."""
        group = self._groups.get(output_id)
        if group is None:
            return False
        self._end(group)
        return True

    def _advance(self, group: BeamGroup) -> list[StepOutput]:
        rows = torch.stack([group.pending[b.request_id] for b in group.live])  # [L, V]
        group.pending.clear()
        if not bool(torch.isfinite(rows.amax(dim=-1)).all()):
            return self._fail(group, NOT_FINITE)
        try:
            step = group.state.advance(rows, [b.output_token_ids for b in group.live], [b.logprobs for b in group.live])
        except Exception as exc:  # this group's fault alone: the rest of the batch goes on
            log.warning("beam group %s failed: %r", group.output_ids[0], exc)
            return self._fail(group, f"beam search failed: {type(exc).__name__}: {exc}"[:500])
        if step.done:
            return self._finish(group)
        self._fork(group, step)
        return []

    def _fork(self, group: BeamGroup, step: BeamStep) -> None:
        """Beam ``i`` becomes parent ``step.parents[i]`` plus its new token, sharing the parent's blocks."""
        old = list(group.live)
        new_states = [(old[p].output_token_ids + [t], old[p].logprobs + ([lp] if lp is not None else []),
                       list(old[p].block_ids), list(old[p].block_hashes), old[p].num_computed_tokens)
                      for p, t, lp in zip(step.parents, step.token_ids, step.logprobs, strict=True)]
        for _, _, block_ids, _, _ in new_states:
            self._pool.touch(block_ids)  # one more reference for the child ...
        for beam in old:
            self._pool.free(beam.block_ids)  # ... one less for the parent: unreferenced blocks are free now
        new_live = group.beams[:len(new_states)]
        for beam, (outputs, logprobs, block_ids, hashes, num_computed) in zip(new_live, new_states, strict=True):
            beam.output_token_ids, beam.logprobs = outputs, logprobs
            beam.block_ids, beam.block_hashes, beam.num_computed_tokens = block_ids, hashes, num_computed
            beam.num_cached_tokens = old[0].num_cached_tokens
            beam.beam_members = group.live
            if beam.status is not RequestStatus.RUNNING:  # the first fork starts beams 1..k-1
                self._scheduler.adopt(beam)
            beam.num_pending_forks = 0
        group.live[:] = new_live  # in place: every member's ``beam_members`` is this list

    def _finish(self, group: BeamGroup) -> list[StepOutput]:
        beam0 = group.beams[0]
        hypotheses = group.state.best(len(group.output_ids))
        try:
            outputs = [self._output(output_id, beam0, h, group.stop_token_ids)
                       for output_id, h in zip(group.output_ids, hypotheses, strict=True)]
        except Exception as exc:  # the detokenizer on a token it cannot decode: this group's fault alone
            return self._fail(group, f"detokenizing failed: {type(exc).__name__}: {exc}"[:500])
        self._end(group)
        return outputs

    def _output(self, output_id: str, beam0: Request, hypothesis: Hypothesis, stop_ids: frozenset[int]
                ) -> StepOutput:
        token_ids = list(hypothesis.token_ids)
        stopped = bool(token_ids) and token_ids[-1] in stop_ids and len(token_ids) > beam0.params.min_tokens
        text = self._detokenize(beam0.prompt_token_ids, token_ids[:-1] if stopped else token_ids)
        return StepOutput(request_id=output_id, new_token_ids=tuple(token_ids), text_delta=text, finished=True,
                          finish_reason="stop" if stopped else "length", num_prompt_tokens=beam0.num_prompt_tokens,
                          num_output_tokens=len(token_ids), num_cached_tokens=beam0.num_cached_tokens,
                          logprobs=hypothesis.logprobs, beam_score=hypothesis.score)

    def _fail(self, group: BeamGroup, error: str) -> list[StepOutput]:
        log.warning("beam group %s failed: %s", group.output_ids[0], error)
        beam0 = group.beams[0]
        block_ids = [b for beam in group.beams for b in beam.block_ids]
        self._end(group)
        self._scrub(block_ids)
        return [StepOutput(request_id=output_id, new_token_ids=(), text_delta="", finished=True,
                           finish_reason="error", num_prompt_tokens=beam0.num_prompt_tokens, num_output_tokens=0,
                           num_cached_tokens=beam0.num_cached_tokens, error=error)
                for output_id in group.output_ids]

    def _end(self, group: BeamGroup) -> None:
        """Remove the group: every beam leaves the scheduler and the engine, and its blocks are freed."""
        for beam in group.beams:
            self._scheduler.finish(beam)
            self._requests.pop(beam.request_id, None)
            self._group_of_beam.pop(beam.request_id, None)
        for output_id in group.output_ids:
            self._groups.pop(output_id, None)
        group.live.clear()
        group.pending.clear()
