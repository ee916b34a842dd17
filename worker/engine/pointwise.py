"""The decoder's per-layer pointwise steps (RMSNorm, residual add + RMSNorm, RoPE, SiLU-and-multiply), in one of
three implementations chosen once per decoder:

- ``"eager"``: the torch ops below, the reference (one kernel per op: ~8 for a norm).
- ``"operators"``: tokenspool's C++ operators (``csrc/fused.cpp``), one call each, on a CPU where they are built.
- ``"compiled"``: the eager functions compiled by inductor, one fused kernel each (Triton on CUDA). A decode step
  at small batch on a GPU is bound by its kernel count, not its bytes: the eager steps made ~20 of a Llama layer's
  ~30 kernels, each ~2 us even inside a CUDA graph (gpu_check's profile, H200). Compiled once with dynamic token
  counts (every step size shares the kernel) and with eager's roundings kept (``emulate_precision_casts``:
  inductor otherwise carries a bf16 sum into the norm unrounded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

POINTWISE_KINDS = ("eager", "operators", "compiled")
Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Activation = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm, in float32 (``weight`` is float32), rounded once to the input dtype. ``eps``: a 0-d
    float32 tensor.

    Spelled out, not ``F.rms_norm``: on CPU that is a composite of ~10 ops with dtype plumbing, 20-40 us per call
    on a [1, 576] row, and a decode step makes 61 calls. ``eps + sum(x^2) / n`` as one ``add`` with ``alpha``
    (against transformers' ``mean`` and a Python-scalar add: a ``mean`` costs twice a ``sum`` on a row, and a
    scalar operand is wrapped in a tensor per call) ran 17 us against 24 (AMD EPYC, one row).
    """
    x32 = x if x.dtype == torch.float32 else x.float()  # a no-op .float() still costs a dispatch
    mean_square = torch.add(eps, x32.square().sum(-1, keepdim=True), alpha=1 / x.shape[-1])  # [T, 1]
    normed = x32 * torch.rsqrt(mean_square) * weight
    return normed if x.dtype == torch.float32 else normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: ``(x + delta, rms_norm(x + delta))``, the sum in the promoted dtype."""
    total = x + delta
    return total, rms_norm(total, weight, eps)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k heads at once: ``qk`` [T, heads, D], ``cos``/``sin`` [T, 1, D] (``Decoder.rope_tables``,
    sin's first half negated), so that ``roll`` by D/2 stands in for ``rotate_half``."""
    return qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of a fused ``[T, 2 I]`` projection -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Pointwise:
    """One implementation's steps, the norm epsilon bound. ``rope`` returns the rotated ``qk`` (the operator
    rotates it in place and returns it)."""

    kind: str
    rms_norm: Norm  # (x [T, n], weight float32 [n]) -> [T, n] in x's dtype
    add_rms_norm: AddNorm  # (x, delta, weight) -> (x + delta, its norm)
    rope: Rope  # (qk [T, heads, D], cos [T, 1, D], sin [T, 1, D]) -> [T, heads, D]
    silu_and_mul: Activation  # [T, 2 I] -> [T, I]


def compile_pointwise(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` compiled by inductor with dynamic shapes, whole (no graph breaks), with eager's dtype roundings."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def make_pointwise(kind: str, eps: float, device: torch.device) -> Pointwise:
    """The steps of ``kind`` (``POINTWISE_KINDS``) for a norm epsilon ``eps``, on ``device``."""
    if kind == "operators":
        ops = torch.ops.tokenspool

        def rope_in_place(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            ops.rope_(qk, cos, sin)
            return qk

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return ops.rms_norm(x, weight, eps)  # type: ignore[no-any-return]

        def add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            total = x + delta
            return total, ops.rms_norm(total, weight, eps)

        return Pointwise(kind, norm, add_norm, rope_in_place, ops.silu_and_mul)
    if kind not in ("eager", "compiled"):
        raise ValueError(f"pointwise kind must be one of {POINTWISE_KINDS}, got {kind!r}")
    eps_tensor = torch.tensor(eps, dtype=torch.float32, device=device)
    wrap = compile_pointwise if kind == "compiled" else (lambda fn: fn)
    norm_fn, add_norm_fn = wrap(rms_norm), wrap(add_rms_norm)
    return Pointwise(kind, lambda x, weight: norm_fn(x, weight, eps_tensor),  # type: ignore[operator]
                     lambda x, delta, weight: add_norm_fn(x, delta, weight, eps_tensor),  # type: ignore[operator]
                     wrap(rope), wrap(silu_and_mul))  # type: ignore[arg-type]
