"""An AVX2-only CPU's kernels on an AVX-512 one: side-by-sides for the CPUs a session did not draw.

    .venv/bin/python benchmarks/llama_cpp.py --avx2 \
        --llama-server ~/.cache/tokenspool/llama.cpp/build-avx2/bin/llama-server   # LLAMA_CPP_ISA=avx2 build
    .venv/bin/python benchmarks/step_cost.py --avx2 --steps 40
    .venv/bin/python benchmarks/projection_rows.py --avx2

What runs as on an AVX2-only CPU:
- torch's own kernels, MKL's and oneDNN's: ``ENVIRONMENT`` (each library reads it once, when it starts, so the
  benchmark starts itself again with it: ``restart_with``);
- tokenspool's C++ operators: built without AVX-512 and AVX-VNNI (``decode_kernel.AVX2_ONLY``) under a name of
  their own and loaded before the engine, which then finds them loaded;
- the engine's CPU rules (dtype, which int4 kernel, row limits): ``config.cpu_flags`` reads this CPU's flags without
  AVX-512 and AMX, in this process only.
Not emulated: fbgemm's float16 matmuls (the dense path of float32 layers from 5 rows, and prefill) pick AVX-512
themselves; clocks, caches and memory are this CPU's. So the numbers say what the AVX2 code paths do on this
silicon, not what an older AVX2-only CPU measures.
"""

from __future__ import annotations

import os
import sys

AVX2_EXTENSION = "tokenspool_kernels_avx2_bench"
LABEL = " (AVX2 kernels: benchmarks/avx2.py)"  # after the CPU's description in a report
ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def restart_with(environment: dict[str, str]) -> None:
    """This process again, from the start, with ``environment`` set; returns where it is set already."""
    if all(os.environ.get(key) == value for key, value in environment.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | environment)


def emulate_avx2() -> None:
    """Everything above, in this process (started again first where the libraries' environment is missing)."""
    restart_with(ENVIRONMENT)
    import torch

    assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
    from worker.engine import config, decode_kernel

    decode_kernel.build(AVX2_EXTENSION, decode_kernel.AVX2_ONLY)  # registers the operators the engine calls

    flags = config.cpu_flags()
    config.cpu_flags = lambda: frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
