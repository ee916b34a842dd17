"""Benchmark-test settings: one torch thread (two cores shared by concurrent jobs; see tests/engine/conftest.py),
restored after each test because the benchmarks set the process-wide thread count themselves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.helpers import torch_threads


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield
