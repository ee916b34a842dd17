"""Linear layers with their weights in the formats the CPU kernels are fast at.

``PackedLinear`` computes ``x @ W.T (+ b)`` and keeps the weight in up to two forms:
- dense, in the compute dtype: used for every call without quantisation, and for calls with many rows (prefill,
  large decode batches), where bf16 matmuls run on AMX and beat the weight-only kernels by 2-3x. A bf16 weight on
  a CPU is kept *prepacked* in oneDNN's blocked layout (``prepack``): ``F.linear`` repacks its weight on every
  call, which with weights streaming from memory (a decode step) made bf16 matmuls 1.3-1.6x slower at 16-32 rows
  and 3x slower at one row; the prepacked call gives bit-identical results;
- weight-only quantised (``"int8"``: one scale per output row, ``torch._weight_int8pack_mm``; ``"int4"``: groups
  of 32 input columns with a scale and an offset each, ``_weight_int4pack_mm_for_cpu``): used for calls with at
  most ``max_rows`` rows (where they beat the dense kernel: ``config.quantized_max_rows``), where a matmul is a
  weight read and 2-4x fewer bytes make it 2-3x faster.
With quantisation the dense copy holds the *de-quantised* weights, so both forms compute the same function up to
the kernels' rounding. Both kernels want bf16 activations (with fp32 ones they are 10-100x slower), so with a
float32 compute dtype (CPUs without AMX, where dense bf16 matmuls are slower than fp32 ones) the few rows going to
a kernel are cast to bf16 and its result back to float32: the dense copy stays float32 for prefill and big batches.

int4 in groups of 32 with a per-group offset is the shape of GGUF's Q4_1 blocks: quantising weights that were
de-quantised from Q4_1 finds each block's own ``(d, m)`` again (min and max of a block are codes 0 and 15), so the
engine serves the shipped model file's weights, up to the rounding of the scales to bf16.

``"q8_0"`` (the LM head's, where the engine's C++ operators are built: ``decode_kernel.py``) is GGUF's Q8_0 block:
int8 codes in groups of 32 input columns with a float16 scale each, multiplied by ``tokenspool::int8_linear``
(``csrc/int8_linear.cpp``) in float32 from float32 or bf16 activations. A GGUF file's own Q8_0 head (SmolLM2's)
comes back exactly; at one row it reads SmolLM2's head in less than half the time of the dense bf16 matmul. Under
float32 such a layer keeps no dense copy either: calls of more rows go to ``tokenspool::q8_0_rows`` over its codes
in tiles (``tile_q8_0``), widened to 16 bits in registers, with the activations rounded to 16 bits per group of
32, for AVX2's 16-bit integer multiply-adds (twice an FMA's products): a 32-row decode step 54.9 against 57.8 ms
with fbgemm's float16 head (Xeon with AVX2 kernels; fbgemm there ran its AVX-512 code), greedy agreement unchanged.

``"q4_1"`` is int4 in GGUF's own Q4_1 blocks (``pack_q4_1``: two codes a byte, float16 scales and minimums), for
``tokenspool::int4_linear`` (``csrc/int4_linear.cpp``): the file's float16 scales as they are, float32 (or bf16)
activations rounded once per call to 16-bit integers per group of 32 (a value moves by at most 2^-16 of its group's
largest) so that each group's dot product with the 4-bit codes is an exact integer one, float32 accumulation. Where
torch's int4 kernel runs its AVX2 code (CPUs without AVX-512) this one is 1.5-1.7x faster at 1-4 rows (AMD EPYC
Zen 3), and greedy decode agrees with the float32 model at every position tested (``config.own_int4_kernel`` picks
it there, and under float32 on AVX-512 CPUs too, with the tiles below: a 32-row step 56.7 against 81.6 ms, Xeon
without its bf16 flags). Under float32 such a layer keeps no dense copy: calls of more than ``max_rows`` rows
(prefill chunks, decode batches) go to ``tokenspool::q4_1_rows`` (``csrc/integer_rows.cpp``) over the same codes one
a byte in tiles (``tile_q4_1``), with the activations rounded to 8 bits per group of 32 (llama.cpp's rounding of
them) for AVX2's 8-bit integer multiply-adds: 1.3-1.7x fbgemm's float16 matmul from 8 rows on an AVX2-only EPYC
(Zen 3), greedy agreement with the float32 model 99.3% on prefill rows (bf16's), half the bytes of the float16
copy.

``"fp16"`` keeps float32 activations and accumulation but stores the weight as float16, in fbgemm's packed layout
(``half_pack``; torch's x86 builds carry fbgemm): a matmul reads half the bytes of a float32 one and converts them
in registers, so on CPUs without fast bf16 it beats the float32 matmul at every row count (1.5-2.8x from 4 rows on
an AVX2 EPYC, at prefill sizes no slower) and, there, the int4 kernel from 4 rows (at 1-2 rows int4 is ~15%
faster), with float32 activations instead of the kernels' bf16 ones. Its results equal ``F.linear`` on the weight
rounded to float16, up to the sum's order. Under int8/int4 with a float32 compute dtype the dense copy (and the LM
head) use this layout too.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.engine import decode_kernel

QUANTIZATIONS = ("int8", "int4", "q4_1", "q8_0", "fp16")
GROUP_SIZE = 32  # input columns a scale covers in the int4 and q8_0 formats (GGUF's blocks)
QUANTIZED_MAX_ROWS = 4  # the default of ``PackedLinear(max_rows=...)``; the engine passes its plan's value
KERNEL_DTYPE = torch.bfloat16  # the activations and scales both weight-only kernels are fast with
QUANTIZED_COMPUTE_DTYPES = (torch.float32, torch.bfloat16)  # the compute dtypes a quantised layer serves


def prepacks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense weights of ``dtype`` on ``device`` are kept prepacked for oneDNN (bf16 on a CPU it supports)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in oneDNN's layout for ``dense_linear`` where ``prepacks`` says so, else unchanged."""
    if not prepacks(weight.dtype, weight.device):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # the row hint only tunes; any row count works


