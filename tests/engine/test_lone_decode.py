"""The compiled one-request decode step: the same logits as the eager step, bit for bit, whether the request's
blocks are consecutive (views) or not (gathered), in bf16 and float32; engines with it serve the same tokens; other
steps and other configurations stay eager."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.attention import PagedContext
from worker.engine.lone_decode import is_lone_decode
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledChunk

# inductor's first import warns of a deprecated torch.jit API it uses itself (torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

PROMPT = (5, 9, 14, 3, 27, 8, 11, 30, 2, 19, 6, 24, 13, 7, 21, 16, 4, 28, 10, 15)  # 20 tokens: two 16-token blocks


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def runner(request: pytest.FixtureRequest, snapped_llama: Path) -> Iterator[ModelRunner]:
    """The own decoder with the step compiled: bf16 or float32 activations, the int4 weights of a Q4_1 file."""
    config = EngineConfig(model=str(snapped_llama), dtype=request.param, quantization="int4", block_size=16,
                          num_kv_blocks=16, device="cpu", compile_lone_decode=True)
    yield ModelRunner(config, snapped_llama)


def eager_logits(runner: ModelRunner, chunk: ScheduledChunk) -> torch.Tensor:
    input_ids, positions, metadata, logits_indices = runner.prepare_inputs([chunk])
    with torch.inference_mode():
        return runner.forward(input_ids[0], positions[0], PagedContext(runner.kv_cache, metadata), logits_indices)


def test_a_step_is_a_lone_decode_only_for_one_request_and_one_token() -> None:
    one = ScheduledChunk("a", (5,), 7, (0,), needs_logits=True)
    assert is_lone_decode([one])
    assert not is_lone_decode([one, ScheduledChunk("b", (6,), 3, (1,), needs_logits=True)])
    assert not is_lone_decode([ScheduledChunk("a", (5, 6), 7, (0,), needs_logits=True)])  # prefill or speculation
    assert not is_lone_decode([ScheduledChunk("a", (5,), 7, (0,), needs_logits=False)])  # a prompt's 1-token chunk


@pytest.mark.parametrize("blocks", [(3, 4), (9, 2)], ids=["consecutive", "scattered"])
def test_compiled_step_equals_the_eager_step(runner: ModelRunner, blocks: tuple[int, int]) -> None:
    assert runner.lone_decode is not None
    eager_logits(runner, ScheduledChunk("r", PROMPT, 0, blocks, needs_logits=True))  # the prompt's K/V
    for position, token in ((20, 17), (21, 29)):  # each step writes its token's K/V, then attends
        chunk = ScheduledChunk("r", (token,), position, blocks, needs_logits=True)
        with torch.inference_mode():
            compiled = runner.lone_decode.run(chunk)
        assert torch.equal(compiled, eager_logits(runner, chunk))  # the K/V write is idempotent


def test_engines_with_and_without_it_serve_the_same_tokens_and_it_never_recompiles(snapped_llama: Path) -> None:
    engines = [Engine(EngineConfig(model=str(snapped_llama), dtype="bfloat16", quantization="auto",
                                   num_kv_blocks=32, compile_lone_decode=compiled)) for compiled in (True, False)]
    assert engines[0].runner.lone_decode is not None and engines[1].runner.lone_decode is None
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)  # over 4 blocks: the table grows
    with torch._dynamo.config.patch(error_on_recompile=True):  # compiled once, when the engine was built
        alone = [engine.generate([list(PROMPT)], params)[0].token_ids for engine in engines]
    together = [[o.token_ids for o in engine.generate([list(PROMPT), [3, 1, 4, 1, 5]], params)]
                for engine in engines]  # two requests: eager steps, until one is left
    assert alone[0] == alone[1] and together[0] == together[1]
    assert all(engine.stats().num_free_blocks == engine.stats().num_total_blocks for engine in engines)


def test_it_is_not_used_where_the_step_is_not_the_own_decoders_on_a_cpu(tiny_llama: Path) -> None:
    exact = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=32, compile_lone_decode=True))
    assert exact.runner.decoder is None and exact.runner.lone_decode is None  # transformers' reference forward
