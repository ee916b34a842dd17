"""Paged attention plugged into transformers' ``AttentionInterface``.

One forward pass carries every scheduled request's new tokens flattened into a single ``[1, T]`` sequence with
explicit positions. In each layer the model hands us that sequence's Q/K/V; we write the new K/V into the block
pool at the slot mapping, then attend each query token to *its own request's* cached keys, causally.

Two groups, each vectorised:
- single-token queries (decodes, and 1-token prefill chunks): ``decode_attention.py``, in groups: sequences
  sharing cached prefix blocks attend to them once (cascade attention), the rest in length buckets;
- multi-token prefill chunks: one SDPA per chunk (a step has few, because of the token budget), causal, with an
  offset mask when earlier chunks of the same prompt are already cached.
With ``attention_backend="flex"`` both groups go through FlexAttention instead (``flex_attention.py``), which
reads the blocks in place: the metadata then carries a ``FlexStep`` and no decode groups or prefill chunks.

Per-step state reaches the function as a keyword argument (``paged_context``) that transformers passes through
the model's ``**kwargs``; so the registered function is stateless and one registration serves every engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from worker.engine.decode_attention import DecodeBatch, DecodeGroup, attend_decode, attend_group
from worker.engine.flex_attention import FlexStep, attend_flex, flex_rows
from worker.engine.kv_cache import KVCache

PAGED_ATTENTION_NAME = "tokenspool_paged"


@dataclass(frozen=True)
class PrefillChunk:
    """A multi-token chunk of one request: flat token range ``[token_start, token_end)`` of the step."""

    token_start: int
    token_end: int
    block_table: torch.Tensor  # [1, num_blocks] of this request
    context_len: int  # tokens cached after this step (start position + chunk length)
    mask: torch.Tensor | None  # [chunk_len, context_len] bool, None when the chunk starts at position 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Index tensors for one step, built once and reused by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    decode: DecodeBatch | None  # the single-token queries, None when the step has none
    prefills: tuple[PrefillChunk, ...]
    flex: FlexStep | None = None  # the flex backend's calls (then ``decode`` is None and ``prefills`` empty)


@dataclass(frozen=True)
class PagedContext:
    """What the attention function needs besides Q/K/V: where the cache is and how this step addresses it."""

    kv_cache: KVCache
    metadata: AttentionMetadata


def prepare_prefill_chunk(token_start: int, start_position: int, num_tokens: int, block_table: torch.Tensor
                          ) -> PrefillChunk:
    """Describe a multi-token chunk; query ``i`` (at position ``start_position + i``) sees keys ``<=`` it."""
    context_len = start_position + num_tokens
    mask = None
    if start_position > 0:
        query_pos = torch.arange(start_position, context_len, device=block_table.device)
        key_pos = torch.arange(context_len, device=block_table.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [chunk_len, context_len]
    return PrefillChunk(token_start, token_start + num_tokens, block_table, context_len, mask)


def _attend_prefill(layer: int, query: torch.Tensor, chunk: PrefillChunk, ctx: PagedContext,
                    scaling: float) -> torch.Tensor:
    """``query``: [T, H, D]; returns [chunk_len, H, D]."""
    q = query[chunk.token_start:chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    keys, values = ctx.kv_cache.gather(layer, chunk.block_table)  # [1, L, kvh, D]
    keys = keys[:, :chunk.context_len].transpose(1, 2).to(q.dtype)  # [1, kvh, ctx, D]
    values = values[:, :chunk.context_len].transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                         scale=scaling, enable_gqa=q.shape[1] != keys.shape[1])
    return out[0].transpose(0, 1)  # [n, H, D]


def whole_step_group(meta: AttentionMetadata, num_tokens: int) -> DecodeGroup | None:
    """The decode group holding all ``num_tokens`` of the step in order (a decode-only step of one group, e.g. one
    stream's decode), else None; a flex step has no decode batch, so never one."""
    if meta.decode is None or meta.prefills:
        return None
    return meta.decode.whole_step(num_tokens)


def paged_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: PagedContext,
                    scale: float) -> torch.Tensor:
    """Store this step's K/V of ``layer`` and attend. ``query``: [T, H, D]; ``key``/``value``: [T, kvh, D].

    Returns [T, H, D]. Shared by the transformers entry point below and the engine's own decoder (``decoder.py``).
    """
    meta = ctx.metadata
    ctx.kv_cache.write(layer, meta.slot_mapping, key, value)
    whole = whole_step_group(meta, query.shape[0])
    if whole is not None:  # one group holds the step: no output buffer to fill
        return attend_group(layer, query, whole, ctx.kv_cache, scale)
    flex = meta.flex
    if flex is not None and len(flex.calls) == 1 and flex.calls[0].whole_step:
        return flex_rows(layer, query, flex.calls[0], flex, ctx.kv_cache, scale).to(query.dtype)  # no scatter
    out = torch.empty_like(query)
    if flex is not None:
        attend_flex(layer, query, flex, ctx.kv_cache, scale, out)
    if meta.decode is not None:
        attend_decode(layer, query, meta.decode, ctx.kv_cache, scale, out)
    for chunk in meta.prefills:
        out[chunk.token_start:chunk.token_end] = _attend_prefill(layer, query, chunk, ctx, scale)
    return out


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, paged_context: PagedContext | None = None,
                            **kwargs: object) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry point. ``query``: [1, H, T, D]; ``key``/``value``: [1, kvh, T, D].

    Returns ``[1, T, H, D]`` as transformers' attention functions do.
    """
    if paged_context is None:
        raise RuntimeError(f"{PAGED_ATTENTION_NAME} attention needs paged_context=...; call it via the ModelRunner")
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # set by every transformers attention module
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          paged_context, scale)
    return out.unsqueeze(0), None  # [1, T, H, D]


def register_paged_attention() -> str:
    """Make the paged attention available to transformers models; returns the ``attn_implementation`` name.

    Called when a model runner is built, never at import. Idempotent: the function is stateless (all per-step
    state arrives in ``paged_context``), so every engine in the process can share the one registration.
    """
    AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention_forward)
    return PAGED_ATTENTION_NAME
