"""The outbox on its own: writes go out in order through one drain, ``put`` blocks while it is full (backpressure),
``flush`` waits for everything put so far, and a write that fails for good is raised to the step loop."""

from __future__ import annotations

import asyncio

import pytest

from worker.outbox import Outbox, Write


class RecordingWriter:
    """A writer that records each write, each taking until ``gate`` opens."""

    def __init__(self) -> None:
        self.written: list[Write] = []
        self.gate = asyncio.Event()
        self.fail = False

    async def write(self, write: Write) -> None:
        await self.gate.wait()
        if self.fail:
            raise ConnectionError("redis gone for good")
        self.written.append(write)


async def test_writes_are_ordered_bounded_and_flushed() -> None:
    writer = RecordingWriter()
    outbox = Outbox(writer, max_pending=2)
    outbox.start()
    writes = [object() for _ in range(4)]
    for w in writes[:3]:  # one taken by the drain (blocked at the gate), two queued: full
        await outbox.put(w)  # type: ignore[arg-type]
    blocked = asyncio.create_task(outbox.put(writes[3]))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not blocked.done()  # backpressure: the step loop waits instead of queueing without bound
    writer.gate.set()
    await blocked
    await outbox.flush()
    assert writer.written == writes
    await outbox.close()


async def test_a_failed_write_is_raised_by_flush_and_put() -> None:
    writer = RecordingWriter()
    writer.fail = True
    writer.gate.set()
    outbox = Outbox(writer)
    outbox.start()
    await outbox.put(object())  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        await outbox.flush()
    with pytest.raises(ConnectionError):
        await outbox.put(object())  # type: ignore[arg-type]
