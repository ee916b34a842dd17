"""int8 weights: quality against float32 on real text (SmolLM2), and the engine serving with them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.quantization import Int8Linear, quantize_linears_int8

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, and its cafes.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight to synthesize foods from carbon dioxide "
    "and water.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon during the Apollo 11 mission.",
    "To make a cup of tea, boil water, put a tea bag in a cup, pour the hot water over it and wait three minutes.",
]


def test_int8_linear_is_close_to_float() -> None:
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(5, 7, 64)
    with torch.inference_mode():
        expected, got = linear(x), Int8Linear(linear)(x)
    assert got.shape == expected.shape
    assert (got - expected).norm() / expected.norm() < 0.05


@pytest.mark.slow
def test_int8_smollm2_keeps_greedy_choices_and_perplexity(smollm2: Path) -> None:
    """Teacher-forced over natural text: the int8 model's top-1 token agrees with float32's at >= 75% of positions
    and its perplexity is at most 1.4x float32's (measured: 81%, 6.9 -> 8.6; all-int8 gave 52%, 6.9 -> 21)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    quantized = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    assert quantize_linears_int8(quantized) == 30 * 6 + 1  # q, k, v, o, gate, up per layer, and the LM head
    agree = total = 0
    nll_ref = nll_q = 0.0
    with torch.inference_mode():
        for text in TEXTS:
            ids = torch.tensor([tokenizer.encode(text)])
            ref_logits, q_logits = reference(ids).logits[0, :-1], quantized(ids).logits[0, :-1]
            targets = ids[0, 1:]
            agree += int((ref_logits.argmax(-1) == q_logits.argmax(-1)).sum())
            total += len(targets)
            nll_ref += float(torch.nn.functional.cross_entropy(ref_logits, targets, reduction="sum"))
            nll_q += float(torch.nn.functional.cross_entropy(q_logits, targets, reduction="sum"))
    assert agree / total >= 0.75
    assert math.exp(nll_q / total) <= 1.4 * math.exp(nll_ref / total)


def test_engine_serves_int8(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama), quantization="int8", num_kv_blocks=32))
    assert any(isinstance(m, Int8Linear) for m in engine.runner.model.modules())
    outs = engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
