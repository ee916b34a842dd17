"""Projection cost by row count: where the weight-only kernels stop beating the dense matmul on this CPU.

    .venv/bin/python benchmarks/projection_rows.py [--rows 1,2,4,8,12,16,32] [--threads 2] [--passes 20]
        [--layouts bf16,bf16+int4,fp32,fp16,fp32+int4,fp32+q4_1,bf16+q4_1,fp32+tiles]
        [--avx2]

A decode step calls each of SmolLM2's 30 layers' four projections (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) once, with as many rows as running requests, and the weights stream from memory ("cold"). This
times one such pass over 30 layers' worth of random weights per layout, the layouts alternating pass by pass
(median ms per pass), with ``PackedLinear``: exactly the calls the engine makes. Layouts:
- ``bf16``: prepacked dense bf16 (oneDNN; AMX where the CPU has it); ``bf16+int4``: the int4 kernel, bf16 rows;
- ``fp32``: dense float32; ``fp16``: float16 weights in fbgemm's layout, float32 rows (what a float32 layer keeps
  under quantisation); ``fp32+int4``: the int4 kernel fed float32 rows cast to bf16 and back;
- ``fp32+q4_1``, ``bf16+q4_1``: tokenspool's own int4 operator (GGUF's Q4_1 blocks, ``csrc/int4_linear.cpp``);
- ``fp32+tiles``: the same blocks in ``tile_q4_1``'s tiles, activations rounded to 8 bits (``csrc/integer_rows.cpp``:
  what a float32 q4_1 layer runs past its ``max_rows``).
The C++ operators are built (or loaded) first. ``--avx2``: an AVX2-only CPU's kernels on this one (torch's, MKL's,
oneDNN's and the operators'; not fbgemm's: ``benchmarks/avx2.py``).
``config.quantized_max_rows`` holds the crossing points; each line names the CPU and its flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.avx2 import emulate_avx2  # noqa: E402
from benchmarks.machine import read_cpu_info  # noqa: E402
from worker.engine.decode_kernel import load_decode_kernel  # noqa: E402
from worker.engine.linear import PackedLinear, half_packs  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's qkv, o, gate_up, down [N, K]
# name: (compute dtype, quantization); every layout takes its quantised kernel at every row count but
# ``fp32+tiles``, which takes ``q4_1_rows`` at every row count (``TILES``)
LAYOUTS = {
    "bf16": (torch.bfloat16, None),
    "bf16+int4": (torch.bfloat16, "int4"),
    "fp32": (torch.float32, None),
    "fp16": (torch.float32, "fp16"),
    "fp32+int4": (torch.float32, "int4"),
    "fp32+q4_1": (torch.float32, "q4_1"),
    "bf16+q4_1": (torch.bfloat16, "q4_1"),
    "fp32+tiles": (torch.float32, "q4_1"),
}
TILES = "fp32+tiles"


def load_operators(avx2: bool) -> None:
    """The C++ operators as the engine builds them, or (``avx2``) an AVX2-only CPU's kernels."""
    if avx2:
        emulate_avx2()
        return
    problem = load_decode_kernel()
    if problem is not None:
        raise SystemExit(f"the C++ operators could not be built: {problem}")


def build(dtype: torch.dtype, quantization: str | None, layers: int, max_rows: int = 1 << 30) -> list[PackedLinear]:
    """``layers`` layers' projections in one layout (random weights); quantised layouts take their kernel up to
    ``max_rows`` rows (every row count by default)."""
    generator = torch.Generator().manual_seed(0)
    return [PackedLinear(torch.randn(n, k, generator=generator) * 0.02, None, dtype, quantization, max_rows=max_rows)
            for _ in range(layers) for n, k in SHAPES]


def one_pass(layers: list[PackedLinear], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,12,16,32")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2 has 30")
    parser.add_argument("--avx2", action="store_true", help="an AVX2-only CPU's kernels (benchmarks/avx2.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_operators(args.avx2)
    names = [n for n in args.layouts.split(",") if n != "fp16" or half_packs(torch.device("cpu"))]
    stacks = {n: build(*LAYOUTS[n], args.layers, max_rows=0 if n == TILES else 1 << 30) for n in names}
    cpu = read_cpu_info().describe()
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {dtype: {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}
                  for dtype in (torch.bfloat16, torch.float32)}
        times: dict[str, list[float]] = {n: [] for n in names}
        for index in range(args.passes + 1):
            for name in names:
                elapsed = one_pass(stacks[name], inputs[LAYOUTS[name][0]])
                if index:  # the first pass warms the kernels up
                    times[name].append(elapsed)
        print(json.dumps({"rows": rows, **{n: round(statistics.median(t) * 1e3, 2) for n, t in times.items()},
                          "unit": f"ms per {len(SHAPES) * args.layers} projections", "threads": args.threads,
                          "load": round(os.getloadavg()[0], 1), "cpu": cpu,
                          "aten": torch.backends.cpu.get_cpu_capability(),
                          "emulated": "avx2" if args.avx2 else None}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
