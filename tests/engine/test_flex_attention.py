"""The FlexAttention backend: block masks from block tables, against plain attention over gathered keys, and the
engine on it against transformers ``generate``.

The unit tests run flex's unfused reference (eager: it applies the ``mask_mod`` to every score, so the mask must
be complete by itself); the engine tests run the compiled kernel (inductor's C++ template on CPU), as the engine
does. Compilation costs ~10 s per new shape on the 2-core test machine, so the engine tests keep to few shapes.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.helpers import mixed_workload
from tests.engine.test_engine_parity import check_parity
from worker.engine import EngineConfig
from worker.engine.config import EnginePlan, ModelShape, pick_attention_backend, pick_cuda_graphs
from worker.engine.flex_attention import (
    FlexCall,
    FlexStep,
    attend_flex,
    flex_rows,
    kernel_options,
    make_flex_fn,
    prepare_flex_decode,
    prepare_flex_prefill,
)
from worker.engine.kv_cache import KVCache, prepare_slot_mapping

# torch's own inductor imports a module of its that uses a deprecated torch.jit API (torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
CPU = torch.device("cpu")
BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def make_cache(num_blocks: int = 16) -> KVCache:
    shape = ModelShape(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, vocab_size=10, max_position_embeddings=64)
    return KVCache(shape, EnginePlan(device=CPU, dtype=torch.float32, block_size=BLOCK, num_kv_blocks=num_blocks,
                                     max_model_len=64))


def fill_cache(cache: KVCache) -> None:
    """Random K/V in every slot: keys a wrong mask lets through change the result."""
    cache.keys[0].copy_(torch.randn_like(cache.keys[0]))
    cache.values[0].copy_(torch.randn_like(cache.values[0]))


def reference(query: torch.Tensor, cache: KVCache, table: list[int], first_position: int) -> torch.Tensor:
    """Queries at positions ``first_position...`` against their table's keys, causally. query: [n, H, D]."""
    n = query.shape[0]
    slots = torch.tensor(prepare_slot_mapping(table, 0, first_position + n, BLOCK))
    keys = cache.keys[0].view(-1, KV_HEADS, DIM)[slots].transpose(0, 1)[None]  # [1, kvh, S, D]
    values = cache.values[0].view(-1, KV_HEADS, DIM)[slots].transpose(0, 1)[None]
    mask = torch.arange(first_position + n)[None, :] <= torch.arange(first_position, first_position + n)[:, None]
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, H, D]


def test_decodes_see_only_their_own_blocks_up_to_their_length() -> None:
    """Shared leading blocks (a cached prefix), a partly filled last block, and padding to a bucket of 4 rows."""
    torch.manual_seed(0)
    cache = make_cache()
    fill_cache(cache)
    tables, lens = [[3, 7, 9], [3, 7, 2], [5]], [10, 12, 1]
    query = torch.randn(4, HEADS, DIM)  # token 0 is no decode's
    call = prepare_flex_decode([1, 2, 3], tables, lens, 4, cache, CPU)
    assert call.gather_idx.tolist() == [1, 2, 3, 1] and call.block_mask.kv_num_blocks[:, 0, 0].tolist() == [3, 3, 1, 1]
    out = torch.zeros_like(query)
    attend_flex(0, query, FlexStep((call,), make_flex_fn(compile_kernel=False)), cache, DIM ** -0.5, out)
    rows = enumerate(zip(tables, lens, strict=True))
    expected = torch.cat([reference(query[i + 1:i + 2], cache, table, n - 1) for i, (table, n) in rows])
    torch.testing.assert_close(out[1:], expected, rtol=1e-5, atol=1e-5)
    assert not out[0].any()


@pytest.mark.parametrize("start_position", [0, 5])
def test_a_prefill_chunk_attends_causally_after_its_cached_part(start_position: int) -> None:
    torch.manual_seed(1)
    cache = make_cache()
    fill_cache(cache)
    table, num_tokens = [6, 1, 12, 4], 9
    query = torch.randn(2 + num_tokens, HEADS, DIM)  # the chunk is tokens 2..10 of the step
    call = prepare_flex_prefill(2, start_position, num_tokens, table, cache, CPU)
    assert call.num_queries == 128 and call.token_idx.tolist() == list(range(2, 2 + num_tokens))
    out = torch.zeros_like(query)
    attend_flex(0, query, FlexStep((call,), make_flex_fn(compile_kernel=False)), cache, DIM ** -0.5, out)
    torch.testing.assert_close(out[2:], reference(query[2:], cache, table, start_position), rtol=1e-5, atol=1e-5)


def reference_step(call: FlexCall) -> FlexStep:
    """A step of one call on flex's unfused reference."""
    return FlexStep((call,), make_flex_fn(compile_kernel=False))


