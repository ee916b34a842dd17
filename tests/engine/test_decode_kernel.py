"""The C++ operators, built on this machine as the engine builds them. Decode attention (``csrc/paged_decode.cpp``):
against float64 attention over the gathered keys, on scattered blocks, every head layout and dtype it serves, and
in the engine against ``generate``. The Q8_0 and Q4_1 matmuls (``csrc/int8_linear.cpp``,
``csrc/int4_linear.cpp``): against float64 on every row count and group layout. The decoder's fused steps
(``csrc/fused.cpp``): against the torch forms they replace. And the engine's fallback where they cannot be
built."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.helpers import mixed_workload, torch_threads
from tests.engine.test_engine_parity import check_parity
from worker.engine import Engine, EngineConfig, decode_kernel
from worker.engine.decode_kernel import cpu_description, kernel_name, load_decode_kernel
from worker.engine.linear import pack_q4_1, tile_q4_1, tile_q8_0
from worker.engine.pointwise import rms_norm, rope, silu_and_mul

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    problem = load_decode_kernel()
    assert problem is None, f"the kernel must build where the tests run (make setup builds it): {problem}"


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The operator picks its work split (and with it its form) by the thread count: 2 threads, the machines'
    count, where the engine tests otherwise run on one (``conftest.single_torch_thread``)."""
    with torch_threads(2):
        yield


def scattered_case(seed: int, lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, ...]:
    """A pool with random K/V everywhere (keys past a sequence's length are junk a wrong read would take in),
    block tables of shuffled block ids right-padded with junk ids, and queries as a strided view (as the decoder
    hands them over: a slice of the fused QKV output)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    keys = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator).to(dtype)
    values = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator).to(dtype)
    ids = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_per_seq) + 1
    tables = []
    for count in blocks_per_seq:
        tables.append(ids[:count] + [ids[-1]] * (width - count))  # padding: a real block, never to be read
        ids = ids[count:]
    fused = torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=generator).to(dtype)
    return fused[:, :heads], keys, values, torch.tensor(tables), torch.tensor(lens)


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of each query over its own first ``lens[b]`` keys, gathered. -> [B, H, D]."""
    outs = []
    for b in range(query.shape[0]):
        k = keys[tables[b]].flatten(0, 1)[:lens[b]].double().transpose(0, 1)  # [kvh, S, D]
        v = values[tables[b]].flatten(0, 1)[:lens[b]].double().transpose(0, 1)
        q = query[b].double()[:, None]  # [H, 1, D]
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 40), (4, 2, 20)])
@pytest.mark.parametrize("lens", [[1], [37], [5, 70], [16, 1, 130, 47, 32, 9, 200, 3]])
def test_operator_matches_float64_attention(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                                            lens: list[int]) -> None:
    """The three work splits (with 2 threads: one sequence by query head, two by KV head, eight by sequence),
    lengths on and off block boundaries; head sizes 64 and 128 (unrolled), 40 (the generic loop) and 20 (not a
    whole number of vectors: the scalar scores and tails); GQA and plain multi-head."""
    query, keys, values, tables, context = scattered_case(len(lens) * dim, lens, heads, kv_heads, dim, dtype)
    scale = dim ** -0.5
    out = torch.ops.tokenspool.paged_decode_attention(query, keys, values, tables, context, scale)
    assert out.dtype == dtype and out.shape == query.shape
    expected = reference(query, keys, values, tables, context, scale)
    # float32 accumulation either way; the output rounds to the dtype (bf16 keeps 8 bits of mantissa)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 40), (4, 2, 20)])
