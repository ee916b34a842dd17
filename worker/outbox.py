"""One ordered path from the step loop to Redis: every write the worker makes for its jobs goes through here.

The step loop ``put``s writes (a step's events, a job's result, a release) and goes on stepping; one task drains
them in order, so a job's events go out in seq order and before its result by construction, not by remembering
to wait. At most ``max_pending`` writes wait: beyond that ``put`` blocks, so a slow Redis slows the step loop
instead of growing memory. ``flush`` waits until everything put so far is written (the first-token fast path).
A write that fails for good (Redis gone past the retry patience) ends the drain; ``put`` and ``flush`` raise it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Protocol

from shared.schemas import TokenEvent
from worker.jobs import ActiveJob

MAX_PENDING_WRITES = 8  # a write is one step's pipeline or one job's result: a few steps of slack


@dataclass(frozen=True)
class Publish:
    """One step's events, per job, in one pipeline."""

    batches: list[tuple[ActiveJob, list[TokenEvent]]]


@dataclass(frozen=True)
class Finish:
    """A job the engine is done with: completed, cancelled (aborted choices) or failed (``job.error``)."""

    job: ActiveJob


@dataclass(frozen=True)
class Release:
    """A job handed back to the queue: ``crashed`` after an engine failure (charged or isolated), else a drain.
    ``give_up_s`` bounds the retries (shutdown gives Redis one lease, not the full patience)."""

    job: ActiveJob
    crashed: bool
    give_up_s: float | None = None


Write = Publish | Finish | Release


class Writer(Protocol):
    async def write(self, write: Write) -> None: ...


class Outbox:
    """Ordered, bounded, drained by one task (``start`` it inside the running loop)."""

    def __init__(self, writer: Writer, max_pending: int = MAX_PENDING_WRITES) -> None:
        self._writer = writer
        self._writes: asyncio.Queue[Write] = asyncio.Queue(max_pending)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._drain(), name="outbox")

    async def put(self, write: Write) -> None:
        """Queue ``write`` behind every earlier one; waits while the outbox is full."""
        self._raise_if_failed()
        await self._writes.put(write)

    async def flush(self) -> None:
        """Wait until every write put so far is done."""
        assert self._task is not None, "start() the outbox first"
        joined = asyncio.ensure_future(self._writes.join())
        await asyncio.wait([joined, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not joined.done():
            joined.cancel()
        self._raise_if_failed()

    async def close(self) -> None:
        """Flush, then stop the drain."""
        try:
            await self.flush()
        finally:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task

    def _raise_if_failed(self) -> None:
        if self._task is not None and self._task.done() and not self._task.cancelled():
            failure = self._task.exception()
            if failure is not None:
                raise failure

    async def _drain(self) -> None:
        while True:
            write = await self._writes.get()
            try:
                await self._writer.write(write)
            finally:
                self._writes.task_done()
