"""Loads the model and runs one scheduled step through it.

All scheduled chunks are flattened into one ``[1, T]`` sequence with explicit positions; paged attention
(``attention.py``) keeps each request's tokens attending only to their own request. Only positions whose request
needs a next token are projected to logits (``logits_to_keep`` with explicit indices), which saves the
``[T, vocab]`` matmul for every prefill token but the last. The attention metadata is built for the backend the
config picks (gathered SDPA, or FlexAttention in place); decode-only steps may instead run from a bucket's
static buffers, replayed as a CUDA graph (``cuda_graphs.py``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from worker.engine.attention import (
    AttentionMetadata,
    PagedContext,
    prepare_prefill_chunk,
    register_paged_attention,
)
from worker.engine.config import (
    ComputePlan,
    EngineConfig,
    EnginePlan,
    ModelShape,
    make_plan,
    pick_async_scheduling,
    pick_attention_backend,
    pick_cascade,
    pick_compile_pointwise,
    pick_cuda_graphs,
    pick_device,
    pick_dtype,
    pick_kv_dtype,
    plan_compute,
)
from worker.engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, FedTokens, pick_bucket
from worker.engine.decode_attention import prepare_decode_batch
from worker.engine.decode_kernel import load_decode_kernel
from worker.engine.decoder import Decoder, unsupported_reason
from worker.engine.flex_attention import (
    FlexStep,
    kernel_options,
    make_flex_fn,
    prepare_flex_decode,
    prepare_flex_prefill,
)
from worker.engine.host_memory import keep_freed_memory_for_reuse
from worker.engine.kv_cache import KVCache, prepare_slot_mapping
from worker.engine.linear import lies_on_int4_grid
from worker.engine.scheduler import ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)


def model_shape(config: PretrainedConfig) -> ModelShape:
    """Layer/head geometry from a transformers config (Llama, Qwen2 and GPT-2 spellings)."""
    text = config.get_text_config()
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return ModelShape(
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or text.n_positions,
    )


def load_model(config: EngineConfig, folder: Path, device: torch.device, dtype: torch.dtype
               ) -> tuple[torch.nn.Module, Decoder | None, ComputePlan]:
    """The model to run, the engine's own ``Decoder`` when that is what runs (else None: transformers' forward),
    and the plan that chose between them (``config.plan_compute``)."""
    attn_name = register_paged_attention()
    # The decoder quantises from (and de-quantises back to) float32 weights, so it loads them in float32.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn_name)
    model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() via a decorator
    reason = unsupported_reason(model)
    on_grid = config.quantization == "auto" and reason is None and weights_on_int4_grid(model)
    kernels = functools.cache(lambda: operators_loaded(device))  # built (or found) once, where a plan needs them
    compute = plan_compute(config, device, dtype, reason, on_grid, kernels=kernels)
    if not compute.own_decoder:
        return model.to(dtype), None, compute
    decoder = Decoder(model, dtype, compute.quantization, compute.quantized_max_rows, kernels=kernels(),
                      compiled=pick_compile_pointwise(config, device), head_max_rows=compute.head_max_rows)
    return decoder, decoder, compute


def operators_loaded(device: torch.device) -> bool:
    """Whether tokenspool's C++ operators run here: on a CPU, once built and loaded; where they cannot be built the
    decoder runs torch's ops (a quantised LM head keeps torch's formats), with a warning."""
    if device.type != "cpu":
        return False
    problem = load_decode_kernel()
    if problem is not None:
        log.warning("the C++ operators could not be built (%s): the decoder runs torch's ops", problem)
    return problem is None


def settle_kernel(config: EngineConfig, backend: str) -> str:
    """``backend``, once the C++ decode kernel it may name is loaded (built the first time); a picked kernel that
    cannot be built falls back to ``"sdpa"`` with a warning, an asked-for one is an error."""
    if backend != "kernel":
        return backend
    problem = load_decode_kernel()
    if problem is None:
        return backend
    if config.attention_backend == "kernel":
        raise RuntimeError(f"attention_backend='kernel': the C++ decode kernel could not be built ({problem})")
    log.warning("the C++ decode attention kernel could not be built (%s): decode attention gathers K/V", problem)
    return "sdpa"


def weights_on_int4_grid(model: torch.nn.Module) -> bool:
    """Whether the first layer's weights were de-quantised from 4-bit GGUF blocks (Llama family only)."""
    first = model.model.layers[0]  # type: ignore[union-attr, index]  # a Llama-family model (checked by caller)
    return all(lies_on_int4_grid(w.weight) for w in (first.self_attn.q_proj, first.mlp.down_proj))


