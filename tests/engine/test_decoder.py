"""The engine's fused decoder computes what transformers' forward computes, in the same dtype.

Each test drives ``Decoder`` over the paged KV cache step by step (a prefill chunk, then teacher-forced decode
steps, two requests in one step) and compares every position's logits with transformers' full-sequence forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import decoder_logits
from worker.engine import EngineConfig
from worker.engine.decode_kernel import load_decode_kernel
from worker.engine.decoder import Decoder
from worker.engine.model_runner import ModelRunner

BLOCK = 8  # tokens a KV block (decoder_logits gives each sequence 8 blocks)
# inductor's import (the compiled pointwise steps) warns about a deprecated torch.jit API it uses
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def compare(model_path: Path, dtype: torch.dtype, quantization: str | None = None, kernels: bool = False,
            compiled: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(decoder logits, transformers logits) per sequence, both from weights loaded in float32 and run in ``dtype``;
    ``kernels``: with tokenspool's C++ operators (fused norms, RoPE, SiLU-and-multiply, the K/V write; a q8_0
    head); ``compiled``: those steps compiled by inductor instead (the CUDA form, here inductor's C++)."""
    source = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    decoder = Decoder(source, dtype, quantization, kernels=kernels, compiled=compiled)
    assert decoder.ops.kind == ("operators" if kernels else "compiled" if compiled else "eager")
    # The runner only lays out the steps and holds the KV cache, in ``dtype``; ``decoder`` computes them.
    runner = ModelRunner(EngineConfig(model=str(model_path), dtype=str(dtype).removeprefix("torch."),
                                      block_size=BLOCK, num_kv_blocks=16, device="cpu"), model_path)
    runner.kv_cache.fused_write = kernels  # as the runner sets it for a decoder on the operators (kv_write_)
    sequences = [[5, 17, 99, 3, 42, 8, 250, 13, 77, 64, 1000, 2, 31], [7, 300, 11, 12, 500, 6, 9, 21, 4]]
    prefill = 6
    got = decoder_logits(decoder, runner, sequences, prefill)
    reference = source.to(dtype)
    with torch.inference_mode():
        expected = [reference(torch.tensor([s])).logits[0, prefill - 1:].float() for s in sequences]
    return list(zip(got, expected, strict=True))


@pytest.fixture(params=["eager", "operators", "compiled"])
def pointwise(request: pytest.FixtureRequest) -> dict[str, bool]:
    """Every form of the decoder's small steps (``pointwise.py``): torch's ops, tokenspool's C++ operators (built
    here), and inductor-compiled kernels (what CUDA runs; inductor's C++ on this CPU)."""
    if request.param == "operators":
        assert load_decode_kernel() is None, "the C++ operators must build where the tests run"
    return {"kernels": request.param == "operators", "compiled": request.param == "compiled"}


def test_float32_decoder_equals_transformers_forward(tiny_model: Path, pointwise: dict[str, bool]) -> None:
    """Llama and Qwen2 (q/k/v biases): float32 logits agree to float rounding (measured: 2e-6 of their spread)."""
    for got, expected in compare(tiny_model, torch.float32, **pointwise):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=2e-5 * float(expected.std()), rtol=0)


def test_bfloat16_decoder_is_close_to_transformers_bfloat16(tiny_model: Path, pointwise: dict[str, bool]) -> None:
    """bf16 against transformers in bf16: a few bf16 roundings apart (measured: 0.2-0.4% relative error)."""
    for got, expected in compare(tiny_model, torch.bfloat16, **pointwise):
        assert float((got - expected).norm() / expected.norm()) < 0.01


def test_quantized_decoders_stay_close_to_the_unquantized_model(tiny_llama: Path) -> None:
    """Weight-only int8 and int4 on random weights (harder to quantise than trained ones) stay near transformers
    in the same compute dtype, bf16 and float32 (whose kernel rows go through bf16; measured relative error:
    int8 1.0-1.3%, int4 7-8% in both)."""
    for dtype in (torch.bfloat16, torch.float32):
        for quantization, bound in (("int8", 0.03), ("int4", 0.15)):
            for got, expected in compare(tiny_llama, dtype, quantization):
                assert float((got - expected).norm() / expected.norm()) < bound, (dtype, quantization)
