"""The engine's own forward pass for Llama-family models: fewer, larger ops per step.

With one request a decode step is dispatch-bound: transformers' Llama forward costs ~1,600 small aten ops per
step (separate q/k/v and gate/up projections, RoPE and masks rebuilt per layer, generic kwargs plumbing). This
module runs the same mathematics on the weights of a loaded transformers model with
- fused projections: one ``[q; k; v]`` matmul and one ``[gate; up]`` matmul per layer (``PackedLinear``, optionally
  with weight-only int8/int4 weights for small batches);
- RoPE's cos/sin built once per step (by the model's own rotary module, so every RoPE scaling it knows works)
  and applied to q and k together, with ``rotate_half`` as one ``roll`` against a sign-folded sin;
- paged attention called directly (``attention.paged_attention``), no ``[1, T]`` batch dimension;
- the final norm and LM head only on the rows that need logits.
Its results equal transformers' in the same dtype up to float rounding (tests/engine/test_decoder.py). The
float32 unquantised engine keeps transformers' own forward (``ModelRunner``): that path is token-for-token
identical to ``generate`` and stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from worker.engine.attention import PagedContext, paged_attention
from worker.engine.decode_layers import LayerStack, run_stack, stack_layers
from worker.engine.linear import QUANTIZED_MAX_ROWS, PackedLinear, keeps_half, prepacks
from worker.engine.pointwise import Pointwise, make_pointwise

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class DecoderShape:
    """Head geometry of the decoder."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot run on ``Decoder`` (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (supported: {SUPPORTED_MODEL_TYPES})"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "an MLP other than SiLU-gated without bias"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    return None


