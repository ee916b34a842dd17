"""Decode steps from static buffers, padded to a batch-size bucket, and replayed from a CUDA graph per bucket.

A decode step at small batch is launch-bound on a GPU: hundreds of small kernels whose launch costs more than
their work. A CUDA graph records one step's kernels once and replays them with one launch, but only over the
same memory with the same shapes. So decode-only steps (every request adds one token and needs its logits) are
padded to the next bucket of ``BATCH_BUCKETS`` and run from static buffers: token ids, positions, slots and the
FlexAttention index (``flex_attention.FlexIndex``), rewritten in place before each replay. Padded rows are token
0 at position 0, write their K/V to the cache's scratch block and read block 0; their logits are dropped.

``capture=False`` runs the very same padded static-buffer step without a graph: every part but the capture and
the replay, so it is what runs (and is tested) on CPU. Steps with a prefill chunk, speculative tokens or more
rows than the largest bucket take the ordinary path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.engine.attention import AttentionMetadata, PagedContext
from worker.engine.flex_attention import (
    FlexCall,
    FlexEntries,
    FlexFn,
    FlexIndex,
    FlexStep,
    allocate_flex_index,
    clear_flex_index,
    make_block_mask,
    stage_flex_index,
    write_flex_index,
)
from worker.engine.kv_cache import KVCache
from worker.engine.request import PENDING_TOKEN
from worker.engine.scheduler import ScheduledChunk
from worker.engine.staging import Staging

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARMUP_RUNS = 2  # before a capture: compiles flex for the bucket's shape, lets cuBLAS settle its workspaces
# The forward a graph records: (input_ids [T], position_ids [T], context, logits_indices [B]) -> logits [B, V]
StepFn = Callable[[torch.Tensor, torch.Tensor, PagedContext, torch.Tensor], torch.Tensor]


def buckets_up_to(max_num_seqs: int, buckets: Sequence[int] = BATCH_BUCKETS) -> tuple[int, ...]:
    """The buckets a batch of at most ``max_num_seqs`` rows can need: up to the first that holds it."""
    chosen = [b for b in buckets if b < max_num_seqs]
    larger = [b for b in buckets if b >= max_num_seqs]
    return tuple(chosen + larger[:1])


def pick_bucket(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows; None above the largest."""
    return next((b for b in buckets if b >= num_seqs), None)


def is_plain_decode(chunks: Sequence[ScheduledChunk]) -> bool:
    """Whether every chunk adds exactly one token and needs its logits (no prefill, no speculative tokens)."""
    return bool(chunks) and all(len(c.token_ids) == 1 and c.needs_logits and not c.num_spec_tokens for c in chunks)


@dataclass(frozen=True, eq=False)
class FedTokens:
    """Input ids that never leave the device (``overlap.py``): the previous step's drawn tokens ``drawn`` [B'], and
    for each chunk of this step the row of its id there, or -1 where the chunk carries its own id."""

    drawn: torch.Tensor  # [B'] long
    rows: tuple[int, ...]  # [len(chunks)]


@dataclass(frozen=True)
class StaticDecode:
    """One bucket's views of the static buffers, and the context its forward (and graph) reads."""

    input_ids: torch.Tensor  # [b]
    positions: torch.Tensor  # [b]
    slot_mapping: torch.Tensor  # [b]
    logits_indices: torch.Tensor  # [b] = arange(b): every row's logits
    index: FlexIndex  # b rows
    context: PagedContext


