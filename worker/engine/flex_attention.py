"""Paged attention with FlexAttention: queries read their request's K/V blocks in place, no gather.

The KV pool of a layer, ``[num_blocks, block_size, kvh, D]``, is viewed (not copied) as one long key sequence
``[1, kvh, num_blocks * block_size, D]`` whose index is the flat *slot*. A ``BlockMask`` with a KV block size of
the engine's block size lists, for every query row, the physical blocks of its request's table, so the fused
kernel visits only those; the ``mask_mod`` then keeps, inside them, the keys at logical positions the query may
see (causal, and below the request's context length). It maps a slot to its logical position through a per-row
``physical -> logical block`` table (-1 where the block is not the row's), which also makes the mask complete on
its own: flex's unfused reference (eager, CPU) ignores the block lists and applies only the ``mask_mod``.

A step makes one call for all its decodes (batch = decode rows, one query each; padded to a bucket size, padded
rows read block 0 and are dropped) and one call per multi-token prefill chunk (batch 1, its queries padded to a
power of two). Padding bounds the number of shapes the compiled kernel is built for: on CPU each new shape costs
~10 s of inductor compilation, on CUDA a Triton build.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from worker.engine.kv_cache import KVCache, num_blocks_needed
from worker.engine.staging import Staging

FLEX_Q_BLOCK = 128  # flex's query tile: a prefill chunk's queries are padded to a power of two at least this
FLEX_MAX_SHAPES = 64  # compiled shapes allowed per process (torch's default recompile limit, 8, is too few)
FlexFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class FlexIndex:
    """The index tensors behind a call's ``BlockMask``, for ``batch`` rows; ``write_flex_index`` fills them in
    place (and ``clear_flex_index`` empties them again), so a CUDA graph captured over them replays with the new
    step's tables."""

    to_logical: torch.Tensor  # [B, N] int32: logical index of each physical block in row b's table, else -1
    first_positions: torch.Tensor  # [B] int32: position of row b's first query
    context_lens: torch.Tensor  # [B] int32: keys row b may see, at most
    kv_num_blocks: torch.Tensor  # [B, 1, num_q_blocks] int32: blocks the kernel visits per query tile
    kv_indices: torch.Tensor  # [B, 1, num_q_blocks, N] int32: which ones (row b's table, then zeros)
    no_full_blocks: torch.Tensor  # [B, 1, num_q_blocks] zeros: no block skips the mask_mod
    no_full_indices: torch.Tensor  # [B, 1, num_q_blocks, N] zeros (a tensor of its own: inductor's CPU template
    # does not compile with one tensor passed as both index arguments)

    @property
    def batch(self) -> int:
        return int(self.to_logical.shape[0])


@dataclass(frozen=True)
class FlexCall:
    """One flex call: queries ``query[gather_idx]`` laid out as ``[batch, H, num_queries, D]``, padded.

    Row-major order of ``(batch, query)`` puts the real queries first: the first ``len(token_idx)`` rows of the
    flattened result are theirs (decodes: batch b, query 0; a prefill chunk: batch 0, query i).
    """

    token_idx: torch.Tensor  # [n] flat indices of the real queries in the step's token sequence
    gather_idx: torch.Tensor  # [batch * num_queries] the same, padded (with the first index) to the call's size
    num_queries: int
    block_mask: BlockMask
    # The call's queries are all the step's tokens in order (a static decode step, ``cuda_graphs.py``): read in
    # place, not gathered, and returned as the step's attention, not scattered. Only that path sets it, so the
    # compiled kernel sees one query layout per shape (a gathered query is contiguous, a read one strided).
    whole_step: bool = False


@dataclass(frozen=True)
class FlexStep:
    """Every flex call of one step, the (compiled) ``flex_attention`` to make them with and its kernel options."""

    calls: tuple[FlexCall, ...]
    attend: FlexFn
    options: dict[str, int] | None = None