def half_packs(device: torch.device) -> bool:
    """Whether float32 layers on ``device`` can keep float16 weights in fbgemm's layout (``half_pack``)."""
    return device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines


def keeps_half(quantization: str | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a layer under ``quantization`` computing in ``dtype`` keeps its dense weights as float16
    (``half_pack``): under any quantisation of a float32 layer where fbgemm can pack them."""
    return quantization is not None and dtype == torch.float32 and half_packs(device)


def half_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.ScriptObject:
    """``weight`` [N, K] rounded to float16 and packed, with the float32 ``bias``, for ``dense_linear``."""
    return torch.ops.quantized.linear_prepack_fp16(weight.float(), None if bias is None else bias.float())


DenseWeight = torch.Tensor | torch.ScriptObject  # plain, oneDNN-prepacked, or fbgemm's float16 pack (bias inside)


def dense_linear(x: torch.Tensor, weight: DenseWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain, a ``prepack``-ed or a ``half_pack``-ed weight (whose bias was packed
    with it: ``bias`` must be None). ``x``: [M, K] -> [M, N]."""
    if isinstance(weight, torch.ScriptObject):
        assert bias is None, "a half-packed weight carries its bias"
        return torch.ops.quantized.linear_dynamic_fp16(x, weight)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8. ``weight``: [N, K] float -> (codes [N, K] int8, scales [N] float32)."""
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    codes = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group_size`` columns (Q4_1's layout): ``w ~ d * q + m``, ``q`` in [0, 15].

    ``weight``: [N, K] float -> (codes [N, K] int32, scales ``d`` [N, K/g], minimums ``m`` [N, K/g]), float32.
    """
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"int4 quantisation needs in_features divisible by {group_size}, got {cols}")
    groups = weight.float().view(rows, cols // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return codes.view(rows, cols), scales, low


def quantize_q8_0(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of ``group_size`` columns with float16 scales (GGUF's Q8_0): ``w ~ d * q``.

    ``weight``: [N, K] float -> (codes [N, K] int8, scales ``d`` [N, K/g] float16). Weights de-quantised from Q8_0
    come back exactly: a block's largest code is +-127, so ``amax / 127`` is its own scale again."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"q8_0 quantisation needs in_features divisible by {group_size}, got {cols}")
    groups = weight.float().view(rows, cols // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / 127.0).clamp(min=1e-12).half()
    codes = torch.round(groups / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.view(rows, cols), scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, low: torch.Tensor, group_size: int = GROUP_SIZE
                    ) -> torch.Tensor:
    """``quantize_int4``'s codes [N, K] with scales and minimums [N, K/g] (any float dtype) -> ``d * q + m`` [N, K],
    float32."""
    rows, cols = codes.shape
    grouped = codes.view(rows, cols // group_size, group_size).float()
    return (grouped * scales.float()[..., None] + low.float()[..., None]).view(rows, cols)


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``quantize_q8_0``'s codes [N, K] with scales [N, K/g] -> ``d * q`` [N, K], float32."""
    rows, cols = codes.shape
    return (codes.view(rows, cols // group_size, group_size).float() * scales.float()[..., None]).view(rows, cols)


def pack_q4_1(codes: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``quantize_int4``'s codes [N, K] in Q4_1's byte order -> [N, K/2] uint8: in each group of 32, byte ``j``
    holds code ``j`` in its low and code ``j + 16`` in its high nibble."""
    rows, cols = codes.shape
    groups = codes.view(rows, cols // group_size, group_size).to(torch.uint8)
    half = group_size // 2
    return (groups[..., :half] | (groups[..., half:] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_q4_1(packed: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``pack_q4_1``'s bytes [N, K/2] -> the codes [N, K] (uint8)."""
    rows, half_cols = packed.shape
    groups = packed.view(rows, -1, group_size // 2)
    return torch.cat([groups & 0x0F, groups >> 4], dim=-1).reshape(rows, 2 * half_cols)


TILE_COLUMNS = 8  # output columns a tile of ``tokenspool::q4_1_rows`` / ``q8_0_rows`` holds (``csrc/integer_rows.cpp``)
TILED = ("q4_1", "q8_0")  # the quantisations whose float32 layers run calls of many rows on tiles


def tile_codes(codes: torch.Tensor, inputs: int, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Codes [N, K] in tiles [N/8, K/g, g/inputs, 8, inputs]: a vector holds ``inputs`` consecutive inputs of 8
    columns. N a multiple of 8."""
    rows, cols = codes.shape
    blocks, groups = rows // TILE_COLUMNS, cols // group_size
    tiles = codes.view(blocks, TILE_COLUMNS, groups, group_size // inputs, inputs).permute(0, 2, 3, 1, 4)
    return tiles.contiguous()


def tile_per_group(values: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, K/g] (scales, minimums; any float dtype) in the tiles' order: float32 [N/8, K/g, 8]."""
    rows, groups = values.shape
    return values.float().view(rows // TILE_COLUMNS, TILE_COLUMNS, groups).transpose(1, 2).contiguous()


def tile_q4_1(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``quantize_int4``'s codes [N, K] and scales and minimums [N, K/32] as ``tokenspool::q4_1_rows`` takes them:
    codes one a byte [N/8, K/32, 8, 8, 4] (8 columns x 4 inputs a vector), scales and minimums [N/8, K/32, 8]."""
    return tile_codes(codes.to(torch.uint8), 4), tile_per_group(scales), tile_per_group(mins)


def tile_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``quantize_q8_0``'s codes [N, K] and scales [N, K/32] as ``tokenspool::q8_0_rows`` takes them: codes int8
    [N/8, K/32, 16, 8, 2] (8 columns x 2 inputs a vector, once widened to 16 bits), scales [N/8, K/32, 8]."""
    return tile_codes(codes, 2), tile_per_group(scales)


VECTOR_CAPABILITIES = ("AVX2", "AVX512")  # torch's names of the CPUs whose vectors run the tiles' integer code


def tiles_rows(quantization: str | None, dtype: torch.dtype, out_features: int) -> bool:
    """Whether a layer under ``quantization`` computing in ``dtype`` runs its calls of many rows on tiles
    (``q4_1_rows``, ``q8_0_rows``: float32 compute, ``out_features`` a multiple of 8, a CPU with AVX2, where the
    operators' vector code runs rather than their scalar loops) rather than on float16 weights."""
    return (quantization in TILED and dtype == torch.float32 and out_features % TILE_COLUMNS == 0
            and torch.backends.cpu.get_cpu_capability() in VECTOR_CAPABILITIES)


def lies_on_int4_grid(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> bool:
    """Whether int4 groups of ``group_size`` reproduce ``weight`` exactly (to float32 rounding): true of weights
    de-quantised from GGUF Q4_1 blocks, false of trained float weights."""
    if weight.shape[-1] % group_size:
        return False
    codes, scales, low = quantize_int4(weight, group_size)
    error = (dequantize_int4(codes, scales, low, group_size) - weight.float()).abs().max()
    return bool(error <= 1e-5 * weight.abs().max())


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` dense, and optionally weight-only quantised for calls of at most ``max_rows``
    rows. The dense form is in ``dtype``, except under any quantisation of a float32 layer where fbgemm can pack
    it: then float16 (``half_pack``), which is all that ``"fp16"`` keeps."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 quantization: str | None = None, max_rows: int = QUANTIZED_MAX_ROWS) -> None:
        super().__init__()
        if quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
        if quantization is not None and dtype not in QUANTIZED_COMPUTE_DTYPES:
            raise ValueError(f"quantized layers compute in one of {QUANTIZED_COMPUTE_DTYPES}, got {dtype}")
        self.out_features, self.in_features = weight.shape
        tiled = tiles_rows(quantization, dtype, self.out_features)
        self.half = keeps_half(quantization, dtype, weight.device) and not tiled
        if quantization == "fp16" and not self.half:
            raise ValueError(f"quantization 'fp16' needs dtype float32 on a CPU with fbgemm, got {dtype} on "
                             f"{weight.device.type}")
        if quantization in ("q8_0", "q4_1") and not decode_kernel.loaded():
            raise ValueError(f"quantization {quantization!r} needs the C++ operators "
                             "(decode_kernel.load_decode_kernel)")
        self.quantization, self.max_rows = quantization, max_rows
        self.bias = None if bias is None else bias.detach().to(dtype)
        weight = weight.detach().float()
        self.codes = self.scales = self.mins = None
        self.tiles: tuple[torch.Tensor, ...] | None = None
        if quantization == "int8":
            codes, scales = quantize_int8(weight)
            self.codes, self.scales = codes, scales.to(KERNEL_DTYPE)
            weight = codes.float() * self.scales.float()[:, None]
        elif quantization == "q8_0":
            self.codes, self.scales = quantize_q8_0(weight)
            if tiled:
                self.tiles = tile_q8_0(self.codes, self.scales)
            weight = dequantize_q8_0(self.codes, self.scales)
        elif quantization == "q4_1":
            codes, scales, low = quantize_int4(weight)
            self.codes, self.scales, self.mins = pack_q4_1(codes), scales.half(), low.half()
            if tiled:
                self.tiles = tile_q4_1(codes, self.scales, self.mins)
            weight = dequantize_int4(codes, self.scales, self.mins)
        elif quantization == "int4":
            codes, scales, low = quantize_int4(weight)
            # The kernel's convention: w = (q - 8) * scale + zero, scales_and_zeros [K/g, N, 2].
            zeros = low + 8 * scales
            self.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.scales = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
            pairs = self.scales.float().transpose(0, 1)  # [N, K/g, 2]: the rounded scales the kernel uses
            grouped = codes.view(self.out_features, -1, GROUP_SIZE).float() - 8
            weight = (grouped * pairs[..., :1] + pairs[..., 1:]).view(self.out_features, self.in_features)
        # [N, K]: plain, or opaque when packed (``dense_weight`` reads it); a half pack holds the bias too. Tiled
        # layers keep no dense copy: ``dense_weight`` rebuilds it from the codes.
        self.weight: DenseWeight | None = (None if tiled else half_pack(weight, self.bias) if self.half
                                           else prepack(weight.to(dtype)))
        self.dense_bias = None if self.half else self.bias
        # float32 rows go to torch's kernels as bf16 (tokenspool's takes either)
        self.casts = quantization in ("int8", "int4") and dtype != KERNEL_DTYPE

    def forward(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        """``x``: [..., K] -> [..., N]. 2-d inputs (the decoder's) skip the reshapes: a step makes ~120 calls.

        ``cast_back=False`` may return a kernel's bf16 result as it is, for a caller that adds it to a tensor of
        the compute dtype: type promotion then gives the same sum as the cast would, one op fewer."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.tiles is not None and rows.shape[0] > self.max_rows:
            rows_op = torch.ops.tokenspool.q4_1_rows if self.quantization == "q4_1" else torch.ops.tokenspool.q8_0_rows
            out = rows_op(rows, *self.tiles)
            out = out if self.bias is None else out + self.bias
        elif self.codes is None or rows.shape[0] > self.max_rows:
            assert self.weight is not None
            out = dense_linear(rows, self.weight, self.dense_bias)
        else:
            few = rows.to(KERNEL_DTYPE) if self.casts else rows  # a no-op .to() still costs a dispatch
            if self.quantization == "q4_1":
                out = torch.ops.tokenspool.int4_linear(few, self.codes, self.scales, self.mins)
            elif self.quantization == "q8_0":
                out = torch.ops.tokenspool.int8_linear(few, self.codes, self.scales)
            elif self.quantization == "int8":
                out = torch._weight_int8pack_mm(few, self.codes, self.scales)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(few, self.codes, GROUP_SIZE, self.scales)
            if self.casts and (cast_back or self.bias is not None):
                out = out.to(rows.dtype)
            if self.bias is not None:
                out = out + self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The dense weight [N, K] in the plain layout: in the compute dtype (float32 values of the float16 weight
        when half-packed; of the Q4_1 blocks when tiled)."""
        if self.weight is None:
            assert self.codes is not None and self.scales is not None
            if self.mins is None:
                return dequantize_q8_0(self.codes, self.scales)
            return dequantize_int4(unpack_q4_1(self.codes), self.scales, self.mins)
        if isinstance(self.weight, torch.ScriptObject):
            weight: torch.Tensor = torch.ops.quantized.linear_unpack_fp16(self.weight)[0]
            return weight
        return self.weight.to_dense() if self.weight.is_mkldnn else self.weight

    def layout(self) -> str:
        """How the dense weight is stored: ``"half"`` (fbgemm float16), ``"prepacked"`` (oneDNN), ``"plain"``, or
        ``"tiles"`` (none: the GGUF blocks serve every call, ``tile_q4_1`` / ``tile_q8_0``)."""
        if self.weight is None:
            return "tiles"
        if isinstance(self.weight, torch.ScriptObject):
            return "half"
        return "prepacked" if self.weight.is_mkldnn else "plain"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, quantization={self.quantization}, "
                f"max_rows={self.max_rows}, layout={self.layout()}")
