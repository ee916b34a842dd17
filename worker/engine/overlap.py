"""Async scheduling: the next decode step is scheduled and launched while the device still runs this one.

On a GPU a batch-1 decode step of a 1B model replays in ~1.4 ms, and the host's share of a step (scheduling,
filling the static buffers, launching, reading the tokens back, detokenising, checking stops) was another ~0.6 ms
during which the device waited (docs/performance.md, GPU). Overlapped, step N+1 is scheduled as soon as step N is
launched: each request N draws for counts one token further (``Request.num_pending_tokens``), whose id N+1 takes
from N's drawn tokens on the device (``cuda_graphs.FedTokens``); N's tokens are then read back (a non-blocking
copy and an event: no wait for N+1) and settled while N+1 runs. A request that N ends (a stop token or string, an
error) computed one row of N+1 for nothing, which is dropped; one that reaches ``max_tokens`` with N's token is not
scheduled behind it.

An overlapped step draws without reading anything back first, so only requests whose draw needs nothing from the
host between steps take part (``overlaps``): no grammar (its mask follows the last token), no penalties (they
count output ids), no logprobs (read back with the tokens), ``min_tokens`` reached, no beam search; and every
running request decodes, with nobody waiting (``can_overlap``). Any other step settles the pending one first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.engine.cuda_graphs import FedTokens
from worker.engine.draw import finite_rows
from worker.engine.request import PENDING_TOKEN, Request
from worker.engine.sampler import SamplerOutput
from worker.engine.scheduler import ScheduledChunk, Scheduler

# What the engine samples with: (requests, their logit rows [B, V]) -> one token per row, on the device
SampleFn = Callable[[Sequence[Request], torch.Tensor], SamplerOutput]


class Readback:
    """Device tensors copied to the host behind the work queued so far, without waiting for work queued later."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._host = list(tensors)
        if tensors and tensors[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[list[int]]:
        """Each tensor as a list, once its copy is done."""
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._host]


@dataclass(frozen=True, eq=False)
class PendingStep:
    """A launched step whose tokens are not read back yet: one row per request, in the step's order."""

    requests: tuple[Request, ...]
    goes_on: tuple[bool, ...]  # whether the row's token was counted pending (its request is scheduled behind it)
    drawn: torch.Tensor  # [B] long on the device, each id within the vocabulary: what the next step is fed
    readback: Readback  # of the drawn ids as sampled [B] and whether each row's logits were finite [B]


def overlaps(request: Request) -> bool:
    """Whether a request's next draw needs nothing from the host but its parameters, and it decodes."""
    params = request.params
    return (request.grammar is None and params.logprobs is None and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
            and request.num_output_tokens >= params.min_tokens and not request.beam_members
            and request.num_uncomputed_tokens <= 1)


def can_overlap(scheduler: Scheduler, max_rows: int) -> bool:
    """Whether the next step may be scheduled behind a pending one: a decode of every running request (at most
    ``max_rows``, the largest static bucket), all of them ``overlaps``, nobody waiting."""
    running = scheduler.running
    return scheduler.num_waiting == 0 and 0 < len(running) <= max_rows and all(overlaps(r) for r in running)


def fed_tokens(chunks: Sequence[ScheduledChunk], pending: PendingStep | None) -> FedTokens | None:
    """Where each chunk's pending id lies in ``pending``'s drawn tokens; None when no chunk's id is pending."""
    if pending is None or all(c.token_ids[0] != PENDING_TOKEN for c in chunks):
        return None
    row_of = {r.request_id: i for i, r in enumerate(pending.requests) if not r.is_finished}
    rows = tuple(row_of[c.request_id] if c.token_ids[0] == PENDING_TOKEN else -1 for c in chunks)
    return FedTokens(pending.drawn, rows)


def launch_draw(requests: Sequence[Request], logits: torch.Tensor, sample: SampleFn) -> PendingStep:
    """Draw one token per request on the device (``logits`` [B, V] float32), read nothing back, and count each
    token pending for the requests that go on after it. Rows whose logits are not finite are zeroed before the
    sampler sees them (``draw.draw_tokens``' deferred check); their requests fail when the step is settled."""
    finite = finite_rows(logits)  # [B]
    drawn = sample(requests, torch.where(finite[:, None], logits, 0.0)).token_ids  # [B]
    goes_on = tuple(r.num_output_tokens + r.num_pending_tokens + 1 < r.max_tokens for r in requests)
    for request, counted in zip(requests, goes_on, strict=True):
        request.num_pending_tokens += counted
    return PendingStep(tuple(requests), goes_on, drawn.clamp(0, logits.shape[-1] - 1), Readback(drawn, finite))
