"""Attention for single-token queries (decodes), batched, with shared prefixes attended once (cascade attention).

After the matmuls, a CPU decode step's cost is reading every sequence's K/V: stock torch has no kernel that reads
a paged cache in place, so each layer gathers every block table into a contiguous tensor. When sequences share a
prefix (a system prompt, which prefix caching maps to the same block ids at the start of their tables) that
gather copied the same blocks once per sequence, and attention over them ran as many thin per-sequence products.

So the decode queries are split into groups. A *cascade group* is a set of sequences whose tables start with the
same blocks: those shared blocks are gathered once, and all the group's queries meet them in one matmul per KV
head; only each sequence's own suffix is gathered per sequence. The two parts' scores go through one softmax, so
this is exact attention, not an approximation. Everything else forms *plain groups*, each attended with a single
``scaled_dot_product_attention`` and a key-length mask. A batched gather pads every table to the group's longest,
so plain rows are bucketed by length (a short prompt beside a long one no longer reads the long one's width of
padding); each bucket costs a few kernel launches per layer, so buckets are cut only where the padding they save
outweighs that (``split_by_length``).

Cascade scores are explicit matmuls because one softmax must span both parts and SDPA does not return its
log-sum-exp; the per-sequence part is short there, so the explicit version costs little.

With the C++ operator (``decode_kernel.py``, the ``"kernel"`` backend) nothing is gathered for plain queries: they
form one group whatever their lengths, attended in one call per layer that reads each sequence's blocks where
they lie (``DecodeGroup.context_lens`` set). Cascade groups keep their gathered path, which costs more than it saves
there, so by default the engine forms none beside the operator (``config.pick_cascade``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.engine.kv_cache import KVCache, prepare_block_tables

# A cascade group pays for itself when it saves gathering this many tokens' K/V per layer (shared tokens times
# members beyond the first); below that, its extra per-layer kernel launches cost more than the copy it avoids.
MIN_SHARED_TOKENS_SAVED = 1024
# What one more group costs per layer (its gather and attention launches), in gathered tokens: ~100 us of fixed
# cost against ~0.25 us per gathered token of SmolLM2's K/V on the development CPU (docs/performance.md).
GROUP_COST_TOKENS = 400


@dataclass(frozen=True)
class DecodeGroup:
    """Decode queries attended together, and the blocks they read."""

    token_idx: torch.Tensor  # [Bg] flat indices of the queries in the step's token sequence
    shared_block_ids: torch.Tensor | None  # [P] blocks every table in the group starts with; None: plain group
    block_tables: torch.Tensor  # [Bg, max_blocks - P] each sequence's own blocks, right-padded
    # [Bg, 1, 1, (max_blocks - P) * block_size] bool: true for real keys; None for the kernel's group
    key_mask: torch.Tensor | None
    # (start, end) when the queries are the step's tokens start..end-1 in order (a decode-only step of one group):
    # then they are read and written as slices, without a gather and a scatter per layer.
    token_range: tuple[int, int] | None = None
    # A plain group of one sequence (one stream) reads exactly its keys, without a mask: its length, and its
    # blocks as (first, end) when their ids are consecutive, which makes its K/V a view of the cache, not a copy:
    # ``lone_kv``, those keys and values of every layer laid out for attention (``KVCache.block_range_all``, two
    # [num_layers, 1, kvh, num_keys, D]), built once per step where the cache was at hand (the model runner's
    # way); without it, the group's K/V are gathered per layer.
    num_keys: int | None = None
    block_range: tuple[int, int] | None = None
    lone_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    # [Bg] int64 keys of each sequence, set when the C++ operator reads the blocks in place (no mask, no gather)
    context_lens: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeBatch:
    """All single-token queries of one step, as disjoint groups."""

    groups: tuple[DecodeGroup, ...]

    def whole_step(self, num_tokens: int) -> DecodeGroup | None:
        """The one group when it holds all ``num_tokens`` of the step in order (a decode-only step of one group,
        e.g. one stream): its attention is then the step's, with no output to scatter into."""
        if len(self.groups) == 1 and self.groups[0].token_range == (0, num_tokens):
            return self.groups[0]
        return None


