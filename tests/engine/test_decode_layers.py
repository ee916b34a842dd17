"""The decoder's layer loop as one C++ call (``decode_layers.py``) computes what the Python loop computes, bit for
bit, and serves exactly the steps it is for: single-token decodes, at most ``max_rows`` of them, on the operators.

Each test drives the decoder over the paged KV cache (a prefill chunk of two requests side by side, then one token
a step, the shorter request finishing first) twice, with the operator and with the Python loop, and compares
every position's logits and the K/V the steps wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import decoder_logits, needs_fbgemm
from worker.engine import EngineConfig, decoder
from worker.engine.decode_kernel import load_decode_kernel
from worker.engine.decoder import Decoder
from worker.engine.model_runner import ModelRunner

SEQUENCES = [[5, 17, 99, 3, 42, 8, 250, 13, 77, 64, 1000, 2, 31], [7, 300, 11, 12, 500, 6, 9, 21, 4]]
PREFILL = 6


def run(model_path: Path, dtype: torch.dtype, quantization: str | None, max_rows: int, stacked: bool,
        monkeypatch: pytest.MonkeyPatch, kv_dtype: str | None = None
        ) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Each sequence's logits, the key and value pools after the steps, and the token count of every step the
    operator served (``stacked=False``: none, the Python loop runs them all). ``kv_dtype``: the cache's (None: the
    engine's pick)."""
    assert load_decode_kernel() is None, "the C++ operators must build where the tests run"
    source = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the tiny models' norms are all ones: distinct ones tell the layer's two norms apart
        for name, weight in source.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5, generator=generator)
    model = Decoder(source, dtype, quantization, max_rows, kernels=True)
    if not stacked:
        model.stack = None
    runner = ModelRunner(EngineConfig(model=str(model_path), dtype=str(dtype).removeprefix("torch."), block_size=8,
                                      num_kv_blocks=16, device="cpu", attention_backend="kernel",
                                      quantization="int8" if quantization == "int8" else "int4",
                                      kv_cache_dtype=kv_dtype), model_path)
    runner.kv_cache.fused_write = True  # as the runner sets it for a decoder on the operators (a quantised one: the
    # runner's own plan then picks the cache's dtype as the engine's would)
    served: list[int] = []

    def counting_run_stack(stack, hidden, cos, sin, ctx):  # type: ignore[no-untyped-def]
        out = run_stack(stack, hidden, cos, sin, ctx)
        if out is not None:
            served.append(hidden.shape[0])
        return out

    run_stack = decoder.run_stack
    monkeypatch.setattr(decoder, "run_stack", counting_run_stack)
    logits = decoder_logits(model, runner, SEQUENCES, PREFILL)
    pools = torch.stack([runner.kv_cache.key_pool, runner.kv_cache.value_pool])
    return logits, pools, served


@pytest.mark.parametrize(("dtype", "quantization", "kv_dtype"), [
    (torch.bfloat16, "int4", None), (torch.float32, "int4", None), (torch.bfloat16, "int8", None),
    (torch.float32, "int8", None), (torch.float32, "q4_1", None), (torch.bfloat16, "q4_1", None),
    (torch.float32, "q4_1", "float32"), (torch.float32, "int4", "bfloat16")])
def test_the_operator_equals_the_python_loop(tiny_model: Path, dtype: torch.dtype, quantization: str,
                                             kv_dtype: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every weight-only format in both compute dtypes, Llama and Qwen2 (q/k/v biases), float32 ones over the
    cache the engine picks (float16) and over float32 and bf16 ones: the same logits and K/V, bit for bit; the
    operator ran every decode step (3 of two tokens, then 4 of the longer request alone)."""
    got_logits, got_pools, served = run(tiny_model, dtype, quantization, 4, True, monkeypatch, kv_dtype)
    want_logits, want_pools, none = run(tiny_model, dtype, quantization, 4, False, monkeypatch, kv_dtype)
    assert served == [2] * 3 + [1] * 4 and none == []
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(got_pools, want_pools)
    expected = kv_dtype or ("float16" if dtype == torch.float32 else "bfloat16")
    assert got_pools.dtype == getattr(torch, expected)


@pytest.mark.parametrize(("dtype", "quantization", "served_steps"), [
    (torch.bfloat16, "int4", [1] * 4), (torch.float32, "q4_1", [2] * 3 + [1] * 4)])
def test_steps_with_more_rows_than_the_kernels_take(tiny_llama: Path, dtype: torch.dtype, quantization: str,
                                                    served_steps: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """With one row a kernel call, the two-token steps of dense projections (bf16 int4) run the Python loop and the
    lone request's steps the operator; float32 q4_1 layers' tiles take any number of rows, so the operator runs
    every decode step, its two-row ones on ``q4_1_rows``. The results are the all-Python ones either way."""
    got_logits, got_pools, served = run(tiny_llama, dtype, quantization, 1, True, monkeypatch)
    want_logits, want_pools, _ = run(tiny_llama, dtype, quantization, 1, False, monkeypatch)
    assert served == served_steps
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(got_pools, want_pools)


@pytest.mark.parametrize("quantization", [None, pytest.param("fp16", marks=needs_fbgemm)])
def test_layouts_without_a_weight_only_kernel_have_no_stack(tiny_llama: Path, quantization: str | None) -> None:
    """Unquantised layers (dense matmuls at every row count) and float16 ones are not the operator's."""
    assert load_decode_kernel() is None
    source = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert Decoder(source, torch.float32, quantization, kernels=True).stack is None
    assert Decoder(source, torch.float32, "q4_1", kernels=True).stack is not None
    assert Decoder(source, torch.float32, "q4_1", kernels=False).stack is None  # torch's ops: no operators