@pytest.mark.parametrize("lens", [[1], [37], [300], [5, 70], [16, 1, 130, 47, 32, 9, 200, 3]])
def test_float32_queries_read_a_16_bit_cache(kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                                             lens: list[int]) -> None:
    """A float32 engine's cache in 16 bits (``config.pick_kv_dtype``): rows widened as they are read, so the result
    is float32 attention over the rounded keys and values, to float32 rounding. One sequence (items of single
    query heads with 2 threads; two sequences too where every query head has its own KV head) over a float16
    cache with head size 64 or 128 runs ``attend_f16`` where the CPU has F16C: one key, a tail tile (37), several
    tiles and blocks (300)."""
    query, keys, values, tables, context = scattered_case(len(lens) + dim, lens, heads, kv_heads, dim, torch.float32)
    keys, values = keys.to(kv_dtype), values.to(kv_dtype)
    out = torch.ops.tokenspool.paged_decode_attention(query, keys, values, tables, context, dim ** -0.5)
    assert out.dtype == torch.float32
    expected = reference(query, keys, values, tables, context, dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_operator_rejects_what_it_cannot_read() -> None:
    query, keys, values, tables, context = scattered_case(0, [20], 4, 2, 8, torch.float32)
    op = torch.ops.tokenspool.paged_decode_attention
    with pytest.raises(RuntimeError, match="dtypes"):
        op(query.bfloat16(), keys, values, tables, context, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        op(query, keys, values, tables.int(), context, 1.0)
    with pytest.raises(RuntimeError, match="unit last stride"):
        op(query.transpose(1, 2), keys.transpose(2, 3), values.transpose(2, 3), tables, context, 1.0)
    # Indices that would read outside the pool are errors, not reads of memory beyond it.
    width = tables.shape[1] * BLOCK
    for lens in ([0], [width + 1]):
        with pytest.raises(RuntimeError, match="context length"):
            op(query, keys, values, tables, torch.tensor(lens), 1.0)
    for bad_id in (-1, keys.shape[0]):
        bad = tables.clone()
        bad[0, 0] = bad_id
        with pytest.raises(RuntimeError, match="outside the pool"):
            op(query, keys, values, bad, context, 1.0)


def q8_0_blocks(seed: int, out_features: int, groups: int) -> tuple[torch.Tensor, ...]:
    """Random Q8_0 blocks: codes [N, K] in -127..127, float16 scales [N, K/32], and the weights they stand for
    [N, K] in float64."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, 32 * groups), dtype=torch.int8, generator=generator)
    scales = (torch.rand(out_features, groups, generator=generator) * 0.01).half()
    weight = codes.view(out_features, groups, 32).double() * scales.double()[..., None]
    return codes, scales, weight.view(out_features, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "groups"), [(1, 1), (1, 18), (2, 3), (4, 48), (8, 5), (11, 2)])
def test_int8_linear_matches_float64(dtype: torch.dtype, rows: int, groups: int) -> None:
    """x @ (scales * codes).T for every pass size (1-8 rows, and 11: two passes), odd and even group counts, a
    strided x; float32 accumulation, returned in x's dtype (float32: to float32 rounding)."""
    out_features, cols = 37, 32 * groups  # an output count that no work split divides
    codes, scales, weight = q8_0_blocks(rows * 100 + groups, out_features, groups)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * cols, generator=generator).to(dtype)[:, ::2]  # strided, as a slice would be
    expected = x.double() @ weight.T
    out = torch.ops.tokenspool.int8_linear(x, codes, scales)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((out.double() - expected).abs().max() / expected.abs().max()) < tolerance


def test_int8_linear_rejects_what_it_cannot_read() -> None:
    op = torch.ops.tokenspool.int8_linear
    codes, scales = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2, dtype=torch.half)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.zeros(1, 48), torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1, dtype=torch.half))
    with pytest.raises(RuntimeError, match="codes"):
        op(torch.zeros(1, 64), codes.int(), scales)
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.zeros(1, 64), codes, scales.float())
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.zeros(1, 64), codes, torch.ones(4, 3, dtype=torch.half))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.zeros(1, 64, dtype=torch.float16), codes, scales)


