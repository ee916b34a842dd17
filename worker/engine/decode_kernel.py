"""tokenspool's C++ CPU operators (``csrc/``): built once per machine, loaded into torch.

- ``paged_decode_attention`` (``paged_decode.cpp``): stock torch has no CPU kernel that reads a paged K/V cache in
  place, so the Python decode path gathers each sequence's blocks into a copy per layer and pads a group to its
  longest sequence (``decode_attention.py``). This operator walks the block tables instead, one call per layer
  for every plain decode query of the step: ``(query [B, H, D], key_pool, value_pool [NB, BS, KVH, D],
  block_tables [B, MB] int64, context_lens [B] int64, scale) -> [B, H, D]``.
- ``int8_linear`` (``int8_linear.cpp``): the LM head in GGUF's Q8_0 blocks for few rows (``linear.py``'s q8_0).
- ``int4_linear`` (``int4_linear.cpp``): int4 layers in GGUF's Q4_1 blocks for few rows, float32 activations
  (``linear.py``'s q4_1), where torch's int4 kernel runs its AVX2 code or the compute dtype is float32. Both
  matmuls share ``group_matmul.h``.
- ``q4_1_rows``, ``q8_0_rows`` (``integer_rows.cpp``): the same Q4_1 layers and Q8_0 head for calls of more rows
  (prefill, decode batches) under a float32 compute dtype: activations rounded to integers per group of 32 (8 bits
  for Q4_1, 16 for Q8_0) and AVX2's integer multiply-adds (VNNI's fused ones where the CPU has them).
- ``rms_norm``, ``rope_``, ``silu_and_mul`` (``fused.cpp``): the decoder's small per-layer steps, one operator each
  instead of a chain of torch ops (``decoder.py``).
- ``kv_write_`` (``kv_write.cpp``): a layer's new keys and values stored at their slots in one call, not two
  ``index_copy_`` (``kv_cache.py``, for the decoder).
- ``decode_layers`` (``decode_layers.cpp``): the decoder's layer loop for a step of few decodes, calling the
  operators above (``operators.h``) and torch's weight-only kernels from C++ (``decode_layers.py``).

They are compiled with the machine's own instruction set (``-march=native``), by torch's extension builder (g++
and ninja), into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under
a name that carries this CPU's flags, the torch version and the sources' text, so a cache shared between machines
or checkouts never serves a binary built for another CPU or from other sources. ~30 s the first time on 2 cores
(``make setup`` builds them ahead: ``decode_kernel.main``), then a load. Where they cannot be built (no compiler)
the engine keeps torch's ops and says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in (
    "paged_decode.cpp", "int8_linear.cpp", "int4_linear.cpp", "integer_rows.cpp", "fused.cpp", "kv_write.cpp",
    "decode_layers.cpp"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("group_matmul.h", "fast_exp.h", "operators.h"))
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math")  # -fopenmp: at::parallel_for runs threaded; the rest: reductions vectorise
# With ``build``: an AVX2-only CPU's code (no AVX-512, no AVX-VNNI) on a newer one (tests, benchmarks/avx2.py).
AVX2_ONLY = ("-mno-avx512f", "-mno-avxvnni")


OPERATORS = ("paged_decode_attention", "int8_linear", "int4_linear", "q4_1_rows", "q8_0_rows", "rms_norm", "rope_",
             "silu_and_mul", "kv_write_", "decode_layers")


def cpu_description() -> str:
    """This CPU's architecture, model names and flags: what ``-march=native`` compiles for."""
    cpu = platform.processor() + platform.machine()
    with contextlib.suppress(OSError):  # Linux; elsewhere the processor string alone
        cpu += "".join(sorted({line for line in Path("/proc/cpuinfo").read_text().splitlines()
                               if line.startswith(("model name", "flags"))}))
    return cpu


def kernel_name(cpu: str, torch_version: str = torch.__version__) -> str:
    """The extension's name for ``cpu`` (``cpu_description``), the torch version, the flags and the sources' text,
    hashed."""
    sources = "".join(path.read_text() for path in (*SOURCES, *HEADERS))  # any change: a new name
    digest = hashlib.sha256(f"{cpu}|{torch_version}|{' '.join(CFLAGS)}|{sources}".encode()).hexdigest()[:12]
    return f"tokenspool_kernels_{digest}"


def loaded() -> bool:
    """Whether the operators are registered in this process."""
    return all(hasattr(torch.ops.tokenspool, op) for op in OPERATORS)


def build(name: str, extra_cflags: tuple[str, ...] = ()) -> None:
    """Compile (the first time) and load the operators as extension ``name``, ``extra_cflags`` after ``CFLAGS``."""
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed

    load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=[*CFLAGS, *extra_cflags],
         extra_ldflags=["-fopenmp"], is_python_module=False)


def load_decode_kernel() -> str | None:
    """Build (first time) and load the operators; returns None when they are available, else why they are not."""
    if loaded():
        return None
    try:
        build(kernel_name(cpu_description()))
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler or ninja, a failed build
        lines = str(exc).strip().splitlines()  # a failed build's message ends with the compiler's verdict
        return f"{type(exc).__name__}: {lines[-1] if lines else '(no message)'}"
    return None if loaded() else "the built library registered no operator"


def main() -> int:
    """Build the operators ahead of the first worker (``make setup``)."""
    problem = load_decode_kernel()
    if problem is not None:
        print(f"the C++ operators could not be built ({problem}); workers run torch's ops")
        return 0  # not an error: the engine works without it
    print(f"C++ operators: {kernel_name(cpu_description())}")
    return 0
