"""Continuous-batching scheduler: which requests advance by how many tokens in the next forward pass.

Each step, within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running requests:
1. running requests advance first, single-token ones (decodes) before partial prefills, so a long prompt being
   prefilled in chunks never stalls the decodes;
2. if nobody was preempted, waiting requests are admitted by priority (higher first) then arrival, each taking a
   chunk of what budget is left (chunked prefill).
When the block pool runs dry, the running request with the lowest priority and latest arrival is preempted by
recompute: its blocks are freed and it waits again with its tokens kept, so it later re-prefills prompt + output
so far and continues exactly where it stopped.

Only frozen ``SchedulerOutput``/``ScheduledChunk`` records leave this module; they carry block ids, not objects.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from worker.engine.block_pool import BlockPool, hash_block, hash_full_blocks
from worker.engine.kv_cache import num_blocks_needed
from worker.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: compute K/V for ``token_ids`` at positions ``start_position...``."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]  # the request's whole block table
    needs_logits: bool  # the chunk reaches the last known token, so the model's output picks the next one


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Owns the waiting queue, the running list and every request's block table."""

    def __init__(self, block_pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
                 ) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (-priority, arrival, request)
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (*request.sort_key(), request))

    def schedule(self) -> SchedulerOutput:
        """Decide the next step and advance each chosen request's ``num_computed_tokens`` accordingly."""
        scheduled: dict[str, int] = {}  # request_id -> new tokens this step, in batch order
        preempted: list[Request] = []
        budget = self._schedule_running(scheduled, preempted)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        by_id = {r.request_id: r for r in self.running}
        chunks = tuple(self._make_chunk(by_id[rid], n) for rid, n in scheduled.items())
        return SchedulerOutput(chunks, tuple(r.request_id for r in preempted))

    def _schedule_running(self, scheduled: dict[str, int], preempted: list[Request]) -> int:
        """Give running requests their next tokens, preempting when blocks run out; returns the budget left."""
        budget = self.max_num_batched_tokens
        order = sorted(self.running, key=lambda r: (r.num_uncomputed_tokens > 1, r.sort_key()))
        for request in order:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_new = min(request.num_uncomputed_tokens, budget)
            while not self._try_allocate(request, num_new):
                victim = max(self.running, key=Request.sort_key)  # lowest priority, latest arrival
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
        return budget

    def _schedule_waiting(self, scheduled: dict[str, int], budget: int) -> None:
        """Admit waiting requests in (priority, arrival) order while seats, budget and blocks last."""
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][2]
            if self.pool.enable_caching:
                self._apply_prefix_cache(request)
            num_new = min(request.num_uncomputed_tokens, budget)
            if not self._try_allocate(request, num_new):
                self._release_blocks(request)  # a waiting request must not sit on blocks
                break
            heapq.heappop(self._waiting)
            if self.pool.enable_caching and request.num_preemptions == 0:
                self._record_prefix_hit(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new

    def _try_allocate(self, request: Request, num_new: int) -> bool:
        """Grow the request's block table to hold ``num_new`` more tokens; False (nothing taken) if out of blocks."""
        missing = num_blocks_needed(request.num_computed_tokens + num_new, self.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        block_ids = self.pool.allocate(missing)
        if block_ids is None:
            return False
        request.block_ids.extend(block_ids)
        return True

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        token_ids = tuple(request.token_ids_slice(start, start + num_new))
        return ScheduledChunk(request_id=request.request_id, token_ids=token_ids, start_position=start,
                              block_ids=tuple(request.block_ids),
                              needs_logits=request.num_computed_tokens == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it again; it keeps its tokens and recomputes their K/V later."""
        self.running.remove(request)
        self._release_blocks(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)

    def _release_blocks(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.block_hashes = []
        request.num_computed_tokens = 0

    def _apply_prefix_cache(self, request: Request) -> None:
        """Start a request from the longest cached prefix of its tokens (at least one token is left to compute,
        because the next token needs that position's logits)."""
        if request.block_ids:
            return
        num_full = (request.num_tokens - 1) // self.block_size
        tokens = request.token_ids_slice(0, num_full * self.block_size)
        hits: list[int] = []
        for block_hash in hash_full_blocks(tokens, self.block_size, num_full):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
            request.block_hashes.append(block_hash)
        self.pool.touch(hits)
        request.block_ids = hits
        request.num_computed_tokens = len(hits) * self.block_size

    def _record_prefix_hit(self, request: Request) -> None:
        """Count a first admission's prompt lookup (not retries, not recomputes after preemption)."""
        self.prefix_cache_queries += request.num_prompt_tokens
        self.prefix_cache_hits += request.num_computed_tokens
        request.num_cached_tokens = request.num_computed_tokens

    def cache_computed_blocks(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """After the forward pass: publish the hashes of blocks that just became full (prefix caching)."""
        if not self.pool.enable_caching:
            return
        for chunk in output.chunks:
            request = requests[chunk.request_id]
            num_full = request.num_computed_tokens // self.block_size
            for i in range(len(request.block_hashes), num_full):
                parent = request.block_hashes[-1] if request.block_hashes else None
                tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
                block_hash = hash_block(parent, tokens)
                self.pool.cache_block(request.block_ids[i], block_hash)
                request.block_hashes.append(block_hash)

    def finish(self, request: Request) -> None:
        """Remove a request that is done (or aborted) and free its blocks now."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self._waiting = [entry for entry in self._waiting if entry[2] is not request]
            heapq.heapify(self._waiting)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