def q4_1_blocks(seed: int, out_features: int, groups: int) -> tuple[torch.Tensor, ...]:
    """Random Q4_1 blocks: codes [N, K] in 0..15, float16 scales and minimums [N, K/32], and the weights they stand
    for [N, K] in float64."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, 32 * groups), dtype=torch.int32, generator=generator)
    scales = (torch.rand(out_features, groups, generator=generator) * 0.01).half()
    mins = (-torch.rand(out_features, groups, generator=generator) * 0.08).half()
    weight = codes.view(out_features, groups, 32).double() * scales.double()[..., None] + mins.double()[..., None]
    return codes, scales, mins, weight.view(out_features, -1)


def q4_1_case(seed: int, out_features: int, groups: int) -> tuple[torch.Tensor, ...]:
    """``q4_1_blocks`` for ``int4_linear``: the codes packed [N, K/2] uint8 (``pack_q4_1``), scales, minimums,
    weights."""
    codes, scales, mins, weight = q4_1_blocks(seed, out_features, groups)
    return pack_q4_1(codes), scales, mins, weight


def int4_error_bound(x: torch.Tensor, weight: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """[M, N]: how far ``int4_linear`` may be from ``x @ weight.T`` in exact arithmetic. It rounds x to 16-bit
    integers per group of 32 (each value moves by at most half a step, step = max |x| / 32767) before multiplying
    them with the codes, so by at most sum_g half_step[r, g] * sum_j scale[n, g] * code[n, g, j], where
    scale * code = weight - min; plus float32 rounding."""
    rows, cols = x.shape
    groups = cols // 32
    half_step = x.double().view(rows, groups, 32).abs().amax(-1) / 32767 / 2  # [M, G]
    spans = (weight.view(-1, groups, 32) - mins.double()[..., None]).sum(-1)  # [N, G]: sum_j scale * code
    return half_step @ spans.T + 1e-6 * (x.double().abs() @ weight.abs().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "groups"), [(1, 1), (1, 18), (2, 3), (3, 48), (4, 5), (8, 2), (11, 7)])
def test_int4_linear_matches_float64(dtype: torch.dtype, rows: int, groups: int) -> None:
    """x @ (scales * codes + mins).T for every pass size (1-8 rows, and 11: two passes), odd and even group counts
    (one row takes the groups in pairs), a strided x; in float32 within the rounding of x to 16-bit integers per
    group (``int4_error_bound``), in bf16 to bf16's rounding of the result."""
    packed, scales, mins, weight = q4_1_case(rows * 100 + groups, 37, groups)  # no work split divides 37
    generator = torch.Generator().manual_seed(groups)
    x = torch.randn(rows, 2 * weight.shape[1], generator=generator).to(dtype)[:, ::2]
    expected = x.double() @ weight.T
    out = torch.ops.tokenspool.int4_linear(x, packed, scales, mins)
    assert out.dtype == dtype and out.shape == (rows, 37)
    if dtype == torch.float32:
        assert bool(((out.double() - expected).abs() <= int4_error_bound(x, weight, mins)).all())
    else:
        assert float((out.double() - expected).abs().max() / expected.abs().max()) < 1e-2


def test_int4_linear_is_as_close_as_float32_activations_almost() -> None:
    """The 16-bit rounding of the activations costs ~1e-5 of the result's scale, not bf16's ~1e-3: on SmolLM2-sized
    rows the error stays below 3e-5 of the largest output."""
    packed, scales, mins, weight = q4_1_case(3, 64, 18)
    x = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(3))
    expected = x.double() @ weight.T
    out = torch.ops.tokenspool.int4_linear(x, packed, scales, mins)
    assert float((out.double() - expected).abs().max() / expected.abs().max()) < 3e-5


def test_int4_linear_carries_non_finite_activations() -> None:
    """A NaN or an infinity among the activations makes the result non-finite, as a float product would, instead of
    vanishing in the rounding to integers."""
    packed, scales, mins, _ = q4_1_case(5, 8, 2)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 64)
        x[1, 40] = bad
        out = torch.ops.tokenspool.int4_linear(x, packed, scales, mins)
        assert bool(torch.isfinite(out[0]).all()) and not bool(torch.isfinite(out[1]).any())