def test_a_whole_step_call_reads_the_query_in_place() -> None:
    """Decodes that are the step's tokens 0..2 (a static decode step) need no gather; the query is a strided
    slice, as the decoder passes it (q of a [T, q + k heads, D] tensor). The same decodes gathered give the same
    rows; the ordinary path never marks a call whole-step (its queries are gathered, so contiguous)."""
    torch.manual_seed(2)
    cache = make_cache()
    fill_cache(cache)
    tables, lens = [[3, 7, 9], [5], [2, 8]], [10, 1, 7]
    query = torch.randn(3, HEADS + KV_HEADS, DIM)[:, :HEADS]
    gathered = prepare_flex_decode([0, 1, 2], tables, lens, 3, cache, CPU)
    assert not gathered.whole_step
    in_place = dataclasses.replace(gathered, whole_step=True)
    rows = flex_rows(0, query, in_place, reference_step(in_place), cache, DIM ** -0.5)
    expected = torch.cat([reference(query[i:i + 1], cache, table, n - 1)
                          for i, (table, n) in enumerate(zip(tables, lens, strict=True))])
    torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)
    out = torch.zeros_like(query)
    attend_flex(0, query, reference_step(gathered), cache, DIM ** -0.5, out)
    torch.testing.assert_close(out, rows, rtol=1e-6, atol=1e-6)


def test_kernel_tiles_divide_the_block_size_on_cuda_only() -> None:
    assert kernel_options(CPU, 16) is None
    cuda = torch.device("cuda")
    assert [kernel_options(cuda, b) for b in (16, 32, 128)] == [{"BLOCK_N": 16}, {"BLOCK_N": 32}, {"BLOCK_N": 64}]


@pytest.mark.slow  # ~45 s with a cold inductor cache on the 2-core test machine, most of it compiling
def test_engine_on_compiled_flex_matches_generate(tiny_llama: Path) -> None:
    """fp32 through transformers' forward, so the reference is ``generate`` token for token, as for the default
    backend (test_engine_parity.py): queueing, chunked prefill and preemption over the same workload shape."""
    workload = mixed_workload(seed=3, num_requests=12, max_prompt=200, max_output=24, vocab=49152)
    config = EngineConfig(dtype="float32", model=str(tiny_llama), block_size=16, num_kv_blocks=24, max_num_seqs=4,
                          max_num_batched_tokens=96, attention_backend="flex")
    began = time.perf_counter()
    check_parity(tiny_llama, config, workload)
    print(f"compiled flex engine run: {time.perf_counter() - began:.1f} s")


def test_flex_on_a_cpu_needs_blocks_of_a_multiple_of_16() -> None:
    """8-token blocks made the compiled CPU kernel attend wrongly on an AVX2 CPU (config.pick_attention_backend)."""
    with pytest.raises(ValueError, match="block_size must be a multiple of 16"):
        pick_attention_backend(EngineConfig(attention_backend="flex", block_size=8), CPU, own_decoder=True)
    cuda = torch.device("cuda")
    assert pick_attention_backend(EngineConfig(attention_backend="flex", block_size=8), cuda, True) == "flex"
    assert pick_attention_backend(EngineConfig(attention_backend="flex", block_size=32), CPU, True) == "flex"
    assert pick_attention_backend(EngineConfig(block_size=8), CPU, own_decoder=True) == "kernel"


def test_auto_picks_flex_only_on_cuda() -> None:
    """On a CPU ``auto`` is the C++ decode kernel for the own decoder, SDPA for transformers' exact forward."""
    auto, cuda = EngineConfig(), torch.device("cuda")
    assert pick_attention_backend(auto, cuda, True) == "flex" and pick_attention_backend(auto, cuda, False) == "flex"
    assert pick_attention_backend(auto, CPU, own_decoder=True) == "kernel"
    assert pick_attention_backend(auto, CPU, own_decoder=False) == "sdpa"
    assert pick_attention_backend(EngineConfig(attention_backend="flex"), CPU, True) == "flex"
    with pytest.raises(ValueError, match="'kernel' only on a CPU"):
        pick_attention_backend(EngineConfig(attention_backend="kernel"), cuda, True)
    assert pick_cuda_graphs(auto, torch.device("cuda"), "flex", own_decoder=True) == "on"
    assert pick_cuda_graphs(auto, torch.device("cuda"), "flex", own_decoder=False) == "off"
    assert pick_cuda_graphs(auto, CPU, "flex", own_decoder=True) == "off"
    with pytest.raises(ValueError, match="cuda_graphs"):
        pick_cuda_graphs(EngineConfig(cuda_graphs="on"), CPU, "flex", own_decoder=True)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="paged")
    for backend in ("sdpa", "kernel"):
        with pytest.raises(ValueError, match="cuda_graphs"):
            EngineConfig(attention_backend=backend, cuda_graphs="padded")
