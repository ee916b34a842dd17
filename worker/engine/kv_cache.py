"""The paged K/V tensors and the index tensors that address them.

Every layer has one key and one value tensor of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``. A
request owns a list of block ids (its *block table*); its token at position ``p`` lives in block
``block_ids[p // block_size]`` at offset ``p % block_size``, i.e. at flat *slot*
``block_ids[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engine.config import EnginePlan, ModelShape
from worker.engine.staging import to_device


class KVCache:
    """Preallocated K/V storage for all layers. Zero-initialised, and a failed request's blocks are zeroed again
    (``zero_blocks``): padded gathers read finite values, so masked positions contribute exactly nothing (garbage
    NaNs would survive a zero attention weight).

    ``scratch_block``: one block more than the pool, never allocated to a request: padded rows of a static-shape
    step (``cuda_graphs.py``) write their K/V there (``scratch_slot``).

    ``fused_write``: store a layer's K/V with tokenspool's C++ ``kv_write_`` (loaded; one call, not two
    ``index_copy_``), for callers whose K/V rows hold each token's ``[kv_heads, head_dim]`` contiguous (the own
    decoder's views into its fused QKV output)."""

    def __init__(self, shape: ModelShape, plan: EnginePlan, scratch_block: bool = False,
                 fused_write: bool = False) -> None:
        self.fused_write = fused_write
        self.block_size = plan.block_size
        self.num_blocks = plan.num_kv_blocks + int(scratch_block)
        self.num_kv_heads = shape.num_kv_heads
        self.scratch_slot = plan.num_kv_blocks * plan.block_size if scratch_block else None
        dims = (shape.num_layers, self.num_blocks, plan.block_size, shape.num_kv_heads, shape.head_dim)
        # One tensor per side for all layers, so that a step can view every layer's K/V of one request at once
        # (``block_range_all``); keys[layer], values[layer]: [num_blocks, block_size, kv_heads, head_dim] views.
        self.key_pool = torch.zeros(dims, dtype=plan.cache_dtype, device=plan.device)
        self.value_pool = torch.zeros(dims, dtype=plan.cache_dtype, device=plan.device)
        self.keys, self.values = list(self.key_pool.unbind(0)), list(self.value_pool.unbind(0))
        # [num_blocks * block_size, kvh, hd] per layer: the slots ``write`` addresses, viewed once, not per call
        self._flat_keys = [k.view(-1, *dims[3:]) for k in self.keys]
        self._flat_values = [v.view(-1, *dims[3:]) for v in self.values]

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' K/V. ``slot_mapping``: [T]; ``key``/``value``: [T, kv_heads, head_dim]."""
        k_flat, v_flat = self._flat_keys[layer], self._flat_values[layer]
        if key.dtype != k_flat.dtype:  # a no-op .to() still costs a dispatch, 60 times a step
            key, value = key.to(k_flat.dtype), value.to(v_flat.dtype)
        if self.fused_write:
            torch.ops.tokenspool.kv_write_(k_flat, v_flat, slot_mapping, key, value)
            return
        k_flat.index_copy_(0, slot_mapping, key)
        v_flat.index_copy_(0, slot_mapping, value)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole block tables. ``block_tables``: [B, max_blocks] -> two [B, max_blocks * block_size, kvh, hd]."""
        # index_select on a [num_blocks, block_size * kvh * hd] view copies whole blocks as rows: on CPU about 3x
        # faster than advanced indexing of the 4-d tensor (which this gather was, and it showed in decode profiles).
        num_seqs, max_blocks = block_tables.shape
        flat_ids = block_tables.reshape(-1)
        shape = (num_seqs, max_blocks * self.block_size, *self.keys[layer].shape[2:])
        keys = self.keys[layer].view(self.num_blocks, -1).index_select(0, flat_ids).view(shape)
        values = self.values[layer].view(self.num_blocks, -1).index_select(0, flat_ids).view(shape)
        return keys, values

    def block_range_all(self, first: int, end: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_keys`` keys and values of the consecutive blocks ``first..end-1`` in every layer, as
        views laid out for attention, no copy: two [num_layers, 1, kvh, num_keys, hd] (a layer's is what ``gather``
        returns for the table ``[first, ..., end - 1]``, cut to ``num_keys`` and transposed). Built once per step,
        so each layer only indexes it."""
        num_layers, _, _, num_kv_heads, head_dim = self.key_pool.shape
        shape = (num_layers, 1, (end - first) * self.block_size, num_kv_heads, head_dim)
        keys = self.key_pool[:, first:end].view(shape)[:, :, :num_keys].transpose(2, 3)
        values = self.value_pool[:, first:end].view(shape)[:, :, :num_keys].transpose(2, 3)
        return keys, values

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate blocks ``src -> dst`` in every layer, before a request writes into its copy."""
        if not copies:
            return
        src = to_device([s for s, _ in copies], torch.long, self.keys[0].device)
        dst = to_device([d for _, d in copies], torch.long, self.keys[0].device)
        for pool in (self.key_pool, self.value_pool):  # [L, num_blocks, ...]: every layer's blocks at once
            pool.index_copy_(1, dst, pool.index_select(1, src))

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero blocks in every layer: what a failed request leaves (its K/V may be NaN) is finite again."""
        if not block_ids:
            return
        index = to_device(block_ids, torch.long, self.keys[0].device)
        for pool in (self.key_pool, self.value_pool):
            pool.index_fill_(1, index, 0)


def prepare_slot_mapping(block_ids: Sequence[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Flat slots of positions ``[start, start + num_tokens)`` of a request with block table ``block_ids``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def prepare_block_tables(tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Right-pad block tables with block 0 into one ``[B, max_blocks]`` tensor (padding is masked downstream)."""
    width = max(len(t) for t in tables)
    padded = [list(t) + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.long, device=device)


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)
