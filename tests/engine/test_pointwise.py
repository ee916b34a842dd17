"""The decoder's pointwise steps: every implementation computes what the eager reference does, and the engine
config picks the compiled one on CUDA only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.engine import Engine, EngineConfig, SamplingParams, model_runner
from worker.engine.config import pick_compile_pointwise
from worker.engine.decode_kernel import load_decode_kernel
from worker.engine.pointwise import Pointwise, make_pointwise

# inductor's import warns about a deprecated torch.jit API it uses
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
EPS = 1e-5
HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 6, 16, 48, 40


def run_steps(ops: Pointwise, num_tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every step of ``ops`` on seeded inputs of ``num_tokens`` rows; RoPE on a copy (the operator is in place)."""
    gen = torch.Generator().manual_seed(num_tokens)
    x, delta = (torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(HIDDEN, generator=gen) + 0.5  # float32, as the decoder keeps norm weights
    qk = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    angles = torch.rand(num_tokens, 1, HEAD_DIM, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, generator=gen).to(dtype)
    total, normed = ops.add_rms_norm(x, delta, weight)
    return [ops.rms_norm(x, weight), total, normed, ops.rope(qk.clone(), cos, sin), ops.silu_and_mul(gate_up)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_steps_equal_the_eager_ones_for_any_token_count(dtype: torch.dtype) -> None:
    """One compile serves every step size (dynamic shapes); the results are eager's up to the norm's summation order
    (float32 within 1e-6 relative; bf16 within one rounding)."""
    eager, compiled = make_pointwise("eager", EPS, torch.device("cpu")), make_pointwise("compiled", EPS,
                                                                                         torch.device("cpu"))
    tolerance = {"atol": 1e-5, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    for num_tokens in (1, 7, 33):
        for got, expected in zip(run_steps(compiled, num_tokens, dtype), run_steps(eager, num_tokens, dtype),
                                 strict=True):
            assert got.dtype == expected.dtype and got.shape == expected.shape
            torch.testing.assert_close(got, expected, **tolerance)


def test_the_operators_compute_the_eager_steps() -> None:
    assert load_decode_kernel() is None, "the C++ operators must build where the tests run"
    operators, eager = make_pointwise("operators", EPS, torch.device("cpu")), make_pointwise("eager", EPS,
                                                                                              torch.device("cpu"))
    for got, expected in zip(run_steps(operators, 5, torch.float32), run_steps(eager, 5, torch.float32),
                             strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_returns_the_sum_and_its_norm() -> None:
    eager = make_pointwise("eager", EPS, torch.device("cpu"))
    x, delta, weight = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN), torch.rand(HIDDEN) + 0.5
    total, normed = eager.add_rms_norm(x, delta, weight)
    assert torch.equal(total, x + delta) and torch.equal(normed, eager.rms_norm(x + delta, weight))


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="pointwise kind"):
        make_pointwise("triton", EPS, torch.device("cpu"))


def test_auto_compiles_on_cuda_only() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pick_compile_pointwise(EngineConfig(), cuda) and not pick_compile_pointwise(EngineConfig(), cpu)
    assert pick_compile_pointwise(EngineConfig(compile_pointwise="on"), cpu)
    assert not pick_compile_pointwise(EngineConfig(compile_pointwise="off"), cuda)
    with pytest.raises(ValueError, match="compile_pointwise"):
        EngineConfig(compile_pointwise="yes")


def test_an_engine_without_the_operators_runs_compiled_steps_when_asked(tiny_llama: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder a CUDA engine builds, on this CPU: with the C++ operators unavailable (as on a GPU),
    ``compile_pointwise="on"`` compiles the steps and ``"auto"`` keeps torch's ops (CPU); the greedy tokens agree."""
    monkeypatch.setattr(model_runner, "operators_loaded", lambda device: False)
    prompts = [[5, 17, 99, 3, 42], [7, 300, 11, 12, 500, 6, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for mode, kind in (("on", "compiled"), ("auto", "eager")):
        engine = Engine(EngineConfig(model=str(tiny_llama), dtype="bfloat16", quantization="none", num_kv_blocks=32,
                                     compile_pointwise=mode))
        decoder = engine.runner.decoder
        assert decoder is not None and decoder.ops.kind == kind and not decoder.fused
        tokens[mode] = [list(o.token_ids) for o in engine.generate(prompts, [params] * len(prompts))]
    assert tokens["on"] == tokens["auto"]
