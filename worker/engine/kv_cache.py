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


class KVCache:
    """Preallocated K/V storage for all layers. Zero-initialised: padded gathers read finite values, so masked
    positions contribute exactly nothing (garbage NaNs would survive a zero attention weight)."""

    def __init__(self, shape: ModelShape, plan: EnginePlan) -> None:
        self.block_size = plan.block_size
        self.num_blocks = plan.num_kv_blocks
        dims = (plan.num_kv_blocks, plan.block_size, shape.num_kv_heads, shape.head_dim)
        # keys[layer], values[layer]: [num_blocks, block_size, kv_heads, head_dim]
        self.keys = [torch.zeros(dims, dtype=plan.dtype, device=plan.device) for _ in range(shape.num_layers)]
        self.values = [torch.zeros(dims, dtype=plan.dtype, device=plan.device) for _ in range(shape.num_layers)]

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' K/V. ``slot_mapping``: [T]; ``key``/``value``: [T, kv_heads, head_dim]."""
        k_flat = self.keys[layer].view(-1, *self.keys[layer].shape[2:])  # [num_blocks * block_size, kvh, hd]
        v_flat = self.values[layer].view(-1, *self.values[layer].shape[2:])
        k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole block tables. ``block_tables``: [B, max_blocks] -> two [B, max_blocks * block_size, kvh, hd]."""
        keys = self.keys[layer][block_tables]  # [B, max_blocks, block_size, kvh, hd]
        values = self.values[layer][block_tables]
        num_seqs, max_blocks = block_tables.shape
        return (keys.view(num_seqs, max_blocks * self.block_size, *keys.shape[3:]),
                values.view(num_seqs, max_blocks * self.block_size, *values.shape[3:]))


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
