"""Engine-test settings.

One intra-op thread: the test machine has two cores shared by several concurrent jobs, and with oversubscribed
cores torch's two-thread kernels spend their time in barrier spin-waits (a 4-5x slowdown on these tiny models).
Results do not depend on it; only speed does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
