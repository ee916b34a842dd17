"""The dtype follows the hardware unless configured, and picks which forward pass runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import _save_tiny
from tests.engine.helpers import needs_fbgemm, this_cpus_int4
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.config import (
    ComputePlan,
    ModelShape,
    bf16_matmul_speedup,
    cpu_flags,
    head_max_rows,
    make_plan,
    pick_dtype,
    pick_kv_dtype,
    plan_compute,
)
from worker.engine.decoder import Decoder
from worker.engine.linear import QUANTIZED_MAX_ROWS, half_packs
from worker.engine.model_runner import load_model

CPU = torch.device("cpu")


def _never_measured() -> float:
    raise AssertionError("only AVX512-BF16 without AMX is measured")


@pytest.mark.parametrize(("flags", "speedup", "expected"), [
    ({"avx2", "fma"}, None, torch.float32),  # bf16 emulated
    ({"avx512f", "avx512_bf16"}, 0.9, torch.float32),  # bf16 instructions measured slower (Xeon model 207)
    ({"avx512f", "avx512_bf16"}, 3.3, torch.bfloat16),  # measured fast (AMD EPYC, Zen 4)
    ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, None, torch.bfloat16),
])
def test_cpu_dtype_follows_fast_bf16_matmuls(flags: set[str], speedup: float | None, expected: torch.dtype) -> None:
    measure = _never_measured if speedup is None else lambda: speedup
    assert pick_dtype(EngineConfig(), CPU, frozenset(flags), measure) == expected


def test_the_bf16_probe_measures_this_cpu() -> None:
    speedup = bf16_matmul_speedup()
    assert 0.01 < speedup < 100
    if "amx_bf16" in cpu_flags():
        assert speedup > 1.0


def test_configured_dtype_overrides_the_hardware_and_quantization_does_not() -> None:
    """Quantised layers feed their kernels bf16 whatever the compute dtype, so int4 keeps the CPU's float32."""
    amx = frozenset({"amx_bf16"})
    assert pick_dtype(EngineConfig(dtype="float32"), CPU, amx) == torch.float32
    assert pick_dtype(EngineConfig(dtype="float16"), CPU, frozenset()) == torch.float16
    assert pick_dtype(EngineConfig(quantization="int4"), CPU, frozenset({"avx2"})) == torch.float32
    assert pick_dtype(EngineConfig(quantization="int4"), CPU, amx) == torch.bfloat16
    assert pick_dtype(EngineConfig(), torch.device("cuda"), frozenset()) == torch.bfloat16


F32, BF16, CUDA = torch.float32, torch.bfloat16, torch.device("cuda")
AVX2 = frozenset({"avx2", "fma"})
AVX512 = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})


@needs_fbgemm
@pytest.mark.parametrize(("config", "device", "dtype", "unsupported", "on_grid", "expected"), [
    # the default on an AVX-512 CPU without fast bf16: float32 activations, the GGUF's own int4 blocks for up to
    # 16 rows, float16 dense weights above, the own decoder
    (EngineConfig(quantization="auto"), CPU, F32, None, True, ComputePlan(F32, "int4", True, 16)),
    (EngineConfig(quantization="auto"), CPU, BF16, None, True, ComputePlan(BF16, "int4", True, 8)),
    (EngineConfig(quantization="auto"), CPU, F32, None, False, ComputePlan(F32, None, True, 32)),
    (EngineConfig(), CPU, F32, None, True, ComputePlan(F32, None, True, 32)),
    # float32 asked for: transformers' exact forward, "auto" included; explicit int4 still quantises
    (EngineConfig(dtype="float32"), CPU, F32, None, True, ComputePlan(F32, None, False, 32)),
    (EngineConfig(dtype="float32", quantization="auto"), CPU, F32, None, True, ComputePlan(F32, None, False, 32)),
    (EngineConfig(dtype="float32", quantization="int4"), CPU, F32, None, False, ComputePlan(F32, "int4", True, 16)),
    (EngineConfig(dtype="float32", quantization="fp16"), CPU, F32, None, False, ComputePlan(F32, "fp16", True, 16)),
    (EngineConfig(dtype="bfloat16", quantization="none"), CPU, BF16, None, True, ComputePlan(BF16, None, True, 8)),
    (EngineConfig(quantization="auto"), CUDA, BF16, None, True, ComputePlan(BF16, None, True, 8)),
    (EngineConfig(quantization="auto"), CPU, F32, "model type 'gpt2'", False, ComputePlan(F32, None, False, 32)),
])
def test_plan_compute_picks_the_forward_and_the_weights(config: EngineConfig, device: torch.device,
                                                        dtype: torch.dtype, unsupported: str | None, on_grid: bool,
                                                        expected: ComputePlan) -> None:
    assert plan_compute(config, device, dtype, unsupported, on_grid, flags=AVX512) == expected


