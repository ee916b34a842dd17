"""Paged attention against plain causal attention over each request's whole sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine.attention import (
    AttentionMetadata,
    PagedContext,
    paged_attention_forward,
    prepare_prefill_chunk,
)
from worker.engine.config import EnginePlan, ModelShape
from worker.engine.decode_attention import prepare_decode_batch
from worker.engine.kv_cache import KVCache, prepare_slot_mapping

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


class FakeAttentionModule(torch.nn.Module):
    layer_idx = 0


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a whole sequence. q: [S, H, D], k/v: [S, kvh, D] -> [S, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def test_mixed_step_matches_full_causal_attention() -> None:
    torch.manual_seed(0)
    shape = ModelShape(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, vocab_size=10, max_position_embeddings=64)
    plan = EnginePlan(device=torch.device("cpu"), dtype=torch.float32, block_size=BLOCK, num_kv_blocks=16,
                      max_model_len=64)
    cache = KVCache(shape, plan)
    # (sequence length, tokens already cached, block ids): a decode, a fresh prompt, a second prefill chunk.
    requests = [(9, 8, [5, 2, 7]), (6, 0, [0, 1]), (11, 5, [3, 9, 12])]
    full = [(torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM))
            for n, _, _ in requests]
    for (_n, cached, blocks), (_, k, v) in zip(requests, full, strict=True):  # earlier steps' K/V
        if cached:
            slots = torch.tensor(prepare_slot_mapping(blocks, 0, cached, BLOCK))
            cache.write(0, slots, k[:cached], v[:cached])
    q_new, k_new, v_new, slots, prefills = [], [], [], [], []
    offset = 0
    for (n, cached, blocks), (q, k, v) in zip(requests, full, strict=True):
        q_new.append(q[cached:])
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        slots += prepare_slot_mapping(blocks, cached, n - cached, BLOCK)
        if n - cached > 1:
            prefills.append(prepare_prefill_chunk(offset, cached, n - cached, torch.tensor([blocks])))
        offset += n - cached
    decode = prepare_decode_batch([0], [requests[0][2]], [9], BLOCK, torch.device("cpu"), share_prefix=True)
    metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), decode=decode, prefills=tuple(prefills))
    query = torch.cat(q_new).transpose(0, 1)[None]  # [1, H, T, D]
    key, value = torch.cat(k_new).transpose(0, 1)[None], torch.cat(v_new).transpose(0, 1)[None]
    out, _ = paged_attention_forward(FakeAttentionModule(), query, key, value, None, scaling=DIM ** -0.5,
                                     paged_context=PagedContext(cache, metadata))
    expected = torch.cat([reference(q, k, v)[cached:] for (_, cached, _), (q, k, v) in zip(requests, full,
                                                                                          strict=True)])
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
