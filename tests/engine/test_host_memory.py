"""The allocator settings serve tensor temporaries from the heap and keep them there once freed."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh process: how many bytes of fresh mmap one 24 MiB tensor took (mallinfo2's hblkhd), and how many free
# bytes the heap still holds (fordblks) after three such tensors, a decode step's temporaries in miniature, were
# freed. (Page-fault counts would be the direct measure, but transparent huge pages make them vary run to run.)
PROGRAM = """
import ctypes, sys, torch
from worker.engine.host_memory import keep_freed_memory_for_reuse

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert keep_freed_memory_for_reuse()
before = mallinfo2().hblkhd
one = torch.ones(6 << 20)
mapped = mallinfo2().hblkhd - before
del one
for _ in range(3):
    parts = [torch.ones(6 << 20) for _ in range(3)]
    del parts
print(mapped, mallinfo2().fordblks)
"""
TENSOR_BYTES = 24 << 20


def allocator_view(mode: str) -> tuple[int, int]:
    """(bytes freshly mapped for one tensor, free bytes the heap keeps after a step-like round)."""
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    mapped, kept = out.stdout.split()[-2:]
    return int(mapped), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_tensor_temporaries_come_from_the_heap_and_stay_there() -> None:
    mapped, kept = allocator_view("tuned")
    assert mapped == 0, "a 24 MiB tensor should come from the heap"
    assert kept >= 3 * TENSOR_BYTES, "freed temporaries should stay in the heap for the next step"
    # The defaults map such a tensor afresh (page faults and kernel zeroing on every use).
    default_mapped, _ = allocator_view("default")
    assert default_mapped >= TENSOR_BYTES
