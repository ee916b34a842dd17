"""The C++ decode-attention operator (``csrc/paged_decode.cpp``): built once per machine, loaded into torch.

Stock torch has no CPU kernel that reads a paged K/V cache in place, so the Python decode path gathers each
sequence's blocks into a copy per layer and pads a group to its longest sequence (``decode_attention.py``). This
operator walks the block tables instead, one call per layer for every plain decode query of the step:
``torch.ops.tokenspool.paged_decode_attention(query [B, H, D], key_pool, value_pool [NB, BS, KVH, D],
block_tables [B, MB] int64, context_lens [B] int64, scale) -> [B, H, D]``.

It is compiled with the machine's own instruction set (``-march=native``), by torch's extension builder (g++
and ninja), into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under
a name that carries this CPU's flags and the torch version, so a cache shared between machines never serves a
binary built for another CPU. ~15 s the first time on 2 cores (``make setup`` builds it ahead:
``decode_kernel.main``), then a load. Where it cannot be built (no compiler) the engine keeps
the gathered path and says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("paged_decode.cpp", "int8_linear.cpp", "fused.cpp"))
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math")  # -fopenmp: at::parallel_for runs threaded; the rest: reductions vectorise


OPERATORS = ("paged_decode_attention", "int8_linear", "rms_norm", "rope_", "silu_and_mul")


def cpu_description() -> str:
    """This CPU's architecture, model names and flags: what ``-march=native`` compiles for."""
    cpu = platform.processor() + platform.machine()
    with contextlib.suppress(OSError):  # Linux; elsewhere the processor string alone
        cpu += "".join(sorted({line for line in Path("/proc/cpuinfo").read_text().splitlines()
                               if line.startswith(("model name", "flags"))}))
    return cpu


def kernel_name(cpu: str, torch_version: str = torch.__version__) -> str:
    """The extension's name for ``cpu`` (``cpu_description``), the torch version and the flags, hashed."""
    sources = " ".join(path.name for path in SOURCES)
    digest = hashlib.sha256(f"{cpu}|{torch_version}|{' '.join(CFLAGS)}|{sources}".encode()).hexdigest()[:12]
    return f"tokenspool_kernels_{digest}"


def loaded() -> bool:
    """Whether the operators are registered in this process."""
    return all(hasattr(torch.ops.tokenspool, op) for op in OPERATORS)


def load_decode_kernel() -> str | None:
    """Build (first time) and load the operator; returns None when it is available, else why it is not."""
    if loaded():
        return None
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed

    try:
        load(name=kernel_name(cpu_description()), sources=[str(path) for path in SOURCES], extra_cflags=list(CFLAGS),
             extra_ldflags=["-fopenmp"], is_python_module=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler or ninja, a failed build
        lines = str(exc).strip().splitlines()  # a failed build's message ends with the compiler's verdict
        return f"{type(exc).__name__}: {lines[-1] if lines else '(no message)'}"
    return None if loaded() else "the built library registered no operator"


def main() -> int:
    """Build the operator ahead of the first worker (``make setup``)."""
    problem = load_decode_kernel()
    if problem is not None:
        print(f"the C++ decode attention kernel could not be built ({problem}); workers use the gathered path")
        return 0  # not an error: the engine works without it
    print(f"decode attention kernel: {kernel_name(cpu_description())}")
    return 0
