"""Decode steps from padded static buffers (``cuda_graphs.py``): bucket choice, what the buffers hold after a fill,
and the padded path's tokens against the unpadded ones and ``generate``. ``cuda_graphs="padded"`` runs everything
the CUDA path runs except the capture and the replay, which need a GPU (none on the test machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import drain, reference_greedy
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.cuda_graphs import BATCH_BUCKETS, buckets_up_to, is_plain_decode, pick_bucket
from worker.engine.flex_attention import allocate_flex_index, fill_flex_index
from worker.engine.scheduler import ScheduledChunk

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def test_a_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    assert [pick_bucket(n, BATCH_BUCKETS) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert pick_bucket(257, BATCH_BUCKETS) is None
    assert buckets_up_to(4) == (1, 2, 4) and buckets_up_to(6) == (1, 2, 4, 8)
    assert buckets_up_to(1000) == BATCH_BUCKETS


def test_only_plain_decode_steps_take_the_static_path() -> None:
    def chunk(tokens: tuple[int, ...], needs_logits: bool = True, spec: int = 0) -> ScheduledChunk:
        return ScheduledChunk("r", tokens, 5, (0,), needs_logits, spec)

    assert is_plain_decode([chunk((7,)), chunk((8,))])
    assert not is_plain_decode([])
    assert not is_plain_decode([chunk((7,)), chunk((8, 9))])  # a prefill chunk
    assert not is_plain_decode([chunk((7, 8), spec=1)])  # speculative tokens
    assert not is_plain_decode([chunk((7,), needs_logits=False)])


def _engine(model: Path, dtype: str | None = "float32", **kwargs: object) -> Engine:
    # 16-token blocks: the CPU flex kernel needs a multiple of 16 (config.FLEX_CPU_BLOCK_MULTIPLE)
    return Engine(EngineConfig(model=str(model), dtype=dtype, block_size=16, num_kv_blocks=32, max_num_seqs=4,
                               **kwargs))  # type: ignore[arg-type]


def test_fill_pads_rows_past_the_batch(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, attention_backend="flex", cuda_graphs="padded")
    graphs, cache = engine.runner.graphs, engine.runner.kv_cache
    assert graphs is not None and not graphs.capture and graphs.buckets == (1, 2, 4)
    assert cache.num_blocks == 33 and cache.scratch_slot == 32 * 16  # one scratch block past the pool
    chunks = [ScheduledChunk("a", (11,), 19, (3, 5), True), ScheduledChunk("b", (12,), 0, (7,), True),
              ScheduledChunk("c", (13,), 35, (1, 2, 4), True)]
    static = graphs._static[4]
    graphs._fill(static, chunks)
    assert static.input_ids.tolist() == [11, 12, 13, 0] and static.positions.tolist() == [19, 0, 35, 0]
    assert static.slot_mapping.tolist() == [5 * 16 + 3, 7 * 16, 4 * 16 + 3, 32 * 16]
    assert static.index.context_lens.tolist() == [20, 1, 36, 1]
    assert static.index.kv_num_blocks[:, 0, 0].tolist() == [2, 1, 3, 1]
    assert static.index.kv_indices[2, 0, 0, :3].tolist() == [1, 2, 4]
    assert static.index.to_logical[0, [3, 5, 7]].tolist() == [0, 1, -1]


def test_each_fill_leaves_only_its_own_steps_entries(tiny_llama: Path) -> None:
    """The buckets share one index, and a fill clears only the entries the last one made: after steps of 3, then
    2, then 4 and 1 rows, the shared tensors equal a fresh index filled with the last step alone, and the rows
    past its bucket are as allocated."""
    engine = _engine(tiny_llama, attention_backend="flex", cuda_graphs="padded")
    graphs, cache = engine.runner.graphs, engine.runner.kv_cache
    assert graphs is not None
    shared = graphs._static[4].index  # the largest bucket's views are the whole tensors
    steps = [[("a", 19, (3, 5)), ("b", 0, (7,)), ("c", 35, (1, 2, 4))],
             [("a", 20, (3, 5)), ("c", 36, (1, 2, 4))],
             [("d", 47, (9, 10, 11)), ("e", 3, (6,)), ("f", 16, (12, 13)), ("g", 31, (8, 0))],
             [("h", 5, (30,))]]
    for step in steps:
        chunks = [ScheduledChunk(rid, (1,), pos, blocks, True) for rid, pos, blocks in step]
        bucket = pick_bucket(len(chunks), graphs.buckets)
        assert bucket is not None
        graphs._fill(graphs._static[bucket], chunks)
        fresh = allocate_flex_index(bucket, 1, cache.num_blocks, cache.key_pool.device)
        fill_flex_index(fresh, [c.block_ids for c in chunks], [c.start_position for c in chunks],
                        [c.start_position + 1 for c in chunks], cache.block_size)
        for name in ("to_logical", "kv_indices", "first_positions", "context_lens", "kv_num_blocks"):
            assert torch.equal(getattr(shared, name)[:bucket], getattr(fresh, name)), name
        assert bool((shared.to_logical[bucket:] == -1).all()) and not shared.kv_indices[bucket:].any()


@pytest.mark.slow  # ~30 s with a cold inductor cache (compiling flex for 4 shapes)
@pytest.mark.parametrize("dtype", ["float32", None])
def test_padded_decode_gives_the_tokens_of_the_unpadded_path(tiny_llama: Path, dtype: str | None) -> None:
    """Three requests of different lengths: decode batches of 3 and then fewer rows, padded to buckets 4, 2, 1.
    ``float32``: transformers' forward, also checked against ``generate``; None: the engine's own decoder (what
    CUDA graphs capture), in float32 on CPUs without AMX (bf16 elsewhere: then flex and the gathered path may
    round a near-tie apart, so that case is skipped)."""
    prompts = [[5 + 7 * i for i in range(n)] for n in (5, 19, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 8, 4)]
    padded = _engine(tiny_llama, dtype, attention_backend="flex", cuda_graphs="padded")
    if padded.runner.compute.dtype != torch.float32:
        pytest.skip("this CPU runs the own decoder in bfloat16")
    assert padded.runner.compute.own_decoder == (dtype is None) and padded.runner.graphs is not None
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        padded.add_request(f"r{i}", prompt, sp)
    run = drain(padded)
    assert padded.runner.graphs.num_steps == 11  # every step after the one prefill step
    assert padded.stats().num_free_blocks == padded.stats().num_total_blocks
    got = [run.token_ids[f"r{i}"] for i in range(3)]
    default = _engine(tiny_llama, dtype)  # unpadded: gathered SDPA, or the C++ kernel where the own decoder runs
    assert default.runner.graphs is None and default.runner.attention_backend in ("sdpa", "kernel")
    assert got == [list(o.token_ids) for o in default.generate(prompts, params)]
    if dtype == "float32":
        reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        assert got == [reference_greedy(reference, p, sp) for p, sp in zip(prompts, params, strict=True)]
