"""Beam-search bookkeeping of one request: scores, the next beams and the finished hypotheses, exactly as
transformers' ``generate(num_beams=k, do_sample=False)`` computes them (``GenerationMixin._beam_search``).

Each step takes the next-token logits of the live beams ``[L, V]`` and the tokens each beam has generated. It
keeps ``C = max(2, 1 + num_stop_ids) * k`` candidates (the best accumulated log-probabilities over all beams), of
which the best ``k`` that do not stop run on and the stopping ones among the top ``k`` compete for the ``k``
finished slots with score ``sum_logprobs / generated_len ** length_penalty``. The float32 tensor arithmetic
(sentinels of -1e9 included) mirrors transformers' so scores and tie-breaks agree. Nothing here knows of blocks or
the scheduler: ``worker.engine.beam_search`` turns a ``BeamStep`` into forked block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.outputs import Logprob

SENTINEL = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam (``finished`` False only for a slot that no hypothesis ever filled)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...]
    score: float
    finished: bool


@dataclass(frozen=True)
class BeamStep:
    """The next running beams: beam ``i`` extends live beam ``parents[i]`` by ``token_ids[i]``."""

    parents: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob | None, ...]
    done: bool  # the search is over: ``BeamSearchState.best`` holds the result


class BeamSearchState:
    """Running scores, finished hypotheses and the early-stop flag of one beam-search request."""

    def __init__(self, width: int, max_tokens: int, length_penalty: float, early_stopping: bool | str,
                 stop_token_ids: Sequence[int], min_tokens: int = 0, num_logprobs: int | None = None) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.min_tokens = min_tokens
        self.num_logprobs = num_logprobs
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * width
        # One live beam at first: transformers' other k - 1 start at -1e9 and so never reach the top candidates.
        self.running_scores = torch.zeros(1, dtype=torch.float32)  # [L]
        self.finished_scores = torch.full((width,), SENTINEL, dtype=torch.float32)  # [k], sorted descending
        self.finished: list[Hypothesis] = [Hypothesis((), (), SENTINEL, False)] * width
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied

    def advance(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]],
                logprobs: Sequence[Sequence[Logprob]]) -> BeamStep:
        """One step. ``logits``: [L, V] of the live beams; ``outputs``/``logprobs``: what each has generated."""
        raw = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
        device = raw.device
        self.running_scores = self.running_scores.to(device)  # the state follows the logits' device
        self.finished_scores = self.finished_scores.to(device)
        num_generated = len(outputs[0])
        log_probs = raw
        if num_generated < self.min_tokens and self.stop_token_ids:  # transformers' MinNewTokensLength processor
            log_probs = raw.clone()
            log_probs[:, self.stop_token_ids] = float("-inf")
        vocab_size = log_probs.shape[1]
        accumulated = (log_probs + self.running_scores[:, None]).reshape(-1)  # [L * V]
        top_scores, top_index = accumulated.topk(min(self.num_candidates, accumulated.numel()))  # [C]
        parents = (top_index // vocab_size).tolist()
        tokens = (top_index % vocab_size).tolist()
        stops = set(self.stop_token_ids)
        hits = torch.tensor([t in stops or num_generated + 1 >= self.max_tokens for t in tokens], device=device)  # [C]
        candidate_logprobs = self._candidate_logprobs(raw, parents, tokens)

        running = top_scores + hits.to(torch.float32) * SENTINEL
        next_index = running.topk(self.width).indices.tolist()  # [k]
        self._update_finished(top_scores, hits, num_generated, parents, tokens, outputs, logprobs,
                              candidate_logprobs)
        self.running_scores = running[next_index]
        self._update_improvable(num_generated + 1)
        done = not (self.improvable and not (all(h.finished for h in self.finished) and self.early_stopping is True)
                    and not bool(hits.all()))
        return BeamStep(parents=tuple(parents[j] for j in next_index), token_ids=tuple(tokens[j] for j in next_index),
                        logprobs=tuple(candidate_logprobs[j] for j in next_index), done=done)

    def best(self, num: int) -> list[Hypothesis]:
        """The ``num`` best hypotheses, best first (``num_return_sequences``)."""
        return self.finished[:num]

    def _update_finished(self, top_scores: torch.Tensor, hits: torch.Tensor, num_generated: int,
                         parents: list[int], tokens: list[int], outputs: Sequence[Sequence[int]],
                         logprobs: Sequence[Sequence[Logprob]], candidate_logprobs: list[Logprob | None]) -> None:
        """transformers' ``_update_finished_beams``: stopping candidates among the top k enter the finished slots."""
        device = top_scores.device
        is_top = torch.arange(len(tokens), device=device) < self.width
        just_finished = hits & is_top
        scores = top_scores / ((num_generated + 1) ** self.length_penalty)
        all_full = all(h.finished for h in self.finished) and self.early_stopping is True
        scores = scores + torch.tensor(float(all_full), device=device) * SENTINEL
        scores = scores + torch.tensor(float(not self.improvable), device=device) * SENTINEL
        scores = scores + (~just_finished) * SENTINEL
        merged = torch.cat((self.finished_scores, scores))  # [k + C]
        order = merged.topk(self.width).indices.tolist()
        finished: list[Hypothesis] = []
        for index in order:
            if index < self.width:
                finished.append(self.finished[index])
                continue
            j = index - self.width
            lp = candidate_logprobs[j]
            finished.append(Hypothesis(token_ids=(*outputs[parents[j]], tokens[j]),
                                       logprobs=(*logprobs[parents[j]], *([lp] if lp is not None else [])),
                                       score=float(merged[index]), finished=bool(just_finished[j])))
        self.finished = finished
        self.finished_scores = merged[order]

    def _update_improvable(self, num_generated: int) -> None:
        """transformers' ``_check_early_stop_heuristic``: can the best running beam still beat a finished one?"""
        never = self.early_stopping == "never" and self.length_penalty > 0.0
        best_length = self.max_tokens if never else num_generated  # "never": the longest possible beam
        best_running = self.running_scores[:1] / (best_length ** self.length_penalty)
        is_finished = torch.tensor([h.finished for h in self.finished], device=self.finished_scores.device)
        worst_finished = torch.where(is_finished, self.finished_scores.min(), SENTINEL)
        self.improvable = self.improvable and bool(torch.any(best_running > worst_finished))

    def _candidate_logprobs(self, raw: torch.Tensor, parents: list[int], tokens: list[int]
                            ) -> list[Logprob | None]:
        """Each candidate's token log-probability (of the raw model logits) and its parent's top alternatives."""
        if self.num_logprobs is None:
            return [None] * len(tokens)
        chosen = raw[parents, tokens].tolist()
        top_values, top_ids = raw.topk(self.num_logprobs, dim=-1)  # [L, n]
        tops = [tuple(zip(ids, values, strict=True)) for ids, values in zip(top_ids.tolist(), top_values.tolist(),
                                                                             strict=True)]
        return [Logprob(token_id=t, logprob=c, top=tops[p]) for p, t, c in zip(parents, tokens, chosen, strict=True)]