def make_flex_fn(compile_kernel: bool) -> FlexFn:
    """``flex_attention``, compiled to a fused kernel (inductor: Triton on CUDA, C++ on CPU) unless
    ``compile_kernel`` is False (flex's unfused reference: materialises every score, for tests only)."""
    if not compile_kernel:
        def reference(*args: object, **kwargs: object) -> torch.Tensor:
            with warnings.catch_warnings():  # its "called without torch.compile" warning: the point here
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return flex_attention(*args, **kwargs)  # type: ignore[arg-type]

        return reference
    compiled = torch.compile(flex_attention, dynamic=False)  # dynamic shapes break inductor's CPU template

    def attend(*args: object, **kwargs: object) -> torch.Tensor:
        with torch._dynamo.config.patch(recompile_limit=FLEX_MAX_SHAPES):  # scoped, not process-wide
            return compiled(*args, **kwargs)  # type: ignore[no-any-return]

    return attend


def kernel_options(device: torch.device, block_size: int) -> dict[str, int] | None:
    """Triton tiles that divide the KV block size (flex requires it); None on CPU (its template has no tiles)."""
    if device.type != "cuda":
        return None
    tile = 16
    while tile < 64 and block_size % (tile * 2) == 0:
        tile *= 2
    return {"BLOCK_N": tile}


def _padded_queries(num_queries: int) -> int:
    """Queries of a prefill call: the next power of two, at least ``FLEX_Q_BLOCK``."""
    return max(FLEX_Q_BLOCK, 1 << (num_queries - 1).bit_length())


def allocate_flex_index(batch: int, num_queries: int, num_blocks: int, device: torch.device) -> FlexIndex:
    """Index tensors for ``batch`` rows of ``num_queries`` queries over a pool of ``num_blocks`` blocks."""
    num_q_blocks = -(-num_queries // FLEX_Q_BLOCK)
    kv_num_blocks = torch.zeros(batch, 1, num_q_blocks, dtype=torch.int32, device=device)
    return FlexIndex(
        to_logical=torch.full((batch, num_blocks), -1, dtype=torch.int32, device=device),
        first_positions=torch.zeros(batch, dtype=torch.int32, device=device),
        context_lens=torch.ones(batch, dtype=torch.int32, device=device),
        kv_num_blocks=kv_num_blocks,
        kv_indices=torch.zeros(batch, 1, num_q_blocks, num_blocks, dtype=torch.int32, device=device),
        no_full_blocks=torch.zeros_like(kv_num_blocks),
        no_full_indices=torch.zeros(batch, 1, num_q_blocks, num_blocks, dtype=torch.int32, device=device),
    )


@dataclass(frozen=True)
class StagedIndex:
    """Where ``stage_flex_index`` queued an index's values: column numbers in the ``Staging``'s result."""

    blocks: int  # [n] the rows' tables, one after another: the physical block of each (row, logical) pair
    first_positions: int  # [B]
    context_lens: int  # [B]
    num_blocks: int  # [B] blocks in each row's table
    num_entries: int  # n = the sum of ``num_blocks``


def stage_flex_index(stage: Staging, batch: int, tables: Sequence[Sequence[int]], first_positions: Sequence[int],
                     context_lens: Sequence[int], block_size: int) -> StagedIndex:
    """Queue ``len(tables)`` rows of an index of ``batch`` rows; the rows after them become padding.

    Row ``b``'s query ``i`` sits at position ``first_positions[b] + i`` and sees keys at positions ``<=`` that and
    ``< context_lens[b]`` in its table's blocks. A padded row sees block 0's first key: finite, and dropped. Only
    the tables' blocks go one by one: each entry's row and logical place are made on the device from the counts.
    """
    pad_rows = batch - len(tables)
    assert pad_rows >= 0, "more rows than the index holds"
    used = [t[:num_blocks_needed(n, block_size)] for t, n in zip(tables, context_lens, strict=True)]
    used += [(0,)] * pad_rows
    counts = [len(t) for t in used]
    return StagedIndex(
        blocks=stage.add(itertools.chain.from_iterable(used)),
        first_positions=stage.add([*first_positions, *[0] * pad_rows]),
        context_lens=stage.add([*context_lens, *[1] * pad_rows]),
        num_blocks=stage.add(counts),
        num_entries=sum(counts),
    )


@dataclass(frozen=True, eq=False)
class FlexEntries:
    """The table entries a ``write_flex_index`` made, ``[n]`` each: what ``clear_flex_index`` undoes."""

    rows: torch.Tensor
    blocks: torch.Tensor  # physical
    logical: torch.Tensor


def write_flex_index(index: FlexIndex, columns: Sequence[torch.Tensor], staged: StagedIndex) -> FlexEntries:
    """Write the sent columns (``Staging.send``) that ``staged`` names into ``index`` in place; returns the table
    entries written. Each entry's row and logical place are made here on the device from the per-row counts (no
    wait: the entry count is known on the host).

    ``index``'s pool-wide tensors (``to_logical``, ``kv_indices``) must hold no other entries: as allocated, or
    cleared of an earlier write's by ``clear_flex_index``. So a step costs work in its table entries, not in
    ``batch x pool blocks`` (at 256 rows over a GPU's ~500k blocks, two fills of ~0.5 GB each)."""
    counts, blocks = columns[staged.num_blocks], columns[staged.blocks]
    rows = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                   output_size=staged.num_entries)  # [n]
    starts = torch.cumsum(counts, 0) - counts  # [B]: each row's first entry
    logical = torch.arange(staged.num_entries, device=counts.device) - starts[rows]  # [n]
    index.to_logical[rows, blocks] = logical.to(torch.int32)
    index.first_positions.copy_(columns[staged.first_positions])
    index.context_lens.copy_(columns[staged.context_lens])
    index.kv_indices[rows, 0, :, logical] = blocks.to(torch.int32)[:, None]
    index.kv_num_blocks.copy_(counts[:, None, None].expand_as(index.kv_num_blocks))
    return FlexEntries(rows, blocks, logical)


