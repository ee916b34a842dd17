"""An AVX-512 CPU without fast bf16 (Skylake-SP, Cascade Lake, Ice Lake: the engine computes in float32 there) on
one with it, for the side-by-sides of the CPUs a session did not draw.

    .venv/bin/python benchmarks/llama_cpp.py --without-bf16
    .venv/bin/python benchmarks/step_cost.py --without-bf16 --steps 40

What runs as there:
- the engine's CPU rules (dtype, which int4 kernel, row limits): ``config.cpu_flags`` reads this CPU's flags without
  ``HIDDEN`` (bf16, fp16 and AMX), in this process only;
- oneDNN's kernels, which torch's int4 kernel calls: capped at Cascade Lake's ISA (``ENVIRONMENT``; oneDNN reads it
  once, when it starts, so the benchmark starts itself again with it).
Not emulated: tokenspool's C++ operators and fbgemm keep this CPU's ISA (neither uses bf16 in a float32 step);
clocks, caches and memory are this CPU's, so the numbers say what the float32 code paths do on this silicon.
"""

from __future__ import annotations

from benchmarks.avx2 import restart_with

LABEL = " (no fast bf16: benchmarks/without_bf16.py)"  # after the CPU's description in a report
HIDDEN = ("avx512_bf16", "avx512_fp16", "amx")  # flag prefixes the engine does not see
ENVIRONMENT = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}


def emulate_without_bf16() -> None:
    """Everything above, in this process (started again first where oneDNN's environment is missing)."""
    restart_with(ENVIRONMENT)
    from worker.engine import config

    flags = config.cpu_flags()
    config.cpu_flags = lambda: frozenset(f for f in flags if not f.startswith(HIDDEN))
