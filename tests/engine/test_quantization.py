"""Weight-only int8/int4 and float16 weights: the shipped Q4_1 weights reproduced, kernels agreeing with the dense
form, quality on real text (SmolLM2) against float32, and the engine serving with them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.helpers import needs_fbgemm, this_cpus_int4
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.attention import PagedContext
from worker.engine.decode_kernel import load_decode_kernel
from worker.engine.decoder import Decoder
from worker.engine.linear import (
    QUANTIZED_MAX_ROWS,
    PackedLinear,
    dense_linear,
    dequantize_q8_0,
    lies_on_int4_grid,
    pack_q4_1,
    prepack,
    prepacks,
    quantize_int4,
    quantize_q8_0,
    tile_q4_1,
    tile_q8_0,
)
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledChunk

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, and its cafes.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight to synthesize foods from carbon dioxide "
    "and water.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon during the Apollo 11 mission.",
    "To make a cup of tea, boil water, put a tea bag in a cup, pour the hot water over it and wait three minutes.",
]


def test_int4_finds_the_q4_1_blocks_of_smollm2_again(smollm2: Path) -> None:
    """SmolLM2's projections were de-quantised from Q4_1 (``d * q + m`` per block of 32): int4 in groups of 32
    recovers codes, scales and minimums, so de-quantising again gives the same weights to float32 rounding, and the
    kernel's bf16 scales stay within bf16 rounding of them. Random weights (no Q4_1 grid) are far off."""
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as weights:
        names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight")
        tensors = [weights.get_tensor(name).float() for name in names]
    def relative_error(weight: torch.Tensor) -> float:
        codes, scales, low = quantize_int4(weight)
        grouped = codes.view(weight.shape[0], -1, 32).float() * scales[..., None] + low[..., None]
        return float((grouped.view_as(weight) - weight).abs().max() / weight.abs().max())

    assert all(relative_error(weight) < 1e-6 and lies_on_int4_grid(weight) for weight in tensors)
    noise = torch.randn(64, 128) * 0.02
    assert relative_error(noise) > 1e-3 and not lies_on_int4_grid(noise)
    packed = PackedLinear(tensors[0], None, torch.bfloat16, "int4")
    assert float((packed.dense_weight().float() - tensors[0]).abs().max() / tensors[0].abs().max()) < 2 ** -7


