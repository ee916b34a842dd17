"""The one thread that builds the engine and runs every call on it.

The engine is not thread-safe, so one thread owns it; the worker's asyncio loop stays free for leases,
cancellations and publishing while a step computes. That thread also builds the engine: built on the main thread
and stepped on another, a SmolLM2 prefill of ~170 tokens took ~15-18 ms (6%) longer in the worker than in a
plain script; built and stepped on the same thread it took 2-3 ms longer (the runner's own work). Measured with
paired prompts, docs/performance.md ("The cost of the queue").
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class EngineThread:
    """A single worker thread: ``build`` the engine on it once, then ``call`` into it from the event loop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def build(self, factory: Callable[[], T]) -> T:
        """Run ``factory`` (the engine's constructor) on the thread and wait for it; call before serving."""
        return self._executor.submit(factory).result()

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the thread, awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Wait for the running call, then end the thread."""
        self._executor.shutdown(wait=True)
