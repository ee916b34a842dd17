"""A decode step's decoder layers in one C++ call (``csrc/decode_layers.cpp``), for the steps it serves.

With one request (or a few) a CPU decode step is dispatch-bound: ``Decoder._layer`` makes ~15 calls a layer from
Python, 30 layers a step (SmolLM2), and between two kernels the second thread waits for the first to reach the
next. ``tokenspool::decode_layers`` runs the same loop in C++: the same operators and kernels in the same order,
so its result is the Python loop's bit for bit. It serves a step when
- every token is a single-token decode, attended in place by ``paged_decode_attention`` as the step's one group
  (``attention.whole_step_group`` with ``context_lens``: the ``"kernel"`` backend, no prefill chunk, no cascade
  group);
- there are at most ``max_rows`` of them, so every projection runs on its weight-only kernel (``FORMATS``), or
  every projection is a float32 q4_1 one with its tiles (``linear.tile_q4_1``), whose calls of more rows the
  operator sends to ``q4_1_rows`` as ``PackedLinear`` does (``many_rows``): a CPU without fast bf16 then runs its
  decode batches in one call too, not ~15 Python calls a layer;
every other step keeps the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.attention import PagedContext, whole_step_group
from worker.engine.linear import PackedLinear

FORMATS = ("int4", "int8", "q4_1")  # linear.py's weight-only formats that the operator calls


@dataclass(frozen=True)
class LayerStack:
    """Every layer's weights and norms as the operator takes them, gathered once."""

    weights: list[torch.Tensor]  # per layer qkv, o, gate_up, down: (codes, scales, mins, bias, *tiles); empty: none
    norms: list[torch.Tensor]  # per layer (input, post-attention), float32
    quantization: str
    max_rows: int
    many_rows: bool  # every projection has its tiles: any number of rows
    num_heads: int
    scale: float
    eps: float


def stack_layers(projections: Sequence[Sequence[PackedLinear]], norms: Sequence[torch.Tensor], num_heads: int,
                 scale: float, eps: float) -> LayerStack | None:
    """The operator's operands: ``projections`` per layer (qkv, o, gate_up, down), ``norms`` two a layer. None
    where their format is not one the operator calls (unquantised, float16, or mixed)."""
    layout = {(p.quantization, p.max_rows) for layer in projections for p in layer}
    if len(layout) != 1:
        return None
    ((quantization, max_rows),) = layout
    if quantization not in FORMATS:
        return None
    none = torch.empty(0, device=norms[0].device)
    weights = [none if t is None else t for layer in projections for p in layer
               for t in (p.codes, p.scales, p.mins, p.bias, *(p.tiles or (None,) * 3))]
    many_rows = all(p.tiles is not None for layer in projections for p in layer)
    return LayerStack(weights, list(norms), quantization, max_rows, many_rows, num_heads, scale, eps)


def run_stack(stack: LayerStack, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedContext
              ) -> torch.Tensor | None:
    """The layers' output ``[T, hidden]`` for this step (its K/V written), or None when the operator does not serve
    it (the caller runs the Python loop). ``cos``/``sin``: ``Decoder.rope_tables``."""
    num_tokens = hidden.shape[0]
    rows_served = num_tokens <= stack.max_rows or stack.many_rows
    group = whole_step_group(ctx.metadata, num_tokens) if rows_served else None
    if group is None or group.context_lens is None:
        return None
    kv_cache = ctx.kv_cache
    out: torch.Tensor = torch.ops.tokenspool.decode_layers(
        hidden, cos, sin, stack.weights, stack.norms, kv_cache.key_pool, kv_cache.value_pool, ctx.metadata.slot_mapping,
        group.block_tables, group.context_lens, stack.quantization, stack.max_rows, stack.num_heads, stack.scale,
        stack.eps)
    return out
