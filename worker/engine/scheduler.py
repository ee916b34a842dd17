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
    num_spec_tokens: int = 0  # trailing speculative tokens in ``token_ids``; each also needs its logits


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (src, dst) block ids, done before the forward

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
        self._block_copies: list[tuple[int, int]] = []  # this step's copy-on-write (src, dst) pairs
        self._forks: dict[Request, list[Request]] = {}  # parent -> its children not started yet
        self._fork_parent: dict[str, Request] = {}  # child request id -> its parent, while not started

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
        self._block_copies = []
        if self._forks:
            self._start_forks()
        budget = self._schedule_running(scheduled, preempted)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        by_id = {r.request_id: r for r in self.running}
        chunks = tuple(self._make_chunk(by_id[rid], n) for rid, n in scheduled.items())
        return SchedulerOutput(chunks, tuple(r.request_id for r in preempted), tuple(self._block_copies))

    def _schedule_running(self, scheduled: dict[str, int], preempted: list[Request]) -> int:
        """Give running requests their next tokens, preempting when blocks run out; returns the budget left."""
        budget = self.max_num_batched_tokens
        order = sorted(self.running, key=lambda r: (r.num_uncomputed_tokens > 1, r.sort_key()))
        for request in order:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_new = min(request.num_uncomputed_tokens + len(request.spec_token_ids), budget)
            if num_new == 0:
                continue  # a beam whose logits are in, waiting for its siblings' (worker.engine.beam)
            while not self._try_allocate(request, num_new):
                if num_new > request.num_uncomputed_tokens:  # drop speculative tokens before preempting anyone
                    num_new = min(request.num_uncomputed_tokens, budget)
                    continue
                victim = max(self.running, key=Request.sort_key)  # lowest priority, latest arrival
                victims = [m for m in victim.beam_members if m.status is RequestStatus.RUNNING] or [victim]
                for member in victims:  # a beam group goes as a whole
                    budget += scheduled.pop(member.request_id, 0)
                    self._preempt(member)
                    preempted.append(member)
                if request in victims:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
        return budget

    def _schedule_waiting(self, scheduled: dict[str, int], budget: int) -> None:
        """Admit waiting requests in (priority, arrival) order while seats, budget and blocks last."""
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._waiting[0][2]
            reserved = sum(r.num_pending_forks for r in self.running)  # seats promised to running parents' forks
            members = [m for m in request.beam_members if m.status is RequestStatus.WAITING and m is not request]
            seats = 1 + request.num_pending_forks + len(members)
            if len(self.running) + reserved + seats > self.max_num_seqs:
                break
            if self.pool.enable_caching:
                self._apply_prefix_cache(request)
            num_new = min(request.num_uncomputed_tokens, budget)
            if not self._try_allocate(request, num_new):
                self._release_blocks(request)  # a waiting request must not sit on blocks
                break
            heapq.heappop(self._waiting)
            if self.pool.enable_caching and request.num_preemptions == 0:
                self._record_prefix_hit(request)
            self.adopt(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
            if members:  # the rest of a preempted beam group comes back with it; they get tokens from next step on
                self._remove_waiting(members)
                for member in members:
                    if self.pool.enable_caching:
                        self._apply_prefix_cache(member)  # the blocks it held before keep their hashes
                    self.adopt(member)

    def adopt(self, request: Request) -> None:
        """Run ``request`` from now on as it stands (its blocks and computed tokens): a re-admitted or forked beam."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _remove_waiting(self, requests: list[Request]) -> None:
        self._waiting = [entry for entry in self._waiting if entry[2] not in requests]
        heapq.heapify(self._waiting)

    def _try_allocate(self, request: Request, num_new: int) -> bool:
        """Grow the request's block table to hold ``num_new`` more tokens; False (nothing taken) if out of blocks."""
        if not self._try_copy_on_write(request):
            return False
        missing = num_blocks_needed(request.num_computed_tokens + num_new, self.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        block_ids = self.pool.allocate(missing)
        if block_ids is None:
            return False
        request.block_ids.extend(block_ids)
        return True

    def _try_copy_on_write(self, request: Request) -> bool:
        """Before the request writes into a partly filled block that forks share, swap in a private copy (the
        last sharer to write keeps the original); False (nothing changed) if no block is free for the copy."""
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if offset == 0 or index >= len(request.block_ids) or self.pool.ref_count(request.block_ids[index]) == 1:
            return True
        copy = self.pool.allocate(1)
        if copy is None:
            return False
        self._block_copies.append((request.block_ids[index], copy[0]))
        self.pool.free([request.block_ids[index]])
        request.block_ids[index] = copy[0]
        return True

    def add_group(self, parent: Request, children: list[Request]) -> None:
        """Queue a parent whose ``children`` (same prompt, own sampling: a job's n > 1 choices) wait until its
        prompt is computed, then start from its blocks instead of prefilling the prompt again (``_start_forks``)."""
        parent.num_pending_forks = len(children)
        self._forks[parent] = children
        for child in children:
            self._fork_parent[child.request_id] = parent
        self.add(parent)

    def _start_forks(self) -> None:
        """Start the children of every parent whose prompt K/V is complete."""
        for parent in list(self._forks):
            if parent.status is RequestStatus.RUNNING and parent.num_computed_tokens >= parent.num_prompt_tokens:
                self._fork(parent)

    def _fork(self, parent: Request) -> None:
        """Each child shares the parent's blocks for prompt positions ``[0, P - 1)`` (one reference more) and
        computes position ``P - 1`` itself, for its own next-token logits. The block holding ``P - 1``, when it is
        partly filled and shared, is copied on the child's first write (``_try_copy_on_write``)."""
        children = self._forks.pop(parent)
        num_shared = parent.num_prompt_tokens - 1
        shared_ids = parent.block_ids[:num_blocks_needed(num_shared, self.block_size)]
        for child in children:
            del self._fork_parent[child.request_id]
            self.pool.touch(shared_ids)
            child.block_ids = list(shared_ids)
            child.block_hashes = parent.block_hashes[:num_shared // self.block_size]
            child.num_computed_tokens = num_shared
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.num_pending_forks = 0

    def _release_forks(self, parent: Request) -> None:
        """The parent ends: start its children from its prompt if that is computed, else queue them on their own."""
        if parent not in self._forks:
            return
        if parent.status is RequestStatus.RUNNING and parent.num_computed_tokens >= parent.num_prompt_tokens:
            self._fork(parent)
            return
        for child in self._forks.pop(parent):
            del self._fork_parent[child.request_id]
            self.add(child)
        parent.num_pending_forks = 0

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        """``num_new`` known tokens, then any speculative ones the budget left room for. Speculative tokens are
        not counted as computed: the engine advances ``num_computed_tokens`` over the accepted ones afterwards."""
        start = request.num_computed_tokens
        num_known = min(num_new, request.num_uncomputed_tokens)
        spec_token_ids = request.spec_token_ids[:num_new - num_known]
        request.num_computed_tokens += num_known
        token_ids = tuple(request.token_ids_slice(start, start + num_known)) + tuple(spec_token_ids)
        return ScheduledChunk(request_id=request.request_id, token_ids=token_ids, start_position=start,
                              block_ids=tuple(request.block_ids),
                              needs_logits=request.num_computed_tokens == request.num_tokens,
                              num_spec_tokens=len(spec_token_ids))

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
        """After the forward pass: publish the hashes of blocks that just became full (prefix caching). A block
        that holds a pending token (``Request.num_pending_tokens``) waits for a later step, once its id is known."""
        if not self.pool.enable_caching:
            return
        for chunk in output.chunks:
            request = requests[chunk.request_id]
            num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.block_size
            for i in range(len(request.block_hashes), num_full):
                parent = request.block_hashes[-1] if request.block_hashes else None
                tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
                block_hash = hash_block(parent, tokens)
                self.pool.cache_block(request.block_ids[i], block_hash)
                request.block_hashes.append(block_hash)

    def accept_speculation(self, request: Request, num_accepted: int) -> None:
        """After verification: the K/V of the ``num_accepted`` kept speculative tokens count as computed; those of
        rejected ones are dropped (their slots are overwritten later) and blocks left holding only them are freed."""
        request.num_computed_tokens += num_accepted
        assert request.num_computed_tokens < request.num_tokens
        num_kept = num_blocks_needed(request.num_tokens, self.block_size)  # room for the last token's K/V
        self.pool.free(request.block_ids[num_kept:])
        del request.block_ids[num_kept:]

    def finish(self, request: Request) -> None:
        """Remove a request that is done (or aborted) and free its blocks now."""
        if request in self._forks:
            self._release_forks(request)
        parent = self._fork_parent.pop(request.request_id, None)
        if parent is not None:  # a child that never started
            self._forks[parent].remove(request)
            parent.num_pending_forks -= 1
            if not self._forks[parent]:
                del self._forks[parent]
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self._remove_waiting([request])
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
