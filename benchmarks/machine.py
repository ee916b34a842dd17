"""Name the hardware a benchmark ran on: CPU model, core count and the SIMD flags that decide kernel speed.

Benchmarks on these machines are only comparable with the CPU named: the development machines differ (Intel
Xeon with AVX-512 and AMX, AMD EPYC with AVX2 only), and the fast path of torch and of llama.cpp differs with
them.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass

# The flags that change which kernels run, in the order they are reported.
KEY_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    """What a reader needs to compare two benchmark runs: model name, logical CPUs, key ISA flags."""

    model_name: str
    num_cpus: int
    flags: tuple[str, ...]

    def describe(self) -> str:
        """One line, e.g. ``Intel(R) Xeon(R) Processor, 2 CPUs, flags: avx2 avx512f amx_tile``."""
        flags = " ".join(self.flags) or "none of " + "/".join(KEY_FLAGS)
        return f"{self.model_name}, {self.num_cpus} CPUs, flags: {flags}"


def parse_cpu_info(text: str) -> CpuInfo:
    """Parse ``lscpu`` output (``Model name:``, ``CPU(s):``, ``Flags:``) or ``/proc/cpuinfo`` (``model name``,
    ``flags``, one ``processor`` block per CPU). Fields missing from ``text`` read as unknown / 0 / no flags."""
    model_name, num_cpus, processors = "unknown", 0, 0
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "model name" and model_name == "unknown":
            model_name = value
        elif key == "cpu(s)" and value.isdigit():
            num_cpus = int(value)
        elif key == "processor":
            processors += 1
        elif key == "flags" and not flags:
            flags = set(value.split())
    return CpuInfo(model_name=model_name, num_cpus=num_cpus or processors,
                   flags=tuple(f for f in KEY_FLAGS if f in flags))


def read_cpu_info() -> CpuInfo:
    """This machine's CPU, from ``lscpu`` when installed, else ``/proc/cpuinfo``, else what ``platform`` knows."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return CpuInfo(platform.processor() or platform.machine(), os.cpu_count() or 0, ())
    return parse_cpu_info(text)