def test_int4_linear_covers_every_block_of_columns() -> None:
    """Enough output columns for several blocks of widened scales per thread, and a last block cut short."""
    packed, scales, mins, weight = q4_1_case(7, 16 * 9 + 5, 3)
    x = torch.randn(2, weight.shape[1])
    expected = x.double() @ weight.T
    out = torch.ops.tokenspool.int4_linear(x, packed, scales, mins)
    assert bool(((out.double() - expected).abs() <= int4_error_bound(x, weight, mins)).all())


def test_int4_linear_rejects_what_it_cannot_read() -> None:
    op = torch.ops.tokenspool.int4_linear
    codes, scales = torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2, dtype=torch.half)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.zeros(1, 48), torch.zeros(4, 24, dtype=torch.uint8), scales[:, :1], scales[:, :1])
    with pytest.raises(RuntimeError, match="codes"):
        op(torch.zeros(1, 64), codes.to(torch.int8), scales, scales)
    with pytest.raises(RuntimeError, match="codes"):
        op(torch.zeros(1, 64), torch.zeros(4, 64, dtype=torch.uint8), scales, scales)
    with pytest.raises(RuntimeError, match="scales, mins"):
        op(torch.zeros(1, 64), codes, scales, scales.float())
    with pytest.raises(RuntimeError, match="scales, mins"):
        op(torch.zeros(1, 64), codes, torch.ones(4, 3, dtype=torch.half), scales)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.zeros(1, 64, dtype=torch.float16), codes, scales, scales)


# The operators over tiles (csrc/integer_rows.cpp), each with the levels its activations are rounded to per group.
ROWS_LEVELS = {"q4_1_rows": 127, "q8_0_rows": 32767}