class ModelRunner:
    """The model, its KV cache and the tensor plumbing of one forward pass."""

    def __init__(self, config: EngineConfig, folder: Path) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: torch has no per-model thread pool
        device = pick_device(config)
        dtype = pick_dtype(config, device)
        if device.type == "cpu":
            keep_freed_memory_for_reuse()  # process-wide, like the thread count: step temporaries stay mapped
        self.model, self.decoder, self.compute = load_model(config, folder, device, dtype)
        self.shape = model_shape(self.model.config)
        self.attention_backend = settle_kernel(config, pick_attention_backend(config, device,
                                                                              self.compute.own_decoder))
        kv_dtype = pick_kv_dtype(config, device, self.compute, self.attention_backend)
        self.plan: EnginePlan = make_plan(config, self.shape, device, dtype, kv_dtype)
        self.cuda_graphs = pick_cuda_graphs(config, device, self.attention_backend, self.compute.own_decoder)
        self.kv_cache = KVCache(self.shape, self.plan, scratch_block=self.cuda_graphs != "off",
                                fused_write=self.decoder is not None and self.decoder.fused)
        self.cascade_attention = pick_cascade(config, self.attention_backend)
        self.flex: FlexStep | None = None  # the flex backend's kernel, with no calls: each step adds its own
        if self.attention_backend == "flex":
            self.flex = FlexStep((), make_flex_fn(compile_kernel=True), kernel_options(device, self.plan.block_size))
        self.graphs: DecodeGraphs | None = None
        if self.flex is not None and self.cuda_graphs != "off":
            self.graphs = DecodeGraphs(self.forward, self.kv_cache, self.flex.attend, self.flex.options,
                                       config.max_num_seqs, capture=self.cuda_graphs == "on", device=device)
        self.async_scheduling = pick_async_scheduling(config, self.cuda_graphs if self.graphs is not None else "off")
        log.info("model loaded: folder=%s device=%s dtype=%s quantization=%s forward=%s attention=%s "
                 "cuda_graphs=%s async_scheduling=%s kv_blocks=%d kv_dtype=%s block_size=%d max_model_len=%d",
                 folder, device, dtype, self.compute.quantization,
                 f"decoder ({self.decoder.ops.kind} pointwise)" if self.decoder else "transformers",
                 self.attention_backend, self.cuda_graphs, self.async_scheduling, self.plan.num_kv_blocks,
                 self.plan.cache_dtype, self.plan.block_size, self.plan.max_model_len)

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, fed: FedTokens | None = None) -> torch.Tensor:
        """Run the step; returns float32 logits ``[num_chunks_needing_logits, vocab]`` in chunk order. ``fed``: ids
        the previous step drew on the device (a decode step run from the static buffers, ``overlap.py``)."""
        self.kv_cache.copy_blocks(output.block_copies)  # copy-on-write, before this step writes into the copies
        if self.graphs is not None and self.graphs.can_run(output.chunks):
            return self.graphs.run(output.chunks, fed).float()  # [num_sampled, V]
        assert fed is None, "only the static decode path takes ids from the device"
        input_ids, position_ids, metadata, logits_indices = self.prepare_inputs(output.chunks)
        context = PagedContext(self.kv_cache, metadata)
        return self.forward(input_ids[0], position_ids[0], context, logits_indices).float()  # [num_sampled, V]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, context: PagedContext,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``position_ids``: [T]; logits [len(logits_indices), V] in the compute dtype."""
        if self.decoder is not None:
            return self.decoder(input_ids, position_ids, context, logits_indices)  # type: ignore[no-any-return]
        result = self.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                            logits_to_keep=logits_indices, paged_context=context)
        logits: torch.Tensor = result.logits[0]
        return logits

    def prepare_inputs(self, chunks: Sequence[ScheduledChunk]
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten chunks into ``input_ids``/``position_ids`` [1, T], attention metadata and logits indices [B]."""
        device, block_size = self.device, self.plan.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        single_idx: list[int] = []
        single_tables: list[tuple[int, ...]] = []
        single_lens: list[int] = []
        prefills = []
        for chunk in chunks:
            start, num = chunk.start_position, len(chunk.token_ids)
            offset = len(token_ids)
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, start + num))
            slots.extend(prepare_slot_mapping(chunk.block_ids, start, num, block_size))
            if chunk.needs_logits:  # the last known token and every speculative one after it
                logits_indices.extend(range(offset + num - 1 - chunk.num_spec_tokens, offset + num))
            if num == 1:
                single_idx.append(offset)
                single_tables.append(chunk.block_ids)
                single_lens.append(start + 1)
            elif self.flex is None:
                table = torch.tensor([chunk.block_ids], dtype=torch.long, device=device)
                prefills.append(prepare_prefill_chunk(offset, start, num, table))
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        if self.flex is not None:
            metadata = AttentionMetadata(slot_mapping, None, (), self._prepare_flex(chunks, single_idx, single_tables,
                                                                                   single_lens))
        else:
            decode = None
            if single_idx:
                decode = prepare_decode_batch(single_idx, single_tables, single_lens, block_size, device,
                                              share_prefix=self.cascade_attention, kv_cache=self.kv_cache,
                                              in_place=self.attention_backend == "kernel")
            metadata = AttentionMetadata(slot_mapping, decode, tuple(prefills))
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)
        return input_ids, position_ids, metadata, torch.tensor(logits_indices, dtype=torch.long, device=device)

    def _prepare_flex(self, chunks: Sequence[ScheduledChunk], single_idx: list[int],
                      single_tables: list[tuple[int, ...]], single_lens: list[int]) -> FlexStep:
        """The flex calls of a step: its single-token queries in one call, padded to a batch bucket (bounding the
        shapes the kernel compiles for), then one call per multi-token chunk."""
        assert self.flex is not None
        calls = []
        if single_idx:
            batch = pick_bucket(len(single_idx), BATCH_BUCKETS) or len(single_idx)
            calls.append(prepare_flex_decode(single_idx, single_tables, single_lens, batch, self.kv_cache,
                                             self.device))
        offset = 0
        for chunk in chunks:
            if len(chunk.token_ids) > 1:
                calls.append(prepare_flex_prefill(offset, chunk.start_position, len(chunk.token_ids), chunk.block_ids,
                                                  self.kv_cache, self.device))
            offset += len(chunk.token_ids)
        return FlexStep(tuple(calls), self.flex.attend, self.flex.options)