def clear_flex_index(index: FlexIndex, entries: FlexEntries) -> None:
    """Undo the table entries a ``write_flex_index`` into ``index`` made: ``to_logical`` and ``kv_indices`` are as
    allocated again (the per-row columns are rewritten whole by the next write)."""
    index.to_logical[entries.rows, entries.blocks] = -1
    index.kv_indices[entries.rows, 0, :, entries.logical] = 0


def fill_flex_index(index: FlexIndex, tables: Sequence[Sequence[int]], first_positions: Sequence[int],
                    context_lens: Sequence[int], block_size: int) -> None:
    """Write ``len(tables)`` rows into ``index`` (as allocated) in place (``stage_flex_index``), in one
    host-to-device copy."""
    stage = Staging()
    staged = stage_flex_index(stage, index.batch, tables, first_positions, context_lens, block_size)
    write_flex_index(index, stage.send(index.to_logical.device), staged)


def make_block_mask(index: FlexIndex, num_queries: int, block_size: int) -> BlockMask:
    """The ``BlockMask`` over ``index``'s tensors (kept by reference, so later fills change what it masks)."""
    num_blocks = index.to_logical.shape[1]
    # Every visited block runs the mask_mod (no "full" blocks). Zero tensors, not None: the CPU template fails to
    # compile some shapes without them (torch 2.13).
    return BlockMask.from_kv_blocks(index.kv_num_blocks, index.kv_indices, index.no_full_blocks,
                                    index.no_full_indices,
                                    BLOCK_SIZE=(FLEX_Q_BLOCK, block_size),
                                    mask_mod=paged_mask_mod(index.to_logical, index.first_positions,
                                                            index.context_lens, block_size),
                                    seq_lengths=(num_queries, num_blocks * block_size), compute_q_blocks=False)


