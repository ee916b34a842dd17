"""The KV cache: one pool per side for all layers, per-layer views of it, and the per-step views of a lone request."""

from __future__ import annotations

import torch

from worker.engine.config import EnginePlan, ModelShape
from worker.engine.kv_cache import KVCache, prepare_slot_mapping

LAYERS, KV_HEADS, DIM, BLOCK = 3, 2, 8, 4
CPU = torch.device("cpu")


def make_cache() -> KVCache:
    shape = ModelShape(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, vocab_size=10,
                       max_position_embeddings=64)
    return KVCache(shape, EnginePlan(device=CPU, dtype=torch.float32, block_size=BLOCK, num_kv_blocks=8,
                                     max_model_len=32))


def test_layers_are_views_of_one_pool_and_writes_land_in_their_slots() -> None:
    cache = make_cache()
    assert all(k.data_ptr() == cache.key_pool[i].data_ptr() for i, k in enumerate(cache.keys))
    keys, values = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    cache.write(1, torch.tensor(prepare_slot_mapping([5, 2], 0, 6, BLOCK)), keys, values)
    assert torch.equal(cache.key_pool[1, 5], keys[:4]) and torch.equal(cache.value_pool[1, 2, :2], values[4:])
    assert not cache.key_pool[0].any() and not cache.key_pool[2].any()  # other layers untouched


def test_block_range_all_is_every_layers_gather_cut_and_transposed() -> None:
    """What a lone request's decode reads in each layer: the first ``num_keys`` keys of its consecutive blocks,
    laid out [1, kvh, S, D], as views (later writes show through): the gather of its table, without the copy."""
    cache = make_cache()
    torch.manual_seed(0)
    cache.key_pool.normal_()
    cache.value_pool.normal_()
    keys, values = cache.block_range_all(3, 5, num_keys=6)
    assert keys.shape == values.shape == (LAYERS, 1, KV_HEADS, 6, DIM)
    for layer in range(LAYERS):
        own_keys, own_values = cache.gather(layer, torch.tensor([[3, 4]]))  # [1, 8, kvh, D]
        assert torch.equal(keys[layer], own_keys[:, :6].transpose(1, 2))
        assert torch.equal(values[layer], own_values[:, :6].transpose(1, 2))
    cache.write(2, torch.tensor([3 * BLOCK + 5]), torch.ones(1, KV_HEADS, DIM), torch.ones(1, KV_HEADS, DIM))
    assert torch.equal(keys[2, 0, :, 5], torch.ones(KV_HEADS, DIM))


def test_copy_blocks_copies_every_layer() -> None:
    cache = make_cache()
    torch.manual_seed(0)
    cache.key_pool.normal_()
    cache.value_pool.normal_()
    before_keys, before_values = cache.key_pool.clone(), cache.value_pool.clone()
    cache.copy_blocks([(1, 6), (4, 0)])
    assert torch.equal(cache.key_pool[:, 6], before_keys[:, 1]) and torch.equal(cache.key_pool[:, 0], before_keys[:, 4])
    assert torch.equal(cache.value_pool[:, 6], before_values[:, 1])
    untouched = [b for b in range(cache.num_blocks) if b not in (0, 6)]
    assert torch.equal(cache.key_pool[:, untouched], before_keys[:, untouched])
