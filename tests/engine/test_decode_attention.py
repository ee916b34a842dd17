"""Decode attention: the shared-prefix (cascade) split is found correctly and changes nothing but speed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.engine.helpers import Run, drain, reference_greedy
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.config import EnginePlan, ModelShape, pick_cascade
from worker.engine.decode_attention import (
    attend_decode,
    attend_group,
    num_shared_blocks,
    plan_decode_groups,
    prepare_decode_batch,
    split_by_length,
)
from worker.engine.decode_kernel import load_decode_kernel
from worker.engine.kv_cache import KVCache, prepare_slot_mapping

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 8, 4
CPU = torch.device("cpu")


def test_shared_blocks_are_the_common_leading_ids() -> None:
    assert num_shared_blocks([[1, 2, 3, 9], [1, 2, 4, 8]], [16, 15], BLOCK) == 2
    assert num_shared_blocks([[1, 2, 3], [5, 2, 3]], [12, 12], BLOCK) == 0


def test_shared_blocks_never_include_a_block_being_written() -> None:
    # Both tables list block 3 third, but the second sequence's newest token (position 8) lives in it.
    assert num_shared_blocks([[1, 2, 3, 7], [1, 2, 3]], [14, 9], BLOCK) == 2
    # A lone sequence has nothing to share with.
    assert num_shared_blocks([[1, 2, 3]], [12], BLOCK) == 0


def test_groups_form_where_sharing_saves_enough() -> None:
    tables = [[1, 2, 3], [9, 8], [1, 2, 4, 5], [7, 6], [9, 8, 5]]
    lens = [10, 8, 14, 6, 9]
    # Rows 0 and 2 share blocks 1, 2 (8 tokens, saved once); rows 1 and 4 share block 9 only (4 tokens: row 1's
    # newest token lives in block 8); row 3 shares nothing.
    assert plan_decode_groups(tables, lens, BLOCK, min_tokens_saved=4) == [([0, 2], 2), ([1, 4], 1), ([3], 0)]
    assert plan_decode_groups(tables, lens, BLOCK, min_tokens_saved=8) == [([0, 2], 2), ([1, 3, 4], 0)]
    assert plan_decode_groups(tables, lens, BLOCK, min_tokens_saved=9) == [([0, 1, 2, 3, 4], 0)]
    # Read in place (the C++ operator) plain rows are one group even where padding would have split them.
    assert plan_decode_groups(tables, lens, BLOCK, min_tokens_saved=9, group_cost=0) != [([0, 1, 2, 3, 4], 0)]
    assert plan_decode_groups(tables, lens, BLOCK, min_tokens_saved=9, group_cost=0, in_place=True) == [
        ([0, 1, 2, 3, 4], 0)]
    assert plan_decode_groups(tables, lens, BLOCK, min_tokens_saved=8, in_place=True) == [([0, 2], 2),
                                                                                          ([1, 3, 4], 0)]


def test_rows_are_bucketed_where_padding_costs_more_than_a_group() -> None:
    widths = [512, 16, 512, 16, 32]
    # One group: 5 x 512 + 400 = 2960; short rows apart: 3 x 32 + 400 + 2 x 512 + 400 = 1920.
    assert split_by_length(range(5), widths, group_cost=400) == [[1, 3, 4], [0, 2]]
    assert split_by_length(range(5), widths, group_cost=2000) == [[0, 1, 2, 3, 4]]
    assert split_by_length([0, 2], widths, group_cost=0) == [[0, 2]]  # equal widths never split
    assert split_by_length(range(5), widths, group_cost=0) == [[1, 3], [4], [0, 2]]


def test_prepare_splits_tables_and_masks_own_keys() -> None:
    tables, lens = [[1, 2, 3], [6, 7], [1, 2, 4, 5]], [10, 7, 14]
    batch = prepare_decode_batch([4, 5, 6], tables, lens, BLOCK, CPU, share_prefix=True, min_tokens_saved=1)
    cascade, plain = batch.groups
    assert cascade.shared_block_ids is not None and cascade.shared_block_ids.tolist() == [1, 2]
    assert cascade.token_idx.tolist() == [4, 6] and plain.token_idx.tolist() == [5]
    assert cascade.block_tables.tolist() == [[3, 0], [4, 5]]
    assert cascade.key_mask[:, 0, 0].sum(-1).tolist() == [2, 6]
    assert plain.shared_block_ids is None and plain.block_tables.tolist() == [[6, 7]]
    (everything,) = prepare_decode_batch([4, 5, 6], tables, lens, BLOCK, CPU, share_prefix=False).groups
    assert everything.shared_block_ids is None and everything.block_tables.shape == (3, 4)


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last query of a sequence against all its keys. q: [H, D]; k/v: [S, kvh, D] -> [H, D]."""
    out = F.scaled_dot_product_attention(q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         enable_gqa=True)
    return out[0, :, 0]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_decode_matches_plain_attention_over_a_shared_prefix(share_prefix: bool, in_place: bool) -> None:
    """``in_place``: plain queries through the C++ operator (``decode_kernel.py``), beside a cascade group."""
    if in_place:
        assert load_decode_kernel() is None
    torch.manual_seed(0)
    shape = ModelShape(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, vocab_size=10, max_position_embeddings=64)
    plan = EnginePlan(device=CPU, dtype=torch.float32, block_size=BLOCK, num_kv_blocks=16, max_model_len=64)
    cache = KVCache(shape, plan)
    prefix_k, prefix_v = torch.randn(8, KV_HEADS, DIM), torch.randn(8, KV_HEADS, DIM)  # blocks 0 and 1, shared
    cache.write(0, torch.tensor(prepare_slot_mapping([0, 1], 0, 8, BLOCK)), prefix_k, prefix_v)
    # Three sequences share blocks 0-1; a fourth (blocks 2-3) shares nothing.
    tables, lens, keys, values = [[0, 1, 4], [0, 1, 5, 6], [2, 3], [0, 1, 7]], [9, 15, 6, 12], [], []
    for table, n in zip(tables, lens, strict=True):
        start = 8 if table[0] == 0 else 0
        own_k, own_v = torch.randn(n - start, KV_HEADS, DIM), torch.randn(n - start, KV_HEADS, DIM)
        cache.write(0, torch.tensor(prepare_slot_mapping(table, start, n - start, BLOCK)), own_k, own_v)
        keys.append(torch.cat([prefix_k[:start], own_k]))
        values.append(torch.cat([prefix_v[:start], own_v]))
    query = torch.randn(5, HEADS, DIM)  # token 0 is a prefill token of no concern here
    batch = prepare_decode_batch([1, 2, 3, 4], tables, lens, BLOCK, CPU, share_prefix=share_prefix,
                                 min_tokens_saved=1, in_place=in_place)
    assert [g.shared_block_ids is not None for g in batch.groups] == ([True, False] if share_prefix else [False])
    plain = batch.groups[-1]
    assert (plain.context_lens is not None) == in_place
    if in_place:  # the operator reads the blocks: no mask, no views, one group whatever the lengths
        assert plain.key_mask is None and plain.lone_kv is None
    out = torch.zeros_like(query)
    attend_decode(0, query, batch, cache, DIM ** -0.5, out)
    expected = torch.stack([reference_decode(query[i + 1], keys[i], values[i]) for i in range(4)])
    torch.testing.assert_close(out[1:], expected, rtol=1e-5, atol=1e-5)
    assert not out[0].any()


