"""A step's small integer inputs sent to the device in one copy.

A decode step's inputs are a dozen short integer lists: token ids, positions, KV slots, the rows of the flex
attention index. ``torch.tensor(values, device="cuda")`` for each is a copy from pageable memory that the host
waits for, and a batch-1 step on the H200 made ~14 of them (docs/performance.md, GPU). ``Staging`` gathers the
columns into one list, builds one int64 tensor of it (in pinned memory when the device is a GPU) and copies it
once with ``non_blocking``; each column comes back as a view of the one device tensor, to be copied or cast into
place by device work that is ordered after the copy on the stream. On the CPU ``send`` copies nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class Staging:
    """Integer columns queued on the host, then sent to a device together."""

    def __init__(self) -> None:
        self._values: list[int] = []
        self._spans: list[tuple[int, int]] = []  # each column's [start, end) in ``_values``

    def add(self, values: Iterable[int]) -> int:
        """Queue a column; returns its place in ``send``'s result."""
        start = len(self._values)
        self._values.extend(values)
        self._spans.append((start, len(self._values)))
        return len(self._spans) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued column, in ``add`` order, as an int64 view ``[len(column)]`` of one tensor on ``device``."""
        moved = to_device(self._values, torch.long, device)
        return [moved[start:end] for start, end in self._spans]


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``: to a GPU from pinned memory with a non-blocking copy, which
    waits for nothing (the caching host allocator keeps the pinned buffer until it is copied); a copy from pageable
    memory would wait for the stream, i.e. for the forward pass queued before it."""
    host = torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    return host.to(device, non_blocking=True)