class DecodeGraphs:
    """Runs decode-only steps padded to a bucket, from static buffers; captures a graph per bucket on first use."""

    def __init__(self, forward: StepFn, kv_cache: KVCache, attend: FlexFn, options: dict[str, int] | None,
                 max_num_seqs: int, capture: bool, device: torch.device) -> None:
        if kv_cache.scratch_slot is None:
            raise ValueError("DecodeGraphs needs a KVCache with a scratch block for its padded rows")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graph capture needs a CUDA device, got {device}")
        self.forward, self.kv_cache, self.capture = forward, kv_cache, capture
        self.buckets = buckets_up_to(max_num_seqs)
        largest = self.buckets[-1]
        ids = torch.zeros(largest, dtype=torch.long, device=device)
        positions = torch.zeros(largest, dtype=torch.long, device=device)
        slots = torch.zeros(largest, dtype=torch.long, device=device)
        index = allocate_flex_index(largest, 1, kv_cache.num_blocks, device)
        self._static = {b: self._views(b, ids, positions, slots, index, attend, options, device) for b in self.buckets}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None  # the graphs share one memory pool
        # The last fill's index entries (its bucket's index, the entries), cleared before the next fill
        self._written: tuple[FlexIndex, FlexEntries] | None = None
        self.num_steps = 0  # decode steps this path ran

    def _views(self, bucket: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, index: FlexIndex,
               attend: FlexFn, options: dict[str, int] | None, device: torch.device) -> StaticDecode:
        rows = FlexIndex(*(t[:bucket] for t in (index.to_logical, index.first_positions, index.context_lens,
                                                index.kv_num_blocks, index.kv_indices, index.no_full_blocks,
                                                index.no_full_indices)))
        all_rows = torch.arange(bucket, device=device)
        call = FlexCall(token_idx=all_rows, gather_idx=all_rows, num_queries=1,
                        block_mask=make_block_mask(rows, 1, self.kv_cache.block_size), whole_step=True)
        metadata = AttentionMetadata(slot_mapping=slots[:bucket], decode=None, prefills=(),
                                     flex=FlexStep((call,), attend, options))
        return StaticDecode(ids[:bucket], positions[:bucket], slots[:bucket], all_rows, rows,
                            PagedContext(self.kv_cache, metadata))

    def can_run(self, chunks: Sequence[ScheduledChunk]) -> bool:
        return is_plain_decode(chunks) and len(chunks) <= self.buckets[-1]

    def run(self, chunks: Sequence[ScheduledChunk], fed: FedTokens | None = None) -> torch.Tensor:
        """Logits ``[len(chunks), V]`` of a decode-only step (``can_run``); float32 when replayed. ``fed``: ids
        that the previous step drew on the device, for the chunks whose id is still pending."""
        bucket = pick_bucket(len(chunks), self.buckets)
        assert bucket is not None and is_plain_decode(chunks), "not a step DecodeGraphs can run"
        static = self._static[bucket]
        self._fill(static, chunks, fed)
        self.num_steps += 1
        if not self.capture:
            return self._forward(static)[:len(chunks)]
        if bucket not in self._graphs:
            self._graphs[bucket] = self._record(static)
        graph, logits = self._graphs[bucket]
        graph.replay()
        # A copy (the next replay overwrites the static output), made in the float32 the sampler takes: one kernel
        return logits[:len(chunks)].to(torch.float32, copy=True)

    def graph(self, bucket: int) -> torch.cuda.CUDAGraph | None:
        """The graph captured for ``bucket``: None before the bucket's first step, and always without capture.
        Replaying it repeats the bucket's last step (the GPU check times replays alone against whole steps)."""
        entry = self._graphs.get(bucket)
        return entry[0] if entry is not None else None

    def _fill(self, static: StaticDecode, chunks: Sequence[ScheduledChunk], fed: FedTokens | None = None) -> None:
        """Write the step into the bucket's buffers, from one host-to-device copy; rows past ``len(chunks)``
        become padding. The index tensors are shared by every bucket: the last step's entries are cleared first.
        A pending id (``PENDING_TOKEN``) is gathered from ``fed`` on the device."""
        pad = static.input_ids.shape[0] - len(chunks)
        block_size, scratch = self.kv_cache.block_size, self.kv_cache.scratch_slot
        assert scratch is not None, "checked in __init__"
        rows = fed.rows if fed is not None else (-1,) * len(chunks)
        assert all((c.token_ids[0] == PENDING_TOKEN) == (row >= 0) for c, row in zip(chunks, rows, strict=True)), \
            "each pending id, and only those, comes from the fed tokens"
        positions = [c.start_position for c in chunks]
        stage = Staging()
        ids = stage.add([*(max(c.token_ids[0], 0) for c in chunks), *[0] * pad])
        fed_rows = stage.add([*rows, *[-1] * pad]) if fed is not None else None
        starts = stage.add([*positions, *[0] * pad])
        slots = stage.add([*(c.block_ids[p // block_size] * block_size + p % block_size
                             for c, p in zip(chunks, positions, strict=True)), *[scratch] * pad])
        staged = stage_flex_index(stage, static.index.batch, [c.block_ids for c in chunks], positions,
                                  [p + 1 for p in positions], block_size)
        columns = stage.send(static.input_ids.device)
        static.input_ids.copy_(columns[ids])
        if fed is not None and fed_rows is not None:
            from_fed = columns[fed_rows]  # [bucket]
            static.input_ids.copy_(torch.where(from_fed >= 0, fed.drawn[from_fed.clamp(min=0)], static.input_ids))
        static.positions.copy_(columns[starts])
        static.slot_mapping.copy_(columns[slots])
        if self._written is not None:
            clear_flex_index(*self._written)
        self._written = (static.index, write_flex_index(static.index, columns, staged))

    def _forward(self, static: StaticDecode) -> torch.Tensor:
        return self.forward(static.input_ids, static.positions, static.context, static.logits_indices)

    def _record(self, static: StaticDecode) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream, then capture one forward over the bucket's buffers.

        The warm-up runs compute this very step (their K/V writes are the ones the replay repeats), so
        capturing on the first step of a bucket costs time, not correctness."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(static)
        self._pool = graph.pool()
        return graph, logits