def test_engine_with_a_shared_system_prompt_matches_generate(tiny_model: Path) -> None:
    """Prefix caching puts the system prompt's blocks at the start of every table, so decodes take the cascade."""
    rng = random.Random(11)
    system = [rng.randrange(3, 49152) for _ in range(300)]  # 37 shared blocks x 5 extra members > 1024 tokens
    prompts = [system + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 20)) for _ in prompts]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    expected = [reference_greedy(reference, p, sp) for p, sp in zip(prompts, params, strict=True)]
    for cascade in ("on", "off"):
        engine = Engine(EngineConfig(model=str(tiny_model), block_size=8, num_kv_blocks=64, max_num_seqs=8,
                                     dtype="float32", cascade_attention=cascade))
        assert engine.runner.cascade_attention is (cascade == "on")
        engine.add_request("warm", prompts[0], params[0])  # caches the system prompt's blocks first
        run = Run()
        run.record(engine.step())
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt, sp)
        drain(engine, run)
        assert engine.stats().prefix_cache_hits >= 5 * (len(system) // 8)
        assert [run.token_ids[f"r{i}"] for i in range(len(prompts))] == expected, f"cascade={cascade}"


def test_auto_cascades_only_where_decode_attention_gathers(tiny_llama: Path) -> None:
    """Beside the kernel, which reads blocks in place, a cascade group would gather them (slower, measured)."""
    auto = EngineConfig()
    assert pick_cascade(auto, "sdpa") and not pick_cascade(auto, "kernel") and not pick_cascade(auto, "flex")
    assert pick_cascade(EngineConfig(cascade_attention="on"), "kernel")
    assert not pick_cascade(EngineConfig(cascade_attention="off"), "sdpa")
    with pytest.raises(ValueError, match="cascade_attention"):
        EngineConfig(cascade_attention="yes")
    small = dict(model=str(tiny_llama), block_size=8, num_kv_blocks=16, max_num_seqs=2)
    exact = Engine(EngineConfig(**small, dtype="float32")).runner  # transformers' forward: sdpa
    assert (exact.attention_backend, exact.cascade_attention) == ("sdpa", True)
    if load_decode_kernel() is None:
        own = Engine(EngineConfig(**small, dtype="float32", quantization="int8")).runner  # the own decoder: kernel
        assert (own.attention_backend, own.cascade_attention) == ("kernel", False)


@pytest.mark.parametrize("table", [[2, 3], [5, 3]])
def test_one_sequence_reads_exactly_its_keys(table: list[int]) -> None:
    """One stream: no mask, its keys sliced to its length, and read as a view when its blocks are consecutive.
    The slot after its last key holds junk, which a wrong slice would attend to."""
    torch.manual_seed(0)
    shape = ModelShape(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, vocab_size=10, max_position_embeddings=64)
    cache = KVCache(shape, EnginePlan(device=CPU, dtype=torch.float32, block_size=BLOCK, num_kv_blocks=8,
                                      max_model_len=32))
    k, v = torch.randn(7, KV_HEADS, DIM), torch.randn(7, KV_HEADS, DIM)  # 6 keys, then junk in slot 7
    cache.write(0, torch.tensor(prepare_slot_mapping(table, 0, 7, BLOCK)), k, v)
    query = torch.randn(1, HEADS, DIM)
    expected = reference_decode(query[0], k[:6], v[:6])
    # Without the cache at hand each layer slices its own views; with it (the model runner's way) the views of
    # every layer are built once, and a decode-only step of this one group returns its attention directly.
    for kv_cache in (None, cache):
        batch = prepare_decode_batch([0], [table], [6], BLOCK, CPU, share_prefix=True, kv_cache=kv_cache)
        (group,) = batch.groups
        assert group.num_keys == 6
        assert group.block_range == ((2, 4) if table == [2, 3] else None)
        assert (group.lone_kv is not None) == (kv_cache is not None and group.block_range is not None)
        assert batch.whole_step(1) is group and batch.whole_step(2) is None
        out = torch.zeros_like(query)
        attend_decode(0, query, batch, cache, DIM ** -0.5, out)
        torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attend_group(0, query, group, cache, DIM ** -0.5)[0], expected, rtol=1e-5,
                                   atol=1e-5)