def test_q4_1_keeps_the_float16_scales_of_smollm2s_blocks(smollm2: Path) -> None:
    """q4_1 packs the same codes two a byte in Q4_1's order and keeps each block's scale and minimum in float16,
    as the file does: de-quantised again they give SmolLM2's weights to float32 rounding, where int4's bf16
    scales are off by up to bf16 rounding."""
    load_decode_kernel()
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as weights:
        weight = weights.get_tensor("model.layers.3.mlp.gate_proj.weight").float()
    codes, _, _ = quantize_int4(weight)
    linear = PackedLinear(weight, None, torch.bfloat16, "q4_1")
    assert linear.codes.dtype == torch.uint8 and linear.codes.shape == (weight.shape[0], weight.shape[1] // 2)
    assert torch.equal(linear.codes, pack_q4_1(codes))
    assert torch.equal(linear.codes[:, :16] & 15, codes[:, :16].to(torch.uint8))  # byte j: code j and j + 16
    assert torch.equal(linear.codes[:, :16] >> 4, codes[:, 16:32].to(torch.uint8))
    again = (codes.view(weight.shape[0], -1, 32).float() * linear.scales.float()[..., None]
             + linear.mins.float()[..., None]).view_as(weight)
    assert float((again - weight).abs().max() / weight.abs().max()) < 1e-6


@pytest.fixture(scope="module")
def operators() -> None:
    problem = load_decode_kernel()
    assert problem is None, f"the C++ operators must build where the tests run (make setup builds them): {problem}"


def test_q8_0_finds_the_q8_0_blocks_of_smollm2_again(smollm2: Path, operators: None) -> None:
    """SmolLM2's embedding (its LM head, tied) was de-quantised from GGUF's Q8_0: q8_0 gets every code and float16
    scale back, so the head's weight-only form is the model file's own, bit for bit."""
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as weights:
        head = weights.get_tensor("model.embed_tokens.weight").float()
    codes, scales = quantize_q8_0(head)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert torch.equal((codes.view(head.shape[0], -1, 32).float() * scales.float()[..., None]).view_as(head), head)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q8_0(torch.randn(4, 48))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quantization", ["int8", "int4", "q4_1", "q8_0"])
def test_quantized_kernel_and_dense_form_agree(quantization: str, dtype: torch.dtype, operators: None) -> None:
    """Few rows go to the weight-only kernel (torch's as bf16 whatever the compute dtype; tokenspool's q4_1 and q8_0
    ones in it), many to the dense de-quantised copy in the compute dtype: the same function, returned in the compute
    dtype."""
    torch.manual_seed(0)
    linear = PackedLinear(torch.randn(96, 128) * 0.05, torch.randn(96) * 0.1, dtype, quantization)
    x = torch.randn(QUANTIZED_MAX_ROWS + 3, 128, dtype=dtype)
    with torch.inference_mode():
        dense = linear(x)  # more rows than QUANTIZED_MAX_ROWS: the dense matmul
        kernel = torch.cat([linear(row[None]) for row in x])  # one row at a time: the weight-only kernel
    assert dense.shape == kernel.shape == (QUANTIZED_MAX_ROWS + 3, 96)
    assert dense.dtype == kernel.dtype == linear.dense_weight().dtype == dtype
    assert float((kernel.float() - dense.float()).norm() / dense.float().norm()) < 0.01


needs_onednn_bf16 = pytest.mark.skipif(not prepacks(torch.bfloat16, torch.device("cpu")),
                                       reason="this CPU's oneDNN has no bf16 matmuls")


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 5, 8, 33, 300])
def test_prepacked_bf16_weights_compute_what_f_linear_does_bit_for_bit(rows: int) -> None:
    """The oneDNN layout changes where the weight's bytes lie, not the arithmetic: every row count (the packing's
    row hint is 1) and a strided input give F.linear's exact result; float32 weights stay plain."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 128, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    packed = prepack(weight)
    assert packed.is_mkldnn and not prepack(weight.float()).is_mkldnn
    x = torch.randn(rows, 256, dtype=torch.bfloat16)[:, ::2]  # a strided view, as the decoder's slices are
    with torch.inference_mode():
        assert torch.equal(dense_linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias))
        assert torch.equal(dense_linear(x, packed), torch.nn.functional.linear(x, weight))
    assert torch.equal(packed.to_dense(), weight)


@needs_onednn_bf16
def test_a_bf16_decoder_prepacks_its_dense_weights_and_keeps_its_head_out_of_int8(tiny_llama: Path,
                                                                                 operators: None) -> None:
    """bf16 under int4: every projection keeps its int4 codes plus a prepacked dense copy; without tokenspool's
    operators the LM head is prepacked bf16 alone (faster than torch's int8 kernel at one row, and closer to
    float32), with them q8_0 up to 4 rows over a prepacked dense copy."""
    source = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    bf16 = Decoder(source, torch.bfloat16, "int4", max_rows=8)
    projections = [m for layer in bf16.layers for m in layer.modules() if isinstance(m, PackedLinear)]
    assert projections and all(m.weight.is_mkldnn and m.max_rows == 8 for m in projections)
    assert bf16.lm_head.weight.is_mkldnn
    assert bf16.lm_head.quantization is None and bf16.layers[0].qkv.quantization == "int4"
    with_operators = Decoder(source, torch.bfloat16, "int4", max_rows=8, kernels=True).lm_head
    assert (with_operators.quantization, with_operators.max_rows) == ("q8_0", QUANTIZED_MAX_ROWS)
    assert with_operators.weight.is_mkldnn
    assert Decoder(source, torch.bfloat16, None, kernels=True).lm_head.quantization is None  # unquantised stays


@pytest.mark.parametrize("bias", [False, True])
def test_a_kernel_result_left_in_bf16_adds_to_the_same_float32_sum(bias: bool) -> None:
    """``cast_back=False`` (the decoder's o and down projections) hands back the kernel's bf16 rows, and adding them
    to a float32 residual gives exactly the sum the cast would; with a bias (added in float32) it casts anyway.
    Dense calls are unchanged."""
    torch.manual_seed(0)
    linear = PackedLinear(torch.randn(96, 128) * 0.05, torch.randn(96) * 0.1 if bias else None, torch.float32,
                          "int4", max_rows=2)
    residual, few, many = torch.randn(2, 96), torch.randn(2, 128), torch.randn(3, 128)
    with torch.inference_mode():
        kept = linear(few, cast_back=False)
        assert kept.dtype == (torch.float32 if bias else torch.bfloat16)
        assert torch.equal(residual + kept, residual + linear(few))
        assert torch.equal(linear(many, cast_back=False), linear(many))


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
def test_float16_weights_compute_f_linear_on_the_rounded_weight(rows: int) -> None:
    """``fp16`` keeps float32 activations and accumulation: its result is ``F.linear`` with the weight rounded to
    float16, to float32 rounding (not to float16's), bias and strided inputs included; the dense copy of a float32
    int4 layer is packed the same way, and reads back as the rounded weight."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 128) * 0.05, torch.randn(96) * 0.1
    x = torch.randn(rows, 256)[:, ::2]  # a strided view, as the decoder's slices are
    expected = torch.nn.functional.linear(x, weight.half().float(), bias)
    half = PackedLinear(weight, bias, torch.float32, "fp16")
    assert half.layout() == "half" and half.codes is None and torch.equal(half.dense_weight(), weight.half().float())
    with torch.inference_mode():
        got = half(x)
    assert got.dtype == torch.float32
    assert float((got - expected).abs().max()) < 1e-5 * float(expected.abs().max())
    assert float((got - torch.nn.functional.linear(x, weight, bias)).abs().max()) > 0  # the weight was rounded
    assert PackedLinear(weight, bias, torch.float32, "int4").layout() == "half"
    assert PackedLinear(weight, bias, torch.float32, None).layout() == "plain"
    with pytest.raises(ValueError, match="quantization 'fp16' needs dtype float32"):
        PackedLinear(weight, bias, torch.bfloat16, "fp16")


def test_a_float32_q4_1_layer_keeps_tiles_for_many_rows_and_no_dense_copy(operators: None) -> None:
    """Under float32 a q4_1 layer runs few rows on ``int4_linear`` (16-bit activations) and more on ``q4_1_rows``
    (8-bit activations, the tiles of ``tile_q4_1``), with no dense copy: ``dense_weight`` rebuilds the Q4_1
    weights exactly. Rows past ``max_rows`` agree with the one-row kernel to the 8-bit rounding (~0.5%); a layer
    whose output columns are no multiple of 8, and a bf16 one, keep a dense copy."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 128) * 0.05, torch.randn(96) * 0.1
    linear = PackedLinear(weight, bias, torch.float32, "q4_1")
    codes, scales, low = quantize_int4(weight)
    assert linear.layout() == "tiles" and linear.weight is None and linear.tiles is not None
    for got, expected in zip(linear.tiles, tile_q4_1(codes, scales.half(), low.half()), strict=True):
        assert torch.equal(got, expected)
    grid = (codes.view(96, 4, 32).float() * scales.half().float()[..., None]
            + low.half().float()[..., None]).view(96, 128)
    assert torch.equal(linear.dense_weight(), grid)
    x = torch.randn(QUANTIZED_MAX_ROWS + 9, 128)
    with torch.inference_mode():
        many = linear(x)
        one_by_one = torch.cat([linear(row[None]) for row in x])
    exact = torch.nn.functional.linear(x.double(), grid.double(), bias.double())
    assert float((one_by_one.double() - exact).norm() / exact.norm()) < 1e-4
    assert float((many.double() - exact).norm() / exact.norm()) < 0.01
    assert PackedLinear(torch.randn(92, 128), None, torch.float32, "q4_1").layout() != "tiles"
    assert PackedLinear(weight, bias, torch.bfloat16, "q4_1").layout() != "tiles"


def test_a_float32_q8_0_layer_keeps_tiles_for_many_rows_and_no_dense_copy(operators: None) -> None:
    """Under float32 a q8_0 layer (the LM head) runs few rows on ``int8_linear`` (float32 activations) and more on
    ``q8_0_rows`` (16-bit activations, the tiles of ``tile_q8_0``), with no dense copy: ``dense_weight`` rebuilds
    the Q8_0 weights exactly, and both paths agree with them to 1e-4 (the 16-bit rounding moves a value by at most
    2^-16 of its group's largest)."""
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    linear = PackedLinear(weight, None, torch.float32, "q8_0")
    codes, scales = quantize_q8_0(weight)
    assert linear.layout() == "tiles" and linear.weight is None and linear.tiles is not None
    for got, expected in zip(linear.tiles, tile_q8_0(codes, scales), strict=True):
        assert torch.equal(got, expected)
    grid = dequantize_q8_0(codes, scales)
    assert torch.equal(linear.dense_weight(), grid)
    x = torch.randn(QUANTIZED_MAX_ROWS + 9, 128)
    with torch.inference_mode():
        many = linear(x)
        one_by_one = torch.cat([linear(row[None]) for row in x])
    exact = x.double() @ grid.double().T
    for got in (many, one_by_one):
        assert float((got.double() - exact).norm() / exact.norm()) < 1e-4
    assert PackedLinear(weight, None, torch.bfloat16, "q8_0").layout() != "tiles"


def test_only_cpus_with_avx2_keep_tiles(operators: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AVX2 (torch's CPU capability) the tiled operators would run their scalar loops: float32 q8_0 and
    q4_1 layers keep dense weights for many rows there."""
    weight = torch.randn(96, 128) * 0.05
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    for quantization in ("q8_0", "q4_1"):
        linear = PackedLinear(weight, None, torch.float32, quantization)
        assert linear.tiles is None and linear.layout() != "tiles"
        x = torch.randn(QUANTIZED_MAX_ROWS + 3, 128)
        with torch.inference_mode():
            torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.dense_weight()))


@needs_fbgemm
def test_a_float32_decoder_keeps_float16_weights_and_head(tiny_llama: Path) -> None:
    """float32 under int4: int4 codes plus a float16 dense copy; the LM head float16 alone (faster than the int8
    kernel at one row on the AVX2 EPYC, and closer to float32); under fp16 no int4 codes at all."""
    source = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    f32 = Decoder(source, torch.float32, "int4", max_rows=16)
    assert f32.lm_head.quantization == "fp16" and f32.lm_head.layout() == "half"
    assert f32.layers[0].down.max_rows == 16 and f32.layers[0].down.layout() == "half"
    half = Decoder(source, torch.float32, "fp16")
    linears = [m for m in half.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.layout() == "half" and m.codes is None for m in linears)


def teacher_forced(decoder: Decoder, runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position but the last of ``ids``, computed as one prefill chunk: [len(ids) - 1, V]."""
    chunk = ScheduledChunk("r", tuple(ids), 0, tuple(range(16)), needs_logits=True)
    input_ids, positions, metadata, _ = runner.prepare_inputs([chunk])
    with torch.inference_mode():
        logits = decoder(input_ids[0], positions[0], PagedContext(runner.kv_cache, metadata),
                         torch.arange(len(ids) - 1))
    return logits.float()


def teacher_forced_decode(decoder: Decoder, runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The same logits computed one decode step (one row, the weight-only kernels) per token: [len(ids) - 1, V]."""
    rows = []
    for position in range(len(ids) - 1):
        chunk = ScheduledChunk("r", (ids[position],), position, tuple(range(16)), needs_logits=True)
        input_ids, positions, metadata, logits_indices = runner.prepare_inputs([chunk])
        with torch.inference_mode():
            rows.append(decoder(input_ids[0], positions[0], PagedContext(runner.kv_cache, metadata),
                                logits_indices)[0])
    return torch.stack(rows).float()


# (compute dtype, quantisation, forward): "prefill" scores all positions as one chunk (the dense weights),
# "decode" one position per step (the weight-only kernels); measured numbers in the test's docstring.
# int4 and q4_1 cases run as the engine does where tokenspool's operators are built (the LM head in q8_0, the fused
# small steps); "int4 torch-head" without them; "kv16" over a float16 KV cache (a float32 engine's with quantised
# weights: config.pick_kv_dtype); "head-tiles" with the q8_0 head on its tiles at one row too (16-bit activations:
# config.head_max_rows, a float32 engine's on AVX2-only CPUs).
QUALITY_CASES = [(torch.bfloat16, None, "prefill"), (torch.bfloat16, "int8", "prefill"),
                 (torch.bfloat16, "int4", "prefill"), (torch.bfloat16, "int4", "decode"),
                 (torch.bfloat16, "int4 torch-head", "decode"),
                 (torch.float32, "int4", "prefill"), (torch.float32, "int4", "decode"),
                 (torch.bfloat16, "q4_1", "decode"), (torch.float32, "q4_1", "decode"),
                 (torch.float32, "q4_1", "prefill"),
                 (torch.float32, "q4_1 kv16", "decode"), (torch.float32, "q4_1 head-tiles", "decode"),
                 (torch.float32, "fp16", "prefill"), (torch.float32, "fp16", "decode")]


# float32 activations against weights only rounded (float16) or the file's own (q4_1, whose activations are rounded
# to 16-bit integers per group of 32): both measured 100% of the 134 positions.
NEAR_EXACT_MIN_AGREEMENT = 0.995


@pytest.mark.slow
def test_smollm2_bf16_int8_int4_keep_float32_choices_and_perplexity(smollm2: Path, operators: None) -> None:
    """Teacher-forced over natural text against the float32 model: top-1 agreement >= 97% and perplexity within
    3% (measured: bf16 99.3%, int8 99.3%, int4 98.5%; perplexity 6.90 -> 6.97 / 6.90 / 6.95; float32 activations
    with int4, CPUs without fast bf16: see docs/performance.md. The old dynamic int8 option measured 81% and 8.6).
    bf16 int4 decode rows with tokenspool's operators (the engine's where they are built: q8_0 head, fused norms,
    RoPE and SiLU, each rounded once) 99.3%, perplexity 6.96; with torch's ops and the bf16 head 97.0% and 6.96.
    float16 weights with float32 activations, and q4_1 with float32 activations (16-bit integer activations in the
    operator: 100%, perplexity 6.899 against 6.900, AMD EPYC Zen 3; over a float16 KV cache 100%, 6.899, Xeon),
    keep >= 99.5% (``NEAR_EXACT_MIN_AGREEMENT``); so does the q8_0 head on its tiles at one row (16-bit activations:
    100%, perplexity 6.899, AMD EPYC Zen 1).
    Prefill rows run the dense de-quantised weights, decode rows the weight-only kernels with bf16 activations;
    float32 q4_1 prefill rows run ``q4_1_rows`` (activations rounded to 8 bits per group of 32, llama.cpp's Q8_1
    rounding): 99.3%, perplexity 6.86 (AMD EPYC Zen 3), held to the bf16 bar of 97%."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    source = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    runners = {dtype: ModelRunner(EngineConfig(model=str(smollm2), dtype=name, block_size=16, num_kv_blocks=16,
                                               device="cpu"), smollm2)
               for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32"))}
    kv16 = ModelRunner(EngineConfig(model=str(smollm2), dtype="float32", kv_cache_dtype="float16", block_size=16,
                                    num_kv_blocks=16, device="cpu"), smollm2)
    texts = [tokenizer.encode(text) for text in TEXTS]
    with torch.inference_mode():
        references = [source(torch.tensor([ids])).logits[0, :-1] for ids in texts]
    nll_ref = sum(float(torch.nn.functional.cross_entropy(r, torch.tensor(ids[1:]), reduction="sum"))
                  for r, ids in zip(references, texts, strict=True))
    total = sum(len(ids) - 1 for ids in texts)
    for dtype, case_name, forward in QUALITY_CASES:
        quantization = case_name.split()[0] if case_name else None
        decoder = Decoder(source, dtype, quantization, kernels=case_name in ("int4", "q4_1", "q4_1 kv16",
                                                                              "q4_1 head-tiles"),
                          head_max_rows=0 if case_name == "q4_1 head-tiles" else QUANTIZED_MAX_ROWS)
        runner = kv16 if case_name == "q4_1 kv16" else runners[dtype]
        score = teacher_forced if forward == "prefill" else teacher_forced_decode
        agree, nll = 0, 0.0
        for ids, reference in zip(texts, references, strict=True):
            logits = score(decoder, runner, ids)
            agree += int((logits.argmax(-1) == reference.argmax(-1)).sum())
            nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        case = (dtype, case_name, forward)
        exact_enough = quantization == "fp16" or (quantization == "q4_1" and dtype == torch.float32
                                                   and forward == "decode")
        assert agree / total >= (NEAR_EXACT_MIN_AGREEMENT if exact_enough else 0.97), case
        assert math.exp(nll / total) <= 1.03 * math.exp(nll_ref / total), case


@pytest.mark.parametrize(("quantization", "dtype"), [
    ("int8", "bfloat16"), ("int8", "float32"), ("int4", "bfloat16"), ("int4", "float32"),
    pytest.param("fp16", "float32", marks=needs_fbgemm),
])
def test_engine_serves_quantized_weights(tiny_llama: Path, quantization: str, dtype: str, operators: None) -> None:
    """On a CPU whose compiler built tokenspool's operators, every quantised engine's LM head is q8_0."""
    engine = Engine(EngineConfig(model=str(tiny_llama), quantization=quantization, dtype=dtype, num_kv_blocks=32))
    assert engine.runner.plan.dtype == engine.runner.compute.dtype == getattr(torch, dtype)
    assert engine.runner.compute.own_decoder and engine.runner.decoder is engine.runner.model
    assert engine.runner.decoder.lm_head.quantization == "q8_0"
    served = this_cpus_int4(getattr(torch, dtype)) if quantization == "int4" else quantization
    assert engine.runner.compute.quantization == served
    assert any(isinstance(m, PackedLinear) and m.quantization == served for m in engine.runner.model.modules())
    outs = engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_quantization_needs_float32_or_bfloat16_and_a_supported_model(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="quantization 'int8' needs device cpu, dtype float32 or bfloat16"):
        Engine(EngineConfig(model=str(tiny_llama), quantization="int8", dtype="float16", num_kv_blocks=32))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


def test_auto_quantization_takes_int4_only_for_weights_on_the_q4_1_grid(tiny_llama: Path,
                                                                       snapped_llama: Path) -> None:
    """Whatever dtype this CPU picks when none is set (float32 or bfloat16), ``auto`` serves on-grid weights as
    int4 on the own decoder; only an explicit float32 keeps transformers' reference forward."""
    snapped = snapped_llama
    cases = [(tiny_llama, "bfloat16", None), (snapped, "bfloat16", "int4"), (snapped, "float32", "reference"),
             (snapped, None, "int4"), (tiny_llama, None, None)]
    for folder, dtype, expected in cases:
        engine = Engine(EngineConfig(model=str(folder), dtype=dtype, quantization="auto", num_kv_blocks=32))
        decoder = engine.runner.decoder
        got = "reference" if decoder is None else decoder.layers[0].qkv.quantization
        served = this_cpus_int4(engine.runner.plan.dtype) if expected == "int4" else expected  # the picked dtype's
        assert got == served, (folder, dtype)
    plain = Engine(EngineConfig(model=str(snapped), dtype="bfloat16", quantization="none", num_kv_blocks=32))
    assert plain.runner.decoder is not None and plain.runner.decoder.layers[0].qkv.quantization is None
