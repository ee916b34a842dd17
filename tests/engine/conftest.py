"""Engine-test settings.

One intra-op thread: the test machine has two cores shared by several concurrent jobs, and with oversubscribed
cores torch's two-thread kernels spend their time in barrier spin-waits (a 4-5x slowdown on these tiny models).
Results do not depend on it; only speed does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.helpers import torch_threads
from worker.engine.linear import quantize_int4


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def snapped_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with every Linear weight replaced by its int4-g32 (Q4_1) rounding, as if de-quantised from
    a 4-bit GGUF file: what ``quantization="auto"`` recognises."""
    out = tmp_path_factory.mktemp("tiny-q4-1")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0:
                codes, scales, low = quantize_int4(module.weight)
                grid = codes.view(module.out_features, -1, 32).float() * scales[..., None] + low[..., None]
                module.weight.copy_(grid.view_as(module.weight))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out