class DecoderLayer(nn.Module):
    """One pre-norm transformer block with fused projections."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype, quantization: str | None, max_rows: int) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [p.bias for p in projections]
        bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
        self.qkv = PackedLinear(torch.cat([p.weight.detach() for p in projections]), bias, dtype, quantization,
                                max_rows)
        self.o = PackedLinear(attn.o_proj.weight, attn.o_proj.bias, dtype, quantization, max_rows)
        self.gate_up = PackedLinear(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]), None,
                                    dtype, quantization, max_rows)
        self.down = PackedLinear(mlp.down_proj.weight, None, dtype, quantization, max_rows)
        # Norm weights stay float32: the scale is applied before rounding to the compute dtype (one op less than
        # transformers' round-then-scale, and at most one rounding apart from it).
        self.input_norm = layer.input_layernorm.weight.detach().float()
        self.post_attention_norm = layer.post_attention_layernorm.weight.detach().float()
        self.scale = float(attn.scaling)
        # The projections' forwards, bound once: a submodule read through nn.Module.__getattr__ and called through
        # its __call__ (hooks checked) costs a few us of Python each, 120 times a step.
        self.projections = (self.qkv.forward, self.o.forward, self.gate_up.forward, self.down.forward)


def head_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device, kernels: bool = False
                      ) -> str | None:
    """The LM head's weights under the layers' ``quantization``: never int4 (GGUF files keep the head at 8 bits,
    SmolLM2's is Q8_0, and int4 there costs far more quality than anywhere else in the model). ``kernels``:
    tokenspool's C++ operators are loaded (``decode_kernel.load_decode_kernel``).

    - with the operators, q8_0 (GGUF's own head format, so a Q8_0 head comes back exactly) through
      ``tokenspool::int8_linear`` up to ``head_max_rows`` rows (``config.head_max_rows``: 4, none under float32 on
      AVX2-only CPUs), the dense head beyond (under float32 ``q8_0_rows``' tiles): SmolLM2's head at one row 0.9-1.0
      ms against 1.96-2.6 for prepacked bf16 and 1.7-1.9 for float16 (fbgemm); ahead through 4 rows (AMD EPYC
      Zen 4).
    - else bf16 on a CPU: prepacked bf16 alone; at one row it ran 2.1 ms against torch's int8 kernel's 2.4 (SmolLM2's
      49152 x 576, EPYC) and agreed with the float32 head's top token more often (97.3% vs 96.0% of 2,048 positions).
    - float32 with fbgemm: float16 weights, float32 activations (2.7 ms against the int8 kernel's 3.9 at one row,
      22 against 47 for float32 at 32 rows, AVX2 EPYC; docs/performance.md).
    - else int8, with the default row limit (4): the int8 kernel's time grows with the rows (2.4 ms at one, 6.1
      at 8, 24 at 32) faster than the dense head's, so the projections' float32 limit (32) would not do.
    """
    if quantization is None:
        return None
    if kernels and device.type == "cpu":
        return "q8_0"
    if prepacks(dtype, device):
        return None
    return "fp16" if keeps_half(quantization, dtype, device) else "int8"


class Decoder(nn.Module):
    """A Llama/Qwen2 causal LM over the paged KV cache. ``config``/``generation_config``: the source model's;
    ``kernels``: tokenspool's C++ operators are loaded (on a CPU): the LM head takes q8_0 (``head_quantization``)
    under quantisation, and each layer's norms, RoPE and SiLU-and-multiply run as one operator each
    (``csrc/fused.cpp``); else ``compiled``: as one inductor kernel each (CUDA), else as torch ops
    (``pointwise.py``)."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, quantization: str | None = None,
                 max_rows: int = QUANTIZED_MAX_ROWS, kernels: bool = False, compiled: bool = False,
                 head_max_rows: int = QUANTIZED_MAX_ROWS) -> None:
        super().__init__()
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the engine's decoder does not support {reason}")
        config = model.config
        self.config, self.generation_config = config, getattr(model, "generation_config", None)
        self.dtype = dtype
        inner = model.model
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.embed = inner.embed_tokens.weight.detach().to(dtype)  # [V, hidden]
        self.shape = DecoderShape(config.num_attention_heads, config.num_key_value_heads, head_dim,
                                  config.intermediate_size)
        self.rotary = inner.rotary_emb
        self.layers = nn.ModuleList(DecoderLayer(layer, dtype, quantization, max_rows) for layer in inner.layers)
        self.final_norm = inner.norm.weight.detach().float()
        self.eps = float(config.rms_norm_eps)
        operators = kernels and self.embed.device.type == "cpu"
        kind = "operators" if operators else "compiled" if compiled else "eager"
        self.ops: Pointwise = make_pointwise(kind, self.eps, self.embed.device)
        head = head_quantization(quantization, dtype, self.embed.device, kernels)
        self.lm_head = PackedLinear(model.lm_head.weight, None, dtype, head,
                                    max_rows=head_max_rows if head == "q8_0" else QUANTIZED_MAX_ROWS)
        # On the operators, steps of few decodes run every layer in one C++ call (``decode_layers.py``).
        self.stack: LayerStack | None = None
        if operators:
            self.stack = stack_layers([(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in self.layers],
                                      [w for layer in self.layers for w in (layer.input_norm,
                                                                            layer.post_attention_norm)],
                                      self.shape.num_heads, self.layers[0].scale, self.eps)

    @property
    def fused(self) -> bool:
        """Whether the small steps run on tokenspool's C++ operators (then the K/V write does too)."""
        return self.ops.kind == "operators"

    def rope_tables(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, D]`` for ``x * cos + roll(x, D/2) * sin`` (== rotate_half form)."""
        cos, sin = self.rotary(self.embed[:1], position_ids[None])  # [1, T, D] each, in the compute dtype
        half = self.shape.head_dim // 2
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos[0, :, None, :], signed_sin[0, :, None, :]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: PagedContext,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``position_ids``: [T]; returns logits [len(logits_indices), V] in the compute dtype."""
        cos, sin = self.rope_tables(position_ids)
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        stacked = None if self.stack is None else run_stack(self.stack, hidden, cos, sin, ctx)
        if stacked is not None:
            hidden = stacked
        else:
            for index, layer in enumerate(self.layers):
                hidden = self._layer(index, layer, hidden, cos, sin, ctx)
        return self.lm_head(self.ops.rms_norm(hidden[logits_indices], self.final_norm))  # [B, V]

    def _layer(self, index: int, layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ctx: PagedContext) -> torch.Tensor:
        """One block; ``hidden``: [T, hidden] -> [T, hidden]."""
        shape, num_tokens = self.shape, hidden.shape[0]
        num_qk_heads = shape.num_heads + shape.num_kv_heads
        qkv_proj, o_proj, gate_up_proj, down_proj = layer.projections
        ops = self.ops
        qkv = qkv_proj(ops.rms_norm(hidden, layer.input_norm))  # [T, (H + 2 kvh) * D]
        qk = ops.rope(qkv[:, :num_qk_heads * shape.head_dim].view(num_tokens, num_qk_heads, shape.head_dim), cos,
                      sin)  # the operator rotates in place, in qkv
        value = qkv[:, num_qk_heads * shape.head_dim:].view(num_tokens, shape.num_kv_heads, shape.head_dim)
        attn = paged_attention(index, qk[:, :shape.num_heads], qk[:, shape.num_heads:], value, ctx, layer.scale)
        # the residual sum promotes a kernel's bf16
        hidden, normed = ops.add_rms_norm(hidden, o_proj(attn.view(num_tokens, -1), cast_back=False),
                                          layer.post_attention_norm)
        gate_up = gate_up_proj(normed)  # [T, 2 I]
        return hidden + down_proj(ops.silu_and_mul(gate_up), cast_back=False)