def tiles_case(op: str, seed: int, out_features: int, groups: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Random blocks in the tiles of ``op`` (``tile_q4_1``, ``tile_q8_0``), and the weights [N, K] in float64."""
    if op == "q4_1_rows":
        codes, scales, mins, weight = q4_1_blocks(seed, out_features, groups)
        return tile_q4_1(codes, scales, mins), weight
    codes, scales, weight = q8_0_blocks(seed, out_features, groups)
    return tile_q8_0(codes, scales), weight


# (rows, blocks of 8 columns, groups): tiles of 2 rows x 2 blocks and their tails (an odd row, an odd block), one
# group and SmolLM2's 18 and 48.
TILE_SHAPES = [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 4, 18), (32, 12, 18), (7, 9, 48)]


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("op", ROWS_LEVELS)
@pytest.mark.parametrize(("rows", "blocks", "groups"), TILE_SHAPES)
def test_rows_operators_are_exact_where_their_integers_hold_the_activations(op: str, rows: int, blocks: int,
                                                                           groups: int) -> None:
    """Activations that the operator's integers per group of 32 hold exactly (integers, each group's largest +-levels)
    make the integer dot products the whole computation: the result is x @ w.T to float32 rounding, for every tile
    and tail, from a strided x."""
    tiles, weight = tiles_case(op, rows * 1000 + blocks * 10 + groups, 8 * blocks, groups)
    levels = ROWS_LEVELS[op]
    generator = torch.Generator().manual_seed(groups)
    x = torch.randint(-levels, levels + 1, (rows, 2 * 32 * groups), generator=generator).float()[:, ::2]
    x[:, ::32] = levels * torch.where(torch.arange(rows)[:, None] % 2 == 0, 1.0, -1.0)
    expected = x.double() @ weight.T
    out = getattr(torch.ops.tokenspool, op)(x, *tiles)
    assert out.dtype == torch.float32 and out.shape == (rows, 8 * blocks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize(("op", "relative_error"), [("q4_1_rows", 0.008), ("q8_0_rows", 1e-4)])
def test_rows_operators_err_by_the_rounding_of_the_activations(op: str, relative_error: float) -> None:
    """On real-valued rows the result is w . x' for x' rounded per group of 32 (each value moves by at most half a
    step, step = max |x| / levels), so it is off x @ w.T by at most sum_g half_step * sum |w| of the group. Q4_1's
    8 bits: the rounding meets the weights about their middle, ~0.5% of the result's norm on SmolLM2-sized rows,
    not the ~1.3% of rounding against the codes alone; Q8_0's 16 bits: float32's own error, nearly."""
    tiles, weight = tiles_case(op, 11, 64, 18)
    x = torch.randn(32, weight.shape[1], generator=torch.Generator().manual_seed(11))
    expected = x.double() @ weight.T
    out = getattr(torch.ops.tokenspool, op)(x, *tiles).double()
    half_step = x.double().view(32, 18, 32).abs().amax(-1) / ROWS_LEVELS[op] / 2  # [M, G]
    bound = half_step @ weight.abs().view(64, 18, 32).sum(-1).T + 1e-6 * (x.double().abs() @ weight.abs().T)
    assert bool(((out - expected).abs() <= bound).all())
    assert float((out - expected).norm() / expected.norm()) < relative_error


@pytest.mark.parametrize("op", ROWS_LEVELS)
def test_rows_operators_carry_non_finite_activations(op: str) -> None:
    """A NaN or an infinity among a row's activations makes that row's result non-finite, the others finite."""
    tiles, _ = tiles_case(op, 5, 16, 2)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(5, 64)
        x[3, 40] = bad
        out = getattr(torch.ops.tokenspool, op)(x, *tiles)
        finite = torch.isfinite(out).all(dim=1)
        assert finite.tolist() == [True, True, True, False, True]
        assert not bool(torch.isfinite(out[3]).any())


def test_q4_1_rows_rejects_what_it_cannot_read() -> None:
    op = torch.ops.tokenspool.q4_1_rows
    (tiles, scales, mins), _ = tiles_case("q4_1_rows", 1, 16, 2)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.zeros(1, 64, dtype=torch.bfloat16), tiles, scales, mins)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.zeros(1, 48), tiles, scales, mins)
    with pytest.raises(RuntimeError, match="tiles"):
        op(torch.zeros(1, 96), tiles, scales, mins)
    with pytest.raises(RuntimeError, match="tiles"):
        op(torch.zeros(1, 64), tiles.to(torch.int8), scales, mins)
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.zeros(1, 64), tiles, scales.half(), mins)
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.zeros(1, 64), tiles, scales, mins[:1])


def test_q8_0_rows_rejects_what_it_cannot_read() -> None:
    op = torch.ops.tokenspool.q8_0_rows
    (tiles, scales), _ = tiles_case("q8_0_rows", 1, 16, 2)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.zeros(1, 64, dtype=torch.bfloat16), tiles, scales)
    with pytest.raises(RuntimeError, match="tiles"):
        op(torch.zeros(1, 96), tiles, scales)
    with pytest.raises(RuntimeError, match="tiles"):
        op(torch.zeros(1, 64), tiles.to(torch.int16), scales)  # Q8_0's codes are tiled one a byte
    with pytest.raises(RuntimeError, match="tiles"):
        op(torch.zeros(1, 64), tile_q4_1(*q4_1_blocks(1, 16, 2)[:3])[0].to(torch.int8), scales)  # Q4_1's shape
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.zeros(1, 64), tiles, scales.half())
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.zeros(1, 64), tiles, scales[:1])


# One rounding to the compute dtype against the torch forms' two or three: a bf16/float16 ulp apart at most,
# float32 to its rounding.
FUSED_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    scale = float(expected.float().abs().max())
    return got.dtype == expected.dtype and float((got.float() - expected.float()).abs().max()) <= (
        2 * FUSED_TOLERANCE[expected.dtype] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_fused_steps_compute_what_the_torch_forms_do(dtype: torch.dtype, rows: int) -> None:
    """rms_norm, RoPE (in place, on a strided slice of a fused projection, tables in the compute dtype and in
    float32) and SiLU-and-multiply, each against the decoder's torch form, on strided rows (slices of a wider
    tensor) where the decoder hands them over."""
    generator = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * 576, generator=generator).to(dtype)
    x, weight = wide[:, :576], torch.rand(576, generator=generator) + 0.5
    eps = torch.tensor(1e-5)
    assert close(torch.ops.tokenspool.rms_norm(x, weight, 1e-5), rms_norm(x, weight, eps))
    qkv = torch.randn(rows, 15, 64, generator=generator).to(dtype)  # 9 q + 3 k heads rotate, 3 v heads do not
    angles = torch.rand(rows, 1, 32, generator=generator) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    for table_dtype in (dtype, torch.float32):
        expected = rope(qkv[:, :12], cos.to(dtype), sin.to(dtype))
        rotated = qkv.clone()
        torch.ops.tokenspool.rope_(rotated[:, :12], cos.to(table_dtype), sin.to(table_dtype))
        assert close(rotated[:, :12], expected) and torch.equal(rotated[:, 12:], qkv[:, 12:])
    gate_up = torch.randn(rows, 2 * 1536, generator=generator).to(dtype) * 4
    assert close(torch.ops.tokenspool.silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_fused_steps_reject_what_they_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.tokenspool.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="unit last stride"):
        torch.ops.tokenspool.rms_norm(torch.zeros(2, 16)[:, ::2], torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="even head size"):
        torch.ops.tokenspool.rope_(torch.zeros(2, 3, 5), torch.zeros(2, 1, 5), torch.zeros(2, 1, 5))
    with pytest.raises(RuntimeError, match="gate_up"):
        torch.ops.tokenspool.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.tokenspool.silu_and_mul(torch.zeros(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 600])
def test_kv_write_stores_what_index_copy_does(dtype: torch.dtype, rows: int) -> None:
    """K/V rows as the decoder hands them over (views into a fused QKV output: strided rows), to shuffled slots
    of a layer's caches, bit for bit what two index_copy_ store; 600 rows split over the threads."""
    generator = torch.Generator().manual_seed(rows)
    slots_total, kv_heads, dim, heads = 1024, 3, 64, 9
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    key = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    value = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
    slots = torch.randperm(slots_total, generator=generator)[:rows]
    caches = [torch.randn(slots_total, kv_heads, dim, generator=generator).to(dtype) for _ in range(2)]
    expected = [cache.clone().index_copy_(0, slots, new) for cache, new in zip(caches, (key, value), strict=True)]
    torch.ops.tokenspool.kv_write_(caches[0], caches[1], slots, key, value)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_kv_write_rejects_what_it_cannot_store() -> None:
    cache, rows = torch.zeros(32, 3, 64), torch.zeros(2, 3, 64)
    with pytest.raises(RuntimeError, match="slot 32 outside the cache of 32"):
        torch.ops.tokenspool.kv_write_(cache, cache.clone(), torch.tensor([0, 32]), rows, rows)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.tokenspool.kv_write_(cache, cache.clone(), torch.tensor([0, 1]), rows.bfloat16(), rows.bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tokenspool.kv_write_(cache, cache.clone(), torch.tensor([0, 1]),
                                       torch.zeros(2, 64, 3).transpose(1, 2), rows)  # heads interleaved
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.tokenspool.kv_write_(cache, cache.clone(), torch.tensor([0, 1], dtype=torch.int32), rows, rows)
    assert not cache.any()  # nothing written by a refused call


def test_the_decoder_writes_its_k_v_through_the_operator(tiny_model: Path) -> None:
    """Where the operators run the decoder, its K/V go through kv_write_; transformers' forward keeps index_copy_."""
    own = Engine(EngineConfig(model=str(tiny_model), dtype="bfloat16", num_kv_blocks=16))
    exact = Engine(EngineConfig(model=str(tiny_model), dtype="float32", num_kv_blocks=16))
    assert own.runner.kv_cache.fused_write and not exact.runner.kv_cache.fused_write


def test_engine_on_the_kernel_matches_generate(tiny_model: Path) -> None:
    """float32 (so greedy tokens must equal transformers'): mixed lengths, chunked prefill, preemption, and a small
    pool whose blocks scatter; every decode step goes through the operator."""
    workload = mixed_workload(seed=4, num_requests=24, max_prompt=300, max_output=30, vocab=49152)
    config = EngineConfig(dtype="float32", model=str(tiny_model), block_size=BLOCK, num_kv_blocks=40,
                          max_num_seqs=8, max_num_batched_tokens=96, attention_backend="kernel")
    check_parity(tiny_model, config, workload)


def test_auto_runs_the_kernel_for_the_own_decoder_on_a_cpu(tiny_model: Path) -> None:
    """The default: the engine's own decoder decodes through the operator; transformers' exact float32 forward
    keeps SDPA (its greedy tokens stay transformers')."""
    own = Engine(EngineConfig(model=str(tiny_model), dtype="bfloat16", num_kv_blocks=16))
    exact = Engine(EngineConfig(model=str(tiny_model), dtype="float32", num_kv_blocks=16))
    assert (own.runner.compute.own_decoder, own.runner.attention_backend) == (True, "kernel")
    assert (exact.runner.compute.own_decoder, exact.runner.attention_backend) == (False, "sdpa")


def test_without_a_compiler_the_engine_falls_back_or_refuses(tmp_path: Path) -> None:
    """A build with no compiler (``CXX`` names none, in an empty extensions cache): ``auto`` keeps the gathered
    path, an explicit ``kernel`` is an error, and a quantised LM head keeps torch's formats."""
    script = (
        "import torch\n"
        "from worker.engine.config import EngineConfig\n"
        "from worker.engine.model_runner import operators_loaded, settle_kernel\n"
        "print(settle_kernel(EngineConfig(), 'kernel'))\n"
        "try:\n"
        "    settle_kernel(EngineConfig(attention_backend='kernel'), 'kernel')\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n"
        "print(operators_loaded(torch.device('cpu')))\n"
    )
    env = os.environ | {"CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "sdpa"
    assert lines[1].startswith("refused: attention_backend='kernel': the C++ decode kernel could not be built")
    assert lines[2] == "False"
    assert "could not be built" in done.stderr and "the decoder runs torch's ops" in done.stderr  # warnings


AVX2_BUILD = """
import sys
import pytest
from worker.engine.decode_kernel import AVX2_ONLY, build
build("tokenspool_kernels_avx2_test", AVX2_ONLY)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning",
                      sys.argv[1], "-k", "operator_matches or int8_linear or int4_linear or fused_steps or kv_write"]))
"""


@pytest.mark.slow
@pytest.mark.skipif("avx512f" not in cpu_description() or "avx2" not in cpu_description(),
                    reason="the native build is this CPU's only one")
def test_the_avx2_build_passes_the_operator_tests(tmp_path: Path) -> None:
    """The operators' AVX2 code (what AMD EPYCs without AVX-512 run) built here with AVX-512 switched off, and this
    file's operator tests run against that build (the module fixture finds the operators already loaded)."""
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", AVX2_BUILD, str(Path(__file__).resolve())], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_the_build_is_named_for_the_cpu_and_torch() -> None:
    """-march=native: a binary in a shared cache must never serve another CPU or torch; the name says which."""
    here = cpu_description()
    assert "flags" in here  # Linux: /proc/cpuinfo's flags are part of it
    assert kernel_name(here) == kernel_name(here)
    assert kernel_name(here) != kernel_name(here.replace("avx2", "")) != kernel_name(here + " amx_tile")
    assert kernel_name(here) != kernel_name(here, torch_version="0.0.0")


def test_the_build_is_named_for_its_sources_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache shared between checkouts must not serve a build of other sources: a header's text is in the name."""
    header = tmp_path / "extra.h"
    header.write_text("// one\n")
    monkeypatch.setattr(decode_kernel, "HEADERS", (*decode_kernel.HEADERS, header))
    before = kernel_name(cpu_description())
    header.write_text("// two\n")
    assert kernel_name(cpu_description()) != before
