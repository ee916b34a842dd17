"""Optional int8 weights for CPU serving (``EngineConfig(quantization="int8")``).

The ``nn.Linear`` layers (attention projections, MLP gate/up, the LM head; not the MLP down projection, see
``KEEP_FLOAT``) are replaced by ``Int8Linear``:
weights quantised once, symmetric per output channel; activations quantised per call (dynamic quantisation) and
multiplied by fbgemm's int8 kernels. On the 2-core x86 machine of docs/performance.md that is 3-4x faster per
matmul than fp32 at 16-64 rows; the price is a small change in the logits, measured there (greedy agreement with
fp32) and bounded by tests/engine/test_quantization.py. Embeddings, norms and attention stay in float32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

# torch marks its quantized tensor types deprecated (in favour of torchao, not installed here); the fbgemm
# kernels behind them are what we use, so these two warnings are expected while building the packed weights.
_DEPRECATION_MESSAGES = ("torch.quantize_per_tensor", "torch.ao.quantization is deprecated")
# The MLP's down projection reads silu(gate) * up, whose few huge outliers ruin per-tensor int8 activations: on
# SmolLM2, quantising it too took perplexity on natural text from 6.9 to 21 (top-1 agreement 52%); keeping it in
# float32 gives 8.6 (81%). Measured in docs/performance.md.
KEEP_FLOAT = ("down_proj",)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored as int8 (one scale per output row) and ``x`` quantised on the fly."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # [out]
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with warnings.catch_warnings():
            for message in _DEPRECATION_MESSAGES:
                warnings.filterwarnings("ignore", message=message)
            qweight = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0,
                                                 torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [..., in] float32 -> [..., out] float32."""
        rows = x.reshape(-1, self.in_features)
        # reduce_range=True: 7-bit activations, which x86's int8 multiply-add needs to never saturate.
        out: torch.Tensor = torch.ops.quantized.linear_dynamic(rows.float(), self._packed, True)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears_int8(model: nn.Module, keep_float: tuple[str, ...] = KEEP_FLOAT) -> int:
    """Replace the ``nn.Linear`` layers of ``model`` by ``Int8Linear`` in place, except those whose name ends with
    one of ``keep_float``; returns how many were replaced."""
    if "fbgemm" not in torch.backends.quantized.supported_engines and \
            "x86" not in torch.backends.quantized.supported_engines:
        raise ValueError("EngineConfig.quantization 'int8' needs torch's x86/fbgemm quantized engine, which this "
                         f"build lacks (it has {torch.backends.quantized.supported_engines})")
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and not name.endswith(keep_float)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module))
    return len(targets)
