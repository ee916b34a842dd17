"""BlockPool: allocation, reference counts, and the prefix-cache bookkeeping (hashes, LRU reuse)."""

from __future__ import annotations

from worker.engine.block_pool import BlockPool, hash_block, hash_full_blocks


def test_allocate_until_empty_then_none() -> None:
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert pool.allocate(2) is None  # all-or-nothing: nothing taken
    assert pool.num_free_blocks == 1
    last = pool.allocate(1)
    assert last is not None and set(first + last) == {0, 1, 2, 3}
    assert pool.allocate(1) is None


def test_free_returns_blocks_only_when_unreferenced() -> None:
    pool = BlockPool(2)
    block_ids = pool.allocate(2)
    assert block_ids is not None
    pool.touch(block_ids[:1])  # a second user of the first block
    assert pool.ref_count(block_ids[0]) == 2
    pool.free(block_ids)
    assert pool.num_free_blocks == 1 and pool.ref_count(block_ids[0]) == 1
    pool.free(block_ids[:1])
    assert pool.num_free_blocks == 2 and pool.ref_count(block_ids[0]) == 0


def test_hashes_chain_over_the_prefix() -> None:
    a = hash_full_blocks([1, 2, 3, 4], block_size=2, num_blocks=2)
    b = hash_full_blocks([9, 9, 3, 4], block_size=2, num_blocks=2)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens [3, 4] but a different prefix
    assert a[1] == hash_block(a[0], [3, 4])


def test_cached_block_is_found_revived_and_evicted_lru() -> None:
    pool = BlockPool(3, enable_caching=True)
    block_ids = pool.allocate(2)
    assert block_ids is not None
    h0, h1 = hash_full_blocks([1, 2, 3, 4], 2, 2)
    pool.cache_block(block_ids[0], h0)
    pool.cache_block(block_ids[1], h1)
    pool.free(block_ids)  # tail freed first: block_ids[1] is the older free entry
    assert pool.num_free_blocks == 3
    assert pool.lookup(h0) == block_ids[0]
    pool.touch([block_ids[0]])  # a hit revives the free block
    assert pool.num_free_blocks == 2 and pool.ref_count(block_ids[0]) == 1
    fresh = pool.allocate(2)  # takes the never-used block, then evicts the least recently freed cached one
    assert fresh is not None and block_ids[1] in fresh
    assert pool.lookup(h1) is None
    assert pool.lookup(h0) == block_ids[0]


def test_caching_disabled_records_nothing() -> None:
    pool = BlockPool(1)
    block_ids = pool.allocate(1)
    assert block_ids is not None
    pool.cache_block(block_ids[0], hash_block(None, [1]))
    assert pool.lookup(hash_block(None, [1])) is None
