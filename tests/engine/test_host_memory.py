"""The allocator settings stop repeated tensor temporaries from being page-faulted in on every use."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Three 24 MiB tensors alive at once, freed, again and again: a decode step's pattern in miniature. Prints the
# minor page faults of the repeats (after a warm-up round).
PROGRAM = """
import resource, sys, torch
from worker.engine.host_memory import keep_freed_memory_for_reuse
if sys.argv[1] == "tuned":
    assert keep_freed_memory_for_reuse()
def round_():
    parts = [torch.ones(6 << 20) for _ in range(3)]
    return sum(float(p[0]) for p in parts)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def minor_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_allocator_reuses_freed_tensor_memory() -> None:
    default, tuned = minor_faults("default"), minor_faults("tuned")
    pages_per_round = 3 * (24 << 20) // 4096
    assert default > 5 * pages_per_round, "the default allocator was expected to fault the pages in again"
    assert tuned < pages_per_round, f"tuned: {tuned} faults over 20 rounds"