def prepare_flex_call(token_idx: Sequence[int], tables: Sequence[Sequence[int]], first_positions: Sequence[int],
                      context_lens: Sequence[int], batch: int, num_queries: int, kv_cache: KVCache,
                      device: torch.device) -> FlexCall:
    """A call over ``len(tables)`` rows padded to ``batch``: one row per decode (``num_queries`` 1), or one
    prefill chunk (one row, ``token_idx`` its tokens in order)."""
    index = allocate_flex_index(batch, num_queries, kv_cache.num_blocks, device)
    fill_flex_index(index, tables, first_positions, context_lens, kv_cache.block_size)
    idx = list(token_idx)
    gather = idx + [idx[0]] * (batch * num_queries - len(idx))
    return FlexCall(token_idx=torch.tensor(idx, dtype=torch.long, device=device),
                    gather_idx=torch.tensor(gather, dtype=torch.long, device=device), num_queries=num_queries,
                    block_mask=make_block_mask(index, num_queries, kv_cache.block_size))


def prepare_flex_decode(token_idx: Sequence[int], tables: Sequence[Sequence[int]], context_lens: Sequence[int],
                        batch: int, kv_cache: KVCache, device: torch.device) -> FlexCall:
    """All decode queries of a step in one call, padded to ``batch`` rows; each sees its whole context."""
    return prepare_flex_call(token_idx, tables, [n - 1 for n in context_lens], context_lens, batch, 1, kv_cache,
                             device)


def paged_mask_mod(to_logical: torch.Tensor, first_positions: torch.Tensor, context_lens: torch.Tensor,
                   block_size: int) -> Callable[..., torch.Tensor]:
    """The ``mask_mod`` of a call: slot ``kv`` is visible to row ``b``'s query ``q`` when its block is in ``b``'s
    table and its logical position is ``<= first_positions[b] + q`` and ``< context_lens[b]``.

    ``to_logical``: [B, num_blocks] logical block index of each physical block in row b's table, else -1.
    """

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        logical = to_logical[b, kv // block_size]
        position = logical * block_size + kv % block_size
        return (logical >= 0) & (position <= first_positions[b] + q) & (position < context_lens[b])

    return mask_mod


def prepare_flex_prefill(token_start: int, start_position: int, num_tokens: int, block_ids: Sequence[int],
                         kv_cache: KVCache, device: torch.device) -> FlexCall:
    """One multi-token chunk: flat tokens ``[token_start, token_start + num_tokens)`` at ``start_position``."""
    return prepare_flex_call(range(token_start, token_start + num_tokens), [block_ids], [start_position],
                             [start_position + num_tokens], 1, _padded_queries(num_tokens), kv_cache, device)


def attend_flex(layer: int, query: torch.Tensor, step: FlexStep, kv_cache: KVCache, scale: float,
                out: torch.Tensor) -> None:
    """Write every call's attention into ``out``. ``query`` and ``out``: [T, H, D], the whole step."""
    for call in step.calls:
        out[call.token_idx] = flex_rows(layer, query, call, step, kv_cache, scale).to(out.dtype)


def flex_rows(layer: int, query: torch.Tensor, call: FlexCall, step: FlexStep, kv_cache: KVCache,
              scale: float) -> torch.Tensor:
    """One call's attention, ``[len(call.token_idx), H, D]`` in the cache's dtype. ``query``: [T, H, D]; a
    whole-step call reads it as it lies (a view: no gather kernel)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    cache_keys, cache_values = kv_cache.keys[layer], kv_cache.values[layer]
    num_slots = cache_keys.shape[0] * cache_keys.shape[1]
    # [N, bs, kvh, D] -> [1, kvh, N * bs, D]: a strided view of the pool, every slot a key
    keys = cache_keys.view(1, num_slots, *cache_keys.shape[2:]).transpose(1, 2)
    values = cache_values.view(1, num_slots, *cache_values.shape[2:]).transpose(1, 2)
    batch = call.gather_idx.shape[0] // call.num_queries
    rows = query if call.whole_step else query[call.gather_idx]
    q = rows.view(batch, call.num_queries, num_heads, head_dim).transpose(1, 2)
    if q.dtype != keys.dtype:
        q = q.to(keys.dtype)
    result = step.attend(q, keys, values, block_mask=call.block_mask, scale=scale,
                         enable_gqa=num_heads != keys.shape[1], kernel_options=step.options)  # [B, H, Q, D]
    return result.transpose(1, 2).reshape(-1, num_heads, head_dim)[:len(call.token_idx)]
