"""glibc allocator settings for tensor-sized temporaries on the CPU.

glibc serves an allocation above ``M_MMAP_THRESHOLD`` (adjusted dynamically, at most 32 MiB on 64-bit) with fresh
``mmap`` pages, and gives the top of its heap back to the OS once more than ``M_TRIM_THRESHOLD`` (twice the mmap
threshold) is free there. A decode step allocates and frees dozens of multi-megabyte temporaries per layer
(gathered K/V, attention scores, logits), so with the defaults every step page-faulted them in again and paid the
kernel's page zeroing: measured on the development CPU, a batch-64 decode step over contexts of 16-512 tokens took
~1.1 s with the defaults and ~0.5 s with these settings (docs/performance.md). Raising both thresholds keeps freed
memory in the process for the next step, at the cost of the process holding on to up to ``TRIM_THRESHOLD_BYTES``
of freed heap.

The settings are process-wide, like torch's thread count; the model runner applies them when it runs on the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling on 64-bit: larger requests are always mmap'd
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory_for_reuse() -> bool:
    """Raise glibc's mmap and trim thresholds; returns whether they were applied (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
        return False
    applied = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
               and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not applied:
        log.warning("mallopt refused the allocator thresholds; tensor temporaries stay page-faulted per step")
    return applied
