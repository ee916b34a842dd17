"""One stream's decode step as one compiled graph (CPU, the engine's own decoder).

With one request a CPU decode step is 11-12 ms on the AMX Xeon, of which ~3.5 ms are ~1,400 small ops and the
Python between them (norms, RoPE, residual adds, views; docs/performance.md). Compiled by inductor, those become a
few fused C++ loops; the matmuls and SDPA stay the kernels eager calls. What keeps a paged step from compiling
is its attention: per-step Python metadata, K/V written into the pool, key counts that change every step. So a
step of exactly one single-token request (``is_lone_decode``) runs ``Decoder.final_hidden`` compiled once with
static shapes, its attention being one operator per layer (``tokenspool::lone_decode_attention``) that inductor
calls as an opaque kernel: it writes the token's K/V into the pools and attends over the request's blocks (views
when their ids are consecutive, else a gather), with the key count a tensor, so the graph never recompiles. The
LM head stays outside (inductor would turn the prepacked oneDNN weight into a plain ``mm`` and fail). Every other
step runs eager.

The operator is registered with torch once per process (``register_lone_decode_attention``, idempotent, like the
paged attention's registration with transformers); it is stateless, so every engine shares it. bf16 graphs keep
eager's roundings (``emulate_precision_casts``), so the compiled step's logits equal eager's bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.engine.decoder import Decoder
from worker.engine.kv_cache import KVCache, gather_blocks, num_blocks_needed, prepare_slot_mapping
from worker.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

OPERATOR = "tokenspool::lone_decode_attention"
SCHEMA = ("(Tensor query, Tensor key, Tensor value, Tensor(a!) key_pool, Tensor(b!) value_pool, int layer, "
          "Tensor slot, Tensor block_ids, Tensor num_keys, float scale) -> Tensor")
# inductor options: nn-module guards skipped (the decoder's ~300 weight tensors never change; checking them cost
# ~0.4 ms a call), and bf16 arithmetic rounded where eager rounds
COMPILE_OPTIONS = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                   "emulate_precision_casts": True}


@dataclass(frozen=True)
class LoneContext:
    """What the compiled step's attention needs beside Q/K/V: the pools and where this request's keys are."""

    key_pool: torch.Tensor  # [num_layers, num_blocks, block_size, kvh, D], written in place
    value_pool: torch.Tensor
    slot: torch.Tensor  # [1] flat slot of the new token
    block_ids: torch.Tensor  # [max_blocks]: the request's block table, right-padded (one shape: no recompiles)
    num_keys: torch.Tensor  # 0-d: keys to attend to, the new one included


def is_lone_decode(chunks: Sequence[ScheduledChunk]) -> bool:
    """Whether a step is one request decoding one token (no speculative tokens): what the compiled step runs."""
    return len(chunks) == 1 and len(chunks[0].token_ids) == 1 and chunks[0].needs_logits


def padded_table(block_ids: tuple[int, ...], width: int) -> list[int]:
    """A block table right-padded with block 0 to ``width`` entries, so the compiled graph sees one shape."""
    return [*block_ids, *[0] * (width - len(block_ids))]


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
               value_pool: torch.Tensor, layer: int, slot: torch.Tensor, block_ids: torch.Tensor,
               num_keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The operator's kernel: eager's lone-request path (``KVCache.write``, then ``attend_group`` on views of
    consecutive blocks or on the gathered ones). ``query``: [1, H, D]; ``key``/``value``: [1, kvh, D]."""
    _, block_size, num_kv_heads, head_dim = key_pool.shape[1:]
    keys, values = key_pool[layer], value_pool[layer]  # [num_blocks, block_size, kvh, D]
    keys.view(-1, num_kv_heads, head_dim).index_copy_(0, slot, key.to(keys.dtype))
    values.view(-1, num_kv_heads, head_dim).index_copy_(0, slot, value.to(values.dtype))
    count = int(num_keys)
    ids = block_ids[:num_blocks_needed(count, block_size)].tolist()  # the table is padded to a fixed width
    block_ids = block_ids[:len(ids)]
    if ids == list(range(ids[0], ids[0] + len(ids))):
        keys, values = keys[ids[0]:ids[0] + len(ids)], values[ids[0]:ids[0] + len(ids)]
    else:
        keys, values = gather_blocks(keys, block_ids), gather_blocks(values, block_ids)
    keys = keys.view(-1, num_kv_heads, head_dim)[:count].transpose(0, 1)[None].to(query.dtype)  # [1, kvh, n, D]
    values = values.view(-1, num_kv_heads, head_dim)[:count].transpose(0, 1)[None].to(query.dtype)
    num_heads = query.shape[1]
    q = query.reshape(1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # GQA: a KV head's queries together
    out = F.scaled_dot_product_attention(q, keys, values, scale=scale)
    return out.reshape(1, num_heads, head_dim)


def register_lone_decode_attention() -> None:
    """Define ``tokenspool::lone_decode_attention`` for CPU tensors (and its shape function for tracing), once."""
    namespace, name = OPERATOR.split("::")
    if hasattr(getattr(torch.ops, namespace), name):
        return
    torch.library.define(OPERATOR, SCHEMA)
    torch.library.impl(OPERATOR, "CPU", _attention)
    torch.library.register_fake(OPERATOR, lambda query, *args: torch.empty_like(query))


def lone_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: LoneContext,
                   scale: float) -> torch.Tensor:
    """``Decoder``'s attend function for the compiled step: one operator call per layer."""
    op = torch.ops.tokenspool.lone_decode_attention
    return op(query, key, value, ctx.key_pool, ctx.value_pool, layer, ctx.slot, ctx.block_ids,  # type: ignore[no-any-return]
              ctx.num_keys, scale)