@needs_fbgemm
@pytest.mark.parametrize(("config", "dtype", "expected"), [
    # AVX2 alone: the int4 kernel beats float16 weights at 1-2 rows only; a float32 q8_0 head takes its tiles at
    # every row count
    (EngineConfig(quantization="auto"), F32, ComputePlan(F32, "int4", True, 2, 0)),
    (EngineConfig(quantization="fp16"), F32, ComputePlan(F32, "fp16", True, 2, 0)),
    (EngineConfig(dtype="float32", quantization="auto"), F32, ComputePlan(F32, None, False, 32, 0)),
    (EngineConfig(dtype="bfloat16", quantization="auto"), BF16, ComputePlan(BF16, "int4", True, 8)),
])
def test_float32_plans_on_avx2_keep_int4_for_two_rows(config: EngineConfig, dtype: torch.dtype,
                                                      expected: ComputePlan) -> None:
    assert plan_compute(config, CPU, dtype, None, True, flags=AVX2) == expected


@needs_fbgemm
@pytest.mark.parametrize(("config", "dtype", "flags", "expected"), [
    # where torch's int4 kernel is its AVX2 one, int4 runs on tokenspool's operators
    (EngineConfig(quantization="auto"), F32, AVX2 | {"f16c"}, ComputePlan(F32, "q4_1", True, 2, 0)),
    (EngineConfig(quantization="int4"), F32, AVX2 | {"f16c"}, ComputePlan(F32, "q4_1", True, 2, 0)),
    (EngineConfig(dtype="bfloat16", quantization="auto"), BF16, AVX2 | {"f16c"}, ComputePlan(BF16, "q4_1", True, 8)),
    # with AVX-512 torch's kernel stays under bf16, float32 takes the operators; other quantisations never change
    (EngineConfig(quantization="auto"), F32, AVX512 | {"fma", "f16c"}, ComputePlan(F32, "q4_1", True, 2)),
    (EngineConfig(quantization="auto"), BF16, AVX512 | {"fma", "f16c"}, ComputePlan(BF16, "int4", True, 8)),
    (EngineConfig(quantization="int8"), F32, AVX2 | {"f16c"}, ComputePlan(F32, "int8", True, 2, 0)),
    (EngineConfig(quantization="fp16"), F32, AVX2 | {"f16c"}, ComputePlan(F32, "fp16", True, 2, 0)),
    # no F16C (the operator widens float16 scales with it): torch's kernel
    (EngineConfig(quantization="auto"), F32, AVX2, ComputePlan(F32, "int4", True, 2, 0)),
])
def test_int4_takes_the_own_operators_under_float32_or_where_torchs_kernel_is_avx2(
        config: EngineConfig, dtype: torch.dtype, flags: frozenset[str], expected: ComputePlan) -> None:
    assert plan_compute(config, CPU, dtype, None, True, flags=flags, kernels=lambda: True) == expected
    if expected.quantization == "q4_1":  # without the operators: torch's kernel and its limits
        assert plan_compute(config, CPU, dtype, None, True, flags=flags).quantization == "int4"


def _no_operators_asked() -> bool:
    raise AssertionError("only an int4 plan asks whether the operators are loaded")


@pytest.mark.parametrize("config", [EngineConfig(dtype="float32"), EngineConfig(quantization="none"),
                                    EngineConfig(quantization="int8")])
def test_plans_without_int4_never_load_the_operators(config: EngineConfig) -> None:
    """``kernels`` builds the operators when first asked: transformers' exact float32 forward must not pay for it."""
    plan_compute(config, CPU, F32, None, True, flags=AVX2 | {"f16c"}, kernels=_no_operators_asked)


def test_fp16_needs_float32_on_a_cpu() -> None:
    with pytest.raises(ValueError, match="quantization 'fp16' needs"):
        plan_compute(EngineConfig(quantization="fp16"), CPU, BF16, None, True, flags=AVX2)


@needs_fbgemm
def test_quantized_kernels_take_the_row_counts_where_they_beat_the_dense_matmul() -> None:
    """The weight-only kernels serve calls of up to 8 rows beside prepacked bf16 (AMX or not), 2 beside float16
    weights with AVX2 alone and 16 with AVX-512 (measured crossovers: ``config.QUANTIZED_MAX_ROWS_*``)."""
    config = EngineConfig(quantization="int4")
    assert plan_compute(config, CPU, BF16, None, True, frozenset({"amx_bf16"})).quantized_max_rows == 8
    assert plan_compute(config, CPU, BF16, None, True, frozenset({"avx512_bf16"})).quantized_max_rows == 8
    assert plan_compute(config, CPU, F32, None, True, AVX2 | {"amx_bf16"}).quantized_max_rows == 2
    assert plan_compute(config, CPU, F32, None, True, AVX512).quantized_max_rows == 16


@pytest.mark.parametrize(("config", "device", "dtype", "unsupported"), [
    (EngineConfig(dtype="float16", quantization="int8"), CPU, torch.float16, None),
    (EngineConfig(quantization="int4"), CUDA, BF16, None),
    (EngineConfig(quantization="int8"), CPU, F32, "model type 'gpt2'"),
])
def test_plan_compute_refuses_quantization_it_cannot_run(config: EngineConfig, device: torch.device,
                                                         dtype: torch.dtype, unsupported: str | None) -> None:
    with pytest.raises(ValueError, match="EngineConfig.quantization .* needs device cpu, dtype float32 or bfloat16"):
        plan_compute(config, device, dtype, unsupported, True)