def num_shared_blocks(tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int) -> int:
    """Leading block ids common to every table, excluding each sequence's newest block.

    Shared blocks are full, immutable cached blocks; the block a sequence writes this step is its own (the
    scheduler copies on write), so capping at the block before the newest token keeps at least one key in every
    sequence's own part and never treats a block being written as shared.
    """
    if len(tables) < 2:
        return 0
    limit = min(min((n - 1) // block_size for n in context_lens), min(len(t) for t in tables))
    first = tables[0]
    for i in range(limit):
        if any(t[i] != first[i] for t in tables):
            return i
    return limit


def split_by_length(rows: Sequence[int], widths: Sequence[int], group_cost: int) -> list[list[int]]:
    """Cut ``rows`` into groups minimising ``sum(len(group) * max width in group) + group_cost * num_groups``.

    ``widths[r]`` is row ``r``'s padded width (tokens). Optimal over contiguous runs of the rows sorted by width
    (an optimal grouping never interleaves widths); O(n^2) for n rows, a few thousand steps at n = 64.
    """
    ordered = sorted(rows, key=lambda r: widths[r])
    best = [0] * (len(ordered) + 1)  # best[j]: cost of grouping the j narrowest rows
    cut = [0] * (len(ordered) + 1)  # cut[j]: where the last group of that best grouping starts
    for j in range(1, len(ordered) + 1):
        width = widths[ordered[j - 1]]
        best[j], cut[j] = min((best[i] + (j - i) * width + group_cost, i) for i in range(j))
    groups: list[list[int]] = []
    j = len(ordered)
    while j > 0:
        groups.append(sorted(ordered[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def plan_decode_groups(tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int,
                       min_tokens_saved: float, group_cost: int = GROUP_COST_TOKENS, in_place: bool = False
                       ) -> list[tuple[list[int], int]]:
    """Partition decode rows into ``(rows, num_shared_blocks)``; plain groups (0 shared blocks) come last.

    Candidates are rows with the same first block; a candidate becomes a cascade group when sharing saves at
    least ``min_tokens_saved`` gathered tokens (``math.inf``: never), otherwise its rows are plain. Plain rows are
    bucketed by length, or, read ``in_place`` by the kernel (no padding to save), one group.
    """
    by_first_block: dict[int, list[int]] = defaultdict(list)
    for row, table in enumerate(tables):
        by_first_block[table[0]].append(row)
    groups: list[tuple[list[int], int]] = []
    plain: list[int] = []
    for rows in by_first_block.values():
        shared = num_shared_blocks([tables[r] for r in rows], [context_lens[r] for r in rows], block_size)
        if shared * block_size * (len(rows) - 1) >= min_tokens_saved:
            groups.append((rows, shared))
        else:
            plain.extend(rows)
    if in_place:
        return groups + [(sorted(plain), 0)] if plain else groups
    widths = [len(t) * block_size for t in tables]
    groups += [(rows, 0) for rows in split_by_length(plain, widths, group_cost)]
    return groups


def prepare_decode_batch(token_idx: Sequence[int], tables: Sequence[Sequence[int]], context_lens: Sequence[int],
                         block_size: int, device: torch.device, share_prefix: bool,
                         min_tokens_saved: int = MIN_SHARED_TOKENS_SAVED, kv_cache: KVCache | None = None,
                         in_place: bool = False) -> DecodeBatch:
    """Index tensors for the decode queries; ``share_prefix`` enables cascade groups over common blocks. With the
    ``kv_cache``, a lone sequence on consecutive blocks gets its K/V views of every layer built here, once.
    ``in_place``: plain queries are one group for the C++ operator (``decode_kernel.py``)."""
    plan = plan_decode_groups(tables, context_lens, block_size, min_tokens_saved if share_prefix else math.inf,
                              in_place=in_place)
    groups = []
    for rows, num_shared in plan:
        if in_place and not num_shared:
            groups.append(_kernel_group([token_idx[r] for r in rows], [tables[r] for r in rows],
                                        [context_lens[r] for r in rows], device))
            continue
        own_tables = [tables[r][num_shared:] for r in rows]
        own_lens = torch.tensor([context_lens[r] - num_shared * block_size for r in rows], device=device)
        width = max(len(t) for t in own_tables) * block_size
        shared = torch.tensor(tables[rows[0]][:num_shared], dtype=torch.long, device=device) if num_shared else None
        idx = [token_idx[r] for r in rows]
        alone = len(rows) == 1 and not num_shared
        table = own_tables[0]
        consecutive = alone and list(table) == list(range(table[0], table[0] + len(table)))
        block_range = (table[0], table[0] + len(table)) if consecutive else None
        num_keys = context_lens[rows[0]] if alone else None
        groups.append(DecodeGroup(
            token_idx=torch.tensor(idx, dtype=torch.long, device=device),
            token_range=token_range(idx),
            shared_block_ids=shared,
            block_tables=prepare_block_tables(own_tables, device),
            key_mask=(torch.arange(width, device=device)[None, :] < own_lens[:, None])[:, None, None, :],
            num_keys=num_keys,
            block_range=block_range,
            lone_kv=(kv_cache.block_range_all(*block_range, context_lens[rows[0]])
                     if kv_cache is not None and block_range is not None else None),
        ))
    return DecodeBatch(tuple(groups))


def token_range(idx: list[int]) -> tuple[int, int] | None:
    """``(start, end)`` when the queries ``idx`` are the step's tokens start..end-1 in order, else None."""
    return (idx[0], idx[0] + len(idx)) if idx == list(range(idx[0], idx[0] + len(idx))) else None


def _kernel_group(idx: list[int], tables: list[Sequence[int]], context_lens: list[int],
                  device: torch.device) -> DecodeGroup:
    """Plain queries for the C++ operator: their whole block tables and key counts, nothing else."""
    return DecodeGroup(token_idx=torch.tensor(idx, dtype=torch.long, device=device), token_range=token_range(idx),
                       shared_block_ids=None,
                       block_tables=prepare_block_tables(tables, device), key_mask=None,
                       context_lens=torch.tensor(context_lens, dtype=torch.long, device=device))


def attend_decode(layer: int, query: torch.Tensor, batch: DecodeBatch, kv_cache: KVCache, scale: float,
                  out: torch.Tensor) -> None:
    """Write the decode queries' attention into ``out``. ``query`` and ``out``: [T, H, D], the whole step."""
    for group in batch.groups:
        if group.token_range is not None:
            out[group.token_range[0]:group.token_range[1]] = attend_group(layer, query, group, kv_cache, scale)
        else:
            out[group.token_idx] = attend_group(layer, query, group, kv_cache, scale)


def attend_group(layer: int, query: torch.Tensor, group: DecodeGroup, kv_cache: KVCache,
                 scale: float) -> torch.Tensor:
    """``query``: [T, H, D]; returns [Bg, H, D]."""
    num_seqs, num_heads, head_dim = len(group.token_idx), query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.num_kv_heads
    # GQA without expanding K/V: the g query heads sharing a KV head act as that head's queries, grouped
    # consecutively as transformers' repeat_kv assumes.
    rows = query[group.token_idx] if group.token_range is None else query[group.token_range[0]:group.token_range[1]]
    if group.context_lens is not None:  # [Bg, H, D], read where the blocks lie
        return torch.ops.tokenspool.paged_decode_attention(rows, kv_cache.keys[layer], kv_cache.values[layer],
                                                           group.block_tables, group.context_lens, scale)
    q = rows.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Bg, kvh, g, D]
    # A transposed view, not a copy: the fused CPU kernel reads strided K/V faster than a contiguous copy costs.
    if group.lone_kv is not None:
        keys, values = group.lone_kv[0][layer], group.lone_kv[1][layer]  # [1, kvh, S, D], views built per step
    else:
        keys, values = _group_kv(layer, group, kv_cache)  # [Bg, kvh, S, D]
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if group.shared_block_ids is None:
        mask = None if group.num_keys is not None else group.key_mask
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    else:
        out = _attend_cascade(layer, q, keys, values, group, kv_cache, scale)
    return out.reshape(num_seqs, num_heads, head_dim)  # out: [Bg, kvh, g, D]


def _group_kv(layer: int, group: DecodeGroup, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's K/V of ``layer``, gathered from its block tables: two [Bg, kvh, S, D]."""
    keys, values = kv_cache.gather(layer, group.block_tables)  # [Bg, S, kvh, D]
    if group.num_keys is not None:
        keys, values = keys[:, :group.num_keys], values[:, :group.num_keys]
    return keys.transpose(1, 2), values.transpose(1, 2)


def _attend_cascade(layer: int, q: torch.Tensor, own_keys: torch.Tensor, own_values: torch.Tensor,
                    group: DecodeGroup, kv_cache: KVCache, scale: float) -> torch.Tensor:
    """One softmax over [shared prefix keys | own keys]; the shared part is one matmul per KV head for all queries.

    ``q``: [Bg, kvh, g, D]; ``own_keys``/``own_values``: [Bg, kvh, S, D]. Returns [Bg, kvh, g, D].
    """
    assert group.shared_block_ids is not None
    num_seqs, num_kv_heads, num_q_per_kv, head_dim = q.shape
    rows = num_seqs * num_q_per_kv
    own_scores = torch.matmul(q, own_keys.transpose(-1, -2)).mul_(scale)  # [Bg, kvh, g, S]
    assert group.key_mask is not None
    own_scores.masked_fill_(~group.key_mask, float("-inf"))
    shared_keys, shared_values = kv_cache.gather(layer, group.shared_block_ids[None])  # [1, P, kvh, D]
    shared_keys = shared_keys[0].permute(1, 2, 0).to(q.dtype)  # [kvh, D, P]
    shared_values = shared_values[0].transpose(0, 1).to(q.dtype)  # [kvh, P, D]
    num_prefix = shared_keys.shape[-1]
    q_by_head = q.transpose(0, 1).reshape(num_kv_heads, rows, head_dim)  # [kvh, Bg*g, D]
    shared_scores = torch.bmm(q_by_head, shared_keys).mul_(scale)  # [kvh, Bg*g, P]
    shared_scores = shared_scores.view(num_kv_heads, num_seqs, num_q_per_kv, num_prefix).transpose(0, 1)
    probs = torch.cat([shared_scores, own_scores], dim=-1).softmax(-1)  # [Bg, kvh, g, P + S]
    out = torch.matmul(probs[..., num_prefix:], own_values)  # [Bg, kvh, g, D]
    shared_probs = probs[..., :num_prefix].transpose(0, 1).reshape(num_kv_heads, rows, num_prefix)
    shared_out = torch.bmm(shared_probs, shared_values)  # [kvh, Bg*g, D]
    return out.add_(shared_out.view(num_kv_heads, num_seqs, num_q_per_kv, head_dim).transpose(0, 1))
