"""A fixed pool of KV-cache blocks: free list, reference counts and (optionally) a prefix cache.

Blocks are plain integer ids into the preallocated K/V tensors of ``kv_cache.KVCache``; nothing here touches
tensors. ``allocate`` returns None when the pool cannot satisfy a request, and the scheduler decides whom to
preempt.

Prefix caching: a *full* block is identified by a hash of its tokens chained with the hash of every block before
it, so equal hashes mean equal prefixes. Freed blocks keep their hash and stay findable until the allocator
reuses them; the free list is ordered least-recently-freed first, which makes reuse an LRU eviction.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block given the hash of the block before it (None for the first block).

    A cryptographic digest, because a collision would silently hand one request another's keys and values.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, num_blocks: int,
                     parent: BlockHash | None = None) -> list[BlockHash]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids`` (continuing from ``parent``)."""
    hashes: list[BlockHash] = []
    for i in range(num_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Hands out block ids; counts who uses each block; remembers the content hash of cached full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        # Free blocks, least recently freed first: allocation takes from the front, so cached content freed long
        # ago is evicted before content freed just now. OrderedDict gives O(1) removal when a hit revives one.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_with_hash: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request uses (some may still hold reusable cached content)."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` free blocks (evicting their cached content), or None if there are not enough."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._forget_hash(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks nobody uses return to the free list.

        Pass a sequence's blocks in order: they are released last-first, so a prefix's tail is evicted before
        its head (the head is the part other requests are likeliest to share).
        """
        for block_id in reversed(block_ids):
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this prefix hash, if cached (in use or free but not yet reused)."""
        return self._block_with_hash.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to cached blocks (a prefix-cache hit), reviving free ones."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def forget(self, block_ids: Sequence[int]) -> None:
        """Drop these blocks' cached content: no later prefix lookup finds them."""
        for block_id in block_ids:
            self._forget_hash(block_id)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that ``block_id`` now holds the full block with ``block_hash``.

        If another block already holds that content, the first one stays the cached copy.
        """
        if not self.enable_caching or self._hash_of[block_id] is not None:
            return
        if block_hash in self._block_with_hash:
            return
        self._hash_of[block_id] = block_hash
        self._block_with_hash[block_hash] = block_id

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._block_with_hash[block_hash]
            self._hash_of[block_id] = None