def test_default_on_a_cpu_without_fast_bf16_runs_the_decoder_in_float32_with_int4(snapped_llama: Path) -> None:
    """What a worker builds unconfigured (``quantization="auto"``, no dtype) where the CPU flags give float32:
    the own decoder with float32 activations and the int4 kernels for few rows; for many rows tokenspool's Q4_1
    tiles where its operators run the int4 layers (``q4_1``), else the dense weights float16 in fbgemm's layout
    where torch has fbgemm (plain float32 elsewhere)."""
    config = EngineConfig(model=str(snapped_llama), quantization="auto")
    dtype = pick_dtype(config, CPU, frozenset({"avx2", "fma"}))
    model, decoder, compute = load_model(config, snapped_llama, CPU, dtype)
    half = half_packs(CPU)
    int4 = this_cpus_int4(torch.float32)
    assert compute.dtype == torch.float32 and compute.quantization == int4 and compute.own_decoder
    assert isinstance(decoder, Decoder) and decoder is model and decoder.embed.dtype == torch.float32
    qkv = decoder.layers[0].qkv
    assert qkv.quantization == int4 and qkv.max_rows == compute.quantized_max_rows
    assert qkv.layout() == ("tiles" if int4 == "q4_1" else "half" if half else "plain")
    assert qkv.dense_weight().dtype == torch.float32
    assert qkv.scales.dtype == (torch.float16 if int4 == "q4_1" else torch.bfloat16)
    head = decoder.lm_head
    assert head.max_rows == (compute.head_max_rows if head.quantization == "q8_0" else QUANTIZED_MAX_ROWS)


def test_a_float32_q8_0_head_takes_its_tiles_at_every_row_count_on_avx2_only_cpus() -> None:
    assert head_max_rows(F32, AVX2) == 0
    assert head_max_rows(F32, AVX512) == head_max_rows(BF16, AVX2) == head_max_rows(BF16, AVX512) == 4


F32_Q4 = ComputePlan(dtype=torch.float32, quantization="q4_1", own_decoder=True, quantized_max_rows=2)


@pytest.mark.parametrize(("config", "device", "compute", "backend", "expected"), [
    (EngineConfig(), CPU, F32_Q4, "kernel", torch.float16),  # float32 + quantised on the operator: 16 bits
    (EngineConfig(), CPU, F32_Q4, "sdpa", torch.float32),  # gathered K/V for SDPA: the compute dtype
    (EngineConfig(), CPU, ComputePlan(torch.float32, "fp16", True, 16), "kernel", torch.float16),
    (EngineConfig(), CPU, ComputePlan(torch.float32, None, False, 32), "kernel", torch.float32),  # the exact path
    (EngineConfig(), CPU, ComputePlan(torch.float32, None, True, 32), "kernel", torch.float32),  # unquantised
    (EngineConfig(), CPU, ComputePlan(torch.bfloat16, "int4", True, 8), "kernel", torch.bfloat16),
    (EngineConfig(), torch.device("cuda"), ComputePlan(torch.bfloat16, None, True, 8), "flex", torch.bfloat16),
    (EngineConfig(kv_cache_dtype="float32"), CPU, F32_Q4, "kernel", torch.float32),  # asked for
    (EngineConfig(kv_cache_dtype="bfloat16"), CPU, ComputePlan(torch.float32, None, False, 32), "sdpa",
     torch.bfloat16),
])
def test_the_kv_cache_is_16_bits_under_float32_with_quantised_weights(
        config: EngineConfig, device: torch.device, compute: ComputePlan, backend: str, expected: torch.dtype) -> None:
    assert pick_kv_dtype(config, device, compute, backend) == expected


def test_a_16_bit_cache_holds_twice_the_blocks_of_a_float32_one() -> None:
    shape = ModelShape(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=10, max_position_embeddings=10_000)
    config = EngineConfig(kv_cache_bytes=1 << 20)
    wide, narrow = (make_plan(config, shape, CPU, torch.float32, kv) for kv in (None, torch.float16))
    assert narrow.num_kv_blocks == 2 * wide.num_kv_blocks
    assert (wide.cache_dtype, narrow.cache_dtype, narrow.dtype) == (torch.float32, torch.float16, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


def test_a_float32_engine_with_int4_weights_keeps_a_float16_cache(tiny_llama: Path) -> None:
    """The engine's pick end to end, and what it serves: greedy tokens as with a float32 cache (random weights may
    tie near-equal logits differently; these prompts do not)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for kv_dtype in (None, "float32"):
        engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", quantization="int4", num_kv_blocks=32,
                                     kv_cache_dtype=kv_dtype))
        assert engine.runner.kv_cache.key_pool.dtype == (torch.float16 if kv_dtype is None else torch.float32)
        outputs[kv_dtype] = [o.token_ids for o in engine.generate([[5, 6, 7], [8, 9, 10, 11]], params)]
    assert outputs[None] == outputs["float32"]
    exact = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=32))
    assert exact.runner.kv_cache.key_pool.dtype == torch.float32  # transformers' exact forward keeps float32


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
