"""A step's logits -> each request's new tokens, where one faulty request fails alone, never the whole step.

A request fails (``Draw.error``) when its logit rows are not finite (a NaN or +inf anywhere, or every entry
-inf: nothing can be sampled from them), when drawing for it raises, or when a drawn id is outside the
vocabulary. Drawing runs once over the healthy requests (on a GPU over all of them, the unhealthy rows zeroed:
``draw_tokens``); if it raises, the batch is bisected until the requests that raise are alone, so the others
still get their tokens in the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from worker.engine.outputs import Logprob
from worker.engine.request import Request
from worker.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Draw:
    """One request's outcome of a step: its new tokens (several when speculative ones were accepted), or why not."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob | None] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None


NOT_FINITE = "the model's logits for this request are not finite (NaN or inf)"  # that request's error
# What the engine draws with: (requests, their chunks, their logit rows in chunk order) -> one Draw per request.
DrawFn = Callable[[Sequence[Request], Sequence[ScheduledChunk], torch.Tensor], list[Draw]]


def row_spans(chunks: Sequence[ScheduledChunk]) -> list[range]:
    """Each chunk's rows in the logits: one for its last known token plus one per speculative token."""
    spans, first = [], 0
    for chunk in chunks:
        spans.append(range(first, first + 1 + chunk.num_spec_tokens))
        first += 1 + chunk.num_spec_tokens
    return spans


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Whether each row ``[rows]`` of ``logits`` [rows, V] is finite: no NaN or +inf, and not every entry -inf
    (``amax`` propagates NaN)."""
    return torch.isfinite(logits.amax(dim=-1))


def draw_tokens(requests: Sequence[Request], chunks: Sequence[ScheduledChunk], logits: torch.Tensor,
                draw: DrawFn, defer_check: bool = False) -> list[Draw]:
    """``logits``: [sum(1 + num_spec_tokens), V]. One ``Draw`` per request, in order; nothing raises for a
    request's sake (an exception that every single request raises alike still ends up per request).

    Which rows are finite is read back before drawing, and only the healthy requests draw. ``defer_check`` (a
    GPU, where each read-back waits for the device) draws for every request at once instead, the rows that are
    not finite replaced by zeros first so that no sampler sees them, and reads the check back with the drawn
    tokens: one wait per step, not two, and the sampler's kernels queue behind the forward pass."""
    spans = row_spans(chunks)
    finite_flags = finite_rows(logits)  # [rows]
    if defer_check:
        zeroed = torch.where(finite_flags[:, None], logits, 0.0)  # [rows, V]
        drawn = _draw_isolating(requests, chunks, spans, zeroed, draw, list(range(len(requests))))
    finite = finite_flags.tolist()
    healthy = [all(finite[row] for row in span) for span in spans]
    if not defer_check:
        drawn = _draw_isolating(requests, chunks, spans, logits, draw, [i for i, ok in enumerate(healthy) if ok])
    return [checked(drawn[i], int(logits.shape[-1])) if ok else Draw(error=NOT_FINITE)
            for i, ok in enumerate(healthy)]


def _draw_isolating(requests: Sequence[Request], chunks: Sequence[ScheduledChunk], spans: list[range],
                    logits: torch.Tensor, draw: DrawFn, indices: list[int]) -> dict[int, Draw]:
    """Draw for ``indices`` together; when that raises, for each half apart, down to single requests."""
    if not indices:
        return {}
    rows = logits
    if len(indices) != len(requests):
        row_index = torch.tensor([row for i in indices for row in spans[i]], dtype=torch.long, device=logits.device)
        rows = logits[row_index]
    try:
        return dict(zip(indices, draw([requests[i] for i in indices], [chunks[i] for i in indices], rows),
                        strict=True))
    except Exception as exc:
        if len(indices) == 1:
            log.warning("request %s failed in sampling: %r", requests[indices[0]].request_id, exc)
            return {indices[0]: Draw(error=f"sampling failed: {type(exc).__name__}: {exc}"[:500])}
        log.warning("sampling %d requests raised %r; bisecting to find the faulty ones", len(indices), exc)
        mid = len(indices) // 2
        return {**_draw_isolating(requests, chunks, spans, logits, draw, indices[:mid]),
                **_draw_isolating(requests, chunks, spans, logits, draw, indices[mid:])}


def checked(result: Draw, vocab_size: int) -> Draw:
    """The draw, or a failed one if it holds an id the model cannot embed in the next step."""
    bad = [t for t in result.token_ids if not 0 <= t < vocab_size]
    if bad:
        return Draw(error=f"sampled token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return result
