"""Engine configuration (what the operator asked for) and the plan derived from it (what we will do).

``EngineConfig`` is frozen and validated once. Values that depend on the model or the machine (device, dtype,
number of KV blocks, context length) are computed into a separate frozen ``EnginePlan`` and never written back,
so the config always reads as what was requested.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.engine.linear import QUANTIZED_COMPUTE_DTYPES, QUANTIZED_MAX_ROWS, dense_linear, keeps_half, prepack

log = logging.getLogger(__name__)

GIB = 1 << 30
CPU_DEFAULT_KV_BYTES = 1 * GIB  # CPU memory is shared with everything else: a modest fixed budget
CUDA_FREE_FRACTION = 0.9  # of the memory still free after the weights are loaded
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECULATIVE_METHODS = (None, "ngram", "draft")
QUANTIZATIONS = (None, "none", "auto", "int8", "int4", "fp16")
ATTENTION_BACKENDS = ("auto", "sdpa", "kernel", "flex")
FLEX_CPU_BLOCK_MULTIPLE = 16  # KV block sizes inductor's CPU flex kernel got right everywhere it was tried
CUDA_GRAPH_MODES = ("auto", "off", "on", "padded")
COMPILE_POINTWISE_MODES = ("auto", "off", "on")
CASCADE_MODES = ("auto", "off", "on")
ASYNC_SCHEDULING_MODES = ("auto", "off", "on")
# CPU flags (Linux /proc/cpuinfo names) of the units that make dense bf16 matmuls faster than float32 ones: AMX
# tiles always do. AVX512-BF16 without AMX depends on the CPU, so it is measured (``bf16_matmul_speedup``): on an
# AMD EPYC (Zen 4) SmolLM2 decode steps at 32 rows ran 2.3x faster in bf16, on a Xeon model 207 without AMX 7-13%
# slower (docs/performance.md). Without either, bf16 is emulated and slow.
FAST_BF16_CPU_FLAGS = frozenset({"amx_bf16"})
MEASURED_BF16_CPU_FLAGS = frozenset({"avx512_bf16"})
BF16_MIN_SPEEDUP = 1.5  # bf16 when a [32, 576] x [576, 1536] matmul (SmolLM2's shape) runs this much faster
# Rows up to which the weight-only kernels beat the dense matmul, by the dense kernel (a decode step's 120
# projections, weights streaming from memory, SmolLM2 shapes, 2 threads; benchmarks/projection_rows.py,
# docs/performance.md): prepacked bf16 8, on AMX (Xeon model 167: int4 11.1 against 11.8 ms at 8 rows, 15.9 against
# 11.8 at 10) and on AVX512-BF16 (EPYC: 12.2 vs 12.5 at 8, 20.3 vs 15.4 at 12); plain float32 32 (EPYC: int4 46 vs
# float32 78 ms at 32 rows; float32 dense only pays from prefill sizes).
QUANTIZED_MAX_ROWS_BF16, QUANTIZED_MAX_ROWS_FLOAT32 = 8, 32
# Beside float16 weights (fbgemm; float32 activations), which float32 layers keep under quantisation on x86: with
# AVX2 alone the int4 kernel beats them at 1-2 rows (a step's projections 11.5 against 13.6 ms at one row, 12.8
# against 14.2 at two) and loses from 4 (17.8 against 16.1), so 2; with AVX-512 it wins through 20 rows and ties
# at 24 (Xeon model 167: 22.2 against 26.3 ms at 16, 32.3 against 32.0 at 24), so 16.
QUANTIZED_MAX_ROWS_HALF_AVX2, QUANTIZED_MAX_ROWS_HALF_AVX512 = 2, 16
# The flags torch's AVX-512 kernels need (ATen's CPU capability "AVX512"); without them its int4 kernel is the
# AVX2 one, several times slower.
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# There, with AVX2, int4 layers take tokenspool's own operator (linear.py's "q4_1": GGUF's Q4_1 blocks, float32
# activations rounded to 16-bit integers per group of 32 for an integer dot product): a step's 120 projections 10.0
# against torch's 17.2 ms at one row, 12.1 against 19.4 at two, 20.1 against 29.7 at four (AMD EPYC Zen 3, AVX2
# only). With AVX-512 torch's kernel ran as fast at one row and 10-20% faster from 2 (against the operator's first
# form, float32 weights widened in registers; Zen 4), so it stays there under bf16 (a step at 1 / 4 / 8 / 32 rows:
# 9.8 / 13.9 / 22.6 / 41.5 ms against the operators' 9.1 / 16.4 / 25.6 / 41.4, Xeon model 167, AMX). Under float32
# (AVX-512 CPUs without fast bf16) the operators and their tiles win at every batch: 9.2 / 11.1 / 15.1 / 22.8 /
# 33.7 / 55.5 ms against torch's kernel beside float16 weights 10.3 / 11.7 / 14.9 / 25.8 / 43.0 / 80.5 at 1 / 2 /
# 4 / 8 / 16 / 32 rows (the same Xeon without its bf16 flags, alternating steps).
OWN_INT4_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
# Beside float16 weights the operator served up to 4 rows on AVX2 CPUs: against fbgemm's float16 matmul 10.0 / 20.8
# ms at one row, 20.1 / 25.4 at four, 32.1 / 29.1 at six (the same run). Float32 q4_1 layers now run more rows on
# ``q4_1_rows`` (8-bit activations, ``linear.tile_q4_1``) instead of float16 weights, which wins from 3 rows: a
# step's 120 projections 5.1-5.3 / 6.7-6.9 ms at one row, 6.3-6.8 / 7.2-7.4 at two, 8.0-8.9 / 7.6-8.3 at three,
# 11.8-13.3 / 9.4-11.1 at four (AMD EPYC Zen 3, two runs, alternating passes), so 2.
QUANTIZED_MAX_ROWS_Q4_1 = 2
# A GGUF Q8_0 LM head (SmolLM2's 49152 x 576) takes ``int8_linear`` (its codes widened to float32 weights, float32
# FMAs) for calls of up to ``linear.QUANTIZED_MAX_ROWS`` (4) rows, ``q8_0_rows``' tiles (16-bit activations,
# integer multiply-adds) beyond, where measured so (Zen 4: 0.9-1.0 ms at one row, at the memory's rate). Under
# float32 on a CPU with AVX2 and no AVX-512 the tiles win from one row: 2.21 against 2.85 ms at one, 2.75 / 3.44 at
# two, 4.60 / 5.46 at four (AMD EPYC Zen 1, the head streaming from memory, 2 threads), where widening a code to
# float32 costs more than an integer multiply-add; at the memory's rate both read the same codes.
HEAD_MAX_ROWS_FLOAT32_AVX2 = 0


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """What to serve and how much of it at once.

    ``model``: a built-in name (``smollm2``), a Hugging Face folder or a ``.gguf`` file.
    ``num_kv_blocks``: None sizes the KV pool from ``kv_cache_bytes`` (None: 1 GiB on CPU, 90% of free memory on
    CUDA), capped by what ``max_num_seqs`` full-length sequences could ever use.
    ``max_num_batched_tokens``: the token budget of one forward pass; longer prompts are prefilled in chunks.
    ``device``/``dtype``: None picks cuda if available, else cpu; bfloat16 on CUDA and on CPUs with fast bf16
    matmuls (AMX, or AVX512-BF16 where measured fast: ``fast_bf16_cpu``), float32 on other CPUs.
    ``dtype="float32"`` without quantisation (``"auto"`` included) runs transformers' own forward (token-for-token
    equal to its ``generate``); every other setting, a float32 the CPU picked included, runs the engine's fused
    decoder (``decoder.py``) where the architecture allows (``plan_compute``).
    ``enable_prefix_caching``: reuse the K/V of full blocks whose token prefix was computed before (on by default).
    ``cascade_attention``: decode queries attend to the block-table prefix they share (a system prompt found by
    prefix caching) once, in one matmul, instead of once per sequence (exact; docs/performance.md): ``"on"``,
    ``"off"`` or ``"auto"``: on where decode attention gathers K/V (the sdpa backend), off where the C++ kernel
    reads the blocks in place (a cascade group gathers what the kernel would not; ``pick_cascade``).
    ``num_threads``: torch intra-op threads, set (process-wide) when the engine is built; None leaves torch's
    setting alone (its default is the physical cores). Use at most the cores this process really has to itself:
    oversubscribed cores make torch's threads spin at barriers (docs/performance.md).
    ``quantization``: None or ``"none"`` (the model's weights in ``dtype``), ``"int8"`` or ``"int4"``: weight-only
    quantised Linear weights (int8 per output row; int4 in groups of 32 with an offset, GGUF Q4_1's layout)
    multiplied with bf16 activations for batches of a few rows, where a step reads weights; larger batches use the
    same weights de-quantised to ``dtype`` (``linear.py``; float16 in fbgemm's layout for a float32 layer on x86);
    CPU, float32 or bfloat16. ``"fp16"``: float32 activations with every weight stored as float16 (fbgemm, x86
    CPUs, float32 only). ``"auto"``: int4 where that loses nothing, i.e. on a CPU when the weights were de-quantised
    from 4-bit GGUF blocks (the built-in SmolLM2 is Q4_1) and float32 was not asked for, else none.
    ``speculative_method``: None, ``"ngram"`` (prompt lookup) or ``"draft"`` (``draft_model``, a model sharing the
    target's tokenizer); each decoding request proposes up to ``num_speculative_tokens`` tokens per step, but only
    while at most ``speculative_max_batch`` requests run (above that verification costs more than it saves; see
    docs/performance.md). ``ngram_min``/``ngram_max``: the suffix lengths prompt lookup tries, longest first.
    ``attention_backend``: ``"sdpa"`` (gathered K/V, SDPA and cascade groups: ``decode_attention.py``),
    ``"kernel"`` (the same, but plain decode queries through the C++ operator that reads the blocks in place:
    ``decode_kernel.py``; CPU only), ``"flex"`` (FlexAttention reading the blocks in place, compiled:
    ``flex_attention.py``) or ``"auto"``: flex on CUDA; on a CPU the kernel for the engine's own decoder (sdpa
    where it cannot be built, and for transformers' exact float32 forward, whose attention stays SDPA's), sdpa
    otherwise (on CPU flex compiles each new shape for ~10 s).
    ``kv_cache_dtype``: None picks (``pick_kv_dtype``): the compute dtype, or float16 under a float32 own decoder with
    quantised weights on a CPU's C++ decode attention; else one of ``DTYPES``.
    ``cuda_graphs``: decode-only steps replayed from a CUDA graph per batch-size bucket (``cuda_graphs.py``):
    ``"on"`` (CUDA with flex), ``"off"``, ``"padded"`` (the same static, padded buffers without the capture, on
    any device: the graph path's arithmetic, testable on CPU) or ``"auto"``: on with CUDA, the flex backend and
    the engine's own decoder, else off.
    ``compile_pointwise``: the own decoder's norms, RoPE and SiLU-and-multiply as inductor-compiled kernels
    (``pointwise.py``) where tokenspool's C++ operators do not run them: ``"on"``, ``"off"`` (torch ops) or
    ``"auto"``: on CUDA.
    ``async_scheduling``: schedule and launch the next decode step while the device still runs this one, its ids
    taken from this step's drawn tokens on the device, and read this step's tokens back (detokenise, check stops)
    behind it (``overlap.py``); requests with grammars, penalties, logprobs or speculation step one at a time.
    ``"on"`` (where decode steps run from the static buffers: ``cuda_graphs`` on or padded), ``"off"`` or
    ``"auto"``: on where CUDA graphs replay. On a CPU nothing overlaps (each step's work is the host's), so there it
    only delays every token's delivery by a step; ``"on"`` with ``cuda_graphs="padded"`` is for tests.
    """

    model: str = "smollm2"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    device: str | None = None
    dtype: str | None = None
    enable_prefix_caching: bool = True
    cascade_attention: str = "auto"
    speculative_method: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 8
    ngram_min: int = 1
    ngram_max: int = 4
    num_threads: int | None = None
    quantization: str | None = None
    attention_backend: str = "auto"
    cuda_graphs: str = "auto"
    kv_cache_dtype: str | None = None
    compile_pointwise: str = "auto"
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", "a model name or path", self.model)
        _check(1 <= self.block_size <= 1024, "block_size", "in [1, 1024]", self.block_size)
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "None or >= 1",
               self.num_kv_blocks)
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "None or >= 2",
               self.max_model_len)
        _check(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes", "None or > 0",
               self.kv_cache_bytes)
        _check(self.device is None or self.device.split(":")[0] in ("cpu", "cuda"), "device",
               "None, 'cpu' or 'cuda[:N]'", self.device)
        _check(self.dtype is None or self.dtype in DTYPES, "dtype", f"None or one of {sorted(DTYPES)}", self.dtype)
        _check(self.kv_cache_dtype is None or self.kv_cache_dtype in DTYPES, "kv_cache_dtype",
               f"None or one of {sorted(DTYPES)}", self.kv_cache_dtype)
        _check(self.speculative_method in SPECULATIVE_METHODS, "speculative_method", "None, 'ngram' or 'draft'",
               self.speculative_method)
        _check(self.speculative_method != "draft" or bool(self.draft_model), "draft_model",
               "a model name or path when speculative_method is 'draft'", self.draft_model)
        _check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens", "in [1, 16]",
               self.num_speculative_tokens)
        _check(self.speculative_max_batch >= 1, "speculative_max_batch", ">= 1", self.speculative_max_batch)
        _check(1 <= self.ngram_min <= self.ngram_max, "ngram_min", f"in [1, ngram_max={self.ngram_max}]",
               self.ngram_min)
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads", "None or >= 1", self.num_threads)
        _check(self.quantization in QUANTIZATIONS, "quantization", "None, 'none', 'auto', 'int8', 'int4' or 'fp16'",
               self.quantization)
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               "'auto', 'sdpa', 'kernel' or 'flex'", self.attention_backend)
        _check(self.cuda_graphs in CUDA_GRAPH_MODES, "cuda_graphs", "'auto', 'off', 'on' or 'padded'",
               self.cuda_graphs)
        _check(self.cuda_graphs not in ("on", "padded") or self.attention_backend in ("auto", "flex"), "cuda_graphs",
               "'auto' or 'off' unless attention_backend is 'flex' (graphs need flex's static shapes)",
               self.cuda_graphs)
        _check(self.compile_pointwise in COMPILE_POINTWISE_MODES, "compile_pointwise", "'auto', 'off' or 'on'",
               self.compile_pointwise)
        _check(self.cascade_attention in CASCADE_MODES, "cascade_attention", "'auto', 'off' or 'on'",
               self.cascade_attention)
        _check(self.async_scheduling in ASYNC_SCHEDULING_MODES, "async_scheduling", "'auto', 'off' or 'on'",
               self.async_scheduling)
        _check(self.async_scheduling != "on" or self.cuda_graphs in ("auto", "on", "padded"), "async_scheduling",
               "'auto' or 'off' when cuda_graphs is 'off' (it overlaps steps of the static decode path)",
               self.async_scheduling)


@dataclass(frozen=True)
class ModelShape:
    """The few numbers about a model that sizing the KV cache needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class ComputePlan:
    """How a forward pass computes: derived from the config, the CPU and the model's weights (``plan_compute``)."""

    dtype: torch.dtype  # activations and dense weights (and the KV cache, but for ``pick_kv_dtype``'s exception)
    quantization: str | None  # "int8"/"int4"/"q4_1": weight-only kernels for calls of a few rows (``linear.py``)
    own_decoder: bool  # the engine's fused decoder (``decoder.py``); False: transformers' own forward
    quantized_max_rows: int = QUANTIZED_MAX_ROWS_BF16  # calls of up to this many rows take the weight-only kernels
    head_max_rows: int = QUANTIZED_MAX_ROWS  # a q8_0 LM head's calls of up to this many rows take ``int8_linear``


@dataclass(frozen=True)
class EnginePlan:
    """Derived, machine- and model-dependent settings. ``max_model_len`` never exceeds the KV pool, so a request
    alone always fits and preemption can always make progress."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    kv_dtype: torch.dtype | None = None  # the KV cache's (``pick_kv_dtype``); None: ``dtype``

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds."""
        return self.kv_dtype or self.dtype


def pick_device(config: EngineConfig) -> torch.device:
    """The configured device, else cuda when present, else cpu."""
    if config.device is not None:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_attention_backend(config: EngineConfig, device: torch.device, own_decoder: bool) -> str:
    """``"flex"``, ``"kernel"`` or ``"sdpa"``: the configured one; ``"auto"`` is flex on CUDA, the kernel for the
    own decoder on a CPU, else sdpa. (Whether the kernel can be built is the model runner's to find out.)

    Flex on a CPU needs KV blocks of a multiple of ``FLEX_CPU_BLOCK_MULTIPLE`` tokens: with 8-token blocks
    inductor's CPU flex kernel (torch 2.13) attended wrongly on an AVX2 EPYC (greedy tokens off from the second
    step), while 16 and 32 matched the gathered path and 8 had matched on AVX-512 CPUs."""
    backend = config.attention_backend
    if backend == "auto":
        return "flex" if device.type == "cuda" else "kernel" if own_decoder else "sdpa"
    _check(backend != "kernel" or device.type == "cpu", "attention_backend", "'kernel' only on a CPU", backend)
    _check(backend != "flex" or device.type != "cpu" or config.block_size % FLEX_CPU_BLOCK_MULTIPLE == 0,
           "block_size", f"a multiple of {FLEX_CPU_BLOCK_MULTIPLE} for the flex attention backend on a CPU",
           config.block_size)
    return backend


def pick_cuda_graphs(config: EngineConfig, device: torch.device, backend: str, own_decoder: bool) -> str:
    """``"on"`` (capture and replay), ``"padded"`` (static buffers, no capture) or ``"off"``."""
    if config.cuda_graphs == "auto":
        return "on" if device.type == "cuda" and backend == "flex" and own_decoder else "off"
    _check(config.cuda_graphs != "on" or device.type == "cuda", "cuda_graphs", "'on' only on a CUDA device",
           config.cuda_graphs)
    return config.cuda_graphs


def pick_async_scheduling(config: EngineConfig, cuda_graphs: str) -> bool:
    """Whether decode steps overlap (``overlap.py``), given the resolved ``cuda_graphs`` mode: ``"auto"`` where
    graphs replay; ``"on"`` wherever the static decode path runs."""
    if config.async_scheduling == "auto":
        return cuda_graphs == "on"
    _check(config.async_scheduling != "on" or cuda_graphs != "off", "async_scheduling",
           "'on' only where decode steps run from the static buffers (cuda_graphs resolved 'on' or 'padded')",
           config.async_scheduling)
    return config.async_scheduling == "on"


def pick_cascade(config: EngineConfig, backend: str) -> bool:
    """Whether decode queries sharing prefix blocks form cascade groups. ``"auto"``: only where plain decode
    attention gathers K/V (sdpa). Beside the kernel, which reads blocks in place, a cascade group gathers its
    shared blocks and its members' own: SmolLM2's shared-prefix workload ran 0.66-0.75x as fast with cascade as
    without on the kernel, and 1.33-1.34x as fast on sdpa (EPYC Zen 4, docs/performance.md)."""
    if config.cascade_attention == "auto":
        return backend == "sdpa"
    return config.cascade_attention == "on"


def pick_compile_pointwise(config: EngineConfig, device: torch.device) -> bool:
    """Whether the own decoder compiles its pointwise steps (where the C++ operators do not run them)."""
    if config.compile_pointwise == "auto":
        return device.type == "cuda"
    return config.compile_pointwise == "on"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def bf16_matmul_speedup(rows: int = 32, reps: int = 20) -> float:
    """How many times faster a ``[rows, 576] x [576, 1536]`` matmul runs in bf16 than in float32 on this CPU, with
    the process's torch threads: the best of ``reps`` timings each, alternating (~0.1 s). Best of 3 was too few on
    a busy machine: on an EPYC Zen 4 beside a spinning and a bursty process it read 1.66-3.45 (best of 20:
    2.35-2.97), and an engine built while llama-server started once read under ``BF16_MIN_SPEEDUP`` and ran float32
    (docs/performance.md, twenty-second session)."""
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    pairs = {dtype: (torch.randn(rows, 576).to(dtype), prepack(torch.randn(1536, 576).to(dtype))) for dtype in best}
    for rep in range(reps + 1):
        for dtype, (x, w) in pairs.items():
            start = time.perf_counter()
            dense_linear(x, w)  # the kernel the engine's dense layers run
            if rep:  # the first round warms the kernels up
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


def fast_bf16_cpu(flags: frozenset[str], measure: Callable[[], float] = bf16_matmul_speedup) -> bool:
    """Whether dense bf16 matmuls beat float32 ones here: yes with AMX, measured with AVX512-BF16 alone, else no."""
    if FAST_BF16_CPU_FLAGS & flags:
        return True
    if not MEASURED_BF16_CPU_FLAGS & flags:
        return False
    speedup = measure()
    log.info("bf16 matmuls ran %.2fx float32's here (bf16 from %.1fx; a dtype setting pins it)", speedup,
             BF16_MIN_SPEEDUP)
    return speedup >= BF16_MIN_SPEEDUP


def pick_dtype(config: EngineConfig, device: torch.device, flags: frozenset[str] | None = None,
               measure: Callable[[], float] = bf16_matmul_speedup) -> torch.dtype:
    """The configured dtype; else bf16 on CUDA and on CPUs whose bf16 matmuls are fast (``fast_bf16_cpu``;
    ``flags``: default this CPU's), float32 on other CPUs (quantised layers still feed their kernels bf16,
    ``linear.py``)."""
    if config.dtype is not None:
        return DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if fast_bf16_cpu(cpu_flags() if flags is None else flags, measure) else torch.float32


def own_int4_kernel(flags: frozenset[str], kernels: bool, dtype: torch.dtype) -> bool:
    """Whether int4 layers computing in ``dtype`` take tokenspool's operators (``"q4_1"``) over torch's kernel on a
    CPU with ``flags``: where the operators are loaded (``kernels``) and the CPU has AVX2, under float32 always,
    under bf16 where torch's kernel lacks its AVX-512 set."""
    return kernels and flags >= OWN_INT4_CPU_FLAGS and (dtype == torch.float32 or not flags >= AVX512_CPU_FLAGS)


def quantized_max_rows(dtype: torch.dtype, flags: frozenset[str], half: bool, quantization: str | None = None
                       ) -> int:
    """Rows up to which weight-only kernels beat the dense ``dtype`` matmul on a CPU with ``flags``; ``half``: the
    dense weights of a float32 layer are float16 (fbgemm); ``quantization``: the layers' (``"q4_1"``: the own
    operator, whose float32 layers run more rows on their Q4_1 tiles instead)."""
    if dtype == torch.float32:
        if not half:
            return QUANTIZED_MAX_ROWS_FLOAT32
        if quantization == "q4_1":
            return QUANTIZED_MAX_ROWS_Q4_1
        return QUANTIZED_MAX_ROWS_HALF_AVX512 if flags >= AVX512_CPU_FLAGS else QUANTIZED_MAX_ROWS_HALF_AVX2
    return QUANTIZED_MAX_ROWS_BF16


def head_max_rows(dtype: torch.dtype, flags: frozenset[str]) -> int:
    """Rows up to which a q8_0 LM head takes ``int8_linear`` before its tiles (``linear.QUANTIZED_MAX_ROWS``, or
    ``HEAD_MAX_ROWS_FLOAT32_AVX2``)."""
    avx2_only = "avx2" in flags and not flags >= AVX512_CPU_FLAGS
    return HEAD_MAX_ROWS_FLOAT32_AVX2 if dtype == torch.float32 and avx2_only else QUANTIZED_MAX_ROWS


def plan_compute(config: EngineConfig, device: torch.device, dtype: torch.dtype, unsupported: str | None,
                 on_int4_grid: bool, flags: frozenset[str] | None = None,
                 kernels: Callable[[], bool] = lambda: False) -> ComputePlan:
    """Which forward runs with which weights, from the config, the picked ``dtype`` and two facts of the model:
    why the own decoder cannot run it (``unsupported``, None: it can) and whether its weights lie on a 4-bit
    grid per 32 columns (``on_int4_grid``: de-quantised from GGUF Q4_1 blocks).

    ``"auto"`` takes int4 on a CPU for weights on the grid (the model file's own 4-bit blocks, no extra loss) unless
    float32 was asked for: ``dtype="float32"`` with no quantisation is transformers' exact forward, kept as the
    reference. A float32 run the CPU picked (``dtype`` unset) is not that request and runs the own decoder.
    int4 runs as ``"q4_1"`` (tokenspool's operator) where ``own_int4_kernel`` says so (``kernels``: whether the C++
    operators are loaded, loading them; asked only for int4, so a plan that needs no operator builds none).
    """
    flags = cpu_flags() if flags is None else flags
    quantization = None if config.quantization == "none" else config.quantization
    if quantization == "auto":
        wanted = device.type == "cpu" and config.dtype != "float32" and unsupported is None and on_int4_grid
        quantization = "int4" if wanted and dtype in QUANTIZED_COMPUTE_DTYPES else None
    if quantization is not None and (device.type != "cpu" or dtype not in QUANTIZED_COMPUTE_DTYPES or unsupported):
        raise ValueError(f"EngineConfig.quantization {quantization!r} needs device cpu, dtype float32 or bfloat16 "
                         f"and a Llama-family model, got {device.type}, {dtype} and {unsupported or 'a supported'}")
    half = keeps_half(quantization, dtype, device)
    if quantization == "fp16" and not half:
        raise ValueError(f"EngineConfig.quantization 'fp16' needs dtype float32 on a CPU with fbgemm (x86), got "
                         f"{dtype}")
    if quantization == "int4" and own_int4_kernel(flags, kernels(), dtype):
        quantization = "q4_1"
    exact = config.dtype == "float32" and quantization is None
    return ComputePlan(dtype=dtype, quantization=quantization, own_decoder=unsupported is None and not exact,
                       quantized_max_rows=quantized_max_rows(dtype, flags, half, quantization),
                       head_max_rows=head_max_rows(dtype, flags))


def pick_kv_dtype(config: EngineConfig, device: torch.device, compute: ComputePlan, attention_backend: str
                  ) -> torch.dtype:
    """The KV cache's dtype: ``config.kv_cache_dtype``; else the compute dtype, but float16 under a float32 own
    decoder with quantised weights on a CPU whose decode attention is the C++ operator (which widens each row to
    float32 as it reads it). There, at many streams, attention reads more bytes than anything else but the weights
    and waits on memory: 32 sequences of 250 keys over 30 layers 24.3 ms from a float32 cache, 15.9 from a 16-bit one
    (Xeon, 2 threads); and the memory budget holds twice the tokens. Greedy choices are unchanged: teacher-forced
    SmolLM2 q4_1 decode agreed with the float32 model at all 134 positions with a float16 cache, perplexity 6.8988
    as with float32 (bf16: 6.9026). Never under transformers' exact float32 forward (no quantisation)."""
    if config.kv_cache_dtype is not None:
        return DTYPES[config.kv_cache_dtype]
    sixteen_bits = (device.type == "cpu" and compute.dtype == torch.float32 and compute.own_decoder
                    and compute.quantization is not None and attention_backend == "kernel")
    return torch.float16 if sixteen_bits else compute.dtype


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block of tokens."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * itemsize


def default_kv_budget(device: torch.device) -> int:
    """Bytes for the KV pool when the config gives none."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_FRACTION)
    return CPU_DEFAULT_KV_BYTES


def make_plan(config: EngineConfig, shape: ModelShape, device: torch.device, dtype: torch.dtype,
              kv_dtype: torch.dtype | None = None) -> EnginePlan:
    """Size the KV pool (of ``kv_dtype``, None: ``dtype``) and the context length for this model on this device."""
    kv_dtype = kv_dtype or dtype
    model_len = shape.max_position_embeddings
    if config.max_model_len is not None:
        _check(config.max_model_len <= model_len, "max_model_len", f"<= the model's {model_len} positions",
               config.max_model_len)
        model_len = config.max_model_len
    blocks_per_seq = math.ceil(model_len / config.block_size)
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        budget = config.kv_cache_bytes or default_kv_budget(device)
        num_blocks = budget // kv_bytes_per_block(shape, config.block_size, kv_dtype)
        num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise ValueError(f"EngineConfig.kv_cache_bytes is too small for one KV block of this model, got {budget}")
    model_len = min(model_len, num_blocks * config.block_size)
    if model_len < 2:
        raise ValueError(f"EngineConfig.num_kv_blocks must hold at least 2 tokens, got {num_blocks} blocks")
    return EnginePlan(device=device, dtype=dtype, block_size=config.block_size, num_kv_blocks=num_blocks,
                      max_model_len=model_len, kv_dtype=kv_dtype)