class LoneDecode:
    """The compiled one-request decode step of a decoder over a KV cache. Compiling takes ~15 s on 2 cores (a few
    seconds from inductor's on-disk cache), so it happens in ``warm_up`` when the engine is built, not in the first
    request's step."""

    def __init__(self, decoder: Decoder, kv_cache: KVCache, max_model_len: int) -> None:
        register_lone_decode_attention()
        self.decoder, self.kv_cache = decoder, kv_cache
        self.max_blocks = num_blocks_needed(max_model_len, kv_cache.block_size)  # the block table's fixed width
        self.body = torch.compile(self._body, dynamic=False, fullgraph=True, options=COMPILE_OPTIONS)

    def _body(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: LoneContext) -> torch.Tensor:
        logits_index = torch.zeros(1, dtype=torch.long, device=input_ids.device)
        return self.decoder.final_hidden(input_ids, position_ids, ctx, logits_index, attend=lone_attention)

    def run(self, chunk: ScheduledChunk) -> torch.Tensor:
        """Logits [1, V] in the compute dtype for a lone decode chunk (``is_lone_decode``)."""
        device, block_size = self.kv_cache.key_pool.device, self.kv_cache.block_size
        position = chunk.start_position
        slot = prepare_slot_mapping(chunk.block_ids, position, 1, block_size)
        ctx = LoneContext(self.kv_cache.key_pool, self.kv_cache.value_pool,
                          torch.tensor(slot, dtype=torch.long, device=device),
                          torch.tensor(padded_table(chunk.block_ids, self.max_blocks), dtype=torch.long,
                                       device=device),
                          torch.tensor(position + 1, dtype=torch.long, device=device))
        input_ids = torch.tensor(chunk.token_ids, dtype=torch.long, device=device)
        position_ids = torch.tensor([position], dtype=torch.long, device=device)
        return self.decoder.lm_head(self.body(input_ids, position_ids, ctx))  # type: ignore[no-any-return]

    def warm_up(self) -> None:
        """Compile now: one step of a request at position 0 on block 0, whose slot 0 it writes (no request holds a
        block yet, and every block is written before it is read)."""
        with torch.inference_mode():  # as steps run (``ModelRunner.execute``): grad mode is part of the guards
            self.run(ScheduledChunk("warm-up", (0,), 0, (0,), needs_logits=True))
