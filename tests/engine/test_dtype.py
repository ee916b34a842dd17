"""The dtype follows the hardware unless configured, and picks which forward pass runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import _save_tiny
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.config import cpu_flags, pick_dtype
from worker.engine.decoder import Decoder

CPU = torch.device("cpu")


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx2", "fma"}, torch.float32),
    ({"avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
])
def test_cpu_dtype_follows_bf16_units(flags: set[str], expected: torch.dtype) -> None:
    assert pick_dtype(EngineConfig(), CPU, frozenset(flags)) == expected


def test_configured_dtype_and_quantization_override_the_hardware() -> None:
    amx = frozenset({"amx_bf16"})
    assert pick_dtype(EngineConfig(dtype="float32"), CPU, amx) == torch.float32
    assert pick_dtype(EngineConfig(dtype="float16"), CPU, frozenset()) == torch.float16
    assert pick_dtype(EngineConfig(quantization="int4"), CPU, frozenset({"avx2"})) == torch.bfloat16
    assert pick_dtype(EngineConfig(), torch.device("cuda"), frozenset()) == torch.bfloat16


def test_this_machine_reports_its_flags() -> None:
    flags = cpu_flags()
    if Path("/proc/cpuinfo").is_file():
        assert "fpu" in flags or "fp" in flags or "asimd" in flags  # x86 lists fpu; arm64 lists fp/asimd


def test_float32_runs_transformers_and_bfloat16_the_decoder(tiny_llama: Path) -> None:
    reference = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=32))
    fused = Engine(EngineConfig(model=str(tiny_llama), dtype="bfloat16", num_kv_blocks=32))
    assert reference.runner.decoder is None and not isinstance(reference.runner.model, Decoder)
    assert isinstance(fused.runner.decoder, Decoder) and fused.runner.kv_cache.keys[0].dtype == torch.bfloat16
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert [len(o.token_ids) for o in fused.generate([[5, 6, 7], [8, 9]], params)] == [5, 5]


def test_unsupported_architecture_in_bfloat16_falls_back_to_transformers(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = _save_tiny("gpt2", tmp_path_factory.mktemp("tiny-gpt2"))
    engine = Engine(EngineConfig(model=str(folder), dtype="bfloat16", num_kv_blocks=32))
    assert engine.runner.decoder is None
    assert next(engine.runner.model.parameters()).dtype == torch.bfloat16
    outs = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 4
    with pytest.raises(ValueError, match="gpt2"):
        Engine(EngineConfig(model=str(folder), quantization="int8", num_kv_blocks=32))


def test_decoder_verifies_speculative_tokens(tiny_llama: Path) -> None:
    """Prompt-lookup speculation sends multi-token chunks that need logits at every speculative position; in
    bf16 greedy output with speculation equals output without (the same decoder scores both)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    outputs = []
    for method in (None, "ngram"):
        engine = Engine(EngineConfig(model=str(tiny_llama), dtype="bfloat16", num_kv_blocks=32,
                                     speculative_method=method))
        outputs.append(engine.generate([prompt], params)[0].token_ids)
    assert len(outputs[0]) == 12 and outputs[0] == outputs[1]
